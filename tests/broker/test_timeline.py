"""Transfers' timelines from JSON logs (`broker.timeline`, behind `kvbroker trace` and `phases`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from broker.timeline import field_stats, phase_steps, read_events


def _line(tid: str, event: str, ms: float, **extra: object) -> str:
    stamp = f"2026-11-30T04:00:00.{int(ms * 1000):06d}Z"
    return json.dumps({"transfer_id": tid, "event": event, "timestamp": stamp, **extra})


def test_each_step_is_timed_over_every_transfer_in_the_order_steps_come(tmp_path: Path) -> None:
    p, d = tmp_path / "p.log", tmp_path / "d.log"
    # Ten transfers: expect at 0, offered at 1, ready at 2 + k/10, loaded at 10 + k.
    d.write_text("\n".join(
        [_line(f"t{k}", "transfer.expect", 0) for k in range(10)]
        + [_line(f"t{k}", "transfer.ready", 2 + k / 10) for k in range(10)]
        + [_line(f"t{k}", "transfer.loaded", 10 + k) for k in range(10)]
        + ["Traceback (most recent call last):", "not json {\"transfer_id\": 1"]
    ))
    # A vLLM server's log: its engine core's lines come with a process tag in front.
    p.write_text("\n".join(f"(EngineCore_DP0 pid=4242) {_line(f't{k}', 'transfer.offered', 1)}" for k in range(10)))
    events = list(read_events([str(p), str(d)]))
    assert len(events) == 40 and {e["source"] for e in events} == {"p.log", "d.log"}
    steps, whole = phase_steps(events)
    assert [(s.first, s.then, s.transfers) for s in steps] == [
        ("transfer.expect", "transfer.offered", 10),
        ("transfer.offered", "transfer.ready", 10),
        ("transfer.ready", "transfer.loaded", 10),
    ]
    assert steps[0].median_ms == pytest.approx(1.0) and steps[1].at_ms == pytest.approx(1.0)
    assert steps[1].median_ms == pytest.approx(1.45) and steps[1].p90_ms == pytest.approx(1.9)
    assert steps[2].median_ms == pytest.approx(12.05)  # 8 + 0.9 k: the middle of k = 0..9
    assert whole is not None and whole.transfers == 10 and whole.median_ms == pytest.approx(14.5)


def test_a_repeated_event_counts_from_its_first_time_and_lone_events_make_no_step() -> None:
    events = [
        json.loads(_line("a", "transfer.offered", 0)),
        json.loads(_line("a", "transfer.offered", 5)),  # a retry logs it again
        json.loads(_line("a", "transfer.done", 7)),
        json.loads(_line("b", "transfer.offered", 3)),  # only one event: no step
        {"transfer_id": "c", "event": "transfer.done", "timestamp": "yesterday"},
    ]
    steps, whole = phase_steps(events)
    assert [(s.first, s.then, s.transfers, s.median_ms) for s in steps] == [
        ("transfer.offered", "transfer.done", 1, pytest.approx(7.0))
    ]
    assert whole is not None and whole.transfers == 1
    assert phase_steps(events[3:]) == ([], None)


def test_the_durations_lines_carry_are_summarized_per_event_and_field() -> None:
    """Fields named *_us or *_ms (a host's own spans, e.g. how long D took from seeing its
    last receive end to reporting it) are summarized per event, over the lines carrying a
    number there; other fields, flags and text are not."""
    events = [json.loads(_line(f"t{k}", "transfer.loaded", k, wake_us=10 * k, land_us=5, hop_us=None,
                               nbytes=4096, done_ms=True, note_ms="late")) for k in range(10)]
    events += [json.loads(_line("t0", "transfer.sent", 0, took=2.5, wake_us=7))]
    got = {(f.event, f.name): f for f in field_stats(events)}
    assert set(got) == {("transfer.loaded", "wake_us"), ("transfer.loaded", "land_us"),
                        ("transfer.sent", "wake_us")}
    wake = got["transfer.loaded", "wake_us"]
    assert wake.lines == 10 and wake.median == pytest.approx(45.0) and wake.p90 == pytest.approx(90.0)
    assert got["transfer.loaded", "land_us"].median == 5.0 and got["transfer.sent", "wake_us"].lines == 1
    assert field_stats([]) == []
