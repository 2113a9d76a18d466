"""HTTP/1.1 for the gateway: h11 (bytes in, events out) over anyio byte streams.

Only what the gateway needs: one request at a time on a client's connection, and one
upstream request per new connection (`Connection: close`), whose response body is read
through the reply as it comes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import anyio
import h11
import msgspec
from anyio.abc import ByteStream, SocketStream

from .routes import Upstream

READ_CHUNK = 64 << 10


class HttpError(Exception):
    """An answer the gateway gives itself: status and one sentence for the client."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class UpstreamFailed(Exception):
    """An upstream could not be reached or broke off; `reached` says whether it got the request."""

    def __init__(self, upstream: Upstream, reason: str, *, reached: bool) -> None:
        super().__init__(f"{upstream.role} instance {upstream.instance_id} at {upstream.url}: {reason}")
        self.upstream = upstream
        self.reached = reached


def response_head(status: int, headers: list[tuple[str, str]]) -> h11.Response:
    try:
        reason = HTTPStatus(status).phrase
    except ValueError:
        reason = ""
    return h11.Response(status_code=status, headers=headers, reason=reason)


def error_body(status: int, message: str) -> bytes:
    kind = "invalid_request_error" if status < 500 else "upstream_error"
    return msgspec.json.encode({"error": {"message": message, "type": kind, "code": status}})


# --- HTTP/1.1 over one stream -----------------------------------------------------------


class HttpConn:
    """h11 over an anyio byte stream: `next_event` reads as needed, `send` writes."""

    def __init__(self, stream: ByteStream, role: type[h11.CLIENT | h11.SERVER]) -> None:
        self.stream = stream
        self.h = h11.Connection(role)

    async def next_event(self) -> Any:
        while True:
            event = self.h.next_event()
            if event is not h11.NEED_DATA:
                return event
            try:
                data = await self.stream.receive(READ_CHUNK)
            except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
                data = b""
            self.h.receive_data(data)

    async def send(self, *events: Any) -> None:
        for event in events:
            data = self.h.send(event)
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


@dataclass
class UpstreamReply:
    status: int
    headers: list[tuple[bytes, bytes]]
    conn: HttpConn

    def header(self, name: bytes) -> bytes | None:
        return next((v for k, v in self.headers if k.lower() == name), None)

    @property
    def content_type(self) -> str:
        return (self.header(b"content-type") or b"application/json").decode("latin-1")

    async def chunks(self) -> AsyncIterator[bytes]:
        while True:
            event = await self.conn.next_event()
            if isinstance(event, h11.Data):
                yield bytes(event.data)
            elif isinstance(event, h11.EndOfMessage):
                return
            else:
                raise h11.RemoteProtocolError(f"the response ended early ({type(event).__name__}).")

    async def body(self) -> bytes:
        return b"".join([c async for c in self.chunks()])


@asynccontextmanager
async def upstream_request(
    up: Upstream, method: str, target: str, body: bytes, headers: list[tuple[str, str]], connect_timeout_s: float
) -> AsyncIterator[UpstreamReply]:
    """Send one request on a new connection and yield the response head; the body is read
    through the reply. Raises `UpstreamFailed`."""
    try:
        with anyio.fail_after(connect_timeout_s):
            stream: SocketStream = await anyio.connect_tcp(up.host, up.port)
    except (OSError, TimeoutError) as exc:
        raise UpstreamFailed(up, f"cannot connect ({exc or 'timed out'})", reached=False) from None
    async with stream:
        conn = HttpConn(stream, h11.CLIENT)
        head = [("Host", f"{up.host}:{up.port}"), ("Content-Length", str(len(body))), ("Connection", "close"), *headers]
        try:
            await conn.send(h11.Request(method=method, target=target, headers=head), h11.Data(data=body), h11.EndOfMessage())
            event = await conn.next_event()
            while isinstance(event, h11.InformationalResponse):
                event = await conn.next_event()
        except h11.RemoteProtocolError:  # h11's words for a close before any answer
            raise UpstreamFailed(up, "closed the connection before answering", reached=True) from None
        except (anyio.BrokenResourceError, anyio.EndOfStream, OSError) as exc:
            raise UpstreamFailed(up, f"broke off before answering ({exc or type(exc).__name__})", reached=True) from None
        if not isinstance(event, h11.Response):
            raise UpstreamFailed(up, "closed the connection before answering", reached=True)
        try:
            yield UpstreamReply(status=event.status_code, headers=list(event.headers), conn=conn)
        except (anyio.BrokenResourceError, anyio.EndOfStream, h11.RemoteProtocolError) as exc:
            raise UpstreamFailed(up, f"broke off mid-answer ({exc or type(exc).__name__})", reached=True) from None
