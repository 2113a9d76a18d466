"""The chunk plan both sides of an nccl transfer derive on their own (`connector.nccl_link.chunks`).

P posts one send per chunk and D one receive per chunk, and NCCL pairs them by order
alone, so the plan must depend only on what both sides know (the transfer's size and
the staged block size) and must cover the transfer exactly; D lands each chunk, in
order, once its receive ended on a communicator still whole. The GPU runs of it:
tests/gpu/test_connector_nccl.py.
"""

from __future__ import annotations

import threading
import time
from functools import partial
from itertools import pairwise
from types import SimpleNamespace
from typing import Any

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from connector import nccl_link
from connector.nccl_link import (
    NcclLink,
    Poller,
    Posted,
    Waited,
    _Ended,
    _reported,
    _wait_until_ended,
    _Watch,
    chunks,
)
from protocols.errors import RecvTimeout, TransferFailed
from tests.support import wait_until
from workers.gpu_staging import pipeline_bounds

MIB = 1 << 20
LLAMA_BLOCK = 32 * 2 * 16 * 8 * 128 * 2  # one staged block of Llama-3-8B-shaped KV: 2 MiB


@given(st.integers(1, 4096), st.sampled_from([4096, MIB, LLAMA_BLOCK, 3 * MIB + 512]))
def test_chunks_cover_the_transfer_in_order_without_gaps(blocks: int, block_nbytes: int) -> None:
    parts = chunks(blocks * block_nbytes, block_nbytes)
    assert parts[0][0] == 0 and parts[-1][1] == blocks
    assert all(b0 < b1 for b0, b1 in parts)
    assert all(a[1] == b[0] for a, b in pairwise(parts))
    assert parts == chunks(blocks * block_nbytes, block_nbytes)  # the other side gets the same


def test_the_plan_is_the_transports_pipeline() -> None:
    # 2,048 and 8,192 tokens of Llama-3-8B-shaped KV: the plans measured on GPUs.
    for blocks in (128, 512):
        ends = [b1 for _, b1 in chunks(blocks * LLAMA_BLOCK, LLAMA_BLOCK)]
        assert ends == pipeline_bounds(blocks, LLAMA_BLOCK)
    sizes = [(b1 - b0) * 2 for b0, b1 in chunks(128 * LLAMA_BLOCK, LLAMA_BLOCK)]
    assert sizes == [96, 96, 48, 16]  # MiB


def test_a_small_transfer_goes_in_one_op() -> None:
    assert chunks(32 * LLAMA_BLOCK, LLAMA_BLOCK) == [(0, 32)]  # 512 tokens: 64 MiB


@pytest.mark.parametrize(("nbytes", "block_nbytes"), [(1000, 0), (MIB + 1, MIB), (0, MIB)])
def test_sizes_that_are_not_whole_blocks_go_in_one_op(nbytes: int, block_nbytes: int) -> None:
    # One op, which `NcclLink` sends or receives as all of `nbytes`.
    assert chunks(nbytes, block_nbytes) == [(0, 1)]


class _Done:
    """A chunk's op completion that ends when the test says (`wire.add(k)`); `wait`,
    called once it ended, returns at once, as a CUDA event's does."""

    def __init__(self, k: int, log: list[str], comm: Any, abort_at: int | None, wire: set[int]) -> None:
        self.k, self.log, self.comm, self.abort_at, self.wire = k, log, comm, abort_at, wire

    def done(self) -> bool:
        if self.k in self.wire and self.k == self.abort_at:  # the communicator was aborted: its kernel ended early
            self.comm.broken = True
        return self.k in self.wire

    def wait(self, deadline: float, *, spin_s: float = 0.0) -> None:
        if not self.done():
            raise RecvTimeout("t", f"chunk {self.k} did not end by its deadline")
        self.log.append(f"ended {self.k}")


def _posted(n: int, log: list[str], abort_at: int | None = None, wire: set[int] | None = None) -> Posted:
    comm = SimpleNamespace(closed=False, broken=False)
    parts = chunks(n * LLAMA_BLOCK, LLAMA_BLOCK)
    wire = set() if wire is None else wire
    return Posted(peer="p0:0", op="recv", transfer_id="t", comm=comm,
                  completions=[_Done(k, log, comm, abort_at, wire) for k in range(len(parts))], parts=parts,
                  flag=threading.Event())


def _wait(watch: _Watch, poller: Poller, carried: _Ended | None = None) -> Waited:
    """What `NcclLink.wait` does, in this thread: a carried watch's report; without one,
    or once the poller handed it back past its deadline, the watch advanced here."""
    if carried is not None:
        carried.wait()
        if (waited := _reported(carried)) is not None:
            return waited
    return _wait_until_ended(watch, poller)


class _Cache:
    """Where a watch drops a communicator whose later ops could pair with another transfer's."""

    def __init__(self) -> None:
        self.discarded: list[str] = []

    def discard(self, peer: str) -> None:
        self.discarded.append(peer)


