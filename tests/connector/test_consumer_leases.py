"""A receive lease whose bytes a copy may still read goes back to the pool only after it.

Over nccl, D scatters each chunk as it lands (`ConsumerSide._land`), on a stream of its
own; a load can then fail with a chunk's copy still queued behind it. Its lease must
not go back to the pool (where the next receive would overwrite it) before that copy
ran. The copy's CUDA event is replaced by a stand-in here, the rest is a real decode
worker with a real broker (GPU runs of the whole path: tests/gpu/test_connector_nccl.py).
"""

from __future__ import annotations

import time

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


def _receiving(tid: str, lease: object) -> _Load:
    spec = LoadSpec(req_id=f"req-{tid}", block_ids=[1, 2, 3], num_cached_blocks=0, num_tokens=90)
    return _Load(tid, spec, time.monotonic() + 30, state="receiving", lease=lease)  # type: ignore[arg-type]


def test_a_failed_load_keeps_its_lease_until_its_scattered_chunks_ran(broker: BrokerProcess) -> None:
    d = make_worker(broker.endpoint, "d", "d0", make_caches())
    try:
        assert d.consumer is not None and d.pool is not None
        side, pool = d.consumer, d.pool
        load = _receiving("cut", pool.acquire_nowait(4096))
        copy = _Copy()
        load.scattered = copy  # type: ignore[assignment]
        side._fail(load, "the receive was cut short", telling=False)
        assert load.state == "failed" and load.lease is None
        side._drain()
        assert pool.statistics().leases == 1, "the lease went back while a copy could still read it"
        copy.ran = True
        side._drain()
        assert pool.statistics().leases == 0
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
