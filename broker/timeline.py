"""Transfers' timelines from the JSON logs of every process: `kvbroker trace` and `phases`.

Every log line about a transfer carries its `transfer_id`, the process's role and
instance, and a timestamp (`protocols.logs`). `read_events` collects those lines from
any number of files; `phase_steps` turns many transfers into where they spend their
time: for each pair of events that follow one another in a transfer, how long that
step took, over every transfer that had it; `field_stats` summarizes the durations the
lines carry themselves (fields named ``*_us`` or ``*_ms``: a host's own spans, such as
the time from seeing a receive end to reporting it). Plain functions over dicts, so
they run on logs copied off any machine.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from itertools import pairwise
from pathlib import Path
from typing import Any

__all__ = ["FieldStats", "StepStats", "field_stats", "phase_steps", "read_events"]


def read_events(paths: Iterable[str], keep: Callable[[str], bool] = lambda line: True) -> Iterator[dict[str, Any]]:
    """The JSON log lines of `paths` ("-": standard input) that name a transfer, each
    with its file's name as ``source`` unless it says where it came from. `keep` skips
    lines cheaply before they are parsed. A line may carry a tag before its JSON, as vLLM's
    server puts on its engine core's lines. Lines that are not JSON are skipped: console
    logs and tracebacks may be mixed in."""
    for path in paths:
        stream = sys.stdin if path == "-" else open(path, encoding="utf-8", errors="replace")  # noqa: SIM115
        with stream:
            for line in stream:
                if '"transfer_id"' not in line or not keep(line):
                    continue
                try:
                    # vLLM's server tags what its engine core process writes: "(EngineCore pid=7) {...}".
                    event = json.loads(line[line.find("{"):])
                except ValueError:
                    continue
                if isinstance(event, dict) and event.get("transfer_id"):
                    event.setdefault("source", Path(path).name)
                    yield event


def _when(stamp: Any) -> datetime | None:
    try:
        return datetime.fromisoformat(str(stamp).replace("Z", "+00:00"))
    except ValueError:
        return None


def _ms(later: datetime, earlier: datetime) -> float:
    return (later - earlier) / timedelta(milliseconds=1)  # exact to the microsecond, unlike epoch floats


@dataclass(frozen=True)
class StepStats:
    """From event `first` to event `then` (the next one in the same transfer): in how
    many transfers, how long (median, 90th percentile), and when `first` came (median,
    from the transfer's first event)."""

    first: str
    then: str
    transfers: int
    median_ms: float
    p90_ms: float
    at_ms: float


def _p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


def phase_steps(events: Iterable[dict[str, Any]]) -> tuple[list[StepStats], StepStats | None]:
    """Per step (an event and the next in its transfer, the first time each event
    occurs), over all transfers, in the order the steps usually come; and the whole
    span, first event to last, as a step of its own (None without any transfer of two
    events or more)."""
    timelines: dict[str, dict[str, datetime]] = {}
    for e in events:
        t = _when(e.get("timestamp"))
        name = e.get("event")
        if t is None or not isinstance(name, str):
            continue
        seen = timelines.setdefault(str(e["transfer_id"]), {})
        if name not in seen or t < seen[name]:
            seen[name] = t
    steps: dict[tuple[str, str], tuple[list[float], list[float]]] = {}
    spans: list[float] = []
    for seen in timelines.values():
        order = sorted(seen.items(), key=lambda kv: kv[1])
        if len(order) < 2:
            continue
        start = order[0][1]
        spans.append(_ms(order[-1][1], start))
        for (a, ta), (b, tb) in pairwise(order):
            took, at = steps.setdefault((a, b), ([], []))
            took.append(_ms(tb, ta))
            at.append(_ms(ta, start))
    out = [
        StepStats(a, b, len(took), statistics.median(took), _p90(took), statistics.median(at))
        for (a, b), (took, at) in steps.items()
    ]
    out.sort(key=lambda s: (s.at_ms, -s.transfers))
    whole = StepStats("first event", "last", len(spans), statistics.median(spans), _p90(spans), 0.0) if spans else None
    return out, whole


@dataclass(frozen=True)
class FieldStats:
    """A duration field (`name`, in its unit: ``*_us`` or ``*_ms``) of event `event`, over
    every line that carried it: how many, median, 90th percentile."""

    event: str
    name: str
    lines: int
    median: float
    p90: float


def field_stats(events: Iterable[dict[str, Any]]) -> list[FieldStats]:
    """Per event and duration field, over every line with a number there, in the order
    the events first appear."""
    values: dict[tuple[str, str], list[float]] = {}
    for e in events:
        name = e.get("event")
        if not isinstance(name, str):
            continue
        for key, value in e.items():
            if key.endswith(("_us", "_ms")) and isinstance(value, int | float) and not isinstance(value, bool):
                values.setdefault((name, key), []).append(float(value))
    return [FieldStats(event, key, len(got), statistics.median(got), _p90(got)) for (event, key), got in values.items()]