def _watch(posted: Posted, log: list[str], cache: _Cache | None = None, *, deadline: float = float("inf"),
           landed: Any = "log", before: Any = None, at_once: bool = False) -> _Watch:
    if landed == "log":
        def landed(b0: int, b1: int, left: int) -> None:
            log.append(f"landed {b0}-{b1} left {left}")
    return _Watch(posted, deadline, landed, before, (cache or _Cache()).discard, at_once=at_once)


def test_a_receive_sets_up_before_any_chunk_ends_then_lands_each_chunk_in_order() -> None:
    """D's setup for its scatters (`before`) runs before the first chunk is waited for;
    then each chunk lands once its op ended, in order, with how many are still to come."""
    log: list[str] = []
    wire: set[int] = set()
    watch = _watch(_posted(128, log, wire=wire), log, before=lambda: log.append("before"))  # 4 chunks: 2,048 tokens
    assert not watch.advance(0.0) and log == ["before"]
    for k in range(4):
        assert not watch.advance(0.0), "nothing ended: nothing lands"
        wire.add(k)
        assert watch.advance(0.0) == (k == 3)
    assert watch.error is None
    assert log == ["before", "ended 0", "landed 0-48 left 3", "ended 1", "landed 48-96 left 2",
                   "ended 2", "landed 96-120 left 1", "ended 3", "landed 120-128 left 0"]


def test_chunks_that_ended_while_the_receiver_was_busy_land_as_one_copy() -> None:
    """A waiter behind the wire finds the next chunks' ops ended too: they land with the
    first of them, as one range, still in order and with the right count of chunks to
    come; a chunk not ended yet waits for a later pass."""
    log: list[str] = []
    wire = {0, 1, 2}
    watch = _watch(_posted(128, log, wire=wire), log)
    assert not watch.advance(0.0)
    assert log == ["ended 0", "ended 1", "ended 2", "landed 0-120 left 1"]
    wire.add(3)
    assert watch.advance(0.0) and watch.error is None
    assert log[4:] == ["ended 3", "landed 120-128 left 0"]


def test_an_abort_seen_among_ended_chunks_lands_none_of_them() -> None:
    log: list[str] = []
    watch = _watch(_posted(128, log, abort_at=2, wire={0, 1, 2}), log)
    assert watch.advance(0.0)
    assert isinstance(watch.error, TransferFailed) and "cut short" in watch.error.reason
    assert not [line for line in log if line.startswith("landed")]


def test_a_chunk_cut_short_by_an_abort_never_lands_and_the_communicator_is_not_reused() -> None:
    log: list[str] = []
    wire: set[int] = {0}
    watch = _watch(_posted(128, log, abort_at=1, wire=wire), log, before=lambda: None)
    assert not watch.advance(0.0)
    wire.add(1)
    assert watch.advance(0.0)
    assert isinstance(watch.error, TransferFailed) and "cut short" in watch.error.reason
    assert log == ["ended 0", "landed 0-48 left 3", "ended 1"]


def test_a_landing_that_fails_before_the_last_chunk_drops_the_communicator() -> None:
    """Later chunks' receives are posted: left on that communicator they would pair with
    the next transfer's sends."""
    log: list[str] = []
    cache = _Cache()

    def landed(b0: int, b1: int, left: int) -> None:
        raise RuntimeError("the scatter could not be launched")

    watch = _watch(_posted(128, log, wire={0}), log, cache, landed=landed)
    assert watch.advance(0.0)
    assert isinstance(watch.error, RuntimeError) and "scatter" in str(watch.error)
    assert cache.discarded == ["p0:0"]


def test_a_chunk_not_ended_by_the_deadline_fails_the_transfer() -> None:
    """Past its deadline the chunk's own wait decides (a real one aborts the communicator)."""
    log: list[str] = []
    watch = _watch(_posted(128, log, wire={0}), log, deadline=5.0)
    assert not watch.advance(4.9)
    assert watch.advance(5.0)
    assert isinstance(watch.error, RecvTimeout)
    assert log == ["ended 0", "landed 0-48 left 3"]


def test_a_watch_at_once_waits_for_the_last_op_then_lands_every_chunk_in_one_call() -> None:
    """At once (a sender's watch), the waiter needs only the last op's end: it waits for
    that one, whatever ended before it, and then ends the whole transfer in one pass
    (with a `landed`, in one call)."""
    log: list[str] = []
    wire: set[int] = set()
    posted = _posted(128, log, wire=wire)
    watch = _watch(posted, log, before=lambda: log.append("before"), at_once=True)
    for k in range(3):
        assert not watch.advance(0.0)
        assert watch.pending() is posted.completions[-1]
        wire.add(k)
    assert not watch.advance(0.0) and log == ["before"], "chunks landed before the last op ended"
    wire.add(3)
    assert watch.advance(0.0) and watch.error is None
    assert log == ["before", "ended 0", "ended 1", "ended 2", "ended 3", "landed 0-128 left 0"]


