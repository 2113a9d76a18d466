"""P posts a send in the thread that saw D's receive into its blocks
(`NcclLink.send_on_receive`), with no GPU: the link's real poller thread and a real bell,
over a communicator that stands in for the ipc backend's sending side (D's mailbox of
receives, and its sends in posting order; the GPU tests run the real one). What is
checked is the order: a send goes only when it is next in P's order with that peer, it
takes its turn and its transfer in one step, a Go's send holding the turn defers it, and
a post that fails ends the pair's order there."""

from __future__ import annotations

import contextlib
import queue
import random
import sys
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import pytest
import torch

from connector import nccl_link
from connector.nccl_link import NcclLink, Poller, Posted, ReceiveWatch, SendOrder
from protocols.errors import TransferFailed
from tests.support import wait_until
from workers.transports.bell import Bell, Ringer
from workers.transports.ipc_mailbox import transfer_tag
from workers.waker import Spawner, make_waker

PEER, NONCE, BLOCK = "d0", "c1", 4096


class _Comm:
    """P's side of an ipc communicator with D: `mailbox` holds D's receives by number
    (tag, bytes), `sends` what P posted, in order, and in which thread."""

    def __init__(self) -> None:
        self.peer, self.nonce, self.writes_into_blocks = PEER, NONCE, True
        self.closed = self.broken = False
        self.lock = threading.Lock()
        self.mailbox: dict[int, tuple[bytes, int]] = {}
        self.sent = 0
        self.sends: list[tuple[int, bytes, int, str]] = []
        self.refuse = ""  # set: the next send_blocks raises, as a mismatched peer's does

    @property
    def next_send(self) -> int:
        return self.sent + 1

    def next_block_receive(self) -> tuple[int, bytes, int] | None:
        got = self.mailbox.get(self.next_send)
        return None if got is None else (self.next_send, *got)

    def send_ready(self) -> bool:
        return self.next_send in self.mailbox

    def next_receive_takes_blocks(self) -> bool:
        return self.send_ready()

    def send_blocks(self, seq: int, paged: Any, src: int, count: int, *, after: Any, keep: Any, feed: Any,
                    tag: bytes) -> object:
        assert seq == self.next_send, "a send posted out of its order"
        assert self.lock.locked()
        if self.refuse:
            raise ValueError(self.refuse)
        assert tag == self.mailbox[seq][0], "a send paired with another transfer's receive"
        self.sent = seq
        self.sends.append((seq, tag, count, threading.current_thread().name))
        return object()

    def completion(self, works: list[Any], stream: Any, op: str, tid: str) -> _Ended:
        return _Ended()


class _Ended:
    """An op that has ended (nothing runs on a GPU here)."""

    def done(self) -> bool:
        return True

    def wait(self, deadline: float) -> None:
        pass


class _Cache:
    def __init__(self, directory: Path, comm: _Comm) -> None:
        self.comm, self.bell = comm, Bell(str(directory))
        self.discarded: list[str] = []

    def built(self) -> list[_Comm]:
        return [self.comm]

    def current(self, peer: str) -> _Comm | None:
        return self.comm if peer == PEER else None

    def usable(self, peer: str, nonce: str, *, initiator: bool) -> _Comm | None:
        return self.comm if peer == PEER and nonce == NONCE else None

    def discard(self, peer: str) -> None:
        self.discarded.append(peer)


class _Lease:
    base, offset = torch.zeros(1), 0


class _Streaming:
    feed = None


