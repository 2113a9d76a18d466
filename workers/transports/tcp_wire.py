"""What both ends of the TCP transport share: the wire format, limits, errors, socket helpers
and `Completion`. The public surface is `workers.transports.tcp`.

Wire format
-----------
A connection carries transfers one after another (P caches idle connections)::

    P -> D  header   struct "!4sBBHIQ128s", 148 bytes: magic b"KVBT", version, flags
                     (0), id length, attempt, nbytes, transfer id (UTF-8, 1..128 bytes,
                     zero-padded)
            payload  nbytes bytes
    D -> P  status   one byte: ACK once the payload is in D's buffer, or a rejection
                     code, after which D closes the connection.

The id is padded to a fixed size so D reads the whole header in one call: every
socket call releases the GIL, and in a busy process each release can cost a wait of
up to ``sys.getswitchinterval()`` (5 ms) to get it back, so a transfer makes as few
calls as it can (D: header, payload, ack; P: one gathered write, ack).

Deadlines are the kernel's: sockets stay in blocking mode with ``SO_RCVTIMEO`` and
``SO_SNDTIMEO`` set, so a call that stalls past its deadline fails with
``BlockingIOError`` without Python polling before every call.
"""

from __future__ import annotations

import math
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.lowlevel
import torch

from protocols.errors import KvBrokerError, RecvTimeout, TransferFailed
from workers.waker import make_waker

MAGIC = b"KVBT"
VERSION = 1
MAX_ID_BYTES = 128
HEADER = struct.Struct(f"!4sBBHIQ{MAX_ID_BYTES}s")
ACK = 0x06
# Rejection codes D sends before closing the connection.
REJECT_BAD_HEADER, REJECT_UNKNOWN, REJECT_ATTEMPT, REJECT_SIZE, REJECT_BUSY = 0x10, 0x11, 0x12, 0x13, 0x14
REJECT_TEXT = {
    REJECT_BAD_HEADER: "the header is malformed (magic, version or id)",
    REJECT_UNKNOWN: "the receiver expects no such transfer (never registered, already received or cancelled)",
    REJECT_ATTEMPT: "the receiver expects another attempt of this transfer",
    REJECT_SIZE: "the receiver expects another number of bytes",
    REJECT_BUSY: "another connection is already receiving this transfer",
}


@dataclass(frozen=True)
class TcpConfig:
    """Deadlines and limits of the transport; the defaults suit a LAN or loopback.

    Attributes:
        io_timeout_s: longest a single socket read or write may stall mid-transfer.
        connect_timeout_s: longest a connect to a receiver may take.
        idle_timeout_s: a receiver closes a connection idle this long between transfers.
        max_connections: connections a receiver serves at once (one thread each).
        max_expected: transfers a receiver may have registered at once.
        max_idle_per_endpoint: idle connections a sender keeps per receiver for reuse.
        socket_buffer: SO_SNDBUF/SO_RCVBUF in bytes; None keeps the kernel's autotuning,
            which suits any network (a fixed buffer caps a stream at buffer / RTT).
    """

    io_timeout_s: float = 10.0
    connect_timeout_s: float = 5.0
    idle_timeout_s: float = 60.0
    max_connections: int = 256
    max_expected: int = 65536
    max_idle_per_endpoint: int = 8
    socket_buffer: int | None = None

    def __post_init__(self) -> None:
        if min(self.io_timeout_s, self.connect_timeout_s, self.idle_timeout_s) <= 0:
            raise ValueError("io_timeout_s, connect_timeout_s and idle_timeout_s must be > 0 seconds")
        if self.max_connections < 1 or self.max_expected < 1 or self.max_idle_per_endpoint < 0:
            raise ValueError("max_connections and max_expected must be >= 1, max_idle_per_endpoint >= 0")


class TcpTransportError(KvBrokerError):
    """This process misused the transport (a bad buffer, a duplicate registration...)."""


class SourceInUse(TcpTransportError):
    """A cancelled send's thread still reads its source after the deadline: do not release it."""


class SendFailed(TransferFailed):
    """P could not deliver the bytes; D has not acknowledged them."""


class TransferRejected(SendFailed):
    """D refused the header (unknown transfer, wrong attempt or size); `code` says which."""

    def __init__(self, transfer_id: str, code: int) -> None:
        super().__init__(transfer_id, REJECT_TEXT.get(code, f"the receiver answered unknown status 0x{code:02x}"))
        self.code = code


class RecvFailed(TransferFailed):
    """D did not get the whole payload: the sender vanished or the receiver closed."""


