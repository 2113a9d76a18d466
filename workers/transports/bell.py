"""A bell one worker rings to wake a thread of another on the same host: a FIFO in the
directory the ipc backend shares its pages through.

Why: P looks for D's receives straight into its blocks (`connector.nccl_link`) so that it
can send before the broker's Go. On a timer each look took the GIL from P's forward pass,
and a late receive was seen up to one period late (docs/PERFORMANCE.md, "P waits on a
bell for D's receive"). With a bell P's poller waits in `poll()`, which holds no GIL,
and D rings once it has written such a receive's descriptor. The reader drains its bell
before it looks at the mailbox, so a ring that comes after the drain wakes it again: no
ring is lost between a look and the next wait.

Each communicator cache owns one bell (`Bell`, made at its first ipc build), which lives
as long as the cache's link; each ipc communicator holds a `Ringer` on its peer's,
opened at the build. A bell is named by a random token, which each side writes into the
ipc page beside its counters (`ipc_mailbox.Counters.bell`). A worker that dies leaves
its FIFO behind; the next bell made in that directory removes such leftovers (`sweep`).

A ring may carry a note (`Note`): P rings D's bell with the tag of a transfer it has
just staged for D, so that D can post its receive straight into its blocks before the
broker's Prepare (`connector.nccl_link`). Each ring is one write of at most `PIPE_BUF`
bytes, which a FIFO never interleaves with another writer's; the reader keeps the notes
it drained (the latest `NOTES_KEPT`) until they are taken (`Bell.take_notes`). A note is
a hint: one dropped (a full FIFO) only leaves that transfer to its Prepare.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
import struct
import threading
import time
from collections import deque
from dataclasses import dataclass

__all__ = ["BELL_PREFIX", "NOTES_KEPT", "Bell", "Note", "Ringer", "bell_path", "drain", "sweep"]

BELL_PREFIX = "kvbroker-bell-"
# A bell younger than this is never swept: its worker may be between making the FIFO and
# opening its reading end.
SWEEP_AFTER_S = 60.0
# Notes a bell keeps until they are taken; older ones are dropped.
NOTES_KEPT = 256

_RING, _NOTE = 1, 2  # what a ring's first byte says: a wake alone, or a wake with a note
# the transfer's tag, its staged bytes, the communicator's nonce, the prompt's digest ("" unknown)
_NOTE_BODY = struct.Struct("<64sQ16s32s")


@dataclass(frozen=True)
class Note:
    """What P tells D's bell when it has staged a transfer for D: the transfer's tag (a
    digest of its id), the bytes P staged for it, and the nonce of the communicator the
    ring came over (only a receive on that one pairs with P's send)."""

    tag: bytes
    nbytes: int
    nonce: str
    prompt: str = ""  # the digest of the prompt P staged it for (`tokens_digest`); "" unknown or too long

    def pack(self) -> bytes:
        prompt = self.prompt.encode()
        return bytes([_NOTE]) + _NOTE_BODY.pack(self.tag, self.nbytes, self.nonce.encode(),
                                                prompt if len(prompt) <= 32 else b"")


def _parse(data: bytes) -> tuple[list[Note], bytes]:
    """The notes in `data` (rings and notes back to back), and what is left of a note cut
    at its end (a read that stopped inside one)."""
    notes: list[Note] = []
    at, size = 0, 1 + _NOTE_BODY.size
    while at < len(data):
        kind = data[at]
        if kind == _RING:
            at += 1
        elif kind == _NOTE:
            if len(data) - at < size:
                return notes, data[at:]
            tag, nbytes, nonce, prompt = _NOTE_BODY.unpack_from(data, at + 1)
            notes.append(Note(tag, nbytes, nonce.rstrip(b"\0").decode(errors="replace"),
                              prompt.rstrip(b"\0").decode(errors="replace")))
            at += size
        else:  # not a ring of this version: skip the byte
            at += 1
    return notes, b""


def bell_path(directory: str, token: int) -> str:
    """Where the bell named `token` lies."""
    return os.path.join(directory, f"{BELL_PREFIX}{token:016x}")


def drain(fd: int) -> bool:
    """Read everything a non-blocking pipe or FIFO holds; whether it held anything."""
    got_any = False
    while True:
        try:
            got = os.read(fd, 4096)
        except BlockingIOError:
            return got_any
        got_any = got_any or bool(got)
        if len(got) < 4096:
            return got_any


def sweep(directory: str, now: float | None = None) -> int:
    """Remove the bells in `directory` that nobody reads any more (their worker died
    without closing its link) and that are older than `SWEEP_AFTER_S` at `now` (wall
    clock; None: the current time); how many."""
    now = time.time() if now is None else now
    swept = 0
    try:
        names = [n for n in os.listdir(directory) if n.startswith(BELL_PREFIX)]
    except OSError:
        return 0
    for name in names:
        path = os.path.join(directory, name)
        try:
            st = os.lstat(path)
            if not stat.S_ISFIFO(st.st_mode) or now - st.st_ctime < SWEEP_AFTER_S:
                continue
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))  # opens only while someone reads
        except OSError as exc:
            if exc.errno == errno.ENXIO:
                try:
                    os.unlink(path)
                    swept += 1
                except FileNotFoundError:
                    pass
    return swept


