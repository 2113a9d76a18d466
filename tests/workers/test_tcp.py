"""The TCP transport: exact bytes, zero-copy receive, clean failures, rejections, cancellation."""

from __future__ import annotations

import os
import resource
import socket
import threading
import time

import anyio
import pytest
import torch

from protocols.errors import RecvTimeout, SendTimeout
from tests.support import wait_until
from workers.pool import BufferPool
from workers.transports import tcp_receiver
from workers.transports.tcp import (
    HEADER,
    MAGIC,
    REJECT_ATTEMPT,
    REJECT_BAD_HEADER,
    REJECT_SIZE,
    REJECT_UNKNOWN,
    VERSION,
    RecvFailed,
    SendFailed,
    TcpConfig,
    TcpReceiver,
    TcpSender,
    TcpTransportError,
    TransferCancelled,
    TransferRejected,
    parse_endpoint,
)
from workers.transports.tcp_wire import still_open

MiB = 1 << 20
pytestmark = pytest.mark.anyio


def payload(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def header(transfer_id: str, attempt: int, nbytes: int, *, magic: bytes = MAGIC, version: int = VERSION) -> bytes:
    tid = transfer_id.encode()
    return HEADER.pack(magic, version, 0, len(tid), attempt, nbytes, tid)


def raw_connect(endpoint: str) -> socket.socket:
    sock = socket.create_connection(parse_endpoint(endpoint), timeout=5)
    return sock


def read_to_eof(sock: socket.socket) -> bytes:
    data = b""
    while chunk := sock.recv(4096):
        data += chunk
    return data


@pytest.fixture
def receiver():
    with TcpReceiver(config=TcpConfig(io_timeout_s=2.0)) as rx:
        yield rx


@pytest.fixture
def sender():
    with TcpSender(TcpConfig(io_timeout_s=2.0)) as tx:
        yield tx


def tcp_threads(ignore: frozenset[threading.Thread] = frozenset()) -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("kvbroker-tcp") and t not in ignore]


# -- bytes arrive exactly, straight into the pool ---------------------------------------


@pytest.mark.parametrize("n", [0, 1, 4097, 3 * MiB + 5, 16 * MiB])
async def test_bytes_arrive_exactly(receiver: TcpReceiver, sender: TcpSender, n: int) -> None:
    pool = BufferPool(17 * MiB)
    lease = pool.acquire_nowait(max(n, 1))
    src = payload(n, seed=n)
    done = receiver.expect(f"t-{n}", 0, lease.tensor, n)
    with anyio.fail_after(10):
        await sender.send(receiver.endpoint, f"t-{n}", 0, src)
        # The ack comes only once every byte is in D's buffer.
        assert torch.equal(lease.tensor[:n], src), "send returned before the receiver had every byte"
        assert await done.wait() == n
    lease.release()
    assert pool.statistics().free == pool.capacity


async def test_receive_writes_only_the_lease_region_of_the_pool_tensor(receiver: TcpReceiver, sender: TcpSender) -> None:
    pool = BufferPool(4 * MiB)
    pool.tensor.fill_(0xAB)
    first = pool.acquire_nowait(MiB)  # so the lease under test starts mid-pool
    lease = pool.acquire_nowait(MiB + 100)
    assert lease.offset > 0
    src = payload(MiB + 100, seed=1)
    done = receiver.expect("zc", 0, lease.tensor)
    with anyio.fail_after(10):
        await sender.send(receiver.endpoint, "zc", 0, src)
        await done.wait()
    region = pool.tensor[lease.offset : lease.offset + lease.nbytes]
    assert torch.equal(region, src), "the payload did not land in the lease's bytes of the pool tensor"
    outside = torch.cat([pool.tensor[: lease.offset], pool.tensor[lease.offset + lease.nbytes :]])
    assert bool((outside == 0xAB).all()), "bytes outside the lease changed"
    first.release()
    lease.release()


