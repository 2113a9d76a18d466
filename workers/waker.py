"""Reaching an anyio event loop from any thread without blocking that thread."""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import Awaitable
from typing import Any, Callable

import anyio
import anyio.abc
import anyio.lowlevel


def _scheduler() -> Callable[[Callable[[], object]], object]:
    """The current loop's own thread-safe "call this soon" (asyncio's or trio's): it
    queues the call and returns at once, unlike `anyio.from_thread.run_sync`, which
    waits until the loop has run it."""
    native = anyio.lowlevel.current_token().native_token
    if isinstance(native, asyncio.AbstractEventLoop):
        return native.call_soon_threadsafe
    return native.run_sync_soon  # type: ignore[no-any-return]  # trio.lowlevel.TrioToken


def make_waker(event: anyio.Event) -> Callable[[], None]:
    """Return a callable, safe from any thread and never blocking, that sets `event`.

    Call it on the event's own loop: it captures that loop's token. From that loop's
    thread it sets the event directly; from any other thread it schedules the set there.
    """
    schedule = _scheduler()
    owner = threading.get_ident()

    def wake() -> None:
        if threading.get_ident() == owner:
            event.set()
        else:
            schedule(event.set)

    return wake


class Spawner:
    """Starts tasks on an event loop from other threads without waiting for that loop.

    `BlockingPortal.start_task_soon` returns only once the loop thread has run its
    callback, so the calling thread waits for the loop (and for the GIL it holds): in a
    decode engine's `get_finished` on an H200 host that was 0.4-0.8 ms of the step. Here
    the caller appends to a queue and schedules a wake-up, and `run`, a task on the
    loop, starts what is queued in its own task group, in the order it was handed over.

    Args:
        on_error: called on the loop with the task's name and its exception when a
            spawned task raises; the other tasks and the loop go on.
    """

    def __init__(self, on_error: Callable[[str, Exception], None]) -> None:
        self._queue: deque[tuple[Callable[..., Awaitable[Any]], tuple[Any, ...]]] = deque()
        self._schedule: Callable[[Callable[[], object]], object] | None = None
        self._event: anyio.Event | None = None
        self._on_error = on_error

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Start every task handed to `spawn`, until cancelled (its tasks with it)."""
        self._schedule = _scheduler()
        async with anyio.create_task_group() as tasks:
            task_status.started()
            while True:
                self._event = anyio.Event()
                # A wake-up runs on this thread, so none can come between the drain and
                # the wait: whatever is queued after the drain sets the event waited on.
                while self._queue:
                    fn, args = self._queue.popleft()
                    tasks.start_soon(self._guarded, fn, args, name=getattr(fn, "__name__", None))
                await self._event.wait()

    def spawn(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Hand ``fn(*args)`` to the loop; returns at once, from any thread.

        Raises:
            RuntimeError: `run` has not started, or the loop has stopped.
        """
        if self._schedule is None:
            raise RuntimeError("the spawner is not running on a loop yet")
        self._queue.append((fn, args))
        self._schedule(self._wake)

    def _wake(self) -> None:  # on the loop's thread
        if self._event is not None:
            self._event.set()

    async def _guarded(self, fn: Callable[..., Awaitable[Any]], args: tuple[Any, ...]) -> None:
        try:
            await fn(*args)
        except Exception as exc:  # one task's failure must not end the others or the loop
            self._on_error(getattr(fn, "__name__", "?"), exc)
