"""Run a long-lived service (the broker daemon, the gateway) until SIGINT or SIGTERM."""

from __future__ import annotations

import signal
from collections.abc import Callable, Coroutine
from typing import Any

import anyio
import structlog

log = structlog.get_logger("kvbroker")


def run_until_signalled(
    make: Callable[[], Callable[..., Coroutine[Any, Any, Any]]], event: str, backend: str = "asyncio",
    backend_options: dict[str, Any] | None = None,
) -> None:
    """Start the task `make()` returns (one that reports `task_status.started`; made in the
    event loop, since its objects may need one) and cancel it on SIGINT or SIGTERM, logging
    `event` with the signal's name."""

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            await tg.start(make())
            with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for signum in signals:
                    log.info(event, signal=signal.Signals(signum).name)
                    tg.cancel_scope.cancel()
                    break

    anyio.run(main, backend=backend, backend_options=backend_options)
