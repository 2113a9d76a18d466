"""How `Completion.wait` notices the end of an NCCL op: spin first, then back off.

The CUDA event is replaced by a stand-in whose `query` turns true after a number of
calls or at a time, since the point is the host loop around it (GPU runs of the same
loop: tests/gpu).
"""

from __future__ import annotations

import time

import pytest

from protocols.errors import RecvTimeout, SendTimeout
from workers.transports import communicator
from workers.transports.communicator import Completion


class _Event:
    def __init__(self, *, after_calls: int | None = None, at: float | None = None) -> None:
        self.calls, self.after_calls, self.at = 0, after_calls, at

    def query(self) -> bool:
        self.calls += 1
        if self.after_calls is not None:
            return self.calls > self.after_calls
        return self.at is not None and time.monotonic() >= self.at


class _Comm:
    peer = "decode-0"

    def __init__(self) -> None:
        self.failed: list[str] = []

    def fail(self, reason: str) -> None:
        self.failed.append(reason)


@pytest.fixture
def sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Every pause `wait` takes, still taken (so deadlines pass as they would)."""
    taken: list[float] = []
    real = time.sleep

    def sleep(seconds: float) -> None:
        taken.append(seconds)
        real(seconds)

    monkeypatch.setattr(communicator.time, "sleep", sleep)
    return taken


def test_an_op_that_ends_while_spinning_is_seen_without_a_single_sleep(sleeps: list[float]) -> None:
    # A sleep, even sleep(0), hands the CPU away and the end is seen tens of us late.
    event = _Event(after_calls=5000)
    done = Completion(_Comm(), event, "recv", "t-1", keep=["bounce"])  # type: ignore[arg-type]
    done.wait(time.monotonic() + 10.0, spin_s=10.0)
    assert event.calls == 5001
    assert sleeps == []
    assert done._keep == []  # what the op needed is let go once it is seen done


def test_after_the_spin_it_sleeps_in_pauses_that_double_up_to_the_cap(sleeps: list[float]) -> None:
    event = _Event(at=time.monotonic() + 0.05)
    done = Completion(_Comm(), event, "send", "t-2")  # type: ignore[arg-type]
    done.wait(time.monotonic() + 10.0, spin_s=0.001, max_pause_s=0.004)
    assert sleeps, "a wait past the spin must sleep"
    assert all(0 < s <= 0.004 for s in sleeps)
    assert sleeps[:3] == [1e-5, 2e-5, 4e-5]
    assert sleeps[-1] == 0.004


@pytest.mark.parametrize(("op", "exc"), [("send", SendTimeout), ("recv", RecvTimeout)])
def test_a_missed_deadline_aborts_the_communicator_and_names_the_transfer(
    sleeps: list[float], op: str, exc: type[Exception]
) -> None:
    comm = _Comm()
    done = Completion(comm, _Event(), op, "t-3")  # type: ignore[arg-type]
    with pytest.raises(exc, match="t-3"):
        done.wait(time.monotonic() + 0.02, spin_s=0.005)
    assert comm.failed == [f"{op} missed its deadline"]
