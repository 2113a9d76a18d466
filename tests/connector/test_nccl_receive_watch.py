"""P's watch for D's receives straight into its blocks (`NcclLink.watch_receive`), with no
GPU: the link's real poller thread looks at each communicator's next receive, here
communicators that stand in for the ipc backend's (their `next_block_receive` is what
D's mailbox holds; the GPU tests run the real one), and calls back for a watched
transfer only, once, in the poller's thread: when the watch starts, then each time D
rings P's bell (a real FIFO), and in between it waits without looking."""

from __future__ import annotations

import queue
import threading
from pathlib import Path
from typing import Any

import pytest

from connector import nccl_link
from connector.nccl_link import NcclLink, Poller, ReceiveWatch
from tests.support import wait_until
from workers.transports.bell import Bell, Ringer
from workers.transports.ipc_mailbox import transfer_tag


class _Comm:
    """A communicator with D; `receive`: D's next receive, as its mailbox shows it;
    `busy`: looks refused (a post holds it) before the mailbox is read."""

    def __init__(self, peer: str, nonce: str, *, into_blocks: bool = True) -> None:
        self.peer, self.nonce, self.writes_into_blocks = peer, nonce, into_blocks
        self.closed = self.broken = False
        self.receive: tuple[int, bytes, int] | None = None
        self.looked = 0
        self.busy = 0

    def next_block_receive(self) -> tuple[int, bytes, int] | None:
        self.looked += 1
        if self.busy:
            self.busy -= 1
            raise BlockingIOError("busy posting")
        return self.receive


class _Cache:
    def __init__(self, directory: Path, *comms: _Comm) -> None:
        self.comms = list(comms)
        self.bell = Bell(str(directory))

    def built(self) -> list[_Comm]:
        return [c for c in self.comms if not (c.closed or c.broken)]


@pytest.fixture
def made(tmp_path: Path) -> Any:
    links: list[NcclLink] = []

    def make(*comms: _Comm) -> NcclLink:
        link = NcclLink.__new__(NcclLink)
        link._lock, link._watch, link._probing = threading.Lock(), ReceiveWatch(), False
        link.cache, link.poller = _Cache(tmp_path, *comms), Poller()  # type: ignore[assignment]
        links.append(link)
        return link

    yield make
    for link in links:
        link.poller.close()
        link.cache.bell.close()


def _post(link: NcclLink, comm: _Comm, receive: tuple[int, bytes, int]) -> None:
    """D posts a receive into its blocks and rings P's bell, as `IpcCommunicator.post_blocks` does."""
    comm.receive = receive
    ringer = Ringer(str(Path(link.cache.bell.path).parent), link.cache.bell.token)
    try:
        ringer.ring()
    finally:
        ringer.close()


@pytest.fixture
def seen() -> queue.Queue[tuple[str, tuple[Any, ...]]]:
    return queue.Queue()


def _recorder(seen: queue.Queue[tuple[str, tuple[Any, ...]]]) -> nccl_link.Seen:
    return lambda *args: seen.put((threading.current_thread().name, args))


def test_a_watched_transfer_is_reported_once_when_its_receive_is_next(made: Any, seen: queue.Queue) -> None:
    a, b = _Comm("d0", "c1"), _Comm("d1", "c7")
    link = made(a, b)
    link.watch_receive("t1", _recorder(seen))
    link.watch_receive("t2", _recorder(seen))
    link.watch_receive("t3", _recorder(seen))
    link.unwatch_receive("t3")
    _post(link, a, (4, transfer_tag("t3"), 8192))  # no longer watched: its Go sends it
    _post(link, b, (9, transfer_tag("t2"), 4096))
    thread, args = seen.get(timeout=10)
    assert (thread, args) == (link.poller.name, ("t2", "d1", "c7", 9, 4096))
    _post(link, a, (4, transfer_tag("t1"), 8192))
    assert seen.get(timeout=10)[1] == ("t1", "d0", "c1", 4, 8192)
    # Nothing is watched any more: the probe ends, and nobody reports t2 again.
    wait_until(lambda: not link._probing, 10, "the probe to end")
    assert seen.empty() and not link._watch


