"""A receive lease whose bytes a copy may still read goes back to the pool only after it.

Over nccl, D scatters each chunk as it lands (`ConsumerSide._land`), on a stream of its
own; a load can then fail with a chunk's copy still queued behind it. Its lease must
not go back to the pool (where the next receive would overwrite it) before that copy
ran. The copy's CUDA event is replaced by a stand-in here, the rest is a real decode
worker with a real broker (GPU runs of the whole path: tests/gpu/test_connector_nccl.py).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from connector.consumer import _Load
from connector.scheduler import LoadSpec
from tests.connector.test_worker import make_caches, make_worker
from tests.support import BrokerProcess

pytestmark = pytest.mark.slow


class _Copy:
    """Stands in for the CUDA event after a chunk's scatter."""

    def __init__(self) -> None:
        self.ran = False

    def query(self) -> bool:
        return self.ran


class _AskedLock:
    """A load's landing lock that says when someone asks for it."""

    def __init__(self) -> None:
        self.lock, self.asked = threading.Lock(), threading.Event()

    def __enter__(self) -> None:
        self.asked.set()
        self.lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self.lock.release()


def _receiving(tid: str, lease: object) -> _Load:
    spec = LoadSpec(req_id=f"req-{tid}", block_ids=[1, 2, 3], num_cached_blocks=0, num_tokens=90)
    return _Load(tid, spec, time.monotonic() + 30, state="receiving", lease=lease)  # type: ignore[arg-type]


def _lease_back_only_once_copied(side: Any, pool: Any, load: _Load, copy: _Copy) -> None:
    """`load` failed: its lease stays out of the pool until `copy` (a scatter reading it) ran."""
    assert load.state == "failed" and load.lease is None
    side._drain()
    assert pool.statistics().leases == 1, "the lease went back while a copy could still read it"
    copy.ran = True
    side._drain()
    assert pool.statistics().leases == 0


def test_a_failed_load_keeps_its_lease_until_its_scattered_chunks_ran(broker: BrokerProcess) -> None:
    d = make_worker(broker.endpoint, "d", "d0", make_caches())
    try:
        assert d.consumer is not None and d.pool is not None
        side, pool = d.consumer, d.pool
        load = _receiving("cut", pool.acquire_nowait(4096))
        copy = _Copy()
        load.scattered = copy  # type: ignore[assignment]
        side._fail(load, "the receive was cut short", telling=False)
        _lease_back_only_once_copied(side, pool, load, copy)
    finally:
        d.close()


def test_a_failed_load_with_nothing_scattered_gives_its_lease_back_at_once(broker: BrokerProcess) -> None:
    d = make_worker(broker.endpoint, "d", "d0", make_caches())
    try:
        assert d.consumer is not None and d.pool is not None
        load = _receiving("none", d.pool.acquire_nowait(4096))
        d.consumer._fail(load, "no bytes", telling=False)
        assert d.pool.statistics().leases == 0
    finally:
        d.close()


def test_a_load_failed_while_a_chunk_lands_waits_for_that_copy_before_freeing_its_lease(broker: BrokerProcess) -> None:
    """The loop thread fails a load while its receiving thread is launching a chunk's
    scatter (holding the load's landing lock, not the worker's): the fail waits for the
    launch, and the lease stays out of the pool until that copy ran."""
    d = make_worker(broker.endpoint, "d", "d0", make_caches())
    try:
        assert d.consumer is not None and d.pool is not None
        side, pool = d.consumer, d.pool
        load = _receiving("mid", pool.acquire_nowait(4096))
        load.landing = _AskedLock()  # type: ignore[assignment]
        copy, errors = _Copy(), []

        def fail() -> None:
            try:
                side._fail(load, "the broker aborted it", telling=False)
            except BaseException as exc:  # reported below
                errors.append(exc)

        with load.landing.lock:  # a landing under way
            failing = threading.Thread(target=fail)
            failing.start()
            assert load.landing.asked.wait(10), "_fail never asked for the load's landing lock"
            assert load.state == "receiving" and load.lease is not None, "_fail went on during the landing"
            load.scattered = copy  # type: ignore[assignment]  # what the landing publishes as it ends
        failing.join(10)
        assert not failing.is_alive() and not errors, errors
        _lease_back_only_once_copied(side, pool, load, copy)
    finally:
        d.close()


def test_get_finished_reports_ended_loads_while_another_load_is_landing(broker: BrokerProcess) -> None:
    """A landing holds its own load's lock only: the engine's get_finished reports the
    loads that ended meanwhile instead of waiting for it."""
    d = make_worker(broker.endpoint, "d", "d0", make_caches())
    try:
        assert d.consumer is not None and d.pool is not None
        side = d.consumer
        landing = _receiving("landing", d.pool.acquire_nowait(4096))
        ended = _receiving("ended", None)
        ended.state, ended.reason, ended.settled = "failed", "no KV within the load deadline", True
        with d.lock:
            side._loads.update({"landing": landing, "ended": ended})
        got: list[set[str] | None] = []
        with landing.landing:
            reporting = threading.Thread(target=lambda: got.append(side.get_finished(set())))
            reporting.start()
            reporting.join(10)
            assert not reporting.is_alive(), "get_finished waited for another load's landing"
        assert got == [{"req-ended"}]
        assert side.get_block_ids_with_load_errors() == {1, 2, 3}
        side._fail(landing, "test over", telling=False)
    finally:
        d.close()
