"""The order of one (P, D) pair's NCCL transfers: D's tickets (`RecvOrder`) and P's turns
(`SendOrder`), with no GPU. NCCL pairs the k-th op P posts on a communicator with the
k-th op D posts on it, so whatever the schedule and whichever tickets are given up, the
k-th send P posts on a communicator must be the same transfer as D's k-th receive there
(P may post more than D: those sends never pair and end by abort). A send P posts on a
communicator D had already dropped when it sent that transfer's Ready pairs with nothing,
and neither does any send P posts on it later: D's side is gone."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from connector.nccl_link import RecvOrder, SendOrder, Ticket

PEER = "peer"


@dataclass
class Pair:
    """D's side, then P's, run as the link runs them: D takes tickets and posts in its
    turn (or gives a ticket up and drops the communicator); P gets the Go messages in
    the order of D's Readys, but its handlers run in any order."""

    rng: random.Random
    d_current: str | None = None  # D's cached communicator
    p_current: str | None = None  # P's cached communicator
    built: int = 0
    d_posts: dict[str, list[str]] = field(default_factory=dict)
    p_posts: dict[str, list[str]] = field(default_factory=dict)
    p_cut: dict[str, int] = field(default_factory=dict)  # comm -> P's sends on it before one could pair no more
    posted_on: dict[str, str] = field(default_factory=dict)  # transfer -> the communicator D posted it on
    dropped: set[str] = field(default_factory=set)  # communicators D dropped
    dropped_at_ready: dict[str, set[str]] = field(default_factory=dict)
    started: int = 0  # sends started on D's receive, before their Go

    def decode(self, transfers: list[str], give_up: set[str]) -> list[tuple[str, Ticket]]:
        order, goes = RecvOrder(), []
        for tid in transfers:
            ticket = order.ticket(PEER, self.d_current)
            goes.append((tid, ticket))  # the Ready leaves before the post
            self.dropped_at_ready[tid] = set(self.dropped)
            if tid in give_up or (ticket[0] and ticket[0] != self.d_current):
                order.given_up(PEER)
                if self.d_current is not None:  # `give_up` drops the communicator
                    self.dropped.add(self.d_current)
                self.d_current = None
                continue
            if self.d_current is None:
                self.built += 1
                self.d_current = f"c{self.built}"
            self.d_posts.setdefault(self.d_current, []).append(tid)
            self.posted_on[tid] = self.d_current
            order.posted(PEER, ticket, self.d_current)
        return goes

    def prefill(self, goes: list[tuple[str, Ticket]], on_receive: bool = False) -> None:
        """P's side. `on_receive`: P may also start a send on D's receive, seen before its
        Go (`ProducerSide._go_on_receive`): the receive next on P's communicator, with
        `SendOrder.next_on`'s ticket; that transfer's Go is then ignored."""
        order = SendOrder()
        waiting = list(goes)
        posting: tuple[str, Ticket] | None = None
        while waiting or posting:
            if on_receive and posting is None and self.p_current is not None and self.rng.random() < 0.3:
                comm = self.p_current
                sent = len(self.p_posts.get(comm, []))
                receives = self.d_posts.get(comm, [])
                seen = receives[sent] if sent < len(receives) else None
                ticket = order.next_on(PEER, comm)
                go = next((g for g in waiting if g[0] == seen), None)
                if go is not None and ticket is not None:
                    assert ticket == go[1], f"{seen}: started as {ticket}, but its Go names {go[1]}"
                    waiting.remove(go)
                    self.started += 1
                    order.begin(PEER)
                    posting = go
                    continue
            if posting is not None and (not waiting or self.rng.random() < 0.5):
                tid, ticket = posting  # the post's worker thread returns
                posting = None
                comm = self._comm_for(tid, ticket)
                if comm is None:  # P's post failed (no peer to build with): given up
                    order.given_up(PEER)
                    self.p_current = None
                    continue
                self.p_posts.setdefault(comm, []).append(tid)
                if comm in self.dropped_at_ready[tid]:
                    self.p_cut.setdefault(comm, len(self.p_posts[comm]) - 1)
                order.posted(PEER, ticket, comm)
                continue
            verdicts = [(g, order.verdict(PEER, g[1])) for g in waiting]
            ready = [(g, v) for g, v in verdicts if v != "wait"]
            if not ready:
                if posting is not None:
                    continue
                # Nothing can move: the first waiter's deadline passes, and the pair's
                # communicator goes with it.
                waiting.pop(0)
                order.given_up(PEER)
                self.p_current = None
                continue
            (tid, ticket), verdict = self.rng.choice(ready)
            waiting.remove((tid, ticket))
            if verdict == "post":
                order.begin(PEER)
                posting = (tid, ticket)

    def _comm_for(self, tid: str, ticket: Ticket) -> str | None:
        """The communicator P's post lands on."""
        if ticket[0]:
            return ticket[0] if self.p_current == ticket[0] else None
        # No communicator named: P drops its own and builds one for this transfer, which D
        # joins only for this transfer (`CommunicatorCache.get`'s purpose), if it posts it.
        comm = self.posted_on.get(tid) if self.posted_on.get(tid) not in self.p_posts else None
        self.p_current = comm
        return comm


def check_pairs(pair: Pair) -> None:
    for comm, sends in pair.p_posts.items():
        sends = sends[: pair.p_cut.get(comm, len(sends))]
        receives = pair.d_posts.get(comm, [])
        for k in range(min(len(sends), len(receives))):
            assert sends[k] == receives[k], f"on {comm}, send {k} is {sends[k]} but receive {k} is {receives[k]}"


