"""The gateway's TCP connections, on asyncio (uvloop) and trio alike: `receive` (b"" at
the peer's end), `send`, `readable`, `shutdown_write`, `close`.

On asyncio a connection is the event loop's transport (uvloop's, in C): bytes arrive by
callback, with the socket registered once, and a write the kernel takes whole returns at
once. On trio it is a non-blocking socket, read once trio says it is readable and written
as far as the kernel takes it. Why not anyio's socket streams: on asyncio each `send`
there takes a trip through the event loop even when the kernel took every byte, and each
`receive` starts and stops the transport's reading (two system calls), and three
connections are written and read per proxied request. A read through
`anyio.wait_readable` on asyncio costs two more system calls (the socket registered and
unregistered each time) and a future: moving from it to transports cut the gateway's
CPU per request by about a third.
"""

from __future__ import annotations

import asyncio
import errno
import socket
import struct
import sys
from collections.abc import Awaitable, Callable

import anyio
import structlog

log = structlog.get_logger("kvbroker.gateway")

# A send or receive that found the socket not ready.
_NOT_READY = (BlockingIOError, InterruptedError)
# accept() running out of file descriptors or memory: wait and take the next one later.
_ACCEPT_BACKOFF = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


class SocketClosed(Exception):
    """The connection broke (reset, or closed here) while it was read or written."""


# Bytes read and not yet taken past which a transport stops reading, until they are.
MAX_BUFFERED = 256 << 10
# How long a closed connection may take to send what is left of its last answer: a client
# that stopped reading would otherwise hold the connection, and those bytes, for ever.
CLOSE_GRACE_S = 10.0
_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() resets, and drops what is unsent


def _reset(sock: object) -> None:
    """Make closing `sock` drop what is still unsent (a reset), kernel buffers included."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)  # type: ignore[attr-defined]
    except (OSError, AttributeError):
        pass  # closed already, or no socket under it


class TransportStream(asyncio.Protocol):
    """A connection on asyncio: the event loop's transport, bytes kept as they arrive."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False  # closed here, or lost
        self._closed_here = False
        self._lost = False
        self._parts: list[bytes] = []
        self._size = 0
        self._eof = False
        self._paused = False
        self._waiter: asyncio.Future[None] | None = None
        self._room: asyncio.Future[None] | None = None  # while the transport's write buffer is full

    # --- the event loop's callbacks ---

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self._parts.append(data)
        self._size += len(data)
        if self._size > MAX_BUFFERED and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool:
        self._eof = True
        self._wake()
        return True  # half-closed: the answer may still go out

    def connection_lost(self, exc: Exception | None) -> None:
        self._eof = self.closed = self._lost = True
        self._wake()
        self.resume_writing()

    def pause_writing(self) -> None:
        if self._room is None:
            self._room = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        room, self._room = self._room, None
        if room is not None and not room.done():
            room.set_result(None)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # --- the stream ---

    async def receive(self, max_bytes: int) -> bytes:
        while not self._parts:
            if self._closed_here:
                raise SocketClosed("the connection was closed here")
            if self._eof:
                return b""
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        parts = self._parts
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        if len(data) > max_bytes:
            data, rest = data[:max_bytes], data[max_bytes:]
            self._parts, self._size = [rest], len(rest)
        else:
            self._parts, self._size = [], 0
        if self._paused and self._size <= MAX_BUFFERED and self.transport is not None:
            self._paused = False
            self.transport.resume_reading()
        return data

    async def send(self, data: bytes) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            raise SocketClosed("the connection is closed")
        transport.write(data)
        while self._room is not None:  # the kernel took less: wait for the transport's buffer to drain
            await self._room
            if self.closed:
                raise SocketClosed("the connection broke while sending")

    def readable(self) -> bool:
        """Whether a read would not wait: bytes, or the peer's end, have come (for an idle
        connection, the server closed it)."""
        return bool(self._parts) or self._eof

    def shutdown_write(self) -> None:
        if self.transport is not None and self.transport.can_write_eof() and not self.transport.is_closing():
            self.transport.write_eof()

    def close(self, cut_short: bool = False) -> None:
        """Close once what was sent has left. `cut_short`: the last answer was, so what of
        it is still unsent is dropped at once; else a client that reads none of it for
        CLOSE_GRACE_S loses it. Either way the connection, and its buffer, are freed."""
        if not self._closed_here:
            self._closed_here = self.closed = True
            transport = self.transport
            if transport is not None:
                if cut_short and transport.get_write_buffer_size():
                    self._abort_if_open()
                else:
                    transport.close()  # it waits for its write buffer to drain
                    if transport.get_write_buffer_size():
                        asyncio.get_running_loop().call_later(CLOSE_GRACE_S, self._abort_if_open)
            self._wake()

    def _abort_if_open(self) -> None:
        transport = self.transport
        if transport is not None and not self._lost:
            _reset(transport.get_extra_info("socket"))
            transport.abort()