def test_a_watch_at_once_whose_communicator_was_aborted_lands_nothing() -> None:
    log: list[str] = []
    watch = _watch(_posted(128, log, abort_at=1, wire={0, 1, 2, 3}), log, at_once=True)
    assert watch.advance(0.0)
    assert isinstance(watch.error, TransferFailed) and "cut short" in watch.error.reason
    assert not [line for line in log if line.startswith("landed")]


@pytest.mark.anyio
async def test_a_receive_is_set_up_by_the_poller_before_its_ops_end_and_landed_there() -> None:
    """A receive is handed to the poller as it is waited for: the poller sets it up
    before any op ended and lands every chunk, in its own thread."""
    link = NcclLink.__new__(NcclLink)
    link.cache, link.poller = _Cache(), Poller()  # type: ignore[assignment]
    link._lock, link._inflight = threading.Lock(), {}
    where: list[tuple[str, str]] = []
    wire: set[int] = set()
    posted = _posted(128, [], wire=wire)

    def landed(b0: int, b1: int, left: int) -> None:
        where.append((f"{b0}-{b1}", threading.current_thread().name))

    def before() -> None:
        where.append(("before", threading.current_thread().name))

    try:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(partial(link.wait, posted, time.monotonic() + 10, landed=landed, before=before))
                while not where:  # set up, no op ended yet
                    await anyio.sleep(0.001)
                wire.update(range(4))
    finally:
        link.poller.close()
    assert where[0][0] == "before" and where[-1][0].endswith("-128")
    assert {name for _, name in where} == {"kvbroker-nccl-poller"}


@pytest.mark.anyio
async def test_a_sender_is_waited_for_at_its_last_op_only() -> None:
    """Nothing lands on a sender: until its last op ended only that op is polled (one
    wake-up a transfer)."""
    link = NcclLink.__new__(NcclLink)
    link.cache, link.poller = _Cache(), Poller()  # type: ignore[assignment]
    link._lock, link._inflight = threading.Lock(), {}
    log: list[str] = []
    wire: set[int] = set()
    posted = _posted(128, log, wire=wire)
    polled: list[int] = []
    def counted(op: Any) -> Any:
        real = op.done

        def done() -> bool:
            polled.append(op.k)
            return bool(real())
        return done

    for op in posted.completions:
        op.done = counted(op)
    try:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(link.wait, posted, time.monotonic() + 10)
                while not polled:
                    await anyio.sleep(0.001)
                wire.update(range(3))
                seen = len(polled)
                while len(polled) < seen + 3:  # looked again after the first chunks ended
                    await anyio.sleep(0.001)
                assert set(polled) == {3}
                wire.add(3)
    finally:
        link.poller.close()
    assert log == ["ended 0", "ended 1", "ended 2", "ended 3"]


@pytest.mark.anyio
async def test_transfers_waited_for_at_once_each_end_when_their_own_ops_end() -> None:
    """Each waiter's thread advances its own transfer, asleep until the link's poller saw
    its next op end; the loop stays free, and each waiter returns once its ops ended,
    whatever order the transfers end in."""
    link = NcclLink.__new__(NcclLink)
    link.cache, link.poller = _Cache(), Poller()  # type: ignore[assignment]
    link._lock, link._inflight = threading.Lock(), {}
    logs: list[list[str]] = [[], [], []]
    wires: list[set[int]] = [set(), set(), set()]
    woke: list[int] = []
    ended = [anyio.Event(), anyio.Event(), anyio.Event()]

    def landed_by(i: int) -> Any:
        def landed(b0: int, b1: int, left: int) -> None:
            logs[i].append(f"landed {b0}-{b1} left {left}")
        return landed

    async def waiter(i: int) -> None:
        await link.wait(_posted(128, logs[i], wire=wires[i]), float("inf"), landed=landed_by(i))
        woke.append(i)
        ended[i].set()

    try:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tasks:
                for i in range(3):
                    tasks.start_soon(waiter, i)
                for i in (2, 0, 1):  # each ends whole, in its turn
                    wires[i].update(range(4))
                    await ended[i].wait()
    finally:
        link.poller.close()
    assert woke == [2, 0, 1]
    for log in logs:
        assert [line for line in log if line.startswith("landed")][-1].endswith("left 0")


