"""BufferPool: credit invariants, coalescing, fragmentation, FIFO waits, cancellation, threads."""

from __future__ import annotations

import random
import statistics
import threading

import anyio
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from workers.pool import (
    BufferPool,
    InvalidRelease,
    Lease,
    PoolExhausted,
    PoolStats,
    PoolTooSmall,
    _Waiter,
)

KiB = 1024


def check_invariants(pool: BufferPool, leases: list[Lease]) -> None:
    """Everything the pool promises about its state, checked from the outside."""
    s = pool.statistics()
    assert s.reserved + s.free == s.capacity
    assert s.reserved == sum(lease.reserved for lease in leases)
    assert s.leases == len(leases)
    spans = sorted((lease.offset, lease.offset + lease.reserved) for lease in leases)
    for start, end in spans:
        assert 0 <= start < end <= pool.capacity
        assert start % pool.alignment == 0
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert end <= start, "leases overlap"
    free = pool.free_ranges()
    assert sum(size for _, size in free) == s.free
    assert s.largest_free == max((size for _, size in free), default=0)
    for (o1, n1), (o2, _) in zip(free, free[1:]):
        assert o1 + n1 < o2, "free ranges are unsorted, overlapping or not coalesced"
    # Free ranges and leases tile the pool exactly.
    tiles = sorted(spans + [(o, o + n) for o, n in free])
    pos = 0
    for start, end in tiles:
        assert start == pos
        pos = end
    assert pos == pool.capacity


# -- basics ----------------------------------------------------------------------------


def test_lease_is_an_aligned_view_of_the_pool() -> None:
    pool = BufferPool(64 * KiB, alignment=256)
    a = pool.acquire_nowait(100)
    b = pool.acquire_nowait(1000)
    assert (a.offset, a.nbytes, a.reserved) == (0, 100, 256)
    assert (b.offset, b.nbytes, b.reserved) == (256, 1000, 1024)
    assert a.tensor.dtype == torch.uint8 and a.tensor.numel() == 100
    b.tensor.fill_(7)
    assert torch.all(pool.tensor[256:1256] == 7)  # a view, no copy
    v = b.view(torch.float32, (10, 25))
    assert v.shape == (10, 25) and v.data_ptr() == pool.tensor.data_ptr() + 256
    with pytest.raises(ValueError, match="1004 B"):
        a.view(torch.int32, (251, 1))
    assert pool.statistics() == PoolStats(
        capacity=64 * KiB, reserved=1280, free=64 * KiB - 1280, largest_free=64 * KiB - 1280, leases=2, waiting=0
    )
    with a, b:
        pass
    assert pool.statistics().free == 64 * KiB
    assert a.released and b.released


def test_too_small_and_exhausted_messages() -> None:
    pool = BufferPool(4 * KiB)
    with pytest.raises(PoolTooSmall, match=r"4096 B.*5000 B.*raise the pool capacity"):
        pool.acquire_nowait(5000)
    lease = pool.acquire_nowait(3 * KiB)
    with pytest.raises(PoolExhausted, match=r"2048 B.*4096 B pool") as info:
        pool.acquire_nowait(2 * KiB)
    assert isinstance(info.value, anyio.WouldBlock)
    pool.release(lease)
    with pytest.raises(ValueError, match="positive"):
        pool.acquire_nowait(0)


def test_bad_construction() -> None:
    with pytest.raises(ValueError, match="power of two"):
        BufferPool(4096, alignment=48)
    with pytest.raises(ValueError, match="multiple"):
        BufferPool(4000, alignment=256)


def test_double_release_is_refused_and_changes_nothing() -> None:
    pool = BufferPool(8 * KiB)
    a = pool.acquire_nowait(1 * KiB)
    pool.release(a)
    b = pool.acquire_nowait(1 * KiB)  # reuses a's offset
    assert b.offset == a.offset
    before = pool.statistics()
    with pytest.raises(InvalidRelease, match="already released"):
        pool.release(a)
    assert pool.statistics() == before
    other = BufferPool(8 * KiB)
    with pytest.raises(InvalidRelease, match="another pool"):
        other.release(b)
    check_invariants(pool, [b])


