"""The bell one worker rings to wake another's poller (`workers.transports.bell`): a real
FIFO, rung from this process and from another."""

from __future__ import annotations

import os
import select
import subprocess
import sys
from pathlib import Path

import pytest

from workers.transports.bell import BELL_PREFIX, NOTES_KEPT, SWEEP_AFTER_S, Bell, Note, Ringer, bell_path, sweep


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


def _note(i: int) -> Note:
    return Note(bytes([i]) * 64, 1000 + i, f"{i:016x}")


def test_notes_come_in_order_between_plain_rings_and_are_taken_once(bell: Bell) -> None:
    ringer = Ringer(os.path.dirname(bell.path), bell.token)
    try:
        ringer.ring()
        ringer.ring(_note(1))
        ringer.ring()
        ringer.ring(_note(2))
        assert _ready(bell, 10) and bell.drain()
        assert bell.take_notes() == [_note(1), _note(2)]
        assert bell.take_notes() == [] and not bell.drain()
    finally:
        ringer.close()


def test_a_note_cut_by_the_end_of_a_read_is_whole_at_the_next_drain(bell: Bell) -> None:
    """A drain reads 4,096 bytes at a time: with more than that in the FIFO, a read may end
    inside a note, whose rest the next read (or drain) brings."""
    ringer = Ringer(os.path.dirname(bell.path), bell.token)
    try:
        size = len(_note(0).pack())
        assert 4096 % size  # so that some read ends inside a note
        count = 3 * 4096 // size + 1
        for i in range(count):
            ringer.ring(_note(i % 256))
        assert bell.drain()
        assert bell.take_notes() == [_note(i % 256) for i in range(count)]
        # Cut by hand: the first part of a note now, the rest with the next drain.
        packed = _note(7).pack()
        os.write(ringer.fd, packed[:10])
        assert bell.drain() and bell.take_notes() == []
        os.write(ringer.fd, packed[10:])
        assert bell.drain() and bell.take_notes() == [_note(7)]
    finally:
        ringer.close()


def test_notes_nobody_takes_keep_only_the_latest(bell: Bell) -> None:
    ringer = Ringer(os.path.dirname(bell.path), bell.token)
    try:
        for i in range(NOTES_KEPT + 10):
            ringer.ring(_note(i % 256))
        assert bell.drain()
        assert bell.take_notes() == [_note(i % 256) for i in range(10, NOTES_KEPT + 10)]
    finally:
        ringer.close()


def test_a_full_fifo_drops_a_note_without_blocking(bell: Bell) -> None:
    ringer = Ringer(os.path.dirname(bell.path), bell.token)
    try:
        assert ringer.fd is not None
        for size in (4096, 1):  # fill it with plain rings until not one more byte fits
            while True:
                try:
                    os.write(ringer.fd, b"\x01" * size)
                except BlockingIOError:
                    break
        ringer.ring(_note(3))  # dropped: it does not block or raise
        assert bell.drain()
        assert bell.take_notes() == []
    finally:
        ringer.close()