@pytest.fixture
def link(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setattr(nccl_link.torch.cuda, "device", lambda device: contextlib.nullcontext())  # no GPU here
    made = NcclLink.__new__(NcclLink)
    made._lock, made._watch, made._probing = threading.Lock(), ReceiveWatch(), False
    made._send_order, made._order_lock = SendOrder(), threading.Lock()
    made._inflight, made._cancelled, made._order_changed = {}, OrderedDict(), {}
    made.device, made.stream = None, None
    made.cache, made.poller = _Cache(tmp_path, _Comm()), Poller()  # type: ignore[assignment]
    made.spawned = queue.Queue()  # what the link hands to the client's loop

    def spawn(fn: Any, *args: Any) -> None:
        made.spawned.put((fn.__name__, args))

    made._spawn = spawn
    # P posted its first send on this communicator by its Go: the order knows it.
    made._send_order.posted(PEER, ("", 0), NONCE)
    made.cache.comm.sent = 1
    yield made
    made.poller.close()
    made.cache.bell.close()


class _Producer:
    """The producer's side of a watch: its transfers' claims, and the sends posted."""

    def __init__(self, link: NcclLink, *, claimable: bool = True) -> None:
        self.link, self.claimable = link, claimable
        self.claimed: list[str] = []
        self.posted: queue.Queue[tuple[str, Posted | None | TransferFailed]] = queue.Queue()

    def seen(self, tid: str, decode: str, nonce: str, seq: int, nbytes: int) -> bool:
        def claim() -> bool:
            if self.claimable:
                self.claimed.append(tid)
            return self.claimable

        try:
            posted = self.link.send_on_receive(decode, tid, nonce, seq, _Lease(), 0, nbytes,  # type: ignore[arg-type]
                                               block_nbytes=BLOCK, paged=object(), streaming=_Streaming(),
                                               claim=claim)
        except TransferFailed as exc:
            self.posted.put((tid, exc))
            return False
        self.posted.put((tid, posted))
        return posted is not None


def _receive(link: NcclLink, seq: int, tid: str, blocks: int = 2) -> None:
    link.cache.comm.mailbox[seq] = (transfer_tag(tid), blocks * BLOCK)


def _ring(link: NcclLink) -> None:
    ringer = Ringer(str(Path(link.cache.bell.path).parent), link.cache.bell.token)
    try:
        ringer.ring()
    finally:
        ringer.close()


def test_a_steps_receives_are_sent_back_to_back_in_the_pollers_thread(link: Any) -> None:
    """D posts three receives and rings once: the poller posts all three sends, in D's
    order, each claimed as its turn is taken; the loop is only told to wake the sends
    that wait for their turn, once a send."""
    producer = _Producer(link)
    for tid in ("t1", "t2", "t3"):
        link.watch_receive(tid, producer.seen)
    wait_until(lambda: link.poller._listening, 10, "the poller to wait on its bell")
    for seq, tid in ((2, "t2"), (3, "t3"), (4, "t1")):
        _receive(link, seq, tid)
    _ring(link)
    got = [producer.posted.get(timeout=10) for _ in range(3)]
    assert [tid for tid, _ in got] == ["t2", "t3", "t1"] == producer.claimed
    assert all(isinstance(posted, Posted) and posted.into_blocks for _, posted in got)
    comm = link.cache.comm
    assert [(seq, tag) for seq, tag, _, _ in comm.sends] == [(2, transfer_tag("t2")), (3, transfer_tag("t3")),
                                                             (4, transfer_tag("t1"))]
    assert {thread for *_, thread in comm.sends} == {link.poller.name}
    assert [link.spawned.get(timeout=10)[0] for _ in range(3)] == ["_changed_soon"] * 3
    # The order moved on with them: a Go naming place 3 on it (D's third receive there
    # since the first send, t1's) is stale, and place 4 is next.
    assert link._send_order.verdict(PEER, (NONCE, 3)) == "stale"
    assert link._send_order.verdict(PEER, (NONCE, 4)) == "post"
    assert set(link._inflight[PEER]) == {"t1", "t2", "t3"}  # until their waits end


def test_a_send_whose_go_holds_the_turn_is_left_to_the_loop(link: Any) -> None:
    """A Go's send is being posted on the loop (its turn taken): the receive seen meanwhile
    is not sent here, nor its transfer claimed; the loop's path decides."""
    producer = _Producer(link)
    link._send_order.begin(PEER)
    _receive(link, 2, "t1")
    link.watch_receive("t1", producer.seen)
    assert producer.posted.get(timeout=10) == ("t1", None)
    assert producer.claimed == [] and link.cache.comm.sends == []
    assert link._send_order.verdict(PEER, (NONCE, 1)) == "wait"  # still the Go's turn


def test_a_transfer_its_go_took_first_is_not_sent_again(link: Any) -> None:
    """The Go came first and is sending it: the claim is refused, the turn left untaken."""
    producer = _Producer(link, claimable=False)
    _receive(link, 2, "t1")
    link.watch_receive("t1", producer.seen)
    assert producer.posted.get(timeout=10) == ("t1", None)
    assert link.cache.comm.sends == []
    assert link._send_order.verdict(PEER, (NONCE, 1)) == "post"


def test_a_receive_on_a_communicator_p_does_not_post_on_is_not_sent(link: Any) -> None:
    """P's order has moved to another communicator with D (this one was given up): a
    receive D posted on the old one pairs with nothing P sends; its Go decides."""
    producer = _Producer(link)
    link._send_order.posted(PEER, ("", 0), "c2")
    _receive(link, 2, "t1")
    link.watch_receive("t1", producer.seen)
    assert producer.posted.get(timeout=10) == ("t1", None)
    assert producer.claimed == [] and link.cache.comm.sends == []


def test_a_send_that_fails_to_post_ends_the_pairs_order(link: Any) -> None:
    """Claimed, its post refused (a mismatched peer): the caller gets TransferFailed with
    the reason, nothing more goes on that communicator, and the loop drops it."""
    producer = _Producer(link)
    link.cache.comm.refuse = "d0's cache has 16 layers, this side's 32"
    _receive(link, 2, "t1")
    _receive(link, 3, "t2")
    link.watch_receive("t1", producer.seen)
    link.watch_receive("t2", producer.seen)
    tid, failed = producer.posted.get(timeout=10)
    assert tid == "t1" and isinstance(failed, TransferFailed) and "16 layers" in failed.reason
    assert link.spawned.get(timeout=10)[0] == "_dropped"
    assert link._send_order.verdict(PEER, (NONCE, 2)) == "stale"
    assert PEER not in link._inflight or "t1" not in link._inflight[PEER]
    assert link.cache.comm.sends == []


@pytest.mark.anyio
async def test_gos_on_the_loop_and_sends_on_receive_keep_ds_order_each_sent_once(link: Any) -> None:
    """Forty transfers of one pair, D's receives posted (and rung) one by one from a
    thread of their own, while their Gos come on the loop in random turns: a third only
    by their Go (not watched), the rest also watched. Whichever path takes a transfer
    (the Go's `send`, or `send_on_receive` in the poller's thread or on the loop right
    after a send), each is sent once, in D's order, and both paths do send."""
    spawner = Spawner(lambda name, exc: failures.append((name, exc)))
    failures: list[tuple[str, Exception]] = []
    link._spawn = spawner.spawn
    comm, n = link.cache.comm, 40
    tids = [f"t{k}" for k in range(1, n + 1)]
    taken: dict[str, str] = {}  # transfer -> who sent it: the producer's claim
    claims = threading.Lock()
    rng = random.Random(5)

    def seen(tid: str, decode: str, nonce: str, seq: int, nbytes: int) -> bool:
        def claim() -> bool:
            with claims:
                return taken.setdefault(tid, "receive") == "receive"

        posted = link.send_on_receive(decode, tid, nonce, seq, _Lease(), 0, nbytes, block_nbytes=BLOCK,  # type: ignore[arg-type]
                                      paged=object(), streaming=_Streaming(), claim=claim)
        if posted is not None:
            spawner.spawn(link.wait, posted, time.monotonic() + 30)
        return posted is not None

    async def go(k: int, tid: str) -> None:
        await ready_sent[tid].wait()  # a Go follows D's Ready, which D sends once its receive is posted
        for _ in range(rng.randrange(40)):
            await anyio.sleep(0)  # the Gos come in random turns between the loop's other work
        with claims:
            if taken.setdefault(tid, "go") != "go":
                return  # its send started on D's receive: this Go sends nothing
        await link.send(PEER, tid, _Lease(), 0, 2 * BLOCK, None, time.monotonic() + 30,  # type: ignore[arg-type]
                        block_nbytes=BLOCK, ticket=(NONCE, k), paged=object(), streaming=_Streaming())

    def decode() -> None:  # D posts each receive straight into its blocks, rings, and sends its Ready
        for k, tid in enumerate(tids, start=2):
            _receive(link, k, tid)
            _ring(link)
            readies[tid]()

    ready_sent = {tid: anyio.Event() for tid in tids}
    readies = {tid: make_waker(event) for tid, event in ready_sent.items()}
    for k, tid in enumerate(tids, start=1):
        if k % 3:
            link.watch_receive(tid, seen)
    d = threading.Thread(target=decode, name="decode")
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # the threads take turns at once: the windows between two steps are hit
    try:
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                await tg.start(spawner.run)
                d.start()
                async with anyio.create_task_group() as gos:
                    for k, tid in enumerate(tids, start=1):
                        gos.start_soon(go, k, tid)
                await anyio.to_thread.run_sync(d.join)
                while len(comm.sends) < n or link._inflight.get(PEER):  # the waits spawned last end too
                    await anyio.sleep(0.01)
                tg.cancel_scope.cancel()
    finally:
        sys.setswitchinterval(switch)
    assert not failures
    assert [(seq, tag) for seq, tag, _, _ in comm.sends] == [(k, transfer_tag(t)) for k, t in enumerate(tids, 2)]
    ways = [taken[t] for t in tids]
    assert all(ways[k - 1] == "go" for k in range(3, n + 1, 3))  # not watched: only by their Go
    assert ways.count("receive") >= 1 and ways.count("go") > n // 3
    assert link._send_order.verdict(PEER, (NONCE, n + 1)) == "post"  # the order is past all forty
