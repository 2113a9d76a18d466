"""The decode side of the TCP transport: `TcpReceiver` (see `workers.transports.tcp`).

Threads: one accept thread, and one thread per connection that reads a header,
claims the expected transfer it names, receives the payload straight into that
transfer's buffer, acknowledges and settles the `Completion`. `close()` wakes every
thread (a socket shutdown ends any blocked call at once) and joins them all.
"""

from __future__ import annotations

import selectors
import socket
import threading
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.to_thread
import structlog

from protocols.errors import RecvTimeout, TransferFailed

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
    TcpConfig,
    TcpTransportError,
    TransferCancelled,
    byte_view,
    configure,
    drain_and_finish,
    encode_id,
    recv_exact,
    recv_exact_into,
    shutdown,
    timeval,
)

log = structlog.get_logger("kvbroker.tcp")

ACCEPT_BACKOFF_S = 0.1  # pause after a failed accept (EMFILE...) before trying again


@dataclass
class _Expected:
    completion: Completion
    views: list[memoryview]  # filled in order: a buffer, or the places its bytes go (`expect`'s `into`)
    conn: _Conn | None = None  # the connection receiving into `view` right now
    cancel_reason: str | None = None


class _Conn:
    def __init__(self, sock: socket.socket, peer: str) -> None:
        self.sock = sock
        self.peer = peer
        self.thread: threading.Thread | None = None

    def abort(self) -> None:
        shutdown(self.sock)


@dataclass(frozen=True)
class ReceiverStats:
    connections: int
    expected: int
    receiving: int  # expected transfers whose stream has begun
    received: int
    bytes: int
    failed: int
    rejected: int


