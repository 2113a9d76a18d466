"""D's turns with one producer (`NcclLink.recv_turn`, `post_recv`), with no GPU: tickets
handed out in order, receives posted in ticket order, the next Ready free to leave
before this receive is posted when the ticket names D's communicator, and a ticket
given up failing the ones behind it without building anything."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import anyio
import pytest

from connector import nccl_link
from connector.nccl_link import NcclLink, Posted, RecvOrder, RecvTurn
from protocols.errors import TransferFailed

PEER = "p0:0"
pytestmark = pytest.mark.anyio


class _Cache:
    """D's communicators with the producer: `nonce` cached, or none."""

    def __init__(self, nonce: str | None) -> None:
        self.comm = None if nonce is None else SimpleNamespace(nonce=nonce)
        self.discarded: list[str] = []
        self.built: list[str] = []

    def current(self, peer: str) -> Any:
        return self.comm

    def usable(self, peer: str, nonce: str, *, initiator: bool) -> Any:
        return None  # every post goes the worker thread's way

    def discard(self, peer: str) -> None:
        self.discarded.append(peer)
        self.comm = None

    def get(self, peer: str, **kw: Any) -> Any:
        self.built.append(kw.get("purpose", ""))
        raise AssertionError("a ticket naming a dropped communicator must not build one")


def _link(nonce: str | None, posts: list[str] | None = None) -> NcclLink:
    """A link whose cache holds `nonce`, and whose order knows it (an earlier transfer
    posted on it). With `posts`, a post only records its transfer."""
    link = NcclLink.__new__(NcclLink)
    link.cache = _Cache(nonce)  # type: ignore[assignment]
    link._lock, link._inflight, link._receiving, link._post_queues = threading.Lock(), {}, {}, {}
    link._recv_order = RecvOrder()
    link.device = -1  # type: ignore[assignment]
    if nonce is not None:
        link._recv_order.posted(PEER, ("", 0), nonce)
    if posts is not None:
        async def post(peer: str, op: str, tid: str, *args: Any) -> Posted:
            posts.append(tid)
            comm = link.cache.comm  # type: ignore[attr-defined]
            return Posted(peer=peer, op=op, transfer_id=tid, comm=comm, completions=[], parts=[], flag=threading.Event())
        link._post = post  # type: ignore[method-assign,assignment]
    return link


async def _receive(link: NcclLink, tid: str, ticketed: dict[str, RecvTurn], go: anyio.Event) -> None:
    async with link.recv_turn(PEER) as turn:
        ticketed[tid] = turn
        await go.wait()  # the Ready's send
        await link.post_recv(turn, tid, SimpleNamespace(offset=0), 64, float("inf"))  # type: ignore[arg-type]


@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "held"])
async def test_the_next_ticket_goes_before_this_post_and_posts_keep_ticket_order(
    pipelined: bool, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(nccl_link, "PIPELINE_READIES", pipelined)
    posts: list[str] = []
    link = _link("c1", posts)
    ticketed: dict[str, RecvTurn] = {}
    go = {tid: anyio.Event() for tid in "abc"}
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tasks:
            for tid in "abc":
                tasks.start_soon(_receive, link, tid, ticketed, go[tid])
                await anyio.wait_all_tasks_blocked()
            # a's Ready not even sent yet
            assert list(ticketed) == (["a", "b", "c"] if pipelined else ["a"])
            go["c"].set()  # c is ready to post first, b next: both wait for a
            go["b"].set()
            await anyio.wait_all_tasks_blocked()
            assert posts == []
            go["a"].set()
    assert posts == ["a", "b", "c"]
    assert [ticketed[t].ticket for t in "abc"] == [("c1", 1), ("c1", 2), ("c1", 3)]
    assert link.cache.discarded == []  # type: ignore[attr-defined]


async def test_a_ticket_given_up_fails_the_ones_behind_it_at_once() -> None:
    """a leaves its turn without posting (its load was cancelled after the Ready): the
    communicator goes, so b, ticketed on it already, fails its post without building
    a new one; c, ticketed after, names none and may build."""
    link = _link("c1")
    ticketed: dict[str, RecvTurn] = {}
    failed: dict[str, str] = {}

    async def abandon() -> None:
        async with link.recv_turn(PEER) as turn:
            ticketed["a"] = turn
            await b_ticketed.wait()

    async def receive_b() -> None:
        try:
            async with link.recv_turn(PEER) as turn:
                ticketed["b"] = turn
                b_ticketed.set()
                await link.post_recv(turn, "b", SimpleNamespace(offset=0), 64, float("inf"))  # type: ignore[arg-type]
        except TransferFailed as exc:
            failed["b"] = exc.reason

    b_ticketed = anyio.Event()
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(abandon)
            await anyio.wait_all_tasks_blocked()
            tasks.start_soon(receive_b)
    assert ticketed["a"].ticket == ("c1", 1) and ticketed["b"].ticket == ("c1", 2)
    assert "was dropped" in failed["b"] and link.cache.built == []  # type: ignore[attr-defined]
    assert link.cache.discarded  # type: ignore[attr-defined]
    async with link.recv_turn(PEER) as turn:  # the next one starts over
        assert turn.ticket == ("", 0)
        turn.posted = Posted(peer=PEER, op="recv", transfer_id="c", comm=None, completions=[], parts=[],
                             flag=threading.Event())  # as if posted: nothing to give up


async def test_a_ticket_naming_no_communicator_holds_the_next_until_its_post() -> None:
    posts: list[str] = []
    link = _link(None, posts)
    ticketed: dict[str, RecvTurn] = {}
    go = {tid: anyio.Event() for tid in "ab"}
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tasks:
            for tid in "ab":
                tasks.start_soon(_receive, link, tid, ticketed, go[tid])
                await anyio.wait_all_tasks_blocked()
            assert list(ticketed) == ["a"]  # b waits: a's post decides the communicator
            link.cache.comm = SimpleNamespace(nonce="c7")  # type: ignore[attr-defined]  # a's post builds c7
            go["a"].set()
            await anyio.wait_all_tasks_blocked()
            assert list(ticketed) == ["a", "b"] and ticketed["b"].ticket == ("c7", 1)
            go["b"].set()
    assert posts == ["a", "b"]
