"""P's watch for D's receives straight into its blocks (`NcclLink.watch_receive`), with no
GPU: the link's real poller thread looks at each communicator's next receive, here
communicators that stand in for the ipc backend's (their `next_block_receive` is what
D's mailbox holds; the GPU tests run the real one), and calls back for a watched
transfer only, once, in the poller's thread: at each turn for a first window, then at a
slower pace until the watch is dropped."""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

import pytest

from connector import nccl_link
from connector.nccl_link import NcclLink, Poller, ReceiveWatch
from tests.support import wait_until
from workers.transports.ipc_mailbox import transfer_tag


class _Comm:
    """A communicator with D; `receive`: D's next receive, as its mailbox shows it."""

    def __init__(self, peer: str, nonce: str, *, into_blocks: bool = True) -> None:
        self.peer, self.nonce, self.writes_into_blocks = peer, nonce, into_blocks
        self.closed = self.broken = False
        self.receive: tuple[int, bytes, int] | None = None
        self.looked = 0

    def next_block_receive(self) -> tuple[int, bytes, int] | None:
        self.looked += 1
        return self.receive


class _Cache:
    def __init__(self, *comms: _Comm) -> None:
        self.comms = list(comms)

    def built(self) -> list[_Comm]:
        return [c for c in self.comms if not (c.closed or c.broken)]


def _link(*comms: _Comm) -> NcclLink:
    link = NcclLink.__new__(NcclLink)
    link._lock, link._watch, link._probing = threading.Lock(), ReceiveWatch(), False
    link.cache, link.poller = _Cache(*comms), Poller()  # type: ignore[assignment]
    return link


@pytest.fixture
def seen() -> queue.Queue[tuple[str, tuple[Any, ...]]]:
    return queue.Queue()


def _recorder(seen: queue.Queue[tuple[str, tuple[Any, ...]]]) -> nccl_link.Seen:
    return lambda *args: seen.put((threading.current_thread().name, args))


def test_a_watched_transfer_is_reported_once_when_its_receive_is_next(seen: queue.Queue) -> None:
    a, b = _Comm("d0", "c1"), _Comm("d1", "c7")
    link = _link(a, b)
    try:
        link.watch_receive("t1", _recorder(seen))
        link.watch_receive("t2", _recorder(seen))
        link.watch_receive("t3", _recorder(seen))
        link.unwatch_receive("t3")
        a.receive = (4, transfer_tag("t3"), 8192)  # no longer watched: its Go sends it
        b.receive = (9, transfer_tag("t2"), 4096)
        thread, args = seen.get(timeout=10)
        assert (thread, args) == (link.poller.name, ("t2", "d1", "c7", 9, 4096))
        a.receive = (4, transfer_tag("t1"), 8192)
        assert seen.get(timeout=10)[1] == ("t1", "d0", "c1", 4, 8192)
        # Nothing is watched any more: the probe ends, and nobody reports t2 again.
        wait_until(lambda: not link._probing, 10, "the probe to end")
        assert seen.empty() and link._watch.pace(0.0) is None
    finally:
        link.poller.close()