class TransferCancelled(RecvFailed):
    """The receiving side gave the transfer up (`TcpReceiver.cancel`)."""


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``"tcp://HOST:PORT"`` (HOST may be ``[v6]``) -> (host, port)."""
    if not endpoint.startswith("tcp://"):
        raise ValueError(f"a TCP endpoint looks like tcp://HOST:PORT, not {endpoint!r}")
    host, sep, port = endpoint[6:].rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"a TCP endpoint looks like tcp://HOST:PORT, not {endpoint!r}")
    return host.strip("[]"), int(port)


def encode_id(transfer_id: str) -> bytes:
    raw = transfer_id.encode()
    if not 0 < len(raw) <= MAX_ID_BYTES:
        raise TcpTransportError(f"a transfer id must be 1..{MAX_ID_BYTES} UTF-8 bytes, not {transfer_id!r}")
    return raw


def byte_view(data: Any, *, writable: bool) -> memoryview:
    """A flat 'B' memoryview of a CPU tensor, bytes-like or memoryview; never a copy."""
    if isinstance(data, torch.Tensor):
        if data.device.type != "cpu" or not data.is_contiguous():
            raise TcpTransportError(
                f"the TCP transport needs a contiguous CPU buffer, not a {data.device} tensor with strides "
                f"{data.stride()}; stage the bytes in a CPU pool lease"
            )
        flat = data.detach().reshape(-1)
        return memoryview(flat.view(torch.uint8).numpy())  # type: ignore[arg-type]  # numpy arrays are buffers
    view = memoryview(data)
    if not view.c_contiguous:
        raise TcpTransportError("the TCP transport needs a C-contiguous buffer")
    if view.format != "B" or view.ndim != 1:
        view = view.cast("B")
    if writable and view.readonly:
        raise TcpTransportError("the receive buffer is read-only; pass a writable buffer such as a pool lease's tensor")
    return view


# -- socket helpers --------------------------------------------------------------------


def timeval(seconds: float) -> bytes:
    """A ``struct timeval`` for SO_RCVTIMEO / SO_SNDTIMEO."""
    whole = int(seconds)
    return struct.pack("ll", whole, int((seconds - whole) * 1e6))


def configure(sock: socket.socket, config: TcpConfig) -> None:
    """Blocking mode with kernel deadlines, no Nagle delay, optional fixed buffers."""
    sock.settimeout(None)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval(config.io_timeout_s))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval(config.io_timeout_s))
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if config.socket_buffer:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, config.socket_buffer)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, config.socket_buffer)


def recv_exact(sock: socket.socket, view: memoryview) -> int:
    """Fill `view` from `sock`; return the bytes received (short only at EOF).

    ``MSG_WAITALL`` makes a whole payload one call in the common case. Raises
    BlockingIOError when a call gets nothing within SO_RCVTIMEO, OSError on a reset.
    """
    n, got = len(view), 0
    while got < n:
        k = sock.recv_into(view[got:], n - got, socket.MSG_WAITALL)
        if k == 0:
            break
        got += k
    return got


# Buffers one sendmsg or recvmsg_into call takes (Linux's IOV_MAX).
IOV_MAX = 1024


def recv_exact_into(sock: socket.socket, views: list[memoryview]) -> int:
    """Fill `views` ('B' memoryviews) in order from `sock`, `IOV_MAX` to a call; return the
    bytes received (short only at EOF). `recv_exact` for a payload that lands in many
    places (a request's KV straight into its cache blocks). Raises as `recv_exact`."""
    views = [v for v in views if len(v)]  # a call given no room at all waits for bytes it cannot take
    got = 0
    i, pending = 0, list(views[:IOV_MAX])
    while pending:
        k = sock.recvmsg_into(pending, 0, socket.MSG_WAITALL)[0]
        if k == 0:
            break
        got += k
        while pending and k >= len(pending[0]):  # the views filled whole
            k -= len(pending.pop(0))
            i += 1
        if pending:
            pending[0] = pending[0][k:]  # one filled in part
        if len(pending) < IOV_MAX and i + len(pending) < len(views):
            pending += views[i + len(pending) : i + IOV_MAX]
    return got


def send_buffers(sock: socket.socket, buffers: list[Any]) -> int:
    """Write `buffers` ('B' memoryviews or bytes) in order, `IOV_MAX` to a call, resuming
    after a partial write; the bytes written."""
    total = sum(len(b) for b in buffers)
    i = 0
    while i < len(buffers):
        sent = sock.sendmsg(buffers[i : i + IOV_MAX])
        while i < len(buffers) and sent >= len(buffers[i]):
            sent -= len(buffers[i])
            i += 1
        if sent:  # the kernel took part of buffer i
            buffers[i] = memoryview(buffers[i])[sent:]
    return total


def drain_and_finish(sock: socket.socket, max_bytes: int = 1 << 20, max_s: float = 0.5) -> None:
    """Half-close after a rejection code and read what the peer still sends, within bounds.

    Closing with unread bytes makes the kernel send a reset, which can destroy the code
    byte before the peer reads it; draining a little first lets the code arrive.
    """
    sock.shutdown(socket.SHUT_WR)
    deadline = time.monotonic() + max_s
    scratch = bytearray(64 * 1024)
    while max_bytes > 0:
        left = deadline - time.monotonic()
        if left <= 0 or not _readable(sock, left):
            return
        k = sock.recv_into(scratch)
        if k == 0:
            return
        max_bytes -= k


def shutdown(sock: socket.socket) -> None:
    """Wake any thread blocked on `sock` (it sees EOF or an error); safe to repeat."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


_TCP_ESTABLISHED = 1


def still_open(sock: socket.socket) -> bool:
    """Whether an idle connection can carry another transfer (the peer has not closed it).

    On Linux this reads the TCP state with getsockopt, which keeps the GIL (no thread
    switch); elsewhere it polls the socket, where readable-while-idle means EOF.
    """
    if hasattr(socket, "TCP_INFO"):
        try:
            return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0] == _TCP_ESTABLISHED
        except OSError:
            return False
    return not _readable(sock, 0)


def _readable(sock: socket.socket, timeout_s: float) -> bool:
    """Whether `sock` has something to read (or its end) within `timeout_s`. poll, not
    select.select: that refuses descriptors >= 1024, common in a vLLM process."""
    readable = select.poll()
    readable.register(sock, select.POLLIN)
    return bool(readable.poll(math.ceil(timeout_s * 1000)))


# -- completion ------------------------------------------------------------------------


class Completion:
    """The outcome of one expected transfer, settled exactly once.

    It is settled (with the byte count, or an error) only after nothing writes into its
    buffer any more, so once `wait()` returns or raises, the buffer's lease may be
    released.
    """

    def __init__(self, transfer_id: str, attempt: int, nbytes: int) -> None:
        self.transfer_id = transfer_id
        self.attempt = attempt
        self.nbytes = nbytes
        self._lock = threading.Lock()
        self._settled = threading.Event()
        self._error: TransferFailed | None = None
        self._wakers: list[Callable[[], None]] = []

    def done(self) -> bool:
        return self._settled.is_set()

    def result(self) -> int:
        """The bytes received. Raises the transfer's error, or RuntimeError if it is not settled."""
        if not self._settled.is_set():
            raise RuntimeError(f"transfer {self.transfer_id} is still pending; await wait() first")
        if self._error is not None:
            raise self._error
        return self.nbytes

    async def wait(self) -> int:
        """Wait until the payload is in the buffer; no timeout (wrap in ``anyio.fail_after``).

        Raises: RecvFailed (or TransferCancelled, RecvTimeout) when the transfer failed.
        """
        event: anyio.Event | None = None
        with self._lock:
            if not self._settled.is_set():
                event = anyio.Event()
                waker = make_waker(event)
                self._wakers.append(waker)
        if event is None:
            await anyio.lowlevel.checkpoint()
        else:
            try:
                await event.wait()
            finally:
                with self._lock:
                    if waker in self._wakers:
                        self._wakers.remove(waker)
        return self.result()

    def wait_blocking(self, timeout: float) -> int:
        """`wait` for synchronous code. Raises RecvTimeout after `timeout` s (the transfer stays pending)."""
        if not self._settled.wait(timeout):
            raise RecvTimeout(self.transfer_id, f"no complete payload within {timeout:g} s")
        return self.result()

    def wait_settled(self, timeout: float) -> bool:
        """Block until settled, success or not; False if `timeout` passed first."""
        return self._settled.wait(timeout)

    def settle(self, error: TransferFailed | None) -> None:
        """Record the outcome and wake every waiter; later calls do nothing. For the receiver only."""
        with self._lock:
            if self._settled.is_set():
                return
            self._error = error
            self._settled.set()
            wakers, self._wakers = self._wakers, []
        for wake in wakers:
            try:
                wake()
            except (RuntimeError, anyio.RunFinishedError):
                continue  # the waiter's event loop is gone; nobody is left to wake
