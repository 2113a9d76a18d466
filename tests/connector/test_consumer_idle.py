"""A step that runs no model reports a load that lands during its get_finished.

vLLM's engine sleeps 1 ms after a step that ran no model, and a load landing in that
sleep was reported only at the next step. Such a step's get_finished (`idle`) waits for
a load being received to land or fail (`ConsumerSide._await_landing`) and reports it
in the same call. A real decode worker with a real broker; the loads are set in their
receiving state here, and a second thread lands or fails them the way the transport's
threads do, once the step is seen waiting. The wait's bounds are raised for the test, so
a slow machine cannot turn a landing into a timeout.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from connector.consumer import IDLE_WAIT_S, _Load
from connector.scheduler import LoadSpec
from tests.connector.test_worker import make_caches, make_worker
from tests.support import BrokerProcess

pytestmark = pytest.mark.slow


class _SaysWaiting(threading.Condition):
    """The consumer's `landed` condition, on the same lock, that says when a step waits on
    it: `waiting` at the first wait, `waits[k]` at the (k+1)-th."""

    def __init__(self, lock: Any) -> None:
        super().__init__(lock)
        self.waits = [threading.Event() for _ in range(4)]
        self.count = 0

    @property
    def waiting(self) -> threading.Event:
        return self.waits[0]

    def wait_for(self, predicate: Callable[[], bool], timeout: float | None = None) -> bool:
        self.waits[min(self.count, len(self.waits) - 1)].set()
        self.count += 1
        return super().wait_for(predicate, timeout)


@pytest.fixture
def side(broker: BrokerProcess) -> Iterator[Any]:
    d = make_worker(broker.endpoint, "d", "d0", make_caches())
    try:
        assert d.consumer is not None
        d.consumer.landed = _SaysWaiting(d.lock)
        d.consumer.idle_wait_s = d.consumer.landing_gap_s = 30.0
        yield d.consumer
    finally:
        d.close()


def _load(side: Any, tid: str, state: str = "receiving") -> _Load:
    spec = LoadSpec(req_id=f"req-{tid}", block_ids=[1, 2, 3], num_cached_blocks=0, num_tokens=40)
    w = side.w
    nbytes = len(spec.block_ids) * len(w.layers) * w.block_nbytes  # what the producer's bytes fill
    load = _Load(tid, spec, time.monotonic() + 60, state=state, lease=w.pool.acquire_nowait(nbytes), nbytes=nbytes)
    with side.w.lock:
        side._loads[tid] = load
    return load


def _once_waiting(side: Any, *acts: Callable[[], None]) -> threading.Thread:
    """A thread that runs ``acts[k]`` once a step waits on `landed` the (k+1)-th time
    (stopping at the first wait that never comes)."""

    def run() -> None:
        for k, act in enumerate(acts):
            if not side.landed.waits[k].wait(30):
                return
            act()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_the_bound_is_a_few_of_the_engines_sleeps_and_well_below_a_decode_step() -> None:
    """Long enough that most landings fall in the wait rather than in vLLM's 1 ms sleep,
    short enough that a request arriving at an idle engine is not held for long."""
    assert 2e-3 <= IDLE_WAIT_S <= 5e-3


def test_an_idle_step_reports_a_load_that_lands_while_it_waits(side: Any) -> None:
    load = _load(side, "lands")

    def land() -> None:
        with side.w.lock:
            side._received(load)

    t = _once_waiting(side, land)
    started = time.monotonic()
    assert side.get_finished(set(), idle=True) == {"req-lands"}
    assert time.monotonic() - started < 30, "the step waited out its bound instead of waking on the landing"
    assert side.landed.waiting.is_set()
    assert side.w.counters["seen_waiting"] == 1
    t.join(5)


def test_an_idle_step_reports_together_the_loads_that_keep_landing(side: Any) -> None:
    """The first landing does not end the step's wait while another load is still being
    received: it waits for the next landing (within `landing_gap_s`), and reports both."""
    first, second = _load(side, "first"), _load(side, "second")

    def land(load: _Load) -> Callable[[], None]:
        def act() -> None:
            with side.w.lock:
                side._received(load)
        return act

    t = _once_waiting(side, land(first), land(second))
    assert side.get_finished(set(), idle=True) == {"req-first", "req-second"}
    assert side.landed.count == 2
    assert side.w.counters["seen_waiting"] == 1  # one step saw them: counted once
    t.join(5)


def test_an_idle_step_that_finds_a_load_landed_reports_it_at_once(side: Any) -> None:
    """A load that landed during the engine's sleep is reported without waiting for
    another still being received."""
    landed = _load(side, "landed")
    _load(side, "later")
    with side.w.lock:
        side._received(landed)
    assert side.get_finished(set(), idle=True) == {"req-landed"}
    assert side.landed.count == 0
    assert side.w.counters["seen_waiting"] == 0  # it landed before the step


def test_an_idle_step_reports_a_load_that_fails_while_it_waits(side: Any) -> None:
    load = _load(side, "fails")
    t = _once_waiting(side, lambda: side._fail(load, "the producer was lost", telling=False))
    assert side.get_finished(set(), idle=True) == {"req-fails"}
    assert side.get_block_ids_with_load_errors() == {1, 2, 3}
    t.join(5)


def test_a_step_that_ran_a_model_does_not_wait(side: Any) -> None:
    _load(side, "busy")
    assert side.get_finished(set(), idle=False) is None
    assert not side.landed.waiting.is_set()


def test_an_idle_step_does_not_wait_for_a_load_with_no_bytes_on_the_way(side: Any) -> None:
    """A load still waiting for its Prepare: nothing can land in this step."""
    _load(side, "other", state="waiting")
    assert side.get_finished(set(), idle=True) is None
    assert side.landed.count == 0
