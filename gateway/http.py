"""HTTP/1.1 for the gateway: its clients' side in h11 (bytes in, events out) over anyio
byte streams, one request at a time on a connection; its upstreams' side through
httpcore (httpx's HTTP core), whose kept-alive connections (gateway.pool) every request
shares.

An upstream request that is cancelled (the client left, the deadline passed, P's or D's
request is no longer needed) closes its connection instead of handing it back to the
pool, so the vLLM server sees the disconnect and aborts the request.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from http import HTTPStatus
from typing import Any

import anyio
import h11
import httpcore
import msgspec
from anyio.abc import ByteStream

from .pool import PooledBody, StackPool
from .routes import Upstream

READ_CHUNK = 64 << 10


class HttpError(Exception):
    """An answer the gateway gives itself: status, one sentence for the client, and any
    headers beside it (a 503's Retry-After)."""

    def __init__(self, status: int, message: str, headers: list[tuple[str, str]] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or []


class UpstreamFailed(Exception):
    """An upstream could not be reached or broke off; `reached` says whether it got the request."""

    def __init__(self, upstream: Upstream, reason: str, *, reached: bool) -> None:
        super().__init__(f"{upstream.role} instance {upstream.instance_id} at {upstream.url}: {reason}")
        self.upstream = upstream
        self.reached = reached


def response_head(status: int, headers: list[tuple[str, str]]) -> h11.Response:
    return h11.Response(status_code=status, headers=headers, reason=_reason(status))


@functools.lru_cache(maxsize=64)
def _reason(status: int) -> bytes:
    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b""


def error_body(status: int, message: str) -> bytes:
    kind = "invalid_request_error" if status < 500 else "upstream_error"
    return msgspec.json.encode({"error": {"message": message, "type": kind, "code": status}})


# --- HTTP/1.1 over one stream -----------------------------------------------------------


class HttpConn:
    """h11 over an anyio byte stream: `pump` reads, `next_event` waits for what it read,
    `send` writes."""

    def __init__(self, stream: ByteStream, role: type[h11.CLIENT | h11.SERVER]) -> None:
        self.stream = stream
        self.h = h11.Connection(role)
        self._arrived = anyio.Event()
        # The scope of the request being answered, if any: `pump` cancels it when the
        # client hangs up before its whole answer went out, and sets `gone`.
        self.request_scope: anyio.CancelScope | None = None
        self.gone = False

    async def pump(self) -> None:
        """Feed h11 every byte the peer sends, until it closes: run as a task beside the
        one that answers. Bytes that come while a request is answered are a pipelined next
        request; h11 keeps them for the next cycle."""
        while True:
            try:
                data = await self.stream.receive(READ_CHUNK)
            except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
                data = b""
            self.h.receive_data(data)
            self._arrived.set()
            if not data:
                scope = self.request_scope
                if scope is not None and self.h.our_state is not h11.DONE:
                    self.gone = True  # it had not its whole answer; P's request may still end on its own
                    scope.cancel()
                return

    async def next_event(self) -> Any:
        while True:
            event = self.h.next_event()
            if event is not h11.NEED_DATA:
                return event
            await self._arrived.wait()
            self._arrived = anyio.Event()

    async def send(self, *events: Any) -> None:
        """Send the events' bytes in one write: a head and its body leave together."""
        data = b"".join([self.h.send(event) or b"" for event in events])
        if data:
            await self.stream.send(data)

    async def read_body(self, limit: int) -> bytes:
        parts, size = [], 0
        while True:
            event = await self.next_event()
            if isinstance(event, h11.Data):
                size += len(event.data)
                if size > limit:
                    raise HttpError(413, f"the request body is over {limit} bytes; send a smaller one or raise --max-body-bytes.")
                parts.append(bytes(event.data))
            elif isinstance(event, h11.EndOfMessage):
                return b"".join(parts)
            elif isinstance(event, h11.ConnectionClosed):
                raise HttpError(400, "the connection closed before the request body ended.")


class UpstreamReply:
    """An upstream's response head; its body is read through `chunks` or `body`."""

    __slots__ = ("status", "headers", "_body")

    def __init__(self, status: int, headers: list[tuple[bytes, bytes]], body: PooledBody) -> None:
        self.status = status
        self.headers = headers
        self._body = body

    def header(self, name: str) -> str | None:
        want = name.encode().lower()
        for key, value in self.headers:
            if key.lower() == want:
                return value.decode("latin-1")
        return None

    @property
    def content_type(self) -> str:
        return self.header("content-type") or "application/json"

    def chunks(self) -> AsyncIterator[bytes]:
        """The body as it comes, as sent (not decoded: the client gets the same bytes)."""
        return self._body.__aiter__()

    async def body(self) -> bytes:
        parts = [c async for c in self._body]
        return parts[0] if len(parts) == 1 else b"".join(parts)


# What an upstream's connection does wrong, as httpcore names it: before any answer, the
# request may have reached the server; no connection at all, it cannot have.
_NOT_REACHED = (httpcore.ConnectError, httpcore.ConnectTimeout)
_BROKE = (httpcore.NetworkError, httpcore.TimeoutException, httpcore.ProtocolError)


class UpstreamPool:
    """Kept-alive connections to the upstreams, shared by every request: httpcore's
    HTTP/1.1 connections in a `StackPool` (gateway.pool says why not a pool of httpx's).

    Opened by `async with` inside the event loop that uses it. `keepalive_s` stays under
    uvicorn's (vLLM's server's) 5 s keep-alive, so an idle connection is dropped here
    before the server closes it under a request.
    """

    def __init__(self, connect_timeout_s: float, max_connections: int, keepalive_s: float = 4.0) -> None:
        self.pool = StackPool(connect_timeout_s, max_connections, keepalive_s)
        self._urls: dict[tuple[Upstream, str], tuple[httpcore.URL, bytes]] = {}

    async def __aenter__(self) -> UpstreamPool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.pool.aclose()

    def _url(self, up: Upstream, target: str) -> tuple[httpcore.URL, bytes]:
        got = self._urls.get((up, target))
        if got is None:
            host = up.host.encode("idna")
            url = httpcore.URL(scheme=b"http", host=host, port=up.port, target=target.encode())
            got = self._urls[(up, target)] = (url, b"%s:%d" % (host, up.port))
        return got

    @asynccontextmanager
    async def request(
        self, up: Upstream, method: str, target: str, body: bytes, headers: list[tuple[str, str]]
    ) -> AsyncIterator[UpstreamReply]:
        """Send one request on a pooled connection and yield the response head; the body
        is read through the reply. Raises `UpstreamFailed`."""
        url, host = self._url(up, target)
        # The body passes through as sent (identity), on a kept-alive connection.
        head = [(b"Host", host), (b"Accept-Encoding", b"identity"), (b"Content-Length", b"%d" % len(body))]
        head += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers]
        request = httpcore.Request(method.encode(), url, headers=head, content=body)
        try:
            response, stream = await self.pool.send((up.host, up.port), request)
        except _NOT_REACHED as exc:
            raise UpstreamFailed(up, f"cannot connect ({exc or type(exc).__name__})", reached=False) from None
        except _BROKE as exc:
            raise UpstreamFailed(up, f"broke off before answering ({exc or type(exc).__name__})", reached=True) from None
        try:
            yield UpstreamReply(response.status, response.headers, stream)
        except _BROKE as exc:
            raise UpstreamFailed(up, f"broke off mid-answer ({exc or type(exc).__name__})", reached=True) from None
        finally:
            await stream.aclose()  # a body not read to its end closes the connection