@pytest.mark.parametrize("pieces", [1, 7, 2500])  # past IOV_MAX (1024) places a call: refilled as they fill
async def test_a_payload_fills_the_places_it_is_expected_into_in_order(receiver: TcpReceiver, sender: TcpSender,
                                                                        pieces: int) -> None:
    """`expect(into=...)`: the payload lands in the places one after another (a request's KV
    straight into its cache blocks), here pieces of a buffer in shuffled order, of uneven
    sizes; the bytes between them stay untouched."""
    gen = torch.Generator().manual_seed(pieces)
    sizes = torch.randint(1, 3000, (pieces,), generator=gen).tolist()
    at, slots = 0, []
    for size in sizes:  # a gap of 5 bytes after each place
        slots.append((at, size))
        at += size + 5
    dest = torch.full((at,), 0xCD, dtype=torch.uint8)
    order = torch.randperm(pieces, generator=gen).tolist()
    view = memoryview(dest.numpy())
    places = [view[slots[k][0] : slots[k][0] + slots[k][1]] for k in order]
    n = sum(sizes)
    src = payload(n, seed=pieces)
    done = receiver.expect(f"into-{pieces}", 0, into=places)
    with anyio.fail_after(20):
        await sender.send(receiver.endpoint, f"into-{pieces}", 0, src)
        assert await done.wait() == n
    got, wire = dest.numpy(), src.numpy()
    cursor = 0
    for k in order:
        start, size = slots[k]
        assert (got[start : start + size] == wire[cursor : cursor + size]).all(), f"place {k} holds other bytes"
        assert (got[start + size : start + size + 5] == 0xCD).all(), f"the gap after place {k} was written"
        cursor += size


async def test_a_connection_carries_many_transfers(receiver: TcpReceiver, sender: TcpSender) -> None:
    buf = bytearray(1000)
    for i in range(20):
        done = receiver.expect(f"m-{i}", 0, buf)
        with anyio.fail_after(5):
            await sender.send(receiver.endpoint, f"m-{i}", 0, bytes([i]) * 1000)
            await done.wait()
        assert buf == bytes([i]) * 1000
    stats = sender.statistics()
    assert (stats.sent, stats.connects, stats.reused) == (20, 1, 19)


async def test_a_connection_idle_half_the_receivers_idle_timeout_is_not_reused() -> None:
    """The receiver closes a connection idle `idle_timeout_s`; a send that reused one just
    then had its header cross that close and failed. The sender reuses a connection only
    while it has been idle less than half that long, and opens a new one after."""
    config = TcpConfig(idle_timeout_s=0.6)
    with TcpReceiver(config=config) as rx, TcpSender(config) as tx:
        buf = bytearray(10)

        async def send(tid: str) -> None:
            done = rx.expect(tid, 0, buf)
            with anyio.fail_after(5):
                await tx.send(rx.endpoint, tid, 0, bytes(10))
                await done.wait()

        await send("a")
        await send("b")  # at once: the same connection
        assert (tx.statistics().connects, tx.statistics().reused) == (1, 1)
        idle = time.monotonic()
        await anyio.to_thread.run_sync(wait_until, lambda: time.monotonic() > idle + 0.35, 5, "half the idle timeout")
        await send("c")
        assert (tx.statistics().sent, tx.statistics().connects, tx.statistics().reused) == (3, 2, 1)


class Gate:
    """Parts for `TcpSender.send_parts` that wait, on the sending thread, until the test opens each."""

    def __init__(self, parts: list[list[memoryview]]) -> None:
        self.parts = parts
        self.open = [threading.Event() for _ in parts]
        self.asked = [threading.Event() for _ in parts]  # the sending thread waits for this part
        self.stopped = threading.Event()

    def __iter__(self):
        for part, gate, asked in zip(self.parts, self.open, self.asked):
            asked.set()
            while not gate.wait(0.01):
                if self.stopped.is_set():
                    raise SendFailed("gate", "stopped")
            yield part


async def test_parts_stream_as_they_become_ready(receiver: TcpReceiver, sender: TcpSender) -> None:
    """A payload sent part by part is in D's buffer part by part: the first part's bytes
    (several buffers, 2,000 of them in one part, beyond one sendmsg's 1,024) arrive while
    the second does not exist yet, and the send returns once D has all of it."""
    src = payload(3 * MiB, seed=7)
    view = memoryview(src.numpy())
    first = [view[i * 512 : (i + 1) * 512] for i in range(2000)]  # 1,024,000 bytes in 2,000 buffers
    rest = [view[2000 * 512 : 2 * MiB], view[2 * MiB :]]
    gate = Gate([first, rest])
    buf = torch.zeros(3 * MiB, dtype=torch.uint8)
    done = receiver.expect("parts", 0, buf)
    gate.open[0].set()
    async with anyio.create_task_group() as tg:
        tg.start_soon(sender.send_parts, receiver.endpoint, "parts", 0, 3 * MiB, gate)
        with anyio.fail_after(10):
            while not torch.equal(buf[: 2000 * 512], src[: 2000 * 512]):
                await anyio.sleep(0.005)
        assert not done.done() and bool((buf[2000 * 512 :] == 0).all())
        gate.open[1].set()
        with anyio.fail_after(10):
            assert await done.wait() == 3 * MiB
    assert torch.equal(buf, src)
    assert sender.statistics().sent == 1


