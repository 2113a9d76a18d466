"""One place that configures structlog, for the broker CLI and for worker processes.

Production logs are JSON lines (one object per event, `transfer_id`, `role`, `instance`
and `phase` as fields) so `kvbroker trace` can join one transfer's timeline across
processes; a terminal gets the readable console renderer.
"""

from __future__ import annotations

import logging
import sys
from typing import IO, Any

import msgspec
import structlog

# One encoder for every line; anything msgspec cannot encode is logged as its repr.
_json = msgspec.json.Encoder(enc_hook=repr)


def _dumps(obj: Any, **_: Any) -> bytes:
    # JSONRenderer passes `default=`; the encoder's enc_hook already covers it.
    return _json.encode(obj)


def configure_logging(fmt: str = "console", level: str = "info", stream: IO[Any] | None = None) -> None:
    """Configure structlog process-wide. `fmt` is "json" or "console"."""
    if fmt not in ("json", "console"):
        raise ValueError(f"log format must be 'json' or 'console', not {fmt!r}")
    lvl = logging.getLevelName(level.upper())
    if not isinstance(lvl, int):
        raise ValueError(f"unknown log level {level!r}; use debug, info, warning or error")
    stream = stream or sys.stderr
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if fmt == "json":
        processors = shared + [
            structlog.processors.dict_tracebacks,
            structlog.processors.JSONRenderer(serializer=_dumps),
        ]
        factory: Any = structlog.BytesLoggerFactory(stream.buffer if hasattr(stream, "buffer") else stream)
    else:
        processors = shared + [structlog.dev.ConsoleRenderer(colors=False)]
        factory = structlog.PrintLoggerFactory(stream)
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=factory,
        cache_logger_on_first_use=True,
    )
