"""The gateway's TCP sockets: non-blocking sockets written as far as they go, waiting
through anyio (`wait_writable`) only when the kernel takes no more, and read once anyio
says they are readable (`wait_readable`), on asyncio (uvloop) and trio alike.

Why not anyio's socket streams: on asyncio each `send` there takes a trip through the
event loop even when the kernel took every byte, and each `receive` starts and stops the
transport's reading (two system calls); with three sockets written and read per proxied
request, that was a seventh of the gateway's time. Here a write the kernel takes whole
returns at once.
"""

from __future__ import annotations

import errno
import socket
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


class Stream:
    """A connected TCP socket: `receive` (b"" at the peer's end), `send`, `aclose`."""

    __slots__ = ("sock", "closed")

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
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

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            anyio.notify_closing(self.sock)  # wakes a task that waits on it
            self.sock.close()


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
            return Stream(sock)
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
            tg.start_soon(handle, Stream(sock))