class Bell:
    """The reading end: `fileno()` becomes readable once a peer rings. Raises OSError if
    the FIFO cannot be made (a directory that takes none).

    Safe to drain from one thread while another closes it: a closed bell's number may
    already name another file, so nothing reads through it once closed."""

    def __init__(self, directory: str) -> None:
        sweep(directory)
        self.token = secrets.randbits(63) + 1  # 0 is "no bell" in the page
        self.path = bell_path(directory, self.token)
        os.mkfifo(self.path, 0o600)
        try:
            self.fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
            # Once the last writer closes, a FIFO's reader reads as ready forever (end of
            # file): this side keeps a writer of its own, so only a ring makes it ready.
            self._writer = os.open(self.path, os.O_WRONLY | os.O_NONBLOCK)
        except BaseException:
            os.unlink(self.path)
            raise
        self._lock = threading.Lock()
        self._closed = False
        self._notes: deque[Note] = deque(maxlen=NOTES_KEPT)
        self._rest = b""  # a note cut by the end of a read

    def fileno(self) -> int | None:
        """What to wait on for a ring (`poll()`); None once closed."""
        with self._lock:
            return None if self._closed else self.fd

    def drain(self) -> bool:
        """Take every ring so far, keeping the notes they carry; whether there was any.
        Never blocks."""
        with self._lock:
            if self._closed:
                return False
            chunks = []
            while True:
                try:
                    got = os.read(self.fd, 4096)
                except BlockingIOError:
                    break
                chunks.append(got)
                if len(got) < 4096:
                    break
            if not any(chunks):
                return False
            notes, self._rest = _parse(self._rest + b"".join(chunks))
            self._notes.extend(notes)
            return True

    def take_notes(self) -> list[Note]:
        """The notes drained so far and not yet taken, oldest first."""
        with self._lock:
            notes = list(self._notes)
            self._notes.clear()
        return notes

    def close(self) -> None:
        """Remove the FIFO and close both ends (a ringer's next ring is then dropped);
        idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            for fd in (self.fd, self._writer):
                os.close(fd)


class Ringer:
    """A writer on a peer's bell. Raises OSError if the bell is gone (its worker closed
    its link, or never had one in this directory). Safe to ring from one thread while
    another closes it (a closed descriptor's number may already name another file)."""

    def __init__(self, directory: str, token: int) -> None:
        self.fd: int | None = os.open(bell_path(directory, token), os.O_WRONLY | os.O_NONBLOCK)
        self._lock = threading.Lock()

    def ring(self, note: Note | None = None) -> None:
        """Wake the bell's reader, with `note` if given; never blocks. A full FIFO already
        wakes it, and a bell whose reader closed has nobody left to wake: both are
        dropped (a note with them)."""
        data = bytes([_RING]) if note is None else note.pack()
        with self._lock:
            if self.fd is None:
                return
            try:
                os.write(self.fd, data)
            except BlockingIOError:
                pass
            except OSError as exc:
                if exc.errno != errno.EPIPE:
                    raise

    def close(self) -> None:
        with self._lock:
            if self.fd is not None:
                os.close(self.fd)
                self.fd = None
