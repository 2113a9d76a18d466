"""The bell one worker rings to wake another's poller (`workers.transports.bell`): a real
FIFO, rung from this process and from another."""

from __future__ import annotations

import os
import select
import subprocess
import sys
from pathlib import Path

import pytest

from workers.transports.bell import BELL_PREFIX, SWEEP_AFTER_S, Bell, Ringer, bell_path, sweep


def _ready(bell: Bell, timeout_s: float) -> bool:
    fd = bell.fileno()
    assert fd is not None
    waiting = select.poll()
    waiting.register(fd, select.POLLIN)
    return bool(waiting.poll(timeout_s * 1e3))


@pytest.fixture
def bell(tmp_path: Path) -> Bell:
    b = Bell(str(tmp_path))
    yield b
    b.close()


def test_a_ring_wakes_the_reader_and_a_drain_takes_it(bell: Bell) -> None:
    assert bell.path == bell_path(os.path.dirname(bell.path), bell.token)
    assert os.path.basename(bell.path).startswith(BELL_PREFIX) and bell.token > 0
    assert not _ready(bell, 0) and not bell.drain()
    ringer = Ringer(os.path.dirname(bell.path), bell.token)
    try:
        ringer.ring()
        ringer.ring()
        assert _ready(bell, 10)
        assert bell.drain()
        assert not _ready(bell, 0) and not bell.drain()
    finally:
        ringer.close()


def test_a_ringer_that_closes_leaves_the_bell_quiet(bell: Bell) -> None:
    """A FIFO whose last writer closed reads as ready forever: a poller waiting on it
    would spin. The bell keeps a writer of its own, so it stays quiet until rung."""
    ringer = Ringer(os.path.dirname(bell.path), bell.token)
    ringer.ring()
    ringer.close()
    ringer.close()  # idempotent
    assert bell.drain()
    assert not _ready(bell, 0.05)
    ringer.ring()  # a closed ringer rings nothing
    assert not bell.drain()


def test_rings_nobody_drains_fill_the_fifo_without_blocking_or_failing(bell: Bell) -> None:
    ringer = Ringer(os.path.dirname(bell.path), bell.token)
    try:
        for _ in range(70_000):  # past a FIFO's 64 KiB
            ringer.ring()
        assert bell.drain()
        assert not bell.drain()
    finally:
        ringer.close()


def test_a_closed_bell_is_gone_and_its_ringers_ring_nothing(tmp_path: Path) -> None:
    bell = Bell(str(tmp_path))
    ringer = Ringer(str(tmp_path), bell.token)
    try:
        bell.close()
        bell.close()  # idempotent
        assert not os.path.exists(bell.path) and bell.fileno() is None and not bell.drain()
        ringer.ring()  # nobody reads: dropped, not raised
        with pytest.raises(FileNotFoundError):
            Ringer(str(tmp_path), bell.token)
    finally:
        ringer.close()


def test_another_process_rings_by_the_token_alone(bell: Bell) -> None:
    """As D's worker does, from the token P wrote into the ipc page."""
    code = ("import sys; from workers.transports.bell import Ringer; "
            "r = Ringer(sys.argv[1], int(sys.argv[2])); r.ring(); r.close()")
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code, os.path.dirname(bell.path), str(bell.token)], cwd=root, check=True,
                   timeout=60)
    assert _ready(bell, 10) and bell.drain()


def test_a_bell_left_by_a_dead_worker_is_swept_once_old_and_a_live_one_never(tmp_path: Path) -> None:
    """A worker that dies leaves its FIFO behind (nobody reads it). The next bell made in
    that directory removes it once it is older than `SWEEP_AFTER_S` (a younger one may be
    a worker between making its FIFO and opening it), and leaves a bell that is read."""
    live, dead = Bell(str(tmp_path)), Bell(str(tmp_path))
    os.close(dead.fd)  # as a crash leaves it: both ends closed, the FIFO still there
    os.close(dead._writer)
    (tmp_path / f"{BELL_PREFIX}0123").write_text("")  # not a FIFO: not ours to remove
    made = os.stat(dead.path).st_ctime
    try:
        assert sweep(str(tmp_path), now=made + SWEEP_AFTER_S - 1) == 0  # too young
        assert os.path.exists(dead.path)
        assert sweep(str(tmp_path), now=made + SWEEP_AFTER_S + 1) == 1
        assert not os.path.exists(dead.path) and os.path.exists(live.path)
        assert (tmp_path / f"{BELL_PREFIX}0123").exists()
        ringer = Ringer(str(tmp_path), live.token)  # the live bell still rings
        ringer.ring()
        ringer.close()
        assert live.drain()
    finally:
        live.close()
