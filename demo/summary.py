"""The demo's summary: plain functions over the answers, the broker's counters and the logs.

The broker keeps its counters in memory, so a restart starts them again from zero: the
demo reads them just before it kills the broker and once more at the end, and the
totals add the broker's lifetimes up.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .stream import Answer


def counter_total(lifetimes: Sequence[Mapping[str, int]], key: str) -> int:
    """One broker counter summed over the broker's lifetimes (a missing one counts 0)."""
    return sum(int(c.get(key, 0)) for c in lifetimes)


@dataclass(frozen=True)
class Comparison:
    identical: int  # answers whose token ids equal the plain run's for their prompt
    differing: list[Answer]  # answered, with other token ids
    failed: list[Answer]  # no usable answer


def compare(answers: Iterable[Answer], reference: Mapping[int, list[int]]) -> Comparison:
    """Each answer against the plain run's token ids for its prompt."""
    identical, differing, failed = 0, [], []
    for a in answers:
        if not a.ok:
            failed.append(a)
        elif a.token_ids == reference[a.prompt]:
            identical += 1
        else:
            differing.append(a)
    return Comparison(identical, differing, failed)


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def prometheus_value(text: str, name: str) -> float | None:
    """The value of a metric in Prometheus' text format, summed over its labels (a
    counter's `_total` sample counts as the metric); None when it is absent."""
    found, total = False, 0.0
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and m.group(1) in (name, f"{name}_total"):
            found, total = True, total + float(m.group(3))
    return total if found else None


def log_events(lines: Iterable[str], event: str) -> list[dict[str, Any]]:
    """The JSON log lines that carry this event. A line is read from its first brace:
    vLLM may put a process tag before the lines its engine core writes."""
    out = []
    for line in lines:
        start = line.find("{")
        if start < 0 or f'"{event}"' not in line:
            continue
        try:
            rec = json.loads(line[start:])
        except ValueError:
            continue
        if isinstance(rec, dict) and rec.get("event") == event:
            out.append(rec)
    return out


def count_events(lines: Iterable[str], event: str) -> int:
    """How many JSON log lines carry this event."""
    return len(log_events(lines, event))


@dataclass
class Summary:
    requests: int
    distinct: int
    rate: float
    comparison: Comparison
    completed: list[int]  # the broker's completed transfers, per lifetime
    retried: int  # re-delivered to another decode instance after the one holding it was lost
    claims_moved: int  # handed to the decode instance the gateway sent the request to again
    gateway_retries: float | None  # requests the gateway sent to another decode instance
    loaded: int  # transfer.loaded lines of the decode servers
    load_failed: int  # transfer.load_failed lines: D computed the prompt itself
    in_flight_at_end: int
    wall_s: float
    phases: list[tuple[str, float]] = field(default_factory=list)  # (what, seconds since start)
    logdir: str = ""

    @property
    def redeliveries(self) -> int:
        return self.retried + self.claims_moved

    @property
    def failed(self) -> int:
        return len(self.comparison.failed)


def problems(s: Summary) -> list[str]:
    """Why the demo failed; empty when it did not."""
    out = []
    if s.failed:
        out.append(f"{s.failed} of {s.requests} requests failed")
    if s.comparison.differing:
        out.append(f"{len(s.comparison.differing)} answers differ from the plain run")
    return out


def rows(s: Summary) -> list[tuple[str, str]]:
    c = s.comparison
    per_prompt = s.requests / s.distinct
    life = ", ".join(f"broker {i + 1}: {n}" for i, n in enumerate(s.completed))
    retries = "?" if s.gateway_retries is None else f"{s.gateway_retries:g}"
    return [
        ("requests", f"{s.requests} through the gateway at {s.rate:g}/s, {s.distinct} distinct prompts "
                     f"(each about {per_prompt:.0f} times)"),
        ("identical answers", f"{c.identical} of {s.requests} equal a plain run's token ids "
                              f"({len(c.differing)} differ, {len(c.failed)} failed)"),
        ("KV transfers completed", f"{sum(s.completed)} ({life}; the broker's counters)"),
        ("KV loaded by decode", f"{s.loaded} (their logs); {s.load_failed} loads failed and were computed by D"),
        ("re-deliveries", f"{s.redeliveries} (broker: {s.retried} after a decode instance was lost, "
                          f"{s.claims_moved} claims moved; gateway re-sent {retries} requests to another decode)"),
        ("failed requests", f"{s.failed}"),
        ("in flight at end", f"{s.in_flight_at_end} transfers held by the broker"),
        ("wall time", f"{s.wall_s:.1f} s"),
    ]


def render(s: Summary) -> str:
    """The summary as an aligned two-column table, the timeline and any failures below it."""
    table = rows(s)
    width = max(len(k) for k, _ in table)
    lines = ["kvbroker demo summary", "-" * (width + 60)]
    lines += [f"{k:<{width}}  {v}" for k, v in table]
    if s.phases:
        lines += ["", "timeline (seconds since start)"]
        lines += [f"  {t:7.1f}  {what}" for what, t in s.phases]
    bad = s.comparison.failed + s.comparison.differing
    if bad:
        lines += ["", "requests that failed or differ"]
        for a in sorted(bad, key=lambda a: a.index)[:20]:
            why = a.error or "token ids differ from the plain run"
            lines.append(f"  #{a.index:<3} prompt {a.prompt:<2} sent at {a.sent_s:5.1f} s  {why}")
        if len(bad) > 20:
            lines.append(f"  ... and {len(bad) - 20} more")
    if s.logdir:
        lines += ["", f"logs: {s.logdir}  (kvbroker trace TRANSFER_ID {s.logdir}/*.log)"]
    return "\n".join(lines)