@given(st.data())
def test_waits_land_every_transfer_whole_and_in_order_however_their_ends_interleave(data: st.DataObject) -> None:
    """Several transfers waited for at once; each one's chunks end in order (one NCCL
    stream), the transfers' ends interleave at random, and the waiters poll at random moments.
    Each transfer lands exactly its blocks, in order, once each, with the right count of
    chunks to come, and ends when its last chunk landed; one whose communicator was
    aborted lands nothing from the aborted chunk on, and fails."""
    n = data.draw(st.integers(1, 4), label="transfers")
    sizes = data.draw(st.lists(st.sampled_from([16, 32, 128, 512]), min_size=n, max_size=n), label="blocks")
    aborts = data.draw(st.lists(st.one_of(st.none(), st.integers(0, 5)), min_size=n, max_size=n), label="abort at")
    at_once = data.draw(st.lists(st.booleans(), min_size=n, max_size=n), label="at once")
    logs: list[list[str]] = [[] for _ in range(n)]
    wires: list[set[int]] = [set() for _ in range(n)]
    landed: list[list[tuple[int, int, int]]] = [[] for _ in range(n)]
    watches = []
    for i in range(n):
        posted = _posted(sizes[i], logs[i], abort_at=aborts[i], wire=wires[i])
        watches.append(_watch(posted, logs[i], landed=lambda b0, b1, left, i=i: landed[i].append((b0, b1, left)),
                              at_once=at_once[i]))
    counts = [len(w.posted.completions) for w in watches]
    order = data.draw(st.permutations([i for i in range(n) for _ in range(counts[i])]), label="ends")
    passes = data.draw(st.lists(st.booleans(), min_size=len(order), max_size=len(order)), label="passes")
    ended = [False] * n

    def advance_all() -> None:  # each waiter's next poll
        for i, watch in enumerate(watches):
            if not ended[i]:
                ended[i] = watch.advance(0.0)

    for i, passing in zip(order, passes, strict=True):
        wires[i].add(len(wires[i]))  # that transfer's next chunk ends
        if passing:
            advance_all()
    advance_all()
    assert all(ended), "every chunk ended, yet a transfer is not over"
    for i, watch in enumerate(watches):
        parts = watch.posted.parts
        got = landed[i]
        assert all(a[1] == b[0] for a, b in pairwise(got)) and (not got or got[0][0] == 0)
        assert not at_once[i] or len(got) <= 1, "a transfer waited for at once landed in pieces"
        for b0, b1, left in got:
            k = next(k for k, p in enumerate(parts) if p[1] == b1)
            assert left == len(parts) - 1 - k
        cut = aborts[i] if aborts[i] is not None and aborts[i] < len(parts) else None
        if cut is None:
            assert watch.error is None and got and got[-1][1] == parts[-1][1] and got[-1][2] == 0
        else:
            assert isinstance(watch.error, TransferFailed)
            assert all(b1 <= parts[cut][0] for _, b1, _ in got), "a chunk cut short by the abort landed"


class _Op:
    """An op that ends when the test says; records which threads polled it."""

    def __init__(self) -> None:
        self.ended = False
        self.polled_by: set[str] = set()

    def done(self) -> bool:
        self.polled_by.add(threading.current_thread().name)
        return self.ended


def test_the_poller_alone_polls_and_wakes_each_waiting_thread_when_its_op_ends() -> None:
    poller = Poller()
    ops = [_Op() for _ in range(4)]
    got: dict[int, float | None] = {}
    threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, poller.wait(ops[i], 10)), name=f"waiter-{i}")
               for i in range(4)]
    try:
        for t in threads:
            t.start()
        wait_until(lambda: len(poller._waits) == 4, 5, "four waits given to the poller")
        polled_before = {i: set(op.polled_by) for i, op in enumerate(ops)}
        for i in (3, 1, 0, 2):
            ops[i].ended = True
            threads[i].join(5)
            assert not threads[i].is_alive() and got[i] is not None
            assert all(not threads[j].is_alive() for j in range(4) if ops[j].ended)
            assert all(threads[j].is_alive() for j in range(4) if not ops[j].ended), "woke before its op ended"
        for i, op in enumerate(ops):  # a waiting thread looks once before sleeping, and once when woken
            assert op.polled_by - polled_before[i] <= {"kvbroker-nccl-poller", f"waiter-{i}"}
            assert "kvbroker-nccl-poller" in op.polled_by
    finally:
        poller.close()
    assert poller._thread is not None and not poller._thread.is_alive()


def test_a_waiting_thread_learns_when_the_poller_saw_its_op_end() -> None:
    """`wait` gives the moment the poller saw the end (after the op ended, before
    the thread resumed), so a transfer's log line can tell a late wake-up from a late poll."""
    poller = Poller()
    op, got = _Op(), []
    try:
        waiter = threading.Thread(target=lambda: got.append((poller.wait(op, 10), time.monotonic())))
        waiter.start()
        wait_until(lambda: len(poller._waits) == 1, 5, "the wait given to the poller")
        ended_at = time.monotonic()
        op.ended = True
        waiter.join(10)
        assert not waiter.is_alive()
        seen, resumed = got[0]
        assert seen is not None and ended_at <= seen <= resumed
        before = time.monotonic()
        assert before <= poller.wait(op, 1.0) <= time.monotonic()  # type: ignore[operator]  # ended: seen now
        assert poller.wait(_Op(), 0.01) is None
    finally:
        poller.close()


