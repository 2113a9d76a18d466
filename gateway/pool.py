"""The gateway's upstream connection pool: an httpx transport that keeps, per upstream,
a stack of idle HTTP/1.1 connections (httpcore's), the last used first.

httpx's own pool (httpcore's `AsyncConnectionPool`) walks every connection it holds, and
asks each idle one's socket whether it is readable (a system call), at the start and
the end of every request: with the 100-odd connections a gateway holds at 64 clients,
that walk cost more than the request itself. Here a request takes the top of its
upstream's stack and checks that one connection only; a connection that is not idle
when its response closes (a body not read to the end, a cancelled request, a
server's `Connection: close`) is closed by httpcore, never handed out again.

Each connection sends a request's head and body in one write (`_Coalesced`).

At most `max_connections` requests are in flight at once (a request over it waits for
one to end, under the caller's deadline); at most `max_connections` idle connections are
kept, each for `keepalive_s`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import contextmanager
from typing import Any

import anyio
import httpcore
import httpx

# httpcore's errors as httpx names them, most specific first: the gateway sees one family.
_ERRORS: list[tuple[type[Exception], type[httpx.TransportError]]] = [
    (httpcore.ConnectTimeout, httpx.ConnectTimeout),
    (httpcore.ConnectError, httpx.ConnectError),
    (httpcore.TimeoutException, httpx.TimeoutException),
    (httpcore.ReadError, httpx.ReadError),
    (httpcore.WriteError, httpx.WriteError),
    (httpcore.NetworkError, httpx.NetworkError),
    (httpcore.RemoteProtocolError, httpx.RemoteProtocolError),
    (httpcore.LocalProtocolError, httpx.LocalProtocolError),
    (httpcore.ProtocolError, httpx.ProtocolError),
]


@contextmanager
def _as_httpx() -> Any:
    try:
        yield
    except Exception as exc:
        for theirs, ours in _ERRORS:
            if isinstance(exc, theirs):
                raise ours(str(exc)) from exc
        raise


Key = tuple[bytes, int]


class StackPool(httpx.AsyncBaseTransport):
    def __init__(self, connect_timeout_s: float, max_connections: int, keepalive_s: float) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.max_connections = max_connections
        self.keepalive_s = keepalive_s
        self._backend = httpcore.AnyIOBackend()  # anyio: asyncio and trio alike
        self._idle: dict[Key, list[httpcore.AsyncHTTP11Connection]] = {}
        self._slots = anyio.Semaphore(max_connections)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        key = (url.raw_host, url.port or 80)
        await self._slots.acquire()
        try:
            conn = await self._idle_connection(key)
            with _as_httpx():
                if conn is None:
                    conn = await self._connect(url, key)
                response = await conn.handle_async_request(httpcore.Request(
                    method=request.method,
                    url=httpcore.URL(scheme=url.raw_scheme, host=url.raw_host, port=url.port, target=url.raw_path),
                    headers=request.headers.raw, content=request.stream, extensions=request.extensions,
                ))
        except BaseException:
            self._slots.release()
            raise
        body = _Body(response.stream, self, key, conn)
        return httpx.Response(status_code=response.status, headers=response.headers, stream=body,
                              extensions=response.extensions)

    async def _idle_connection(self, key: Key) -> httpcore.AsyncHTTP11Connection | None:
        stack = self._idle.get(key)
        while stack:
            conn = stack.pop()
            if conn.is_idle() and not conn.has_expired():  # expired, or closed by the server meanwhile
                return conn
            with anyio.CancelScope(shield=True):
                await conn.aclose()
        return None

    async def _connect(self, url: httpx.URL, key: Key) -> httpcore.AsyncHTTP11Connection:
        stream = await self._backend.connect_tcp(url.host, key[1], timeout=self.connect_timeout_s)
        origin = httpcore.Origin(url.raw_scheme, url.raw_host, key[1])
        return httpcore.AsyncHTTP11Connection(origin, _Coalesced(stream), keepalive_expiry=self.keepalive_s)

    async def _returned(self, key: Key, conn: httpcore.AsyncHTTP11Connection) -> None:
        """A response closed: its connection is kept if httpcore left it idle."""
        self._slots.release()
        stack = self._idle.setdefault(key, [])
        if conn.is_idle() and len(stack) < self.max_connections:
            stack.append(conn)
        elif not conn.is_closed():
            with anyio.CancelScope(shield=True):
                await conn.aclose()

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            for stack in self._idle.values():
                while stack:
                    await stack.pop().aclose()


class _Coalesced(httpcore.AsyncNetworkStream):
    """A connection whose writes wait until the next read: httpcore writes a request's
    head and body apart, and here they leave in one segment (one system call, and one
    wake-up of the server). The gateway holds each request body whole anyway."""

    def __init__(self, inner: httpcore.AsyncNetworkStream) -> None:
        self._inner = inner
        self._out: list[bytes] = []

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if buffer:
            self._out.append(buffer)

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        if self._out:
            data = b"".join(self._out)
            self._out.clear()
            await self._inner.write(data, timeout)
        return await self._inner.read(max_bytes, timeout)

    async def aclose(self) -> None:
        self._out.clear()
        await self._inner.aclose()

    def get_extra_info(self, info: str) -> Any:
        return self._inner.get_extra_info(info)


class _Body(httpx.AsyncByteStream):
    def __init__(self, stream: Any, pool: StackPool, key: Key, conn: httpcore.AsyncHTTP11Connection) -> None:
        self._stream, self._pool, self._key, self._conn = stream, pool, key, conn
        self._closed = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        with _as_httpx():
            async for part in self._stream:
                yield part

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            with _as_httpx():
                await self._stream.aclose()  # httpcore shields its own clean-up
        finally:
            await self._pool._returned(self._key, self._conn)