async def test_parts_that_fall_short_of_the_size_fail_both_sides(receiver: TcpReceiver, sender: TcpSender) -> None:
    buf = bytearray(1000)
    done = receiver.expect("short", 0, buf)
    with anyio.fail_after(10), pytest.raises(SendFailed, match="held 600 B of the 1000 B"):
        await sender.send_parts(receiver.endpoint, "short", 0, 1000, [[memoryview(bytes(600))]])
    with anyio.fail_after(10), pytest.raises(RecvFailed):
        await done.wait()


async def test_a_send_cancelled_while_its_next_part_is_not_ready_stops_the_wait(receiver: TcpReceiver,
                                                                                  sender: TcpSender) -> None:
    """Cancelled while the sending thread waits for a part, the send calls `stop`, and
    returns once that thread let go of the parts; D's receive fails."""
    gate = Gate([[memoryview(bytes(100))], [memoryview(bytes(100))]])
    gate.open[0].set()
    done = receiver.expect("stalled", 0, bytearray(200))

    async def cancel_once_the_thread_waits(scope: anyio.CancelScope) -> None:
        await anyio.to_thread.run_sync(gate.asked[1].wait, 10, abandon_on_cancel=True)
        scope.cancel()

    with anyio.fail_after(10):
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(cancel_once_the_thread_waits, scope)
                await sender.send_parts(receiver.endpoint, "stalled", 0, 200, gate, stop=gate.stopped.set)
        assert scope.cancelled_caught and gate.stopped.is_set()
        with pytest.raises(RecvFailed):
            await done.wait()


def test_blocking_api_from_threads(receiver: TcpReceiver, sender: TcpSender) -> None:
    bufs = [bytearray(256 * 1024) for _ in range(8)]
    dones = [receiver.expect(f"b-{i}", 3, bufs[i]) for i in range(8)]
    srcs = [payload(256 * 1024, seed=i) for i in range(8)]
    threads = [
        threading.Thread(target=sender.send_blocking, args=(receiver.endpoint, f"b-{i}", 3, srcs[i])) for i in range(8)
    ]
    for t in threads:
        t.start()
    for i, d in enumerate(dones):
        assert d.wait_blocking(10) == 256 * 1024
        assert bytes(bufs[i]) == srcs[i].numpy().tobytes()
    for t in threads:
        t.join(10)
    assert receiver.statistics().received == 8


# -- a peer that vanishes or stalls fails the transfer, on time ------------------------