@pytest.mark.parametrize("poller_lands", [True, False], ids=["poller lands", "waiter lands"])
def test_a_transfer_wait_says_when_its_end_was_seen_and_when_it_had_landed(poller_lands: bool) -> None:
    log: list[str] = []
    wire: set[int] = set()
    poller = Poller()
    landed_at: list[float] = []
    posted = _posted(128, log, wire=wire)
    watch = _watch(posted, log, landed=lambda b0, b1, left: landed_at.append(time.monotonic()))
    got: list[Waited] = []
    try:
        carried = poller.carry(watch) if poller_lands else None
        waiter = threading.Thread(target=lambda: got.append(_wait(watch, poller, carried)))
        waiter.start()
        wait_until(lambda: len(poller._carried if poller_lands else poller._waits) == 1, 5,
                   "the wait given to the poller")
        ended_at = time.monotonic()
        wire.update(range(4))
        waiter.join(10)
        assert not waiter.is_alive() and watch.error is None
    finally:
        poller.close()
    waited = got[0]
    assert ended_at <= waited.seen <= waited.resumed <= landed_at[0] <= landed_at[-1] <= waited.ended
    fields = waited.log_fields(waited.ended + 0.002)
    assert set(fields) == {"wake_us", "land_us", "hop_us"} and fields["hop_us"] == 2000
    assert all(v >= 0 for v in fields.values())
    # Ended before it was waited for: the thread never slept, and says so.
    done = _watch(_posted(16, [], wire={0}), [])
    quick = _wait_until_ended(done, Poller())
    assert quick.seen == quick.resumed <= quick.ended


def test_the_poller_sets_a_receive_up_lands_its_chunks_in_order_and_wakes_its_thread_once() -> None:
    log: list[str] = []
    wire: set[int] = set()
    poller = Poller()
    where: list[tuple[str, str]] = []  # (what, the thread that did it)
    posted = _posted(128, log, wire=wire)  # four chunks
    watch = _watch(posted, log, before=lambda: where.append(("before", threading.current_thread().name)),
                   landed=lambda b0, b1, left: where.append((f"{b0}-{b1} left {left}",
                                                             threading.current_thread().name)))
    got: list[Waited] = []
    try:
        carried = poller.carry(watch)
        waiter = threading.Thread(target=lambda: got.append(_wait(watch, poller, carried)),
                                  name="receiving")
        waiter.start()
        wait_until(lambda: bool(where), 5, "the receive set up by the poller")  # before any chunk ended
        for k, (b0, b1) in enumerate(posted.parts):
            wire.add(k)
            wait_until(lambda b0=b0, b1=b1: any(w[0].startswith(f"{b0}-{b1} ") for w in where), 5,
                       f"chunk {k} landed")
            assert waiter.is_alive() == (k < len(posted.parts) - 1), "the receiving thread woke before the end"
        waiter.join(5)
        assert not waiter.is_alive() and watch.error is None and poller._carried == []
    finally:
        poller.close()
    left = len(posted.parts) - 1
    assert where == [("before", "kvbroker-nccl-poller")] + [
        (f"{b0}-{b1} left {left - k}", "kvbroker-nccl-poller") for k, (b0, b1) in enumerate(posted.parts)
    ]
    assert got[0].seen == got[0].resumed <= got[0].ended


@pytest.mark.parametrize("poller_lands", [True, False], ids=["poller lands", "waiter lands"])
def test_a_landing_that_fails_at_the_first_look_is_not_tried_again(poller_lands: bool) -> None:
    calls: list[tuple[int, int]] = []

    def landed(b0: int, b1: int, left: int) -> None:
        calls.append((b0, b1))
        raise RuntimeError("the scatter's launch failed")

    watch = _watch(_posted(128, [], wire={0, 1, 2, 3}), [], landed=landed)  # every chunk ended already
    poller = Poller()
    try:
        _wait(watch, poller, poller.carry(watch) if poller_lands else None)
    finally:
        poller.close()
    assert isinstance(watch.error, RuntimeError) and calls == [(0, 128)] and poller._carried == []


class _SlowAbort(_Done):
    """A chunk that never ends; waiting for it past the deadline aborts its communicator,
    which blocks until the test lets it go (a real abort takes up to a second)."""

    def __init__(self, *args: Any, release: threading.Event, aborted_by: list[str]) -> None:
        super().__init__(*args)
        self.release, self.aborted_by = release, aborted_by

    def wait(self, deadline: float, *, spin_s: float = 0.0) -> None:
        self.aborted_by.append(threading.current_thread().name)
        self.release.wait(10)
        raise RecvTimeout("t", f"chunk {self.k} did not end by its deadline")