def test_between_rings_the_poller_waits_without_looking(made: Any, seen: queue.Queue) -> None:
    """As under a proxy that sends the request to D only with P's answer: D's receive
    comes long after the Offer. The poller looks once when the watch starts, then waits
    for the bell, holding no GIL: a receive D wrote without ringing stays unseen, and
    the ring that follows has it reported."""
    comm = _Comm("d0", "c1")
    link = made(comm)
    link.watch_receive("t1", _recorder(seen))
    wait_until(lambda: link.poller._listening and comm.looked, 10, "the poller to wait on its bell")
    looked = comm.looked
    comm.receive = (1, transfer_tag("t1"), 4096)  # written, not rung
    with pytest.raises(queue.Empty):
        seen.get(timeout=0.3)
    assert comm.looked == looked  # on a timer of 1 ms it would have looked about 300 times
    _post(link, comm, (1, transfer_tag("t1"), 4096))
    assert seen.get(timeout=10)[1] == ("t1", "d0", "c1", 1, 4096)
    wait_until(lambda: not link._probing, 10, "the probe to end once nothing is watched")


def test_a_new_watch_is_looked_for_at_once_while_others_wait_for_the_bell(made: Any, seen: queue.Queue) -> None:
    """D may post and ring before P watches the transfer (its Offer's hop is P's own):
    a watch that starts has the poller look now, without a ring."""
    comm = _Comm("d0", "c1")
    link = made(comm)
    link.watch_receive("t1", _recorder(seen))
    wait_until(lambda: link.poller._listening, 10, "the poller to wait on its bell")
    comm.receive = (1, transfer_tag("t2"), 4096)
    link.watch_receive("t2", _recorder(seen))
    assert seen.get(timeout=10)[1] == ("t2", "d0", "c1", 1, 4096)
    assert link._probing  # t1 is still watched


def test_a_communicator_busy_posting_is_looked_at_again_without_a_ring(made: Any, seen: queue.Queue) -> None:
    """A look that finds the communicator held by a post cannot read its mailbox; the
    ring it answered is drained by then, so the poller looks again soon on its own."""
    comm = _Comm("d0", "c1")
    comm.busy = 3
    link = made(comm)
    comm.receive = (1, transfer_tag("t1"), 4096)
    link.watch_receive("t1", _recorder(seen))
    assert seen.get(timeout=10)[1] == ("t1", "d0", "c1", 1, 4096)
    assert comm.looked == 4


def test_a_ring_is_heard_while_the_poller_polls_ops(made: Any, seen: queue.Queue) -> None:
    """With an op to poll the poller pauses between polls rather than wait on the bell;
    it drains the bell at each pause, so a ring then is heard too."""
    comm = _Comm("d0", "c1")
    link = made(comm)
    ended = threading.Event()

    class _Op:
        def done(self) -> bool:
            return ended.is_set()

    waiter = threading.Thread(target=link.poller.wait, args=(_Op(), 30.0))
    waiter.start()
    try:
        wait_until(lambda: link.poller._waits, 10, "the op to be polled")
        link.watch_receive("t1", _recorder(seen))
        wait_until(lambda: comm.looked, 10, "the first look")
        assert not link.poller._listening
        _post(link, comm, (1, transfer_tag("t1"), 4096))
        assert seen.get(timeout=10)[1] == ("t1", "d0", "c1", 1, 4096)
        assert link.poller._waits  # still polled: heard between its polls
    finally:
        ended.set()
        waiter.join(10)


