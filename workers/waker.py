"""Setting an anyio Event from any thread without blocking that thread."""

from __future__ import annotations

import asyncio
import threading
from typing import Callable

import anyio
import anyio.lowlevel


def make_waker(event: anyio.Event) -> Callable[[], None]:
    """Return a callable, safe from any thread and never blocking, that sets `event`.

    Call it on the event's own loop: it captures that loop's token. From that loop's
    thread it sets the event directly; from any other thread it schedules the set there.
    """
    native = anyio.lowlevel.current_token().native_token
    owner = threading.get_ident()
    schedule: Callable[[Callable[[], object]], object]
    if isinstance(native, asyncio.AbstractEventLoop):
        schedule = native.call_soon_threadsafe
    else:  # trio.lowlevel.TrioToken
        schedule = native.run_sync_soon  # type: ignore[attr-defined]

    def wake() -> None:
        if threading.get_ident() == owner:
            event.set()
        else:
            schedule(event.set)

    return wake