def test_split_gives_adjacent_leases_released_one_by_one() -> None:
    pool = BufferPool(64 * KiB, alignment=1 * KiB)
    lease = pool.acquire_nowait(10 * KiB + 100)
    a, b, c = pool.split(lease, [4 * KiB, 2 * KiB, 4 * KiB + 100])
    assert (a.offset, b.offset, c.offset) == (lease.offset, lease.offset + 4 * KiB, lease.offset + 6 * KiB)
    assert lease.released and pool.statistics().leases == 3 and pool.statistics().reserved == 11 * KiB
    with pytest.raises(InvalidRelease, match="already released"):
        pool.release(lease)  # the whole one is spent: its parts hold the bytes now
    pool.release(b)
    assert pool.statistics().reserved == 9 * KiB
    check_invariants(pool, [a, c])
    for bad in ([1536, 1 * KiB], [4 * KiB, 4 * KiB], [0, 4 * KiB]):
        before = pool.statistics()
        with pytest.raises(ValueError):
            pool.split(c, bad)  # unaligned before the last, too many bytes, or empty
        assert pool.statistics() == before
    with pytest.raises(InvalidRelease, match="only a held lease"):
        pool.split(b, [1 * KiB])
    pool.release(a)
    pool.release(c)
    assert pool.free_ranges() == [(0, pool.capacity)]


# -- hypothesis: random alloc/free sequences -------------------------------------------


class PoolMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.pool = BufferPool(64 * KiB, alignment=256)
        self.leases: list[Lease] = []

    @rule(nbytes=st.integers(1, 80 * KiB))
    def acquire(self, nbytes: int) -> None:
        before = self.pool.statistics()
        try:
            lease = self.pool.acquire_nowait(nbytes)
        except PoolTooSmall:
            assert nbytes > self.pool.capacity
        except PoolExhausted:
            assert before.largest_free < -(-nbytes // 256) * 256
            assert self.pool.statistics() == before
        else:
            assert lease.nbytes == nbytes
            self.leases.append(lease)

    @precondition(lambda self: self.leases)
    @rule(data=st.data())
    def split(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.leases) - 1))
        lease = self.leases[i]
        whole = lease.nbytes // 256
        if whole < 1:
            return
        cuts = sorted(data.draw(st.sets(st.integers(1, whole), min_size=1, max_size=4)))
        sizes = [256 * (b - a) for a, b in zip([0, *cuts[:-1]], cuts)]
        sizes[-1] += lease.nbytes - 256 * cuts[-1]  # the last one takes the unaligned rest
        before = self.pool.statistics()
        parts = self.pool.split(self.leases.pop(i), sizes)
        assert [p.nbytes for p in parts] == sizes
        assert [p.offset for p in parts] == [lease.offset + sum(sizes[:k]) for k in range(len(sizes))]
        assert sum(p.reserved for p in parts) == lease.reserved
        assert self.pool.statistics().reserved == before.reserved
        self.leases.extend(parts)

    @precondition(lambda self: self.leases)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.leases) - 1))
        self.pool.release(self.leases.pop(i))

    @precondition(lambda self: not self.leases)
    @rule()
    def all_free_means_one_range(self) -> None:
        assert self.pool.free_ranges() == [(0, self.pool.capacity)]

    @invariant()
    def invariants(self) -> None:
        check_invariants(self.pool, self.leases)


TestPoolMachine = PoolMachine.TestCase
TestPoolMachine.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)


# -- fragmentation ---------------------------------------------------------------------