async def test_sender_dying_mid_stream_fails_the_transfer_and_frees_the_lease(receiver: TcpReceiver) -> None:
    pool = BufferPool(2 * MiB)
    lease = pool.acquire_nowait(MiB)
    done = receiver.expect("half", 0, lease.tensor)
    sock = raw_connect(receiver.endpoint)
    sock.sendall(header("half", 0, MiB) + bytes(MiB // 2))
    sock.close()
    t0 = time.monotonic()
    with anyio.fail_after(5):
        with pytest.raises(RecvFailed, match="closed the stream after 524288 of 1048576 bytes"):
            await done.wait()
    assert time.monotonic() - t0 < 2
    lease.release()
    assert pool.statistics().free == pool.capacity
    assert receiver.statistics().failed == 1


async def test_a_stalled_sender_times_out_per_read() -> None:
    with TcpReceiver(config=TcpConfig(io_timeout_s=0.3)) as rx:
        buf = bytearray(1000)
        done = rx.expect("slow", 0, buf)
        with raw_connect(rx.endpoint) as sock:
            sock.sendall(header("slow", 0, 1000) + bytes(10))
            with anyio.fail_after(5):
                with pytest.raises(RecvTimeout, match="stalled"):
                    await done.wait()
            assert read_to_eof(sock) == b"", "the receiver should close a stalled connection"


async def test_cancel_mid_stream_returns_once_the_buffer_is_free(receiver: TcpReceiver) -> None:
    pool = BufferPool(2 * MiB)
    lease = pool.acquire_nowait(MiB)
    done = receiver.expect("cut", 0, lease.tensor)
    with raw_connect(receiver.endpoint) as sock:
        sock.sendall(header("cut", 0, MiB) + bytes(1000))
        # D's deadline passes mid-stream: once the receiving thread has taken the header up.
        await anyio.to_thread.run_sync(wait_until, lambda: receiver.statistics().receiving, 10, "the stream to begin",
                                       abandon_on_cancel=True)
        assert not done.done()
        with anyio.fail_after(5):
            await receiver.cancel("cut", "no data in time")
        assert done.done()
        with pytest.raises(TransferCancelled, match="no data in time"):
            done.result()
        lease.release()
        assert read_to_eof(sock) == b""
    assert receiver.statistics().expected == 0


async def test_cancel_before_any_data(receiver: TcpReceiver, sender: TcpSender) -> None:
    done = receiver.expect("never", 0, bytearray(10))
    await receiver.cancel("never", "aborted by the broker")
    with pytest.raises(TransferCancelled):
        await done.wait()
    with pytest.raises(TransferRejected) as info:
        await sender.send(receiver.endpoint, "never", 0, bytes(10))
    assert info.value.code == REJECT_UNKNOWN


async def test_send_cancelled_while_the_peer_does_not_read_returns_promptly() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener, TcpSender(TcpConfig(io_timeout_s=30)) as tx:
        port = listener.getsockname()[1]
        src = payload(64 * MiB)  # more than the kernel's buffers hold: the thread blocks in a write
        cancelled_at = 0.0

        async def cancel_once_connected(scope: anyio.CancelScope) -> None:
            nonlocal cancelled_at
            await anyio.to_thread.run_sync(wait_until, lambda: tx.statistics().connects, 10, "the connection",
                                           abandon_on_cancel=True)
            cancelled_at = time.monotonic()
            scope.cancel()

        with anyio.fail_after(10):
            with anyio.CancelScope() as scope:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(cancel_once_connected, scope)
                    await tx.send(f"tcp://127.0.0.1:{port}", "stuck", 0, src)
        assert scope.cancelled_caught
        assert time.monotonic() - cancelled_at < 3, "cancelling a send must interrupt its thread"
        assert tx.statistics().failed == 1


async def test_a_receiver_that_stops_reading_times_the_send_out() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener, TcpSender(TcpConfig(io_timeout_s=0.3)) as tx:
        port = listener.getsockname()[1]
        t0 = time.monotonic()
        with anyio.fail_after(10):
            with pytest.raises(SendTimeout, match="stalled"):
                await tx.send(f"tcp://127.0.0.1:{port}", "stuck", 0, payload(64 * MiB))
        assert time.monotonic() - t0 < 5


async def test_send_to_a_closed_port_fails_fast_naming_what_to_check(sender: TcpSender) -> None:
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]
    with anyio.fail_after(5):
        with pytest.raises(SendFailed, match="cannot connect") as failed:
            await sender.send(f"tcp://127.0.0.1:{port}", "t", 0, b"x")
    assert f"tcp://127.0.0.1:{port}" in failed.value.reason and "tcp_host" in failed.value.reason


# -- unexpected headers close that connection only -------------------------------------


@pytest.mark.parametrize(
    "junk",
    [
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET / HTTP/1.1\r\n" + bytes(200),
        header("x", 0, 1, version=99) + b"x",
        header("x", 0, 1, magic=b"NOPE") + b"x",
        HEADER.pack(MAGIC, VERSION, 0, 0, 0, 5, b""),
        HEADER.pack(MAGIC, VERSION, 0, 3, 0, 5, b"\xff\xfe\xfd"),
    ],
    ids=["short-http", "long-http", "version", "magic", "empty-id", "not-utf8"],
)
async def test_garbage_header_closes_the_connection_and_the_receiver_goes_on(
    receiver: TcpReceiver, sender: TcpSender, junk: bytes
) -> None:
    with raw_connect(receiver.endpoint) as sock:
        sock.sendall(junk)
        sock.shutdown(socket.SHUT_WR)
        assert read_to_eof(sock) == bytes([REJECT_BAD_HEADER])
    buf = bytearray(5)
    done = receiver.expect("after", 0, buf)
    with anyio.fail_after(5):
        await sender.send(receiver.endpoint, "after", 0, b"hello")
        await done.wait()
    assert buf == b"hello"
    assert receiver.statistics().rejected == 1


async def test_wrong_transfer_size_or_attempt_is_rejected_and_the_expectation_survives(
    receiver: TcpReceiver, sender: TcpSender
) -> None:
    buf = bytearray(100)
    done = receiver.expect("x", 2, buf)
    for tid, attempt, data, code in [
        ("x", 2, bytes(99), REJECT_SIZE),
        ("x", 1, bytes(100), REJECT_ATTEMPT),
        ("y", 2, bytes(100), REJECT_UNKNOWN),
    ]:
        with anyio.fail_after(5):
            with pytest.raises(TransferRejected) as info:
                await sender.send(receiver.endpoint, tid, attempt, data)
        assert info.value.code == code
    assert not done.done()
    with anyio.fail_after(5):
        await sender.send(receiver.endpoint, "x", 2, bytes(range(100)))
        assert await done.wait() == 100
    assert buf == bytes(range(100))


def test_expect_refuses_bad_registrations(receiver: TcpReceiver) -> None:
    receiver.expect("dup", 0, bytearray(4))
    with pytest.raises(TcpTransportError, match="already expected"):
        receiver.expect("dup", 0, bytearray(4))
    with pytest.raises(TcpTransportError, match="read-only"):
        receiver.expect("ro", 0, b"abcd")
    with pytest.raises(TcpTransportError, match="do not fit"):
        receiver.expect("big", 0, bytearray(4), 5)
    with pytest.raises(TcpTransportError, match="1..128"):
        receiver.expect("z" * 129, 0, bytearray(4))


# -- connection reuse and lifecycle ------------------------------------------------------


async def test_sender_replaces_a_connection_the_receiver_closed_while_idle() -> None:
    with TcpReceiver(config=TcpConfig(idle_timeout_s=0.1)) as rx, TcpSender() as tx:
        for i in range(2):
            buf = bytearray(3)
            done = rx.expect(f"i-{i}", 0, buf)
            with anyio.fail_after(5):
                await tx.send(rx.endpoint, f"i-{i}", 0, b"abc")
                await done.wait()
            if i == 0:
                with anyio.fail_after(5):
                    while rx.statistics().connections:  # the idle connection times out
                        await anyio.sleep(0.01)
        assert tx.statistics().connects == 2


def test_close_fails_pending_transfers_and_joins_every_thread() -> None:
    others = frozenset(threading.enumerate())  # threads of other tests' transports, if any
    rx = TcpReceiver()
    rx.start()
    pending = rx.expect("p", 0, bytearray(10))
    sock = raw_connect(rx.endpoint)
    sock.sendall(header("p", 0, 10) + b"abc")  # a connection thread mid-transfer
    busy = rx.expect("q", 0, bytearray(10))
    deadline = time.monotonic() + 5
    while rx.statistics().connections == 0 and time.monotonic() < deadline:
        threading.Event().wait(0.01)
    assert tcp_threads(others)
    rx.close()
    assert tcp_threads(others) == []
    for c in (pending, busy):
        with pytest.raises(RecvFailed):
            c.result()
    sock.close()
    with pytest.raises(TcpTransportError, match="not running"):
        rx.expect("late", 0, bytearray(1))


# -- regressions ------------------------------------------------------------------------


async def test_send_cancelled_before_its_thread_starts_returns_at_once() -> None:
    """The shielded wait for the send thread must not last its whole timeout when no thread ever ran."""
    with TcpSender(TcpConfig(io_timeout_s=3, connect_timeout_s=3)) as tx:
        t0 = time.monotonic()
        with anyio.CancelScope() as scope:
            scope.cancel()
            await tx.send("tcp://127.0.0.1:1", "early", 0, payload(16))
        assert scope.cancelled_caught
        assert time.monotonic() - t0 < 1, "a send cancelled before it started must return at once"


class _FailingAccept:
    """The receiver's listener, whose accept() fails like a process out of descriptors."""

    def __init__(self, listener: socket.socket) -> None:
        self.listener = listener
        self.failing = True
        self.calls = 0

    def accept(self):
        self.calls += 1
        if self.failing:
            raise OSError(24, "Too many open files")
        return self.listener.accept()

    def __getattr__(self, name: str):
        return getattr(self.listener, name)


class _Lines:
    def __init__(self) -> None:
        self.events: list[str] = []

    def __getattr__(self, level: str):
        return lambda event, **kw: self.events.append(event)


def test_accept_errors_back_off_and_log_once_per_burst() -> None:
    # The sender waits out the whole failing burst for its ack: its timeout must outlast the burst
    # even on a loaded machine, or the test measures the sender's timeout instead of the receiver.
    with TcpReceiver(config=TcpConfig(io_timeout_s=2.0)) as rx, TcpSender(TcpConfig(io_timeout_s=30.0)) as tx:
        lines = _Lines()
        rx._log = lines  # type: ignore[assignment]
        listener = _FailingAccept(rx._listener)  # type: ignore[arg-type]
        rx._listener = listener  # type: ignore[assignment]
        rx.expect("t", 0, bytearray(8))
        errors: list[BaseException] = []

        def send() -> None:
            try:
                tx.send_blocking(rx.endpoint, "t", 0, bytes(range(8)))
            except BaseException as exc:
                errors.append(exc)

        sent = threading.Thread(target=send)
        sent.start()  # queued on the listener: every accept fails while `failing`
        wait_until(lambda: listener.calls >= 2, 5, "a retried accept")
        threading.Event().wait(0.5)  # a measurement window, not a wait for a condition
        calls = listener.calls
        assert calls <= 10, f"{calls} accept attempts in ~0.5 s: the accept loop spins"
        assert lines.events.count("tcp.accept_failed") == 1
        listener.failing = False
        sent.join(30)
        assert not sent.is_alive() and not errors, errors
        # The ack goes out before the receiver settles and counts the transfer (P may move on first).
        wait_until(lambda: rx.statistics().received == 1, 10, "the transfer counted as received")
        assert "tcp.accept_recovered" in lines.events


def test_expect_refuses_a_strided_view_to_receive_into(receiver: TcpReceiver) -> None:
    """recvmsg_into cannot fill a view with a step: refused here, not on D's thread mid-stream."""
    backing = bytearray(64)
    with pytest.raises(TcpTransportError, match="view 1 is not a writable, contiguous"):
        receiver.expect("strided", 0, into=[memoryview(backing)[:8], memoryview(backing)[16::2]])
    assert receiver.statistics().expected == 0


async def test_any_error_while_receiving_fails_the_transfer_and_lets_go_of_it(
    receiver: TcpReceiver, sender: TcpSender, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever fails between claiming a transfer and settling it (here a buffer that
    recvmsg_into refuses), the completion fails naming it and the transfer is let go: it
    is not left claimed forever, where cancel() refuses and it cannot be expected again."""

    def refuse(sock: socket.socket, views: list[memoryview]) -> int:
        raise BufferError("memoryview: underlying buffer is not C-contiguous")

    monkeypatch.setattr(tcp_receiver, "recv_exact_into", refuse)
    done = receiver.expect("refused", 0, bytearray(32))
    with anyio.fail_after(5):
        with pytest.raises(SendFailed):
            await sender.send(receiver.endpoint, "refused", 0, bytes(32))
        with pytest.raises(RecvFailed, match="BufferError"):
            await done.wait()
    assert (receiver.statistics().receiving, receiver.statistics().expected) == (0, 0)
    monkeypatch.undo()
    buf = bytearray(32)
    again = receiver.expect("refused", 0, buf)
    with anyio.fail_after(5):
        await sender.send(receiver.endpoint, "refused", 0, bytes(range(32)))
        assert await again.wait() == 32
    assert buf == bytes(range(32))


def _failing_start(monkeypatch: pytest.MonkeyPatch, name: str) -> list[str]:
    """Make the next start() of a thread whose name starts with `name` fail as when the
    process is out of threads (memory, RLIMIT_NPROC); the names of those that failed."""
    real_start = threading.Thread.start
    failed: list[str] = []

    def start(thread: threading.Thread) -> None:
        if thread.name.startswith(name) and not failed:
            failed.append(thread.name)
            raise RuntimeError("can't start new thread")
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", start)
    return failed


def test_a_connection_whose_thread_cannot_start_is_closed_and_the_receiver_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    failed = _failing_start(monkeypatch, "kvbroker-tcp-rx")
    with TcpReceiver(config=TcpConfig(io_timeout_s=2.0)) as rx, TcpSender(TcpConfig(io_timeout_s=5.0)) as tx:
        lines = _Lines()
        rx._log = lines  # type: ignore[assignment]
        buf = bytearray(8)
        done = rx.expect("after", 0, buf)
        with raw_connect(rx.endpoint) as sock:
            assert read_to_eof(sock) == b"", "the receiver should close a connection it has no thread for"
        assert failed
        wait_until(lambda: rx.statistics().connections == 0, 5, "the refused connection to be forgotten")
        tx.send_blocking(rx.endpoint, "after", 0, bytes(range(8)))  # the accept thread goes on
        assert done.wait_blocking(5) == 8 and buf == bytes(range(8))
        wait_until(lambda: "tcp.accept_recovered" in lines.events, 5, "the recovery logged")
        assert lines.events.count("tcp.accept_failed") == 1
    # Leaving the block closed the receiver, which joins every thread it started.


def test_a_receiver_whose_accept_thread_did_not_start_still_closes(monkeypatch: pytest.MonkeyPatch) -> None:
    _failing_start(monkeypatch, "kvbroker-tcp-accept")
    rx = TcpReceiver()
    with pytest.raises(RuntimeError, match="can't start new thread"):
        rx.start()
    rx.close()  # must not join a thread that never started


@pytest.mark.parametrize("first", [16, 10], ids=["more-after-the-last-byte", "more-mid-stream"])
async def test_parts_that_hold_more_than_the_size_fail_both_sides_before_the_surplus_goes_out(
    receiver: TcpReceiver, sender: TcpSender, first: int
) -> None:
    """D must never ack a payload P then calls malformed, nor read the surplus as a header."""
    done = receiver.expect("long", 0, bytearray(16))
    parts = [[memoryview(b"A" * first)], [memoryview(b"B" * 200)]]
    with anyio.fail_after(10):
        with pytest.raises(SendFailed) as failed:
            await sender.send_parts(receiver.endpoint, "long", 0, 16, iter(parts))
        written = 0 if first == 16 else first  # the part with the payload's last byte is held back
        with pytest.raises(RecvFailed, match=f"after {written} of 16 bytes"):
            await done.wait()
    stats = receiver.statistics()
    assert (stats.received, stats.rejected) == (0, 0), "the surplus was read as another transfer's header"
    assert "more than the 16 B announced" in failed.value.reason


@pytest.fixture
def fds_past_1024():
    """Take every descriptor below 1030, so the sockets a test opens next get ones that
    select.select() refuses (a vLLM process with torch and zmq gets there)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 2048:
        if hard != resource.RLIM_INFINITY and hard < 2048:
            pytest.skip(f"needs 2048 open files, the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (2048, hard))
    fillers: list[int] = []
    try:
        while not fillers or fillers[-1] < 1030:  # the kernel hands out the lowest free descriptor
            fillers.append(os.open(os.devnull, os.O_RDONLY))
        yield
    finally:
        for fd in fillers:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.usefixtures("fds_past_1024")
def test_a_rejection_on_a_descriptor_past_1024_is_drained_without_crashing() -> None:
    with TcpReceiver(config=TcpConfig(io_timeout_s=2.0)) as rx, TcpSender(TcpConfig(io_timeout_s=2.0)) as tx:
        lines = _Lines()
        rx._log = lines  # type: ignore[assignment]
        rx.expect("z", 0, bytearray(256 * 1024))
        with pytest.raises(TransferRejected) as info:
            tx.send_blocking(rx.endpoint, "z", 1, bytes(256 * 1024))
        assert info.value.code == REJECT_ATTEMPT
        wait_until(lambda: rx.statistics().connections == 0, 5, "the rejected connection to close")
        assert "tcp.rejected" in lines.events and "tcp.connection_crashed" not in lines.events


@pytest.mark.usefixtures("fds_past_1024")
def test_an_idle_connection_past_descriptor_1024_is_checked_without_tcp_info(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where there is no TCP_INFO (macOS...), `still_open` polls the socket instead."""
    monkeypatch.delattr(socket, "TCP_INFO", raising=False)
    with socket.create_server(("127.0.0.1", 0)) as server, socket.create_connection(server.getsockname()) as sock:
        peer, _ = server.accept()
        assert sock.fileno() >= 1024
        assert still_open(sock)
        peer.close()
        wait_until(lambda: not still_open(sock), 5, "the peer's close to show")