class SocketStream:
    """A connection on trio: a non-blocking socket."""

    __slots__ = ("sock", "closed")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.closed = False

    async def receive(self, max_bytes: int) -> bytes:
        """The next bytes, once some came. It waits before it reads: the gateway reads
        when it expects an answer or a next request, which has seldom come yet, and a
        read that finds nothing costs a system call and an exception."""
        while True:
            try:
                await anyio.wait_readable(self.sock)
            except anyio.ClosedResourceError:
                raise SocketClosed("the connection was closed here") from None
            try:
                return self.sock.recv(max_bytes)
            except _NOT_READY:
                pass
            except OSError as exc:
                if self.closed:
                    raise SocketClosed("the connection was closed here") from None
                if exc.errno in (errno.ECONNRESET, errno.ECONNABORTED, errno.ETIMEDOUT, errno.EPIPE):
                    return b""  # the peer is gone: as an end, for the reader
                raise SocketClosed(str(exc)) from None

    async def send(self, data: bytes) -> None:
        view: memoryview | None = None
        while True:
            try:
                sent = self.sock.send(data if view is None else view)
            except _NOT_READY:
                sent = 0
            except OSError as exc:
                raise SocketClosed(str(exc) or type(exc).__name__) from None
            total = len(data) if view is None else len(view)
            if sent == total:
                return
            view = (memoryview(data) if view is None else view)[sent:]
            try:
                await anyio.wait_writable(self.sock)
            except anyio.ClosedResourceError:
                raise SocketClosed("the connection was closed here") from None

    def readable(self) -> bool:
        """Whether a read would not wait: bytes, or the peer's end, have come (for an idle
        connection, the server closed it)."""
        try:
            self.sock.recv(1, socket.MSG_PEEK)
        except _NOT_READY:
            return False
        except OSError:
            pass
        return True

    def shutdown_write(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def close(self, cut_short: bool = False) -> None:
        """Close at once: what the kernel still holds it sends, or drops, on its own
        (`cut_short` changes nothing here: no byte waits in this process)."""
        if not self.closed:
            self.closed = True
            anyio.notify_closing(self.sock)  # wakes a task that waits on it
            self.sock.close()


Stream = TransportStream | SocketStream


async def wrap(sock: socket.socket) -> Stream:
    """A connected socket as the running event loop's stream."""
    sock.setblocking(False)
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # not asyncio: trio
        return SocketStream(sock)
    _, stream = await loop.connect_accepted_socket(TransportStream, sock)
    return stream


async def connect(host: str, port: int) -> Stream:
    """A connection to host:port (each address it resolves to in turn); OSError if none
    takes it. The caller's deadline bounds the wait."""
    try:
        infos = [(socket.AF_INET6 if ":" in host else socket.AF_INET, (host, port))]
        socket.inet_pton(infos[0][0], host)
    except OSError:  # a name, not an address
        infos = [(fam, addr) for fam, _, _, _, addr in await anyio.getaddrinfo(host, port, type=socket.SOCK_STREAM)]
    last: OSError = OSError(f"{host} resolves to no address")
    for family, addr in infos:
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            try:
                sock.connect(addr)
            except _NOT_READY:
                await anyio.wait_writable(sock)
                err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if err:
                    raise OSError(err, f"{errno.errorcode.get(err, err)} connecting to {host}:{port}")
            return await wrap(sock)
        except OSError as exc:
            sock.close()
            last = exc
        except BaseException:
            sock.close()
            raise
    raise last


async def listen(host: str, port: int) -> list[socket.socket]:
    """Listening sockets on every address `host` names (one port for all of them; port 0
    picks a free one)."""
    infos = await anyio.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    socks: list[socket.socket] = []
    try:
        for family, _, _, _, addr in dict.fromkeys(infos):
            sock = socket.socket(family, socket.SOCK_STREAM)
            socks.append(sock)
            if sys.platform != "win32":
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            if port == 0 and len(socks) > 1:  # the port the first address got, for all
                addr = (addr[0], socks[0].getsockname()[1], *addr[2:])
            sock.bind(addr)
            sock.listen(socket.SOMAXCONN)
            sock.setblocking(False)
    except BaseException:
        for sock in socks:
            sock.close()
        raise
    return socks


async def serve(listener: socket.socket, handle: Callable[[Stream], Awaitable[None]], tg: anyio.abc.TaskGroup) -> None:
    """Accept connections forever, each handled in a task of `tg`."""
    while True:
        await anyio.wait_readable(listener)
        while True:
            try:
                sock, _ = listener.accept()
            except _NOT_READY + (ConnectionAbortedError,):
                break
            except OSError as exc:
                if exc.errno not in _ACCEPT_BACKOFF:
                    raise
                log.warning("gateway.accept_failed", error=str(exc))
                await anyio.sleep(0.1)
                break
            tg.start_soon(_handle, handle, sock)


async def _handle(handle: Callable[[Stream], Awaitable[None]], sock: socket.socket) -> None:
    try:
        stream = await wrap(sock)
    except BaseException:
        sock.close()
        raise
    await handle(stream)
