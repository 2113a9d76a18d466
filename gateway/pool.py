"""The gateway's upstream connection pool: per upstream, a stack of idle HTTP/1.1
connections (httpcore's, the HTTP core of httpx), the last used first.

httpcore's own pool (`AsyncConnectionPool`) walks every connection it holds, and asks
each idle one's socket whether it is readable (a system call), at the start and the end
of every request: with the 100-odd connections a gateway holds at 64 clients, that walk
cost more than the request itself. Here a request takes the top of its upstream's stack
and checks that one connection only; a connection that is not idle when its response
closes (a body not read to the end, a cancelled request, a server's `Connection:
close`) is closed by httpcore, never handed out again.

Requests go to httpcore's connections as they are, without httpx's `AsyncClient` on top
(its request and response models, cookies, auth and redirect layers cost a third of the
gateway's time per request, and the gateway uses none of them).

Each connection sends a request's head and body in one write, straight on the anyio
socket stream (`_Stream`).

At most `max_connections` requests are in flight at once (a request over it waits for
one to end, under the caller's deadline); at most `max_connections` idle connections are
kept, each for `keepalive_s`.
"""

from __future__ import annotations

import select
import socket
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpcore
from anyio.abc import SocketAttribute, SocketStream

Key = tuple[str, int]


class StackPool:
    def __init__(self, connect_timeout_s: float, max_connections: int, keepalive_s: float) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.max_connections = max_connections
        self.keepalive_s = keepalive_s
        self._idle: dict[Key, list[_Connection]] = {}
        # fast_acquire: a free slot is taken without a trip through the event loop.
        self._slots = anyio.Semaphore(max_connections, fast_acquire=True)

    async def send(self, key: Key, request: httpcore.Request) -> tuple[httpcore.Response, PooledBody]:
        """Send `request` on a pooled connection to `key` (host, port); the response's body
        is read, and its connection handed back, through the `PooledBody`."""
        await self._slots.acquire()
        try:
            conn = await self._idle_connection(key)
            if conn is None:
                conn = await self._connect(request.url.origin, key)
            response = await conn.handle_async_request(request)
        except BaseException:
            self._slots.release()
            raise
        return response, PooledBody(response.stream, self, key, conn)

    async def _idle_connection(self, key: Key) -> _Connection | None:
        stack = self._idle.get(key)
        while stack:
            conn = stack.pop()
            if conn.is_idle() and not conn.has_expired():  # expired, or closed by the server meanwhile
                return conn
            with anyio.CancelScope(shield=True):
                await conn.aclose()
        return None

    async def _connect(self, origin: httpcore.Origin, key: Key) -> _Connection:
        try:
            with anyio.fail_after(self.connect_timeout_s):
                stream = await anyio.connect_tcp(key[0], key[1])
        except TimeoutError:
            raise httpcore.ConnectTimeout(f"no connection within {self.connect_timeout_s:g} s") from None
        except OSError as exc:
            raise httpcore.ConnectError(str(exc) or type(exc).__name__) from None
        return _Connection(origin, _Stream(stream), keepalive_expiry=self.keepalive_s)

    async def _returned(self, key: Key, conn: _Connection) -> None:
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


class _Connection(httpcore.AsyncHTTP11Connection):
    """httpcore's HTTP/1.1 connection, without the lock around its state: this pool hands a
    connection to one request at a time, so the lock is never contended, and taking it
    cost two trips through the event loop per request (anyio's `Lock.acquire`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._state_lock = _Uncontended()


class _Uncontended:
    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, *exc: object) -> None:
        return None


class _Stream(httpcore.AsyncNetworkStream):
    """httpcore's view of an anyio socket stream. Writes wait until the next read:
    httpcore writes a request's head and body apart, and here they leave in one segment
    (one system call, and one wake-up of the server); the gateway holds each request body
    whole anyway. No timeouts here: the caller's deadline covers the request."""

    def __init__(self, stream: SocketStream) -> None:
        self._stream = stream
        self._out: list[bytes] = []

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if buffer:
            self._out.append(buffer)

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        try:
            if self._out:
                data = b"".join(self._out) if len(self._out) > 1 else self._out[0]
                self._out.clear()
                await self._stream.send(data)
            return await self._stream.receive(max_bytes)
        except anyio.EndOfStream:
            return b""
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
            raise httpcore.ReadError(str(exc) or type(exc).__name__) from None

    async def aclose(self) -> None:
        self._out.clear()
        await self._stream.aclose()

    def get_extra_info(self, info: str) -> Any:
        if info == "is_readable":  # an idle connection the server closed: readable, at EOF
            sock = self._stream.extra(SocketAttribute.raw_socket)
            return _readable(sock)
        return None


def _readable(sock: socket.socket) -> bool:
    poll = select.poll()
    poll.register(sock, select.POLLIN)
    return bool(poll.poll(0))


class PooledBody:
    """A response's body as it comes; `aclose` hands its connection back to the pool."""

    def __init__(self, stream: Any, pool: StackPool, key: Key, conn: _Connection) -> None:
        self._stream, self._pool, self._key, self._conn = stream, pool, key, conn
        self._closed = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for part in self._stream:
            yield part

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self._stream.aclose()  # httpcore shields its own clean-up
        finally:
            await self._pool._returned(self._key, self._conn)
