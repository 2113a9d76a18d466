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
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
import threading
import time

__all__ = ["BELL_PREFIX", "Bell", "Ringer", "bell_path", "drain", "sweep"]

BELL_PREFIX = "kvbroker-bell-"
# A bell younger than this is never swept: its worker may be between making the FIFO and
# opening its reading end.
SWEEP_AFTER_S = 60.0


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

    def fileno(self) -> int | None:
        """What to wait on for a ring (`poll()`); None once closed."""
        with self._lock:
            return None if self._closed else self.fd

    def drain(self) -> bool:
        """Take every ring so far; whether there was any. Never blocks."""
        with self._lock:
            return not self._closed and drain(self.fd)

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
    its link, or never had one in this directory)."""

    def __init__(self, directory: str, token: int) -> None:
        self.fd: int | None = os.open(bell_path(directory, token), os.O_WRONLY | os.O_NONBLOCK)

    def ring(self) -> None:
        """Wake the bell's reader; never blocks. A full FIFO already wakes it, and a bell
        whose reader closed has nobody left to wake: both are dropped."""
        if self.fd is None:
            return
        try:
            os.write(self.fd, b"\x01")
        except BlockingIOError:
            pass
        except OSError as exc:
            if exc.errno != errno.EPIPE:
                raise

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
