"""The CPU transport: a direct P -> D byte stream over TCP, received straight into pool memory.

Theory of operation
-------------------
The broker only arranges a transfer; its bytes go straight from the prefill worker (P)
to the decode worker (D). D registers each transfer it expects (`TcpReceiver.expect`:
id, attempt, destination buffer) *before* it tells the broker Ready, so when P's bytes
arrive their destination is known and the kernel copies them straight into it:
``recv_into`` on a memoryview of the pool tensor, no intermediate ``bytes``. P writes
from a memoryview of its staging lease (``sendmsg``, no copy) and `TcpSender.send`
returns only once D has acknowledged the *whole* payload, so "sent" means "D has it",
not "left our socket" (the Mooncake pitfall in DESIGN.md).

Threads move the bytes, not an event loop: ``recv_into`` and ``sendmsg`` release the
GIL for the whole kernel copy, and with ``MSG_WAITALL`` a payload is received in one
call, so Python costs nothing per chunk and the stream runs at loopback speed
(`bench/tcp_transport.py` compares it with a bare socket). The receiver owns one
accept thread and one thread per connection, and joins them all in `close()`; a
sender runs each send on the calling thread (`send_blocking`) or on an anyio worker
thread (`send`). Async callers use `Completion.wait()` and `TcpSender.send()`.

The wire format and the socket helpers live in `tcp_wire`, the receiver in
`tcp_receiver`; this module is the public surface and holds the sender.

Deadlines and faults
--------------------
* Every socket read and write has a deadline: the kernel's ``SO_RCVTIMEO`` and
  ``SO_SNDTIMEO`` (`TcpConfig.io_timeout_s`) bound each call, so a stalled peer is
  noticed within that time; connecting has `connect_timeout_s`; an idle connection
  between transfers is closed after `idle_timeout_s`. The whole transfer's deadline
  is the caller's: wrap `Completion.wait()` or `TcpSender.send()` in
  ``anyio.fail_after``, and call `TcpReceiver.cancel()` when a receive's fires.
* A peer that vanishes mid-stream (EOF, reset, timeout) fails that transfer's
  `Completion` with `RecvFailed`; a completion is settled only once nothing writes to
  its buffer any more, so the caller may then release its pool lease. Likewise a
  cancelled `send()` returns only once its thread no longer reads the source.
* A header that does not fit (bad magic or version, unknown transfer, wrong attempt
  or size) is answered with a rejection code, logged, and its connection closed. It
  never affects other connections or the expected transfer it named.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.to_thread
import structlog

from protocols.errors import SendTimeout

from .tcp_receiver import ReceiverStats, TcpReceiver
from .tcp_wire import (
    ACK,
    HEADER,
    MAGIC,
    MAX_ID_BYTES,
    REJECT_ATTEMPT,
    REJECT_BAD_HEADER,
    REJECT_BUSY,
    REJECT_SIZE,
    REJECT_UNKNOWN,
    VERSION,
    Completion,
    RecvFailed,
    SendFailed,
    SourceInUse,
    TcpConfig,
    TcpTransportError,
    TransferCancelled,
    TransferRejected,
    byte_view,
    configure,
    encode_id,
    parse_endpoint,
    send_buffers,
    shutdown,
    still_open,
)

__all__ = [
    "ACK",
    "HEADER",
    "MAGIC",
    "MAX_ID_BYTES",
    "REJECT_ATTEMPT",
    "REJECT_BAD_HEADER",
    "REJECT_BUSY",
    "REJECT_SIZE",
    "REJECT_UNKNOWN",
    "VERSION",
    "Completion",
    "ReceiverStats",
    "RecvFailed",
    "SendFailed",
    "SenderStats",
    "SourceInUse",
    "TcpConfig",
    "TcpReceiver",
    "TcpSender",
    "TcpTransportError",
    "TransferCancelled",
    "TransferRejected",
    "byte_view",
    "parse_endpoint",
]

log = structlog.get_logger("kvbroker.tcp")


class _SendOp:
    """One send in progress, so a cancelled async caller can interrupt its thread."""

    def __init__(self, stop: Callable[[], None] | None = None) -> None:
        self.lock = threading.Lock()
        self.sock: socket.socket | None = None
        self.aborted = False
        self.started = False
        self.finished = threading.Event()
        self.stop = stop  # ends a wait for the payload's next part (`TcpSender.send_parts`)

    def attach(self, sock: socket.socket) -> None:
        with self.lock:
            self.sock = sock
            if self.aborted:
                shutdown(sock)

    def begin(self) -> bool:
        """Called by the sending thread first; False: aborted before it started, do not touch the data."""
        with self.lock:
            self.started = not self.aborted
            return self.started

    def abort(self) -> None:
        with self.lock:
            if self.finished.is_set():
                return
            self.aborted = True
            if not self.started:
                self.finished.set()  # the thread never ran (or will see `aborted` and not read the data)
            elif self.sock is not None:
                shutdown(self.sock)
        if self.stop is not None:
            self.stop()


@dataclass(frozen=True)
class SenderStats:
    sent: int
    bytes: int
    failed: int
    connects: int
    reused: int
    idle: int


class TcpSender:
    """Sends staged bytes to receivers' endpoints, reusing idle connections per endpoint.

    Thread-safe: any number of sends may run at once (each on its own connection).
    """

    def __init__(self, config: TcpConfig | None = None, *, log_context: dict[str, Any] | None = None) -> None:
        self.config = config or TcpConfig()
        self._log = log.bind(**(log_context or {}))
        self._lock = threading.Lock()
        self._idle: dict[str, list[tuple[socket.socket, float]]] = {}  # per endpoint: (connection, idle since)
        self._active: set[_SendOp] = set()
        self._closed = False
        self._sent = self._bytes = self._failed = self._connects = self._reused = 0

    async def send(self, endpoint: str, transfer_id: str, attempt: int, data: Any) -> None:
        """Send `data` as attempt `attempt` of `transfer_id`; return once D acknowledged all of it.

        No timeout argument: each socket call has `io_timeout_s`; wrap the call in
        ``anyio.fail_after`` for a whole-transfer deadline. Cancelled, it interrupts the
        stream and returns only once the thread has let go of `data`.

        Raises:
            SendFailed, TransferRejected, SendTimeout: D does not have the bytes.
        """
        view = byte_view(data, writable=False)
        await self._run(_SendOp(), endpoint, transfer_id, attempt, len(view), [[view]])

    async def send_parts(self, endpoint: str, transfer_id: str, attempt: int, nbytes: int,
                         parts: Iterable[list[memoryview]], *, stop: Callable[[], None] | None = None) -> None:
        """`send` for a payload that becomes ready part by part: `parts` yields lists of
        'B' buffers in payload order, `nbytes` in all, and may block until its next part
        is ready (it is iterated on the sending thread), so the stream starts before its
        last part exists. An exception from `parts`, or parts holding other than `nbytes`
        bytes, breaks the stream: D's receive fails.
        `stop` is called if the send is cancelled, to end a wait inside `parts`.

        Raises:
            as `send`, and whatever `parts` raises.
        """
        await self._run(_SendOp(stop), endpoint, transfer_id, attempt, nbytes, parts)

    async def _run(self, op: _SendOp, endpoint: str, transfer_id: str, attempt: int, nbytes: int,
                   parts: Iterable[list[memoryview]]) -> None:
        try:
            await anyio.to_thread.run_sync(self._send, op, endpoint, transfer_id, attempt, nbytes, parts,
                                           abandon_on_cancel=True)
        except anyio.get_cancelled_exc_class():
            op.abort()
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(op.finished.wait, self.config.io_timeout_s + self.config.connect_timeout_s)
            if not op.finished.is_set():
                raise SourceInUse(f"transfer {transfer_id}: the cancelled send still reads its source") from None
            raise

    def send_blocking(self, endpoint: str, transfer_id: str, attempt: int, data: Any) -> None:
        """`send` for synchronous code (a vLLM worker thread, a benchmark)."""
        view = byte_view(data, writable=False)
        self._send(_SendOp(), endpoint, transfer_id, attempt, len(view), [[view]])

    def close(self) -> None:
        """Close idle connections and interrupt sends in flight."""
        with self._lock:
            self._closed = True
            idle = [s for socks in self._idle.values() for s, _ in socks]
            self._idle.clear()
            active = list(self._active)
        for sock in idle:
            sock.close()
        for op in active:
            op.abort()

    def statistics(self) -> SenderStats:
        with self._lock:
            idle = sum(len(s) for s in self._idle.values())
            return SenderStats(self._sent, self._bytes, self._failed, self._connects, self._reused, idle)

    def __enter__(self) -> TcpSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _send(self, op: _SendOp, endpoint: str, transfer_id: str, attempt: int, nbytes: int,
              parts: Iterable[list[memoryview]]) -> None:
        if not op.begin():
            raise SendFailed(transfer_id, "the send was cancelled")
        with self._lock:
            self._active.add(op)
        sock: socket.socket | None = None
        ok = False
        try:
            tid = encode_id(transfer_id)
            header = HEADER.pack(MAGIC, VERSION, 0, len(tid), attempt, nbytes, tid)
            sock = self._checkout(endpoint, transfer_id)
            op.attach(sock)
            # The header goes with the first part: one gathered write where the kernel
            # takes it all (every socket call gives up the GIL once).
            head: list[Any] = [header]
            sent = 0  # payload bytes
            it = iter(parts)
            for part in it:
                if op.aborted:
                    raise SendFailed(transfer_id, "the send was cancelled")
                buffers = list(part)
                sent += sum(len(b) for b in buffers)
                if sent == nbytes:
                    # D acks once its last byte arrives: before writing it, see that no bytes follow
                    for extra in it:
                        sent += sum(len(b) for b in extra)
                        if sent > nbytes:
                            break
                if sent > nbytes:
                    # None of this part goes out, so D never acks a payload we call malformed; the header
                    # does if it has not yet, so D's receive fails when we close, not at its deadline.
                    send_buffers(sock, head)
                    raise SendFailed(transfer_id, f"the payload's parts held more than the {nbytes} B announced")
                send_buffers(sock, head + buffers)
                head = []
            if head:
                send_buffers(sock, head)
            if sent != nbytes:  # D would wait for the rest until its deadline: break the stream now
                raise SendFailed(transfer_id, f"the payload's parts held {sent} B of the {nbytes} B announced")
            status = sock.recv(1)
            if not status:
                raise self._failure(op, transfer_id, f"{endpoint} closed the connection before acknowledging")
            if status[0] != ACK:
                raise TransferRejected(transfer_id, status[0])
            ok = True
        except BlockingIOError:
            raise SendTimeout(transfer_id, f"{endpoint} stalled for {self.config.io_timeout_s:g} s") from None
        except OSError as exc:
            raise self._failure(op, transfer_id, f"the stream to {endpoint} broke: {exc}") from None
        finally:
            with op.lock:
                op.finished.set()
            with self._lock:
                self._active.discard(op)
                if ok:
                    self._sent += 1
                    self._bytes += nbytes
                else:
                    self._failed += 1
            if sock is not None:
                if ok:
                    self._checkin(endpoint, sock)
                else:
                    sock.close()

    def _failure(self, op: _SendOp, transfer_id: str, why: str) -> SendFailed:
        if op.aborted:
            return SendFailed(transfer_id, "the send was cancelled")
        return SendFailed(transfer_id, why)

    def _checkout(self, endpoint: str, transfer_id: str) -> socket.socket:
        """An idle connection to `endpoint` that is still open, else a new one."""
        with self._lock:
            if self._closed:
                raise SendFailed(transfer_id, "the sender is closed")
            idle = self._idle.get(endpoint, [])
            # A receiver closes a connection idle `idle_timeout_s` (the same default on
            # both sides): one idle half that long is left alone, so that a header never
            # crosses the receiver's close on the wire, which fails the send.
            fresh = time.monotonic() - self.config.idle_timeout_s / 2
            while idle:
                sock, since = idle.pop()
                if since > fresh and still_open(sock):
                    self._reused += 1
                    return sock
                sock.close()
        host, port = parse_endpoint(endpoint)
        try:
            sock = socket.create_connection((host, port), timeout=self.config.connect_timeout_s)
        except OSError as exc:
            raise SendFailed(transfer_id, f"cannot connect to {endpoint} ({exc}); check that the decode "
                             "instance runs and that its tcp_host is an address this host can reach") from None
        configure(sock, self.config)
        with self._lock:
            self._connects += 1
        return sock

    def _checkin(self, endpoint: str, sock: socket.socket) -> None:
        with self._lock:
            idle = self._idle.setdefault(endpoint, [])
            if not self._closed and len(idle) < self.config.max_idle_per_endpoint:
                idle.append((sock, time.monotonic()))
                return
        sock.close()