def test_a_carried_receive_past_its_deadline_is_aborted_by_its_waiter_while_the_poller_goes_on() -> None:
    """Past its deadline a carried receive goes back to its waiter, which aborts the op:
    the abort blocks, and the poller keeps landing other transfers meanwhile."""
    poller = Poller()
    late_log: list[str] = []
    release, aborted_by = threading.Event(), list[str]()
    late_posted = _posted(128, late_log)  # no chunk ever ends
    late_posted.completions[0] = _SlowAbort(0, late_log, late_posted.comm, None, set(), release=release,
                                            aborted_by=aborted_by)
    late = _watch(late_posted, late_log, deadline=time.monotonic() + 0.05)
    wire: set[int] = set()
    log: list[str] = []
    other = _watch(_posted(16, log, wire=wire), log)
    try:
        carried = [(w, poller.carry(w)) for w in (late, other)]
        waiters = [threading.Thread(target=_wait, args=(w, poller, c), name=f"waiter-{i}")
                   for i, (w, c) in enumerate(carried)]
        for waiter in waiters:
            waiter.start()
        wait_until(lambda: aborted_by, 5, "the late receive's abort")
        wire.add(0)  # while the abort blocks
        waiters[1].join(5)
        assert not waiters[1].is_alive() and other.error is None and "landed 0-16 left 0" in log
        assert aborted_by == ["waiter-0"] and waiters[0].is_alive()
        release.set()
        waiters[0].join(5)
        assert not waiters[0].is_alive() and isinstance(late.error, RecvTimeout)
        assert not any(line.startswith("landed") for line in late_log)
    finally:
        release.set()
        poller.close()


def _bare_link() -> NcclLink:
    link = NcclLink.__new__(NcclLink)
    link.cache, link.poller = _Cache(), Poller()  # type: ignore[assignment]
    link._lock, link._inflight = threading.Lock(), {}
    return link


@pytest.mark.anyio
async def test_a_carried_receive_is_awaited_on_the_loop_without_a_worker_thread() -> None:
    link = _bare_link()
    log: list[str] = []
    wire: set[int] = set()
    posted = _posted(128, log, wire=wire)
    threads = anyio.to_thread.current_default_thread_limiter()
    got: list[Waited] = []

    async def receive() -> None:
        got.append(await link.wait(posted, time.monotonic() + 10, landed=_watch(posted, log).landed))

    try:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(receive)
                while not link.poller._carried:
                    await anyio.sleep(0.001)
                assert threads.borrowed_tokens == 0  # nothing sleeps in a worker thread for it
                wire.update(range(4))
    finally:
        link.poller.close()
    assert [line for line in log if line.startswith("landed")][-1] == "landed 0-128 left 0"
    assert got[0].seen <= got[0].ended


@pytest.mark.anyio
async def test_a_carried_receive_past_its_deadline_fails_its_wait() -> None:
    link = _bare_link()
    log: list[str] = []
    try:
        with anyio.fail_after(10), pytest.raises(TransferFailed, match="did not end by its deadline"):
            await link.wait(_posted(128, log), time.monotonic() + 0.05, landed=_watch(_posted(1, log), log).landed)
    finally:
        link.poller.close()
    assert not any(line.startswith("landed") for line in log)


