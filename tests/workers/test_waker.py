"""`Spawner`: tasks handed to an event loop from another thread, without waiting for it."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import anyio
import anyio.from_thread
import pytest

from workers.waker import Spawner

BACKENDS = ["asyncio", "trio"]


@pytest.fixture(params=BACKENDS)
def loop(request: pytest.FixtureRequest) -> Iterator[tuple[anyio.from_thread.BlockingPortal, Spawner, list]]:
    """A loop thread running a `Spawner`, and the errors its tasks reported."""
    errors: list[tuple[str, Exception]] = []
    with anyio.from_thread.start_blocking_portal(request.param) as portal:
        spawner = Spawner(lambda name, exc: errors.append((name, exc)))
        future, _ = portal.start_task(spawner.run)
        yield portal, spawner, errors
        future.cancel()


def test_spawn_returns_while_the_loop_thread_is_blocked(loop) -> None:
    """The point of it: `BlockingPortal.start_task_soon` would not return until the loop
    thread is free again; `spawn` returns at once, and the task runs once it is."""
    portal, spawner, _ = loop
    blocked, gate, ran = threading.Event(), threading.Event(), threading.Event()

    async def hold_the_loop() -> None:
        blocked.set()
        gate.wait(30)  # blocks the loop's thread itself, as a busy loop thread does

    async def task() -> None:
        ran.set()

    portal.start_task_soon(hold_the_loop)
    assert blocked.wait(10), "the loop never ran the blocking task"
    caller = threading.Thread(target=spawner.spawn, args=(task,))
    caller.start()
    caller.join(10)
    try:
        assert not caller.is_alive(), "spawn waited for the blocked loop thread"
        assert not ran.is_set()
    finally:
        gate.set()
    assert ran.wait(10), "the spawned task never ran after the loop was free"


def test_every_task_runs_once_and_a_failing_one_is_reported(loop) -> None:
    _, spawner, errors = loop
    seen: list[int] = []
    done = threading.Event()
    count = 50

    async def record(k: int) -> None:
        seen.append(k)
        if len(seen) == count:
            done.set()

    async def broken() -> None:
        raise ValueError("boom")

    spawner.spawn(broken)
    for k in range(count):
        spawner.spawn(record, k)
    assert done.wait(10), f"only {len(seen)} of {count} tasks ran"
    assert sorted(seen) == list(range(count))
    assert [(name, type(exc), str(exc)) for name, exc in errors] == [("broken", ValueError, "boom")]


@pytest.mark.parametrize("backend", BACKENDS)
def test_spawn_refuses_before_the_loop_runs_it_and_after_the_loop_stopped(backend: str) -> None:
    spawner = Spawner(lambda name, exc: None)

    async def task() -> None:
        pass

    with pytest.raises(RuntimeError, match="not running"):
        spawner.spawn(task)
    with anyio.from_thread.start_blocking_portal(backend) as portal:
        future, _ = portal.start_task(spawner.run)
        future.cancel()
    with pytest.raises(RuntimeError):
        spawner.spawn(task)