def test_past_its_first_window_a_watch_is_looked_for_at_the_slower_pace(
    seen: queue.Queue, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As under a proxy that sends the request to D only with P's answer: D's receive
    comes long after the Offer. The watch outlives its first window, looked for every
    `RECEIVE_LINGER_S` rather than at each turn, and its receive is still reported."""
    monkeypatch.setattr(nccl_link, "RECEIVE_WATCH_S", 0.05)
    monkeypatch.setattr(nccl_link, "RECEIVE_LINGER_S", 0.02)
    comm = _Comm("d0", "c1")
    link = _link(comm)
    try:
        link.watch_receive("t1", _recorder(seen))
        wait_until(lambda: link._watch.pace(time.monotonic()) == 0.02, 10, "the first window to end")
        looked, since = comm.looked, time.monotonic()
        wait_until(lambda: comm.looked >= looked + 5, 10, "five looks at the slower pace")
        spent = time.monotonic() - since
        # At each turn (at most 0.1 ms apart) it would have looked two hundred times as often.
        assert comm.looked - looked <= spent / 0.02 + 2, (comm.looked - looked, spent)
        assert link._probing and seen.empty()
        comm.receive = (1, transfer_tag("t1"), 4096)
        assert seen.get(timeout=10)[1] == ("t1", "d0", "c1", 1, 4096)
        wait_until(lambda: not link._probing, 10, "the probe to end once nothing is watched")
    finally:
        link.poller.close()


def test_a_new_watch_is_looked_for_at_once_while_others_linger(
    seen: queue.Queue, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The probe paces itself by its watches: one that lingers asks for its next look a
    long way off (here 60 s), and a watch that starts meanwhile has the poller look now."""
    monkeypatch.setattr(nccl_link, "RECEIVE_WATCH_S", 0.0)
    monkeypatch.setattr(nccl_link, "RECEIVE_LINGER_S", 60.0)
    comm = _Comm("d0", "c1")
    link = _link(comm)
    try:
        link.watch_receive("t1", _recorder(seen))
        wait_until(lambda: comm.looked > 0, 10, "the first look")
        monkeypatch.setattr(nccl_link, "RECEIVE_WATCH_S", 30.0)
        comm.receive = (1, transfer_tag("t2"), 4096)
        link.watch_receive("t2", _recorder(seen))
        assert seen.get(timeout=10)[1] == ("t2", "d0", "c1", 1, 4096)
        assert link._probing  # t1 is still watched
    finally:
        link.poller.close()


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


def test_a_watch_that_starts_as_the_probe_ends_is_still_looked_for(seen: queue.Queue) -> None:
    """The link's side of the same moment: its probe finds nothing left to watch and
    ends, and a watch starts before the poller has dropped that probe."""
    comm = _Comm("d0", "c1")
    link = _link(comm)
    real_look = link._look

    def look() -> float | None:
        pace = real_look()
        if pace is None and not seen.qsize() and comm.receive is None:
            comm.receive = (1, transfer_tag("t2"), 4096)
            link.watch_receive("t2", _recorder(seen))  # between the look's end and its removal
        return pace

    link._look = look  # type: ignore[method-assign]
    try:
        link._probing = True  # a probe with nothing left to watch: its first look ends it
        assert link.poller.probe(link._look)
        assert seen.get(timeout=10)[1] == ("t2", "d0", "c1", 1, 4096)
    finally:
        link.poller.close()


def test_nothing_is_watched_without_a_communicator_that_writes_into_blocks(seen: queue.Queue) -> None:
    link = _link(_Comm("d0", "c1", into_blocks=False))
    try:
        link.watch_receive("t1", _recorder(seen))
        assert not link._probing and link._watch.pace(0.0) is None
    finally:
        link.poller.close()


def test_right_after_a_send_is_posted_the_next_receive_is_looked_for_on_the_posting_thread(
    seen: queue.Queue,
) -> None:
    """`NcclLink.send` looks for D's next receive as soon as it posted (`_look_now`): with
    eight of a step, D's next receive is often there already, and its send then starts
    without waiting for the poller's next look. Only while a probe runs (something is
    watched), and each watch is reported once, whoever looks."""
    comm = _Comm("d0", "c1")
    link = _link(comm)
    try:
        comm.receive = (3, transfer_tag("t1"), 4096)
        link._look_now()  # nothing watched: no look at all
        assert comm.looked == 0 and seen.empty()
        # A watch as `watch_receive` makes it, with the poller kept out of the way (it
        # would report the receive itself, in its own thread).
        link._watch.add("t1", float("inf"), _recorder(seen))
        link._probing = True
        link._look_now()
        assert seen.get_nowait() == (threading.current_thread().name, ("t1", "d0", "c1", 3, 4096))
        link._look_now()  # taken: not reported again
        assert seen.empty() and comm.looked == 2
    finally:
        link.poller.close()


def test_the_look_right_after_a_send_never_raises_into_that_send() -> None:
    """The send is posted by then: a failing look (here its callback) is logged, and the
    transfer still has the poller's look and its Go."""
    comm = _Comm("d0", "c1")
    link = _link(comm)

    def broken(*args: Any) -> None:
        raise RuntimeError("the loop is gone")

    try:
        comm.receive = (3, transfer_tag("t1"), 4096)
        link._watch.add("t1", float("inf"), broken)
        link._probing = True
        link._look_now()  # no exception
        assert comm.looked == 1
    finally:
        link.poller.close()