def run_workload(seed: int, *, capacity: int, max_request: int, utilisation: float, steps: int) -> dict[str, float]:
    """Random acquires and frees, never asking beyond `utilisation` of the pool.

    Returns the mean and minimum of largest_free / capacity over the steady state
    (after a warm-up), the mean utilisation, and how often a request that fitted the
    utilisation budget still found no contiguous room.
    """
    rng = random.Random(seed)
    pool = BufferPool(capacity)
    leases: list[Lease] = []
    largest: list[float] = []
    used: list[float] = []
    tries = fails = 0
    for step in range(steps):
        nbytes = rng.randint(1, max_request)
        aligned = -(-nbytes // pool.alignment) * pool.alignment
        if pool.statistics().reserved + aligned <= utilisation * capacity and rng.random() < 0.6:
            tries += 1
            try:
                leases.append(pool.acquire_nowait(nbytes))
            except PoolExhausted:
                fails += 1
        elif leases:
            pool.release(leases.pop(rng.randrange(len(leases))))
        if step >= steps // 10:
            s = pool.statistics()
            largest.append(s.largest_free / capacity)
            used.append(s.reserved / capacity)
    check_invariants(pool, leases)
    for lease in leases:
        pool.release(lease)
    s = pool.statistics()
    assert (s.free, s.largest_free) == (capacity, capacity), "freeing everything must coalesce fully"
    return {
        "mean_largest": statistics.mean(largest),
        "min_largest": min(largest),
        "mean_used": statistics.mean(used),
        "fail_rate": fails / max(tries, 1),
    }


@pytest.mark.parametrize("max_request_div", [4, 16, 64])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fragmentation_stays_bounded(seed: int, max_request_div: int) -> None:
    """At <= 50% utilisation, at least half the capacity is free; the bound asserted is
    that, on average, at least half of *that* (25% of capacity) is one contiguous
    range. Measured with best-fit and coalescing (1 MiB pool, 20k steps, requests up to
    1/4, 1/16, 1/64 of it): mean utilisation 0.23-0.47, mean largest free 0.42-0.69 of
    capacity (about 80% of the free bytes in one range at 47% use), minimum 0.15-0.37,
    and no request that fitted the budget failed. The 25% bound leaves a wide margin;
    the minimum is held to 10%.
    """
    capacity = 1 << 20
    figures = run_workload(
        seed, capacity=capacity, max_request=capacity // max_request_div, utilisation=0.5, steps=20_000
    )
    assert figures["mean_used"] <= 0.5
    assert figures["mean_largest"] >= 0.25, figures
    assert figures["min_largest"] >= 0.10, figures
    assert figures["fail_rate"] <= 0.01, figures


# -- async: waiting, FIFO, cancellation ------------------------------------------------


@pytest.mark.anyio
async def test_acquire_waits_and_wakes_fifo() -> None:
    pool = BufferPool(4 * KiB)
    full = pool.acquire_nowait(4 * KiB)
    order: list[str] = []
    got: dict[str, Lease] = {}

    async def want(name: str, nbytes: int) -> None:
        got[name] = await pool.acquire(nbytes)
        order.append(name)

    async with anyio.create_task_group() as tg:
        # Queue "big" first; the small ones must not pass it even when they would fit.
        for name, nbytes in [("big", 3 * KiB), ("small1", 1 * KiB), ("small2", 1 * KiB)]:
            tg.start_soon(want, name, nbytes)
            await anyio.wait_all_tasks_blocked()
        assert pool.statistics().waiting == 3
        with pytest.raises(PoolExhausted, match="3 waiting"):
            pool.acquire_nowait(256)  # no barging past waiters
        pool.release(full)  # room for big + small1; small2 keeps waiting
        await anyio.wait_all_tasks_blocked()
        # Room is granted in queue order (big is carved first, at offset 0); the order
        # in which woken tasks then run is the scheduler's (trio shuffles it).
        assert sorted(order) == ["big", "small1"]
        assert (got["big"].offset, got["small1"].offset) == (0, 3 * KiB)
        assert pool.statistics().waiting == 1
        pool.release(got["big"])
    assert order[2:] == ["small2"]
    for name in ("small1", "small2"):
        pool.release(got[name])
    check_invariants(pool, [])


@pytest.mark.anyio
async def test_acquire_is_immediate_when_room_and_refuses_oversize() -> None:
    pool = BufferPool(4 * KiB)
    with pytest.raises(PoolTooSmall):
        await pool.acquire(8 * KiB)
    lease = await pool.acquire(1 * KiB)
    assert pool.statistics().reserved == 1 * KiB
    pool.release(lease)


@pytest.mark.anyio
async def test_cancelled_wait_leaves_no_reservation() -> None:
    pool = BufferPool(4 * KiB)
    full = pool.acquire_nowait(4 * KiB)
    with anyio.move_on_after(0.05) as scope:
        await pool.acquire(1 * KiB)
    assert scope.cancelled_caught
    assert pool.statistics().waiting == 0
    with pytest.raises(TimeoutError):
        with anyio.fail_after(0.05):
            await pool.acquire(2 * KiB)
    pool.release(full)
    check_invariants(pool, [])


@pytest.mark.anyio
async def test_cancelling_the_head_lets_the_next_waiter_in() -> None:
    pool = BufferPool(4 * KiB)
    a = pool.acquire_nowait(2 * KiB)
    b = pool.acquire_nowait(2 * KiB)
    got: list[Lease] = []

    async def want(nbytes: int) -> None:
        got.append(await pool.acquire(nbytes))

    async with anyio.create_task_group() as tg:
        with anyio.CancelScope() as head_scope:
            async with anyio.create_task_group() as head:
                head.start_soon(want, 4 * KiB)
                await anyio.wait_all_tasks_blocked()
                tg.start_soon(want, 2 * KiB)
                await anyio.wait_all_tasks_blocked()
                pool.release(a)  # 2 KiB free, but the 4 KiB head blocks the queue
                await anyio.wait_all_tasks_blocked()
                assert got == []
                head_scope.cancel()
    assert len(got) == 1 and got[0].nbytes == 2 * KiB
    pool.release(got[0])
    pool.release(b)
    check_invariants(pool, [])


@pytest.mark.anyio
@pytest.mark.parametrize("cancel_first", [True, False])
async def test_cancel_racing_a_handover_leaks_nothing(cancel_first: bool) -> None:
    """Room handed to a waiter that is cancelled before it resumes must come back.

    Cancelling first, then releasing in the same step, hands room to a task whose
    wait already failed (the pool must take it back). Releasing first lets the
    acquire win on both backends; the task then holds a lease like any other.
    """
    pool = BufferPool(4 * KiB)
    full = pool.acquire_nowait(4 * KiB)
    got: list[Lease] = []

    async def want() -> None:
        got.append(await pool.acquire(1 * KiB))

    async with anyio.create_task_group() as tg:
        tg.start_soon(want)
        await anyio.wait_all_tasks_blocked()
        if cancel_first:
            tg.cancel_scope.cancel()
            pool.release(full)
        else:
            pool.release(full)
            tg.cancel_scope.cancel()
    if cancel_first:
        assert got == []
    for lease in got:
        pool.release(lease)
    s = pool.statistics()
    assert (s.reserved, s.waiting, s.leases) == (0, 0, 0)


@pytest.mark.anyio
async def test_release_from_another_thread_wakes_the_waiter() -> None:
    pool = BufferPool(4 * KiB)
    full = pool.acquire_nowait(4 * KiB)
    async with anyio.create_task_group() as tg:
        tg.start_soon(anyio.to_thread.run_sync, pool.release, full)
        with anyio.fail_after(5):
            lease = await pool.acquire(3 * KiB)
    assert lease.reserved == 3 * KiB
    pool.release(lease)
    check_invariants(pool, [])


def test_waiter_whose_loop_is_gone_gets_its_room_taken_back() -> None:
    pool = BufferPool(4 * KiB)
    full = pool.acquire_nowait(4 * KiB)

    async def make_waiter() -> _Waiter:
        return _Waiter(1 * KiB, 1 * KiB)

    waiter = anyio.run(make_waiter)

    def dead_loop() -> None:
        raise anyio.RunFinishedError

    waiter.wake = dead_loop
    pool._waiters.append(waiter)
    pool.release(full)
    s = pool.statistics()
    assert (s.reserved, s.waiting, s.leases) == (0, 0, 0)
    assert waiter.settled and waiter.lease is None


def test_threads_hammering_the_pool_keep_the_invariants() -> None:
    pool = BufferPool(256 * KiB)
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        mine: list[Lease] = []
        try:
            for _ in range(2000):
                if mine and rng.random() < 0.5:
                    pool.release(mine.pop(rng.randrange(len(mine))))
                else:
                    try:
                        lease = pool.acquire_nowait(rng.randint(1, 8 * KiB))
                    except PoolExhausted:
                        continue
                    lease.tensor.fill_(seed)  # nobody else may own these bytes
                    mine.append(lease)
                    assert torch.all(lease.tensor == seed)
            for lease in mine:
                assert torch.all(lease.tensor == seed)
                pool.release(lease)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i + 1,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert pool.free_ranges() == [(0, pool.capacity)]