def test_a_probe_asked_for_again_as_the_last_one_ends_keeps_running() -> None:
    """A watch that starts just as the link's probe ends (it saw nothing left to watch)
    adds the same look again: the poller drops only the one that ended, so the new watch
    is looked for. Dropping every equal entry lost it, and with it every later watch of
    that link (`_probing` stayed set with no probe running)."""
    poller = Poller()
    calls: list[int] = []
    again = threading.Event()

    def look() -> None:
        calls.append(len(calls))
        if len(calls) == 1:
            assert poller.probe(look)  # asked for again while this look ends
        else:
            again.set()

    try:
        assert poller.probe(look)
        assert again.wait(10), f"the probe asked for again never ran: {calls}"
    finally:
        poller.close()


def test_a_watch_that_starts_as_the_probe_ends_is_still_looked_for(made: Any, seen: queue.Queue) -> None:
    """The link's side of the same moment: its probe finds nothing left to watch and
    ends, and a watch starts before the poller has dropped that probe."""
    comm = _Comm("d0", "c1")
    link = made(comm)
    real_look = link._look

    def look() -> float | None:
        pace = real_look()
        if pace is None and not seen.qsize() and comm.receive is None:
            comm.receive = (1, transfer_tag("t2"), 4096)
            link.watch_receive("t2", _recorder(seen))  # between the look's end and its removal
        return pace

    link._look = look  # type: ignore[method-assign]
    link._probing = True  # a probe with nothing left to watch: its first look ends it
    assert link.poller.probe(link._look, link.cache.bell)
    assert seen.get(timeout=10)[1] == ("t2", "d0", "c1", 1, 4096)


def test_nothing_is_watched_without_a_communicator_that_writes_into_blocks(made: Any, seen: queue.Queue) -> None:
    link = made(_Comm("d0", "c1", into_blocks=False))
    link.watch_receive("t1", _recorder(seen))
    assert not link._probing and not link._watch


def test_right_after_a_send_is_posted_the_next_receive_is_looked_for_on_the_posting_thread(
    made: Any, seen: queue.Queue,
) -> None:
    """`NcclLink.send` looks for D's next receive as soon as it posted (`_look_now`): with
    eight of a step, D's next receive is often there already, and its send then starts
    without waiting for the poller's next look. Only while a probe runs (something is
    watched), and each watch is reported once, whoever looks."""
    comm = _Comm("d0", "c1")
    link = made(comm)
    comm.receive = (3, transfer_tag("t1"), 4096)
    link._look_now()  # nothing watched: no look at all
    assert comm.looked == 0 and seen.empty()
    # A watch as `watch_receive` makes it, with the poller kept out of the way (it
    # would report the receive itself, in its own thread).
    link._watch.add("t1", _recorder(seen))
    link._probing = True
    link._look_now()
    assert seen.get_nowait() == (threading.current_thread().name, ("t1", "d0", "c1", 3, 4096))
    link._look_now()  # taken: not reported again
    assert seen.empty() and comm.looked == 2


def test_the_look_right_after_a_send_never_raises_into_that_send(made: Any) -> None:
    """The send is posted by then: a failing look (here its callback) is logged, and the
    transfer still has the poller's look and its Go."""
    comm = _Comm("d0", "c1")
    link = made(comm)

    def broken(*args: Any) -> None:
        raise RuntimeError("the loop is gone")

    comm.receive = (3, transfer_tag("t1"), 4096)
    link._watch.add("t1", broken)
    link._probing = True
    link._look_now()  # no exception
    assert comm.looked == 1


def test_closing_the_poller_ends_its_wait_on_the_bell(made: Any, seen: queue.Queue) -> None:
    """The poller waits on the bell with no timeout while a watch lasts: closing it wakes
    that wait (its pipe), the thread ends, and the pipe is closed; a bell closed first
    (its link closing) leaves nothing to wait on but that pipe."""
    comm = _Comm("d0", "c1")
    link = made(comm)
    link.watch_receive("t1", _recorder(seen))
    wait_until(lambda: link.poller._listening, 10, "the poller to wait on its bell")
    link.cache.bell.close()
    thread = link.poller._thread
    assert thread is not None
    link.poller.close(timeout_s=10)
    assert not thread.is_alive() and link.poller._wake is None and seen.empty()