@pytest.mark.anyio
async def test_a_poller_stuck_past_the_grace_fails_the_wait_and_drops_the_communicator(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A poller that never reports (here: stuck in a landing's launch) fails the wait
    once the grace after the deadline is over, and the communicator goes, so the ops end."""
    monkeypatch.setattr(nccl_link, "CARRY_GRACE_S", 0.05)
    link = _bare_link()
    stuck = threading.Event()
    posted = _posted(128, [], wire={0, 1, 2, 3})

    def landed(b0: int, b1: int, left: int) -> None:
        stuck.wait(10)

    try:
        with anyio.fail_after(10), pytest.raises(TransferFailed, match="not seen to end"):
            await link.wait(posted, time.monotonic() + 0.05, landed=landed)
    finally:
        stuck.set()
        link.poller.close()
    assert link.cache.discarded == ["p0:0"]  # type: ignore[attr-defined]


def test_a_receive_waited_for_after_the_poller_closed_lands_in_its_own_thread() -> None:
    poller = Poller()
    poller.close()
    log: list[str] = []
    wire: set[int] = set()
    landers: list[str] = []
    watch = _watch(_posted(128, log, wire=wire), log,
                   landed=lambda b0, b1, left: landers.append(threading.current_thread().name))
    got: list[Waited] = []
    assert poller.carry(watch) is None
    waiter = threading.Thread(target=lambda: got.append(_wait_until_ended(watch, poller)), name="receiving")
    waiter.start()
    wire.update(range(4))
    waiter.join(10)
    assert not waiter.is_alive() and watch.error is None and landers and set(landers) == {"receiving"}


def test_a_wait_past_its_timeout_returns_false_and_is_forgotten() -> None:
    poller = Poller()
    try:
        assert poller.wait(_Op(), 0.05) is None
        assert poller._waits == []
    finally:
        poller.close()


def test_after_close_pending_waits_still_end_and_later_waits_look_for_themselves() -> None:
    poller = Poller()
    pending, got = _Op(), []
    waiter = threading.Thread(target=lambda: got.append(poller.wait(pending, 10)))
    waiter.start()
    wait_until(lambda: len(poller._waits) == 1, 5, "the wait given to the poller")
    closing = threading.Thread(target=poller.close)
    closing.start()
    pending.ended = True  # an aborted op ends
    waiter.join(5)
    closing.join(5)
    assert len(got) == 1 and got[0] is not None and not closing.is_alive()
    later = _Op()
    later.ended = True
    assert poller.wait(later, 1.0) is not None
    assert poller.wait(_Op(), 0.01) is None


class _Following:
    """A block send that follows a forward pass: its end (`done`) cannot come before its
    last part is launched (`launch`), which calls the hook `until_launched` was given,
    as `PendingEnd.record` does; counts its polls."""

    def __init__(self) -> None:
        self.launched = self.ended = False
        self.polls = 0
        self.hook: Any = None

    def done(self) -> bool:
        self.polls += 1
        return self.ended

    def wait(self, deadline: float, *, spin_s: float = 0.0) -> None:
        assert self.ended

    def until_launched(self, hook: Any) -> bool:
        if self.launched:
            return False
        self.hook = hook
        return True

    def launch(self) -> None:
        self.launched = True
        hook, self.hook = self.hook, None
        if hook is not None:
            hook()


def test_a_send_whose_last_part_is_still_to_be_launched_is_not_polled_until_it_is() -> None:
    """Eight sends follow P's forward pass: the poller carries them from their post, but
    none can end before its last layers are launched, so it leaves them (and the GIL, to
    the forward pass's thread) alone until then, rather than polling every pause. Each
    launch wakes it, and each send is then seen to end as promptly as before."""
    ops = [_Following() for _ in range(8)]
    poller = Poller()
    carried = []
    looks = [0]

    def look() -> float:  # P's look for D's receives, which wants one every 10 ms: the poller's clock here
        looks[0] += 1
        return 0.01

    try:
        for op in ops:
            posted = Posted(peer="d0:0", op="send", transfer_id="t", comm=SimpleNamespace(closed=False, broken=False),
                            completions=[op], parts=[(0, 1)], flag=threading.Event())
            ended = poller.carry(_watch(posted, [], landed=None, at_once=True))
            assert ended is not None
            carried.append(ended)
        wait_until(lambda: all(op.hook is not None for op in ops), 5, "the poller left the sends to their launches")
        assert poller.probe(look)
        polls, seen = [op.polls for op in ops], looks[0]
        # Five looks are 40 ms or more of the poller's turns: a poll every pause would be
        # about 400 a send; left alone, a send is polled once a turn at most.
        wait_until(lambda: looks[0] >= seen + 5, 5, "five of the probe's looks")
        turns = looks[0] - seen + 2
        assert all(op.polls - before <= turns for op, before in zip(ops, polls)), \
            "the poller polled sends that could not end"
        for k, op in enumerate(ops):
            op.launch()
            op.ended = True  # the last layers' copy, done
            assert carried[k].wait(5), f"send {k} was not seen to end once launched"
            assert all(not e.is_set() for e in carried[k + 1:])
        assert poller._carried == []
    finally:
        poller.close()


class _BrokenOp(_Op):
    """An op whose poll raises, as a CUDA error makes an event query raise."""

    def done(self) -> bool:
        if threading.current_thread().name == "kvbroker-nccl-poller":
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return False


def test_an_op_whose_poll_raises_wakes_its_waiter_at_once_and_the_poller_goes_on() -> None:
    poller = Poller()
    broken = _BrokenOp()
    got: list[float | None] = []
    try:
        waiter = threading.Thread(target=lambda: got.append(poller.wait(broken, 30)))
        waiter.start()
        waiter.join(10)
        assert not waiter.is_alive() and got == [None], "the waiter slept towards its deadline"
        other = _Op()
        ending = threading.Thread(target=lambda: got.append(poller.wait(other, 30)))
        ending.start()
        wait_until(lambda: len(poller._waits) == 1, 5, "the next wait given to the poller")
        other.ended = True
        ending.join(10)
        assert got[0] is None and got[1] is not None, "the poller stopped after the error"
    finally:
        poller.close()


class _Usable:
    """A cache that says which communicator a ticket may be posted on from the loop."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, str, bool]] = []

    def usable(self, peer: str, nonce: str, *, initiator: bool) -> object:
        self.asked.append((peer, nonce, initiator))
        return SimpleNamespace(nonce=nonce, send_ready=lambda: nonce != "waits")


def test_only_a_ticket_naming_a_built_communicator_is_posted_on_the_loop() -> None:
    """A new communicator (ticket "") is built in a worker thread, as is any op of a
    transfer already cancelled, and a send that would wait on the host for its receive;
    one the ticket names is posted on the loop when the cache says it may be (P asks as
    the initiator, D as the acceptor)."""
    link = NcclLink.__new__(NcclLink)
    link.cache = _Usable()  # type: ignore[assignment]
    flag = threading.Event()
    assert link._postable_now("d0:0", "send", ("", 0), flag) is None
    assert link._postable_now("d0:0", "send", ("n1", 3), flag).nonce == "n1"
    assert link._postable_now("p0:0", "recv", ("n1", 4), flag).nonce == "n1"
    assert link._postable_now("d0:0", "send", ("waits", 5), flag) is None
    flag.set()
    assert link._postable_now("p0:0", "recv", ("n1", 5), flag) is None
    assert link.cache.asked == [("d0:0", "n1", True), ("p0:0", "n1", False), ("d0:0", "waits", True)]


@settings(max_examples=25, deadline=None)
@given(st.data())
def test_the_poller_carries_transfers_whole_and_in_order_however_their_ends_interleave(data: st.DataObject) -> None:
    """Several transfers carried by one poller thread; their chunks end in order per
    transfer, interleaved at random across them, sometimes faster than the poller looks.
    Each lands its blocks in order, once each, all from the poller, and its waiter wakes
    once it is whole. A transfer whose last chunk never ends lands at most the chunks
    before it, goes back to its waiter past its deadline, and fails there."""
    n = data.draw(st.integers(1, 4), label="transfers")
    sizes = data.draw(st.lists(st.sampled_from([16, 32, 128, 512]), min_size=n, max_size=n), label="blocks")
    stuck = data.draw(st.lists(st.booleans(), min_size=n, max_size=n), label="last chunk never ends")
    poller = Poller()
    wires: list[set[int]] = [set() for _ in range(n)]
    landed: list[list[tuple[int, int, int, str]]] = [[] for _ in range(n)]
    watches = []
    start = time.monotonic()
    for i in range(n):
        posted = _posted(sizes[i], [], wire=wires[i])
        watches.append(_watch(
            posted, [], deadline=start + 0.3 if stuck[i] else float("inf"),
            landed=lambda b0, b1, left, i=i: landed[i].append((b0, b1, left, threading.current_thread().name))))
    counts = [len(w.posted.completions) - stuck[i] for i, w in enumerate(watches)]
    order = data.draw(st.permutations([i for i in range(n) for _ in range(counts[i])]), label="ends")
    settle = data.draw(st.lists(st.booleans(), min_size=len(order), max_size=len(order)), label="poller looks")
    results: list[Waited | None] = [None] * n

    def waits(i: int, carried: _Ended | None) -> None:
        results[i] = _wait(watches[i], poller, carried)

    try:
        waiters = [threading.Thread(target=waits, args=(i, poller.carry(w)), name=f"waiter-{i}")
                   for i, w in enumerate(watches)]
        for waiter in waiters:
            waiter.start()
        for i, look in zip(order, settle, strict=True):
            wires[i].add(len(wires[i]))  # that transfer's next chunk ends
            if look:
                b1 = watches[i].posted.parts[len(wires[i]) - 1][1]

                def seen(i: int = i, b1: int = b1) -> bool:
                    # A stuck transfer may be past its deadline already (a slow machine gets
                    # here late): then it went back to its waiter, which fails it, and lands nothing more.
                    return bool(landed[i] and landed[i][-1][1] >= b1) or (stuck[i] and not waiters[i].is_alive())

                wait_until(seen, 5, f"transfer {i} landed to {b1}")
        for waiter in waiters:
            waiter.join(10)
        assert not any(waiter.is_alive() for waiter in waiters)
    finally:
        poller.close()
    for i, watch in enumerate(watches):
        parts, got = watch.posted.parts, landed[i]
        assert all(a[1] == b[0] for a, b in pairwise(got)) and (not got or got[0][0] == 0)
        for b0, b1, left, _ in got:
            assert left == len(parts) - 1 - next(k for k, p in enumerate(parts) if p[1] == b1)
        if stuck[i]:  # handed back past its deadline: its waiter may land what ended meanwhile, then fails
            assert {name for *_, name in got} <= {"kvbroker-nccl-poller", f"waiter-{i}"}
            assert isinstance(watch.error, RecvTimeout)
            assert not got or got[-1][1] <= parts[-1][0], "a chunk that never ended landed"
        else:
            assert {name for *_, name in got} == {"kvbroker-nccl-poller"}
            assert watch.error is None and got[-1][1] == parts[-1][1] and got[-1][2] == 0
            assert results[i] is not None and results[i].seen <= results[i].ended  # type: ignore[union-attr]