@settings(max_examples=400, deadline=None)
@given(
    n=st.integers(1, 12),
    give_up=st.sets(st.integers(0, 11), max_size=4),
    seed=st.integers(0, 2**32 - 1),
)
def test_every_send_pairs_with_its_own_receive(n: int, give_up: set[int], seed: int) -> None:
    pair = Pair(random.Random(seed))
    transfers = [f"t{k}" for k in range(n)]
    goes = pair.decode(transfers, {f"t{k}" for k in give_up})
    pair.prefill(goes)
    check_pairs(pair)


@settings(max_examples=400, deadline=None)
@given(
    n=st.integers(1, 12),
    give_up=st.sets(st.integers(0, 11), max_size=4),
    seed=st.integers(0, 2**32 - 1),
)
def test_a_send_started_on_its_receive_takes_the_ticket_its_go_names(n: int, give_up: set[int],
                                                                    seed: int) -> None:
    pair = Pair(random.Random(seed))
    transfers = [f"t{k}" for k in range(n)]
    pair.prefill(pair.decode(transfers, {f"t{k}" for k in give_up}), on_receive=True)
    check_pairs(pair)


def test_sends_started_on_their_receives_go_in_order() -> None:
    started = 0
    for seed in range(50):
        pair = Pair(random.Random(seed))
        transfers = [f"t{k}" for k in range(8)]
        pair.prefill(pair.decode(transfers, set()), on_receive=True)
        assert pair.d_posts == {"c1": transfers} and pair.p_posts == {"c1": transfers}
        started += pair.started
    assert started > 50  # the first transfer builds c1 on its Go; most later ones start on their receive


def test_without_give_ups_every_transfer_is_sent_once_in_order() -> None:
    for seed in range(50):
        pair = Pair(random.Random(seed))
        transfers = [f"t{k}" for k in range(8)]
        pair.prefill(pair.decode(transfers, set()))
        assert pair.d_posts == {"c1": transfers} and pair.p_posts == {"c1": transfers}


def test_a_ticket_given_up_fails_what_queued_behind_it_and_the_next_starts_over() -> None:
    pair = Pair(random.Random(0))
    goes = pair.decode(["a", "b", "c", "d"], {"b"})
    assert [t for _, t in goes] == [("", 0), ("c1", 1), ("", 0), ("c2", 1)]
    pair.prefill(goes)
    check_pairs(pair)
    assert pair.d_posts == {"c1": ["a"], "c2": ["c", "d"]}
    assert pair.p_posts["c2"] == ["c", "d"]  # b's send may go on c1 and never pair; c and d are whole


def test_send_order_verdicts() -> None:
    order = SendOrder()
    assert order.verdict(PEER, ("", 0)) == "post"
    assert order.verdict(PEER, ("c1", 1)) == "wait"  # c1's first post has not begun yet
    order.begin(PEER)
    assert order.verdict(PEER, ("c1", 1)) == "wait"  # the first post may still build c1
    order.posted(PEER, ("", 0), "c1")
    assert order.verdict(PEER, ("c1", 2)) == "wait"
    assert order.verdict(PEER, ("c1", 1)) == "post"
    order.begin(PEER)
    order.posted(PEER, ("c1", 1), "c1")
    assert order.verdict(PEER, ("c1", 1)) == "stale"  # a place already taken
    assert order.verdict(PEER, ("c0", 2)) == "wait"  # not one P posted on: its first post may be under way
    assert not order.abandon(PEER, ("c1", 1))  # a place already passed: nothing to end
    assert not order.abandon(PEER, ("", 0))
    assert order.verdict(PEER, ("c1", 2)) == "post"
    assert order.abandon(PEER, ("c1", 3))  # a send ahead will never come: c1 ends there
    assert order.verdict(PEER, ("c1", 2)) == "stale"
    order.given_up(PEER, also="c0")  # a post failed after building c0
    assert order.verdict(PEER, ("c1", 2)) == "stale"  # given up: c1 is gone for good
    assert order.verdict(PEER, ("c0", 2)) == "stale"
    assert order.verdict(PEER, ("", 0)) == "post"
    order.begin(PEER)
    order.posted(PEER, ("", 0), "c2")
    assert order.verdict(PEER, ("c1", 2)) == "stale" and order.verdict(PEER, ("c2", 1)) == "post"


def test_the_next_send_on_a_communicator_is_known_only_once_p_posted_there() -> None:
    order = SendOrder()
    assert order.next_on(PEER, "c1") is None  # nothing posted yet: c1's first send comes by its Go
    order.begin(PEER)
    order.posted(PEER, ("", 0), "c1")
    assert order.next_on(PEER, "c1") == ("c1", 1) and order.verdict(PEER, ("c1", 1)) == "post"
    assert order.next_on(PEER, "c2") is None and order.next_on(PEER, "") is None
    order.begin(PEER)
    assert order.next_on(PEER, "c1") is None  # a post under way: its place is not settled
    order.posted(PEER, ("c1", 1), "c1")
    assert order.next_on(PEER, "c1") == ("c1", 2)
    order.given_up(PEER)
    assert order.next_on(PEER, "c1") is None


def test_recv_order_tickets() -> None:
    order = RecvOrder()
    assert order.ticket(PEER, None) == ("", 0)
    order.posted(PEER, ("", 0), "c1")
    assert order.ticket(PEER, "c1") == ("c1", 1)
    order.posted(PEER, ("c1", 1), "c1")
    assert order.ticket(PEER, "c1") == ("c1", 2)
    assert order.ticket(PEER, "c9") == ("", 0)  # the cache holds another one now: start over
    assert order.ticket(PEER, "c1") == ("", 0)
    order.posted(PEER, ("", 0), "c1")
    order.given_up(PEER)
    assert order.ticket(PEER, "c1") == ("", 0)
