"""D writes a transfer into its cache as it arrives, off the engine's main thread, and a
receive lease whose bytes a copy may still read goes back to the pool only after it.

`ConsumerSide._land` copies each chunk into D's blocks once it has arrived whole: over
tcp (these tests, CPU caches) in the receiving task's worker thread, over nccl on a
stream of its own (tests/gpu/test_connector_nccl.py). A load can fail with a copy still
running; its lease must not go back to the pool (where the next receive would
overwrite it) before that copy ended, and its blocks are handed back to the engine only
after it.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from connector import consumer
from connector.consumer import _HostCopy, _Load
from connector.scheduler import LoadSpec
from tests.connector.test_worker import (
    LAYERS,
    load,
    make_caches,
    make_worker,
    run_steps,
    stage,
)
from tests.support import BrokerProcess

pytestmark = pytest.mark.slow


def _receiving(tid: str, lease: object) -> _Load:
    spec = LoadSpec(req_id=f"req-{tid}", block_ids=[1, 2, 3], num_cached_blocks=0, num_tokens=90)
    return _Load(tid, spec, time.monotonic() + 30, state="receiving", lease=lease)  # type: ignore[arg-type]


def test_the_copy_into_d_blocks_runs_off_the_main_thread_once_the_bytes_are_in(
    broker: BrokerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    copies: list[tuple[str, int, int, bool]] = []
    real = consumer.ConsumerSide._land_on_host

    def land_on_host(self: consumer.ConsumerSide, ld: _Load, b0: int, b1: int) -> None:
        copies.append((ld.transfer_id, b0, b1, threading.current_thread() is threading.main_thread()))
        real(self, ld, b0, b1)

    monkeypatch.setattr(consumer.ConsumerSide, "_land_on_host", land_on_host)
    pc, dc = make_caches(seed=3), make_caches(seed=4)
    p = make_worker(broker.endpoint, "p", "p0", pc)
    d = make_worker(broker.endpoint, "d", "d0", dc)
    try:
        src, dst = [4, 11, 6, 20, 21], [9, 3, 50, 51, 52]
        saved = {n: t[src].clone() for n, t in pc.items()}
        load(d, "t-1", dst, cached=2)
        stage(p, pc, "t-1", src, decode="d0")
        _, errors, _ = run_steps(d, {"req-t-1"}, 10)
        assert errors == set()
        assert copies == [("t-1", 0, 3, False)]  # the three blocks after the hit, in a worker thread
        for n in LAYERS:
            assert torch.equal(dc[n][dst[2:]], saved[n][2:])
    finally:
        p.close()
        d.close()


def test_a_failed_load_keeps_its_lease_until_its_copy_ended(broker: BrokerProcess) -> None:
    d = make_worker(broker.endpoint, "d", "d0", make_caches())
    try:
        assert d.consumer is not None and d.pool is not None
        side, pool = d.consumer, d.pool
        ld = _receiving("cut", pool.acquire_nowait(4096))
        copy = _HostCopy()
        ld.scattered = copy  # a copy out of this lease still running
        side._fail(ld, "the receive was cut short", telling=False)
        assert ld.state == "failed" and ld.lease is None
        side._drain()
        assert pool.statistics().leases == 1, "the lease went back while a copy could still read it"
        copy.set()
        side._drain()
        assert pool.statistics().leases == 0
    finally:
        d.close()


def test_a_failed_load_hands_its_blocks_back_only_after_its_copy_ended(broker: BrokerProcess) -> None:
    d = make_worker(broker.endpoint, "d", "d0", make_caches())
    try:
        assert d.consumer is not None
        ld = _receiving("cut", None)
        copy = _HostCopy()
        ld.scattered = copy
        ended = threading.Timer(0.2, copy.set)
        ended.start()
        t0 = time.monotonic()
        d.consumer._after(ld)  # what get_finished does before reporting the load's blocks
        assert copy.query() and time.monotonic() - t0 >= 0.15
        ended.join()
    finally:
        d.close()


def test_a_failed_load_with_nothing_copied_gives_its_lease_back_at_once(broker: BrokerProcess) -> None:
    d = make_worker(broker.endpoint, "d", "d0", make_caches())
    try:
        assert d.consumer is not None and d.pool is not None
        ld = _receiving("none", d.pool.acquire_nowait(4096))
        d.consumer._fail(ld, "no bytes", telling=False)
        assert d.pool.statistics().leases == 0
    finally:
        d.close()