class TcpReceiver:
    """Accepts P's connections and receives each expected transfer into its registered buffer.

    Use as a context manager, or `start()` then `close()`. `endpoint` is what D
    advertises in ``Register.endpoints["tcp"]``.

    Args:
        host: address to bind (loopback by default; bind a routable one for other hosts).
        port: port to bind; 0 picks a free one.
        config: deadlines and limits.
        log_context: fields added to every log line (role, instance).
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        config: TcpConfig | None = None,
        log_context: dict[str, Any] | None = None,
    ) -> None:
        self.host = host
        self.port = port
        self.config = config or TcpConfig()
        self._log = log.bind(**(log_context or {}))
        self._idle_tv = timeval(self.config.idle_timeout_s)
        self._io_tv = timeval(self.config.io_timeout_s)
        self._lock = threading.Lock()
        self._expected: dict[str, _Expected] = {}
        self._conns: set[_Conn] = set()
        self._listener: socket.socket | None = None
        self._wake_r: socket.socket | None = None
        self._wake_w: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._closing = False
        self._received = self._bytes = self._failed = self._rejected = 0
        self._serial = 0
        self.endpoint = ""

    # -- lifecycle ------------------------------------------------------------------

    def start(self) -> str:
        """Bind, listen and start the accept thread; return the endpoint ("tcp://HOST:PORT")."""
        if self._listener is not None:
            return self.endpoint
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if self.config.socket_buffer:  # inherited by accepted sockets, before the handshake
                listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.config.socket_buffer)
            listener.bind((self.host, self.port))
            listener.listen(min(self.config.max_connections, socket.SOMAXCONN))
            listener.setblocking(False)
        except OSError as exc:
            listener.close()
            raise TcpTransportError(f"cannot listen on {self.host}:{self.port}: {exc}; pick another host or port") from None
        self._listener = listener
        host, port = listener.getsockname()[:2]
        self.endpoint = f"tcp://[{host}]:{port}" if family == socket.AF_INET6 else f"tcp://{host}:{port}"
        self._wake_r, self._wake_w = socket.socketpair()
        self._accept_thread = threading.Thread(target=self._accept_loop, name="kvbroker-tcp-accept", daemon=True)
        self._accept_thread.start()
        self._log.info("tcp.listening", endpoint=self.endpoint)
        return self.endpoint

    def close(self) -> None:
        """Stop accepting, end every connection, fail pending transfers, join every thread."""
        with self._lock:
            if self._closing or self._listener is None:
                self._closing = True
                return
            self._closing = True
        assert self._wake_w is not None and self._wake_r is not None and self._accept_thread is not None
        self._wake_w.send(b"x")
        if self._accept_thread.ident is not None:  # None: its start() failed
            self._accept_thread.join()
        self._listener.close()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            conn.abort()
        for conn in conns:
            if conn.thread is not None and conn.thread.ident is not None:  # joining a thread never started raises
                conn.thread.join(self.config.io_timeout_s + 1)
                if conn.thread.is_alive():
                    self._log.error("tcp.thread_stuck", peer=conn.peer, thread=conn.thread.name)
        with self._lock:
            pending = list(self._expected.values())
            self._expected.clear()
        for e in pending:
            e.completion.settle(RecvFailed(e.completion.transfer_id, "the receiver was closed"))
        self._wake_r.close()
        self._wake_w.close()

    async def aclose(self) -> None:
        await anyio.to_thread.run_sync(self.close)

    def __enter__(self) -> TcpReceiver:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> TcpReceiver:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # -- expectations ---------------------------------------------------------------

    def expect(self, transfer_id: str, attempt: int, buffer: Any = None, nbytes: int | None = None, *,
               into: list[memoryview] | None = None) -> Completion:
        """Register a transfer before telling the broker Ready; its bytes go straight into `buffer`.

        Args:
            buffer: writable CPU memory (a pool lease's tensor, a bytearray...).
            nbytes: the payload size; the whole buffer when None.
            into: instead of `buffer`, writable contiguous 'B' memoryviews the payload fills one after
                another (a request's KV straight into its cache blocks); `nbytes` their sum.

        Raises:
            TcpTransportError: closed receiver, duplicate id, too many pending, or a bad buffer.
        """
        if into is not None:
            views = list(into)
            for i, v in enumerate(views):
                # recvmsg_into takes contiguous buffers only; found here, not mid-stream on D's thread
                if v.readonly or v.format != "B" or v.ndim != 1 or not v.c_contiguous:
                    raise TcpTransportError(
                        f"transfer {transfer_id}: `into` view {i} is not a writable, contiguous, flat byte view; "
                        "pass slices of a flat 'B' memoryview without a step"
                    )
            nbytes = sum(len(v) for v in views)
        else:
            view = byte_view(buffer, writable=True)
            nbytes = len(view) if nbytes is None else nbytes
            if not 0 <= nbytes <= len(view):
                raise TcpTransportError(f"transfer {transfer_id}: {nbytes} bytes do not fit a {len(view)}-byte buffer")
            views = [view[:nbytes]]
        encode_id(transfer_id)
        completion = Completion(transfer_id, attempt, nbytes)
        with self._lock:
            if self._closing or self._listener is None:
                raise TcpTransportError("the receiver is not running; start() it before expecting transfers")
            if transfer_id in self._expected:
                raise TcpTransportError(f"transfer {transfer_id} is already expected; cancel() it before expecting it again")
            if len(self._expected) >= self.config.max_expected:
                raise TcpTransportError(
                    f"{self.config.max_expected} transfers are already expected; raise TcpConfig.max_expected"
                )
            self._expected[transfer_id] = _Expected(completion, views)
        return completion

    async def cancel(self, transfer_id: str, reason: str = "cancelled by the receiver") -> None:
        """Give up an expected transfer; return once nothing writes into its buffer.

        Its `Completion` fails with `TransferCancelled` (unless it completed first). A
        no-op for an unknown or finished transfer. Shielded: safe in cleanup code.

        Raises:
            TcpTransportError: the receiving thread did not let go in time (do not release the buffer).
        """
        completion = self._begin_cancel(transfer_id, reason)
        if completion is None:
            return
        with anyio.move_on_after(self.config.io_timeout_s + 1, shield=True):
            try:
                await completion.wait()
            except TransferFailed:
                pass
        if not completion.done():
            raise TcpTransportError(f"transfer {transfer_id} is still being received; do not release its buffer")

    def cancel_blocking(self, transfer_id: str, reason: str = "cancelled by the receiver") -> None:
        """`cancel` for synchronous code."""
        completion = self._begin_cancel(transfer_id, reason)
        if completion is not None and not completion.wait_settled(self.config.io_timeout_s + 1):
            raise TcpTransportError(f"transfer {transfer_id} is still being received; do not release its buffer")

    def _begin_cancel(self, transfer_id: str, reason: str) -> Completion | None:
        with self._lock:
            e = self._expected.get(transfer_id)
            if e is None:
                return None
            if e.conn is None:
                del self._expected[transfer_id]
                e.completion.settle(TransferCancelled(transfer_id, reason))
            else:
                e.cancel_reason = reason
                e.conn.abort()  # its thread settles the completion once it lets go of the buffer
            return e.completion

    def statistics(self) -> ReceiverStats:
        with self._lock:
            receiving = sum(e.conn is not None for e in self._expected.values())
            return ReceiverStats(
                len(self._conns), len(self._expected), receiving, self._received, self._bytes, self._failed,
                self._rejected
            )

    # -- threads --------------------------------------------------------------------

    def _accept_loop(self) -> None:
        assert self._listener is not None and self._wake_r is not None
        failures = 0  # accept errors in the current burst
        with selectors.DefaultSelector() as sel, selectors.DefaultSelector() as wake:
            sel.register(self._listener, selectors.EVENT_READ)
            sel.register(self._wake_r, selectors.EVENT_READ)
            wake.register(self._wake_r, selectors.EVENT_READ)
            while not self._closing:
                sel.select()
                if self._closing:
                    return
                try:
                    sock, addr = self._listener.accept()
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError as exc:
                    # EMFILE and friends: the connection stays queued, so the listener
                    # stays readable; wait on the wake socket only, not select, to back off.
                    failures = self._accept_failed(failures, str(exc), wake)
                    continue
                peer = f"{addr[0]}:{addr[1]}"
                try:
                    self._admit(sock, peer)
                except Exception as exc:  # noqa: BLE001 - e.g. can't start new thread (RLIMIT_NPROC): try later
                    failures = self._accept_failed(failures, f"cannot start a thread for {peer}: {exc}", wake)
                    continue
                if failures:
                    self._log.info("tcp.accept_recovered", failures=failures)
                    failures = 0

    def _accept_failed(self, failures: int, error: str, wake: selectors.BaseSelector) -> int:
        """Log the first failure of a burst, back off (unless closing); the burst's new count."""
        if not failures:
            self._log.warning("tcp.accept_failed", error=error, retry_s=ACCEPT_BACKOFF_S)
        wake.select(ACCEPT_BACKOFF_S)
        return failures + 1

    def _admit(self, sock: socket.socket, peer: str) -> None:
        sock.setblocking(True)
        configure(sock, self.config)
        conn = _Conn(sock, peer)
        with self._lock:
            full = len(self._conns) >= self.config.max_connections
            if not full:
                self._serial += 1
                self._conns.add(conn)
                conn.thread = threading.Thread(
                    target=self._serve, args=(conn,), name=f"kvbroker-tcp-rx-{self._serial}", daemon=True
                )
        if full:
            self._log.warning("tcp.refused", peer=peer, reason=f"{self.config.max_connections} connections already open")
            sock.close()
            return
        assert conn.thread is not None
        try:
            conn.thread.start()
        except BaseException:  # can't start new thread (memory, RLIMIT_NPROC): refuse this one, the caller backs off
            with self._lock:
                self._conns.discard(conn)
            sock.close()
            raise

    def _serve(self, conn: _Conn) -> None:
        """Receive transfers on one connection until it closes, idles out or misbehaves."""
        try:
            while not self._closing:
                header = self._read_header(conn)
                if header is None or not self._receive(conn, *header):
                    return
        except Exception as exc:  # noqa: BLE001 - a bug here must be logged, not kill the process
            self._log.exception("tcp.connection_crashed", peer=conn.peer, error=repr(exc))
        finally:
            conn.sock.close()
            with self._lock:
                self._conns.discard(conn)

    def _read_header(self, conn: _Conn) -> tuple[str, int, int] | None:
        """Wait (up to the idle timeout) for the next header and parse it; None ends the connection."""
        sock = conn.sock
        head = bytearray(HEADER.size)
        view = memoryview(head)
        got = 0
        try:
            # One call returns the whole header (and leaves the payload queued) in the
            # common case; only the wait for its first byte may last the idle timeout.
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, self._idle_tv)
            got = sock.recv_into(view, HEADER.size)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, self._io_tv)
            if 0 < got < HEADER.size:
                got += recv_exact(sock, view[got:])
        except BlockingIOError:
            if got:
                self._log.warning("tcp.header_stalled", peer=conn.peer, got=got, io_timeout_s=self.config.io_timeout_s)
            return None  # idle: the sender reconnects when it needs to
        except OSError as exc:  # a reset
            self._log.info("tcp.connection_lost", peer=conn.peer, error=type(exc).__name__)
            return None
        if got == 0:
            return None  # a clean close between transfers
        if got < HEADER.size:
            self._reject(conn, REJECT_BAD_HEADER, "", f"connection closed inside a header ({got} bytes)")
            return None
        magic, version, _flags, id_len, attempt, nbytes, raw_id = HEADER.unpack(head)
        if magic != MAGIC or version != VERSION or not 0 < id_len <= MAX_ID_BYTES:
            why = f"bad header: magic {bytes(magic)!r}, version {version}, id length {id_len}"
            self._reject(conn, REJECT_BAD_HEADER, "", why)
            return None
        try:
            transfer_id = raw_id[:id_len].decode()
        except UnicodeDecodeError as exc:
            self._reject(conn, REJECT_BAD_HEADER, "", f"the transfer id is not UTF-8: {exc}")
            return None
        return transfer_id, attempt, nbytes

    def _receive(self, conn: _Conn, transfer_id: str, attempt: int, nbytes: int) -> bool:
        """Claim the expected transfer, receive its payload, ack. False: close the connection."""
        with self._lock:
            e = self._expected.get(transfer_id)
            if e is None:
                code, why = REJECT_UNKNOWN, "no such transfer is expected"
            elif e.completion.attempt != attempt:
                code, why = REJECT_ATTEMPT, f"attempt {attempt} arrived, {e.completion.attempt} is expected"
            elif e.completion.nbytes != nbytes:
                code, why = REJECT_SIZE, f"{nbytes} bytes announced, {e.completion.nbytes} expected"
            elif e.conn is not None:
                code, why = REJECT_BUSY, f"already being received from {e.conn.peer}"
            else:
                code, why = 0, ""
                e.conn = conn
        if code:
            self._reject(conn, code, transfer_id, why)
            return False
        assert e is not None
        error: TransferFailed | None = None
        try:
            got = recv_exact_into(conn.sock, e.views)
            if got < nbytes:
                error = RecvFailed(transfer_id, f"the sender {conn.peer} closed the stream after {got} of {nbytes} bytes")
        except BlockingIOError:
            error = RecvTimeout(transfer_id, f"the sender {conn.peer} stalled for {self.config.io_timeout_s:g} s")
        except OSError as exc:
            error = RecvFailed(transfer_id, f"the stream from {conn.peer} broke: {exc}")
        except Exception as exc:  # noqa: BLE001 - a claimed transfer must be settled, or nothing can cancel it
            self._log.exception("tcp.recv_crashed", transfer_id=transfer_id, peer=conn.peer, error=repr(exc))
            error = RecvFailed(transfer_id, f"receiving from {conn.peer} failed: {exc!r}")
        if error is None and e.cancel_reason is None:
            try:
                conn.sock.sendall(bytes([ACK]))  # before settling: P may move on while D scatters
            except OSError:
                pass  # D has the bytes; the sender learns it from the broker's Release
        with self._lock:
            if e.cancel_reason is not None:
                error = TransferCancelled(transfer_id, e.cancel_reason)
            self._expected.pop(transfer_id, None)
            e.conn = None
            if error is None:
                self._received += 1
                self._bytes += nbytes
            else:
                self._failed += 1
            e.completion.settle(error)
        if error is not None:
            self._log.warning(
                "tcp.recv_failed", transfer_id=transfer_id, attempt=attempt, peer=conn.peer, reason=error.reason, phase="recv_failed"
            )
        return error is None

    def _reject(self, conn: _Conn, code: int, transfer_id: str, why: str) -> None:
        with self._lock:
            self._rejected += 1
        self._log.warning(
            "tcp.rejected", transfer_id=transfer_id or None, peer=conn.peer, code=code, reason=why, phase="rejected"
        )
        try:
            conn.sock.sendall(bytes([code]))
            drain_and_finish(conn.sock)
        except OSError:
            pass
