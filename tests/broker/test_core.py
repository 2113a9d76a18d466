"""The broker core, driven without bytes: every behaviour by example, then random sequences.

Each test drives a `FakeCluster` (tests/broker/fake_cluster.py), which checks the credit
and reference invariants after every message and every tick.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Literal

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from broker.core import Broker, BrokerConfig, Send
from broker.latency import quantile_bound
from broker.status import render_status
from broker.transfers import (
    HOLDS_CREDIT,
    TRANSITIONS,
    ProtocolViolation,
    Transfer,
    TransferState,
    cancellable,
    check_transition,
)
from protocols.messages import (
    Abort,
    Cancel,
    Cancelled,
    Done,
    Error,
    Expect,
    Go,
    Goodbye,
    Heartbeat,
    LatencyInfo,
    Layout,
    Message,
    Offer,
    Prepare,
    Ready,
    Register,
    Registered,
    Relay,
    Release,
    Status,
    StatusRequest,
)
from tests.broker.fake_cluster import (
    CONFIG,
    FakeCluster,
    FakePeer,
    aborted,
    check_invariants,
    deliver,
    prepared,
    refused,
    snapshot,
)

S = TransferState


@pytest.fixture
def c() -> FakeCluster:
    return FakeCluster()


# -- the handshake -------------------------------------------------------------------


def test_full_handshake(c: FakeCluster) -> None:
    p, d = c.prefill(), c.decode(pool=100)
    layout = Layout(kind="paged", dtype="bfloat16", num_layers=2, num_blocks=4, block_nbytes=8)
    p.offer("t1", 64, layout=layout)
    assert p.take() == []
    assert d.take_one(Prepare) == Prepare(transfer_id="t1", nbytes=64, layout=layout, source="p:0", attempt=0)
    assert c.state("t1") is S.PREPARING and c.pool(d) == (100, 64, 0)

    d.ready("t1", offset=16, nbytes=48)  # D already holds the first 16 bytes
    assert p.take_one(Go) == Go(
        transfer_id="t1", decode="d:0", endpoints={"tcp": "tcp://d-0:7000"}, offset=16, nbytes=48, attempt=0
    )
    assert c.state("t1") is S.SENDING and c.pool(d) == (100, 64, 0)

    d.done("t1", nbytes=48)
    assert p.take_one(Release) == Release(transfer_id="t1")
    assert d.take() == []
    assert c.broker.transfers == {} and c.pool(d) == (100, 0, 0)
    counters = c.status().counters
    assert (counters["offered"], counters["completed"], counters["aborted"], counters["bytes"]) == (1, 1, 0, 48)
    assert [(n.event, n.level) for n in c.notes if n.fields.get("transfer_id") == "t1"] == [
        ("transfer.offered", "info"), ("transfer.done", "info")]


def test_an_offer_left_unrouted_is_noted_with_what_it_waits_for() -> None:
    c = FakeCluster(dataclasses.replace(CONFIG, note_steps=True))
    p = c.prefill()
    c.decode("d1", claims_only=True)
    c.decode("d2", claims_only=True)
    p.offer("t1", 10)  # names no decode instance, and two could hold its request
    assert [(n.event, n.fields, n.level) for n in c.notes if n.fields.get("transfer_id") == "t1"] == [
        ("transfer.offered", {"transfer_id": "t1", "nbytes": 10, "peer": "p:0"}, "info"),
        ("transfer.unrouted", {"transfer_id": "t1", "waiting_for": "a decode peer's Expect (the Offer names none, "
                               "and several could hold the request)"}, "debug")]


def test_message_steps_are_noted_at_debug_level_when_asked() -> None:
    c = FakeCluster(dataclasses.replace(CONFIG, note_steps=True))
    p, d = c.prefill(), c.decode(pool=100)
    deliver(p, d, "t1", 64)
    assert [(n.event, n.level) for n in c.notes if n.fields.get("transfer_id") == "t1"] == [
        ("transfer.offered", "info"), ("transfer.prepared", "debug"), ("transfer.go", "debug"),
        ("transfer.done", "info")]
    prepared = next(n for n in c.notes if n.event == "transfer.prepared")
    assert prepared.fields["decode"] == "d:0" and prepared.fields["credit_free"] == 36


def test_without_transfer_notes_the_core_notes_no_offer_or_delivery() -> None:
    # What a broker logging at warning asks for: the handshake is the same, its info notes gone.
    c = FakeCluster(dataclasses.replace(CONFIG, note_transfers=False))
    p, d = c.prefill(), c.decode(pool=100)
    deliver(p, d, "t1", 64)
    assert c.status().counters["completed"] == 1
    assert [n.event for n in c.notes if n.fields.get("transfer_id") == "t1"] == []


def test_offers_route_by_the_peers_live_now_as_decode_peers_come_and_go(c: FakeCluster) -> None:
    # What the Offers read from the set of peers is kept between them: a peer that left
    # must not be routed to, and one that joined must be.
    p = c.prefill()
    d1 = c.decode("d1")
    deliver(p, d1, "t1", 10)
    d1.goodbye()
    d2 = c.decode("d2")
    deliver(p, d2, "t2", 10)
    d3 = c.decode("d3", claims_only=True)
    deliver(p, d2, "t3", 10)  # two could hold it now, and d3 takes only its claims: d2 gets it
    assert d3.take() == []
    d2.goodbye()
    deliver(p, d3, "t4", 10)  # the one decode peer left that could take it


def test_an_unclaimed_offer_waits_for_the_expect_between_decode_peers_that_take_only_their_own(
    c: FakeCluster,
) -> None:
    """Two vLLM decode instances (`claims_only`) and an Offer that names neither, before
    either's Expect: a guess would be wrong half the time, and the instance holding the
    request would fail it. The Offer waits, unrouted, for the Expect; an Offer naming its
    decode instance routes at once; with one such instance there is nothing to guess."""
    p = c.prefill()
    d1, d2 = c.decode("d1", claims_only=True), c.decode("d2", claims_only=True)
    p.offer("t1", 20)
    assert c.state("t1") is S.UNROUTED and d1.take() == [] and d2.take() == []
    d2.expect("t1")
    assert d2.take_one(Prepare).transfer_id == "t1" and d1.take() == []
    p.offer("t2", 20, decode="d1")
    assert d1.take_one(Prepare).transfer_id == "t2" and d2.take() == []
    d2.goodbye()  # one left: a new unclaimed Offer goes to it at once...
    p.offer("t3", 20)
    assert [(m.transfer_id, m.attempt) for m in d1.take() if isinstance(m, Prepare)] == [("t3", 0)]
    assert c.state("t1") is S.UNROUTED  # ...but not t1, whose request was on d2: only a claim moves it
    d1.expect("t1")
    assert (d1.take_one(Prepare).transfer_id, c.state("t1")) == ("t1", S.PREPARING)
    c.decode("d3")  # a pool that takes anyone's transfers may be chosen beside it
    p.offer("t4", 20)
    assert c.state("t4") is S.PREPARING and c.broker.transfers[("t4", 0)].decode == "d3:0"


def test_an_offer_naming_an_unregistered_decode_instance_waits_one_lease_for_it(c: FakeCluster) -> None:
    """The Offer names the vLLM decode instance that holds the request, and that instance
    is not registered (it restarts, or it is down). No other such instance can use the
    KV, so none gets it, not even the only one there is: the transfer waits one peer lease
    for the named instance, routes when it registers, and else ends, freeing P's copy."""
    p, d0 = c.prefill(), c.decode("d0", claims_only=True)
    p.offer("t1", 20, decode="d1")
    p.offer("t2", 20, decode="d2")
    assert c.state("t1") is S.UNROUTED and c.state("t2") is S.UNROUTED and d0.take() == []
    c.advance(CONFIG.peer_lease_s - 0.5)
    d1 = c.register("d1", "decode", pool=100, claims_only=True)  # d1 comes back: its transfer routes at once
    assert [type(m).__name__ for m in d1.take()] == ["Registered", "Prepare"] and c.state("t1") is S.PREPARING
    c.advance(0.5)
    abort = p.take_one(Abort)
    assert abort.transfer_id == "t2" and abort.reason == (
        "decode peer d2:0 named by the Offer did not register within 5 s; "
        "check that the instance runs and points at this broker")
    assert c.state("t2") is None and d0.take() == [] and c.state("t1") is S.PREPARING
    p.offer("t3", 20, decode="d2")
    d0.expect("t3")  # the proxy sent the request elsewhere after all: the claim wins
    assert d0.take_one(Prepare).transfer_id == "t3"


def test_a_claim_takes_a_transfer_from_the_named_decode_instance_that_never_claimed_it(c: FakeCluster) -> None:
    """The Offer named d1 (a vLLM instance), which got the Prepare and parks it: it holds
    no such request. d0's Expect shows the request is on d0 (the proxy sent it there
    after all): d1 is told to drop it, its credit returns, and d0 gets the transfer. A
    transfer its holder claimed, or one already sending, stays where it is."""
    p = c.prefill()
    d0, d1 = c.decode("d0", claims_only=True), c.decode("d1", claims_only=True)
    p.offer("t1", 20, decode="d1")
    assert d1.take_one(Prepare).transfer_id == "t1" and c.pool(d1)[1] == 20
    d0.expect("t1")
    abort = d1.take_one(Abort)
    assert (abort.transfer_id, abort.reason) == ("t1", "d0:0 claims it now") and c.pool(d1)[1] == 0
    assert d0.take_one(Prepare).transfer_id == "t1" and c.state("t1") is S.PREPARING
    assert [n.fields for n in c.notes if n.event == "transfer.claimed_away"] == [
        {"transfer_id": "t1", "peer": "d0:0", "holder": "d1:0"}]
    assert c.status().counters["claims_moved"] == 1
    d1.expect("t2")
    p.offer("t2", 20, decode="d1")
    d1.take_one(Prepare)
    d0.expect("t2")  # d1 claimed it: d0 waits behind it (see the test of waiting claims)
    p.offer("t3", 20, decode="d1")
    d1.take_one(Prepare)
    d1.ready("t3")
    d0.expect("t3")  # already sending: d0 waits too
    assert d0.take() == [] and d1.take() == [] and (c.state("t2"), c.state("t3")) == (S.PREPARING, S.SENDING)


def test_a_second_claim_waits_behind_the_holder(c: FakeCluster) -> None:
    """d1 holds the request and the transfer; it dies, and the proxy sends the request
    again to d2 before the broker has noticed (d1's lease still runs). d2's claim waits:
    when d1 is lost, d2 gets the staged copy (no second prefill); when the holder finishes
    instead, d2 is told where it went; a claim whose request gave up is withdrawn."""
    p = c.prefill()
    d1, d2 = c.decode("d1", claims_only=True), c.decode("d2", claims_only=True)
    for tid in ("t1", "t2", "t3"):
        d1.expect(tid)
        p.offer(tid, 20)
        d1.take_one(Prepare)
        d2.expect(tid)
    d1.ready("t2")
    assert p.take_one(Go).transfer_id == "t2"
    assert d2.take() == [] and [c.state(t) for t in ("t1", "t2", "t3")] == [S.PREPARING, S.SENDING, S.PREPARING]
    assert {t.transfer_id: t.waiting_for for t in c.status().transfers}["t2"] == "Done from d1:0 (d2:0 waits behind it)"
    d2.abort("t3", "its request finished")  # withdraws d2's claim only
    assert c.state("t3") is S.PREPARING and d1.take() == [] and p.take() == []
    d1.done("t2", 20)
    assert d2.take_one(Abort) == Abort(transfer_id="t2", reason="it was delivered to d1:0")
    p.take()
    c.advance(CONFIG.peer_lease_s, keep_alive=[p, d2])  # d1's lease ends
    prepares = [m for m in d2.take() if isinstance(m, Prepare)]
    assert [(m.transfer_id, m.attempt) for m in prepares] == [("t1", 1)] and c.state("t3") is S.UNROUTED
    d2.ready("t1")
    assert p.take_one(Go).decode == "d2:0"
    assert c.status().counters["claims_waited"] == 3
    waits = [n.fields for n in c.notes if n.event == "transfer.claim_waits"]
    assert waits == [{"transfer_id": t, "peer": "d2:0", "holder": "d1:0"} for t in ("t1", "t2", "t3")]
    assert c.status().counters["claims_waited"] == 3
    waits = [n.fields for n in c.notes if n.event == "transfer.claim_waits"]
    assert waits == [{"transfer_id": t, "peer": "d2:0", "holder": "d1:0"} for t in ("t1", "t2", "t3")]


def test_an_unclaimed_transfer_waits_for_a_claim_when_its_decode_peer_is_lost(c: FakeCluster) -> None:
    """D dies after P's KV was staged for it; the proxy sends the request again, to the
    other of two vLLM decode instances. The staged copy goes there on that instance's
    Expect, without a second prefill; before the Expect it goes nowhere."""
    p = c.prefill()
    d1, d2, d3 = (c.decode(n, claims_only=True) for n in ("d1", "d2", "d3"))
    d1.expect("t1")
    p.offer("t1", 40)
    d1.take_one(Prepare)
    d1.goodbye()
    assert c.state("t1") is S.UNROUTED and d2.take() == [] and d3.take() == []
    d3.expect("t1")
    prepare = d3.take_one(Prepare)
    assert (prepare.transfer_id, prepare.attempt) == ("t1", 1) and d2.take() == []
    d2.goodbye()
    d3.take()
    d3.goodbye()  # none left at all; then one registers: it claims before it gets it
    d4 = c.decode("d4", claims_only=True)
    assert c.state("t1") is S.UNROUTED and d4.take() == []


def test_status_says_what_each_transfer_waits_for(c: FakeCluster) -> None:
    """`kvbroker status` names what holds each transfer, so an operator can act on it."""
    p = c.prefill()
    d1, d2 = c.decode("d1", pool=50, claims_only=True), c.decode("d2", pool=50, claims_only=True)
    d1.expect("t-expected")
    d1.expect_from("t-absent", "q")
    p.offer("t-unclaimed", 10)
    p.offer("t-preparing", 30, decode="d1")
    p.offer("t-credit", 30, decode="d1")
    p.offer("t-sending", 10, decode="d2")
    d2.ready("t-sending")
    p.offer("t-named", 10, decode="d3")
    waiting = {t.transfer_id: t.waiting_for for t in c.status().transfers}
    assert waiting == {
        "t-expected": "an Offer",
        "t-absent": "an Offer from q:0 (not registered)",
        "t-unclaimed": "a decode peer's Expect (the Offer names none, and several could hold the request)",
        "t-preparing": "Ready from d1:0",
        "t-credit": "room in the pool of d1:0",
        "t-sending": "Done from d2:0",
        "t-named": "decode peer d3:0, named by the Offer, to register",
    }
    table = render_status(c.status())
    assert "waiting_for" in table and "room in the pool of d1:0" in table
    assert [(x.peer_id, x.claims_only) for x in c.status().peers] == [("p:0", False), ("d1:0", True), ("d2:0", True)]
    assert "its claims" in table


def test_completed_transfers_are_timed_by_phase(c: FakeCluster) -> None:
    """The broker's clock times each completed transfer: Offer to Go (the handshake), Go
    to Done (the data), Offer to Done. An aborted transfer is not timed; a re-delivered
    one counts its total from the first Offer."""
    p, d1 = c.prefill(), c.decode("d1", pool=100)
    p.offer("t1", 10)
    c.now += 0.003
    d1.ready("t1")
    c.now += 0.04
    d1.done("t1", 10)
    p.offer("t2", 10)
    d1.abort("t2", "gave up")
    p.offer("t3", 10)
    c.now += 1.5
    d2 = c.decode("d2", pool=100)
    d1.goodbye()  # t3 goes to d2, 1.5 s after its Offer
    d2.ready("t3")
    c.now += 0.0001
    d2.done("t3", 10)
    lat = c.status().latency
    bounds = lat["total"].bounds_s

    def bucket(seconds: float) -> int:
        return next(i for i, b in enumerate([*bounds, float("inf")]) if seconds <= b)

    def counts(*seconds: float) -> list[int]:
        out = [0] * (len(bounds) + 1)
        for x in seconds:
            out[bucket(x)] += 1
        return out

    assert lat["handshake"].counts == counts(0.003, 1.5)
    assert lat["data"].counts == counts(0.04, 0.0001)
    assert lat["total"].counts == counts(0.043, 1.5001)
    assert lat["total"].sum_s == pytest.approx(1.5431)


def test_latency_quantile_bounds() -> None:
    info = LatencyInfo(bounds_s=[0.001, 0.01, 0.1], counts=[5, 3, 1, 1], sum_s=0.0)
    assert [quantile_bound(info, q) for q in (0.5, 0.8, 0.9, 0.99)] == [0.001, 0.01, 0.1, float("inf")]
    assert quantile_bound(LatencyInfo(bounds_s=[0.001], counts=[0, 0], sum_s=0.0), 0.5) is None


def test_go_carries_the_communicator_and_place_d_named_in_ready(c: FakeCluster) -> None:
    """nccl: D names the communicator its receive is posted on and its place there; P
    must post its send on the same one in the same order, so the broker relays both."""
    p, d = c.prefill(), c.decode(pool=100)
    for k, tid in enumerate(("t1", "t2")):
        p.send(Offer(transfer_id=tid, nbytes=10))
        assert d.take_one(Prepare).transfer_id == tid
        d.send(Ready(transfer_id=tid, nbytes=10, comm="9af0c3", seq=k))
        go = p.take_one(Go)
        assert (go.transfer_id, go.comm, go.seq) == (tid, "9af0c3", k)


def test_prepare_carries_the_offers_prompt_digest_on_every_delivery(c: FakeCluster) -> None:
    p, d1 = c.prefill(), c.decode("d1", pool=100)
    p.send(Offer(transfer_id="t1", nbytes=10, prompt="9f2c"))
    assert d1.take_one(Prepare).prompt == "9f2c"
    d2 = c.decode("d2", pool=100)
    d1.goodbye()  # re-delivered to d2 from P's staged copy: the digest goes with it
    prepare = d2.take_one(Prepare)
    assert (prepare.prompt, prepare.attempt) == ("9f2c", 1)


def test_expects_naming_a_lost_prefill_peer_end_at_once(c: FakeCluster) -> None:
    """An Expect that names its prefill instance ends when that peer is lost before it
    offers (lease or goodbye), not at the decode side's deadline; a prefill peer that only
    registers again (it reconnected, its Offers follow) ends nothing."""
    c.prefill("p")
    q, d = c.prefill("q"), c.decode(pool=100)
    d.send(Expect(transfer_id="t1", prefill="p"))
    d.send(Expect(transfer_id="t2", prefill="q"))
    d.expect("t3")  # names nobody
    c.register("p", "prefill", identity=b"p/0-again")  # p reconnected
    assert c.state("t1") is S.EXPECTED and d.take() == []
    c.advance(5.0, keep_alive=[q, d])  # p's lease ends
    abort = d.take_one(Abort)
    assert abort.transfer_id == "t1" and "prefill peer p:0 was lost" in abort.reason and "before it offered" in abort.reason
    assert c.state("t1") is None and c.state("t2") is S.EXPECTED and c.state("t3") is S.EXPECTED
    q.goodbye()
    assert d.take_one(Abort).transfer_id == "t2" and c.state("t3") is S.EXPECTED


def test_an_expect_behind_its_transfers_abort_gets_that_abort_at_once(c: FakeCluster) -> None:
    """The broker aborted a transfer before the decode peer holding its request said so
    (P died after offering; the Offer had been routed elsewhere): that peer's Expect gets
    the Abort at once, not a wait until its own deadline. Kept one transfer lease."""
    p, d1, d2 = c.prefill(), c.decode("d1"), c.decode("d2")
    p.offer("t1", 60, decode="d1")
    d1.take()
    c.advance(5.0, keep_alive=[d1, d2])  # p's lease ends: aborted on d1
    assert d1.take_one(Abort).transfer_id == "t1"
    d2.expect("t1")
    abort = d2.take_one(Abort)
    assert abort.transfer_id == "t1" and "prefill peer p:0 was lost" in abort.reason
    assert c.state("t1") is None
    c.advance(CONFIG.transfer_lease_s, keep_alive=True)
    d2.expect("t1")  # a lease later it is forgotten: an Expect waits for its Offer again
    assert c.state("t1") is S.EXPECTED and d2.take() == []


def test_an_offer_sent_again_after_its_transfer_ended_gets_that_ending(c: FakeCluster) -> None:
    """P's client re-sends its Offers when it registers again, until each is settled; the
    Release or Abort that settled one may have gone to its old socket. The broker answers
    with that ending and makes no new transfer: else D's pool would hold credit for a
    transfer nobody asks for until its lease ends. A late Expect for a delivered transfer
    (a second decode peer with the same transfer_id) gets an Abort naming where it went."""
    p, d = c.prefill(), c.decode(pool=100)
    p.offer("t-done", 40)
    d.ready("t-done")
    d.done("t-done", 40)
    p.offer("t-gone", 40)
    d.abort("t-gone", "the request finished before its KV arrived")
    p.take()
    d.take()
    p = c.prefill()  # P registers again (its old socket is gone) and re-sends both Offers
    p.offer("t-done", 40)
    assert p.take_one(Release).transfer_id == "t-done"
    p.offer("t-gone", 40)
    abort = p.take_one(Abort)
    assert abort.transfer_id == "t-gone" and abort.reason == "the request finished before its KV arrived"
    assert c.state("t-done") is None and c.state("t-gone") is None and c.pool(d)[1] == 0 and d.take() == []
    d2 = c.decode("d2")
    d2.expect("t-done")
    assert d2.take_one(Abort).reason == "it was delivered to d:0"


def test_an_expect_naming_a_prefill_peer_already_lost_ends_at_once(c: FakeCluster) -> None:
    """The prefill peer an Expect names was lost before the Expect came: Abort at once,
    until that peer registers again (then its Offers may still come)."""
    p, d = c.prefill(), c.decode()
    p.goodbye()
    d.expect_from("t1", "p")
    abort = d.take_one(Abort)
    assert abort.transfer_id == "t1" and "prefill peer p:0 was lost (it said goodbye) before it offered" in abort.reason
    d.expect_from("t2", "q")  # names a peer never seen: it may still register
    assert c.state("t2") is S.EXPECTED and d.take() == []
    c.prefill()
    d.expect_from("t3", "p")
    assert c.state("t3") is S.EXPECTED and d.take() == []


def test_an_expect_naming_a_prefill_peer_that_never_registers_ends_after_one_peer_lease(c: FakeCluster) -> None:
    """A broker that restarted while a prefill instance was down never hears of it: the
    others register again within a heartbeat, it never does. An Expect naming it ends one
    peer lease after it came, not at D's load deadline; one naming an instance that
    registers within that lease waits for its Offer as any other."""
    d = c.decode()
    d.expect_from("t1", "q")
    d.expect_from("t2", "r")
    assert c.state("t1") is S.EXPECTED and c.state("t2") is S.EXPECTED and d.take() == []
    assert c.broker.next_deadline() == c.now + CONFIG.peer_lease_s
    c.advance(CONFIG.peer_lease_s - 0.5, keep_alive=[d])
    assert d.take() == []
    r = c.prefill("r")
    c.advance(0.5, keep_alive=True)
    abort = d.take_one(Abort)
    assert abort.transfer_id == "t1" and abort.reason == (
        "prefill peer q:0 named by the request did not register within 5 s; "
        "check that the instance runs and points at this broker")
    assert c.state("t1") is None and c.state("t2") is S.EXPECTED and d.take() == []
    r.offer("t2", 40)
    assert d.take_one(Prepare).transfer_id == "t2"
    d.expect_from("t1", "q")  # the same request again: the kept ending answers it
    assert d.take_one(Abort).reason == abort.reason and c.state("t1") is None


def test_a_prefill_peer_that_restarts_ends_the_expects_that_named_it(c: FakeCluster) -> None:
    """A new process registering under a prefill peer's id (another incarnation: it
    crashed and came back within its lease) will never offer what the old one was
    computing: the Expects that named it end at once. The same process registering
    again (a reconnect) ends nothing: its Offers follow."""
    c.prefill(incarnation="a")
    d = c.decode()
    d.expect_from("t1", "p")
    c.register("p", "prefill", incarnation="a", identity=b"p/0-again")  # reconnected
    assert c.state("t1") is S.EXPECTED and d.take() == []
    c.register("p", "prefill", incarnation="b", identity=b"p/0-new")  # restarted
    abort = d.take_one(Abort)
    assert abort.transfer_id == "t1" and abort.reason == "prefill peer p:0 was lost (it restarted) before it offered"
    assert c.state("t1") is None
    d.expect_from("t2", "p")  # the new process may still offer this one
    assert c.state("t2") is S.EXPECTED and d.take() == []


def test_the_same_offer_again_changes_nothing_another_is_refused(c: FakeCluster) -> None:
    """A client re-sends its tracked Offers after a reconnect, and may do so to a broker
    that never lost them: the same Offer again changes nothing, in any state."""
    p, d = c.prefill(), c.decode(pool=100)
    p.offer("t1", 50)
    d.take_one(Prepare)
    p.offer("t1", 50)
    assert c.state("t1") is S.PREPARING and p.take() == [] and d.take() == []
    d.ready("t1")
    p.take_one(Go)
    p.offer("t1", 50)
    assert c.state("t1") is S.SENDING and p.take() == [] and c.pool(d)[1] == 50
    assert c.status().counters["repeated"] == 2 and c.status().counters["offered"] == 1
    refused(c, p.identity, Offer(transfer_id="t1", nbytes=60), ProtocolViolation.code, contains="Offer")


def test_expect_again_changes_nothing_and_a_later_claim_takes_a_transfer_not_granted_yet(c: FakeCluster) -> None:
    """A client re-sends its pending Expects after a reconnect: the same Expect again
    changes nothing. Another decode peer's Expect means the proxy sent the request there
    (again): before the transfer is granted, that claim takes it, and the peer that
    claimed it before is told, so its load does not wait for its deadline."""
    p, d1, d2 = c.prefill(), c.decode("d1", pool=1000), c.decode("d2", pool=100)
    d1.expect("t1")
    d1.expect("t1")
    assert c.state("t1") is S.EXPECTED and d1.take() == []
    d2.expect("t1")
    assert d1.take_one(Abort) == Abort(transfer_id="t1", reason="d2:0 claims it now")
    p.offer("t1", 50)  # d1 has more room, but the request is on d2 now
    assert d2.take_one(Prepare).source == "p:0" and d1.take() == []


def test_expect_before_offer_routes_to_the_expecting_peer(c: FakeCluster) -> None:
    p, d1, d2 = c.prefill(), c.decode("d1", pool=1000), c.decode("d2", pool=100)
    d2.expect("t1")
    assert c.state("t1") is S.EXPECTED and d2.take() == []
    p.offer("t1", 50)  # d1 has more room, but the request lives on d2
    assert d2.take_one(Prepare).source == "p:0" and d1.take() == []
    d2.ready("t1")
    assert p.take_one(Go).decode == "d2:0"
    d2.done("t1")
    assert isinstance(p.take_one(Release), Release) and c.broker.transfers == {}


def test_offer_before_any_decode_peer_waits_unrouted(c: FakeCluster) -> None:
    p = c.prefill()
    p.offer("t1", 50)
    assert c.state("t1") is S.UNROUTED and p.take() == []
    d = c.register("d", "decode", pool=100)  # a decode peer arriving routes what waited
    assert [type(m) for m in d.take()] == [Registered, Prepare]


def test_expect_after_offer_routes_an_unrouted_transfer(c: FakeCluster) -> None:
    p, d = c.prefill(), c.decode(pool=100)
    p.offer("t1", 50)
    d.take()
    d = c.register("d", "decode", pool=100, identity=b"d-restarted")  # D restarts: t1 has no route left
    assert [type(m) for m in d.take()] == [Registered] and c.state("t1") is S.UNROUTED
    d.expect("t1")  # the request reached the restarted D: route t1 there
    assert d.take_one(Prepare) == Prepare(transfer_id="t1", nbytes=50, source="p:0", attempt=1)
    assert p.take() == []


def test_expect_after_offer_on_the_routed_peer_only_records_it(c: FakeCluster) -> None:
    p, d = c.prefill(), c.decode(pool=100)
    p.offer("t0", 100)
    p.offer("t1", 50)
    d.take()
    d.expect("t1")
    assert d.take() == [] and c.state("t1") is S.WAITING_CREDIT
    assert c.broker.transfers[("t1", 0)].expected_by == "d:0" and c.pool(d) == (100, 100, 1)


def test_expect_moves_a_transfer_waiting_for_credit(c: FakeCluster) -> None:
    p, d1 = c.prefill(), c.decode("d1", pool=100)
    p.offer("t0", 100)
    p.offer("t1", 40, decode="d1")
    d2 = c.decode("d2", pool=100)
    assert c.state("t1") is S.WAITING_CREDIT and c.pool(d1) == (100, 100, 1)
    d1.take()
    d2.expect("t1")
    assert d2.take_one(Prepare).transfer_id == "t1" and d1.take() == []
    assert c.pool(d1) == (100, 100, 0) and c.pool(d2) == (100, 40, 0)
    assert {x.peer_id: x.transfers for x in c.status().peers}["d1:0"] == 1  # d1 holds only t0 now


def test_expect_moves_a_transfer_that_another_decode_peer_expected(c: FakeCluster) -> None:
    p, d1, d2 = c.prefill(), c.decode("d1", pool=100), c.decode("d2", pool=100)
    p.offer("t0", 100, decode="d1")
    d1.expect("t1")
    p.offer("t1", 40)
    assert c.state("t1") is S.WAITING_CREDIT and c.broker.transfers[("t1", 0)].decode == "d1:0"
    d2.expect("t1")
    assert c.broker.transfers[("t1", 0)].decode == "d2:0"
    assert ("t1", 0) not in c.broker.peers["d1:0"].transfers
    assert [m for m in d1.take() if isinstance(m, Abort)] == [Abort(transfer_id="t1", reason="d2:0 claims it now")]
    d1.take()
    d1.goodbye()  # d1 no longer holds t1: losing it must not disturb t1
    assert c.broker.transfers[("t1", 0)].attempt == 0 and c.state("t1") is S.PREPARING
    assert prepared(d2) == ["t1"]


def test_offer_hint_picks_the_decode_instance(c: FakeCluster) -> None:
    p, d1, d2 = c.prefill(), c.decode("d1", pool=1000), c.decode("d2", pool=100)
    p.offer("t1", 10, decode="d2")
    assert isinstance(d2.take_one(Prepare), Prepare) and d1.take() == []
    p.offer("t2", 10)  # no hint: the most free room wins
    assert isinstance(d1.take_one(Prepare), Prepare)


def test_expect_trailing_a_hinted_route_is_accepted(c: FakeCluster) -> None:
    # The proxy's hint routed the transfer before D's scheduler announced it.
    p, d1, d2 = c.prefill(), c.decode("d1", pool=1000), c.decode("d2", pool=1000)
    p.offer("t1", 10, decode="d1")
    d1.take_one(Prepare)
    d1.expect("t1")
    assert d1.take() == [] and c.state("t1") is S.PREPARING
    d1.ready("t1")
    d1.expect("t1")  # in SENDING too
    assert d1.take() == [] and c.state("t1") is S.SENDING
    # Another decode peer's claim waits behind the holder: a third is refused.
    d2.expect("t1")
    assert d2.take() == [] and c.state("t1") is S.SENDING
    d3 = c.decode("d3", pool=1000)
    refused(c, d3.identity, Expect(transfer_id="t1"), "protocol", contains="held by d1:0, and d2:0 waits for it")


def test_offer_hint_naming_a_prefill_instance_is_ignored(c: FakeCluster) -> None:
    p, d = c.prefill(), c.decode(pool=100)
    c.prefill("q")
    p.offer("t1", 10, decode="q")
    assert isinstance(d.take_one(Prepare), Prepare)


# -- credit --------------------------------------------------------------------------


def test_credit_is_granted_fifo(c: FakeCluster) -> None:
    p, d = c.prefill(), c.decode(pool=100)
    for tid, n in (("a", 60), ("b", 60), ("c", 30)):
        p.offer(tid, n)
    assert prepared(d) == ["a"]
    assert (c.state("b"), c.state("c")) == (S.WAITING_CREDIT, S.WAITING_CREDIT)  # c fits, yet waits behind b
    assert c.pool(d) == (100, 60, 2)
    d.ready("a")
    d.done("a")
    assert prepared(d) == ["b", "c"]
    assert c.pool(d) == (100, 90, 0)


def test_a_claim_reserves_its_room_and_its_offer_is_prepared_at_once(c: FakeCluster) -> None:
    """D's scheduler took the request: the room is held from its Expect, so an Offer that
    comes later, even behind another Offer waiting for that pool, is prepared at once."""
    p, d = c.prefill(), c.decode(pool=100)
    d.expect("a", nbytes=60)
    assert c.pool(d) == (100, 60, 0) and c.state("a") is S.EXPECTED and d.take() == []
    p.offer("other", 50, decode="d")  # does not fit beside the claim: waits
    assert c.state("other") is S.WAITING_CREDIT
    p.offer("a", 60)
    assert prepared(d) == ["a"] and c.pool(d) == (100, 60, 1)
    d.ready("a")
    d.done("a")
    assert prepared(d) == ["other"] and c.pool(d) == (100, 50, 0)


def test_claims_take_room_in_claim_order_whatever_the_order_of_offers(c: FakeCluster) -> None:
    """Backpressure known before P computes: a claim that finds no room queues for it, and
    its Offer keeps that place instead of going behind the others."""
    p, d = c.prefill(), c.decode(pool=100)
    d.expect("a", nbytes=60)
    d.expect("b", nbytes=60)
    assert c.pool(d) == (100, 60, 1)
    p.offer("b", 60)  # b's prefill ends first: it still waits for a's room
    assert c.state("b") is S.WAITING_CREDIT and d.take() == []
    p.offer("a", 60)
    assert prepared(d) == ["a"]
    d.ready("a")
    d.done("a")
    assert prepared(d) == ["b"] and c.pool(d) == (100, 60, 0)


@pytest.mark.parametrize("how", ["d aborts its load", "d is lost", "the lease ends", "a front end cancels"])
def test_a_claim_that_ends_without_an_offer_gives_its_room_back(c: FakeCluster, how: str) -> None:
    p, d = c.prefill(), c.decode(pool=100)
    d.expect("a", nbytes=100)
    p.offer("b", 50)
    assert c.pool(d) == (100, 100, 1)
    if how == "d aborts its load":
        d.abort("a", "the request finished")
    elif how == "d is lost":
        d2 = c.decode("d2", pool=100)
        c.advance(CONFIG.peer_lease_s + 0.1, keep_alive=[p, d2])
    elif how == "the lease ends":
        c.advance(CONFIG.transfer_lease_s - 0.1)  # b's credit wait ended long before: another Offer waits
        assert c.state("a") is S.EXPECTED and c.state("b") is None
        p.offer("b2", 50)
        assert c.state("b2") is S.WAITING_CREDIT
        c.advance(0.2)
    else:
        c.deliver(b"gateway", Cancel(transfer_id="a"))
    assert c.state("a") is None
    waiting = "b2" if how == "the lease ends" else "b"
    assert c.state(waiting) is S.PREPARING
    if how != "d is lost":  # else it went to d2
        assert c.pool(d) == (100, 50, 0)
        assert [m.transfer_id for m in d.take() if isinstance(m, Prepare)] == [waiting]


def test_an_offer_of_another_size_than_the_claim_is_reserved_anew(c: FakeCluster) -> None:
    p, d = c.prefill(), c.decode(pool=100)
    d.expect("a", nbytes=30)
    p.offer("a", 70)
    assert d.take_one(Prepare).nbytes == 70 and c.pool(d) == (100, 70, 0)


def test_a_claim_that_moves_moves_its_room(c: FakeCluster) -> None:
    p, d1, d2 = c.prefill(), c.decode("d1", pool=100), c.decode("d2", pool=100)
    d1.expect("a", nbytes=80)
    d2.expect("a", nbytes=80)  # the proxy sent the request to d2 instead
    assert c.pool(d1) == (100, 0, 0) and c.pool(d2) == (100, 80, 0)
    assert [m for m in d1.take() if isinstance(m, Abort)] == [Abort(transfer_id="a", reason="d2:0 claims it now")]
    p.offer("a", 80)
    assert prepared(d2) == ["a"] and d1.take() == []


def test_credit_is_reserved_in_whole_pool_alignment_units(c: FakeCluster) -> None:
    # D's pool leases whole 4 KiB units: three 2,000-byte transfers need 12 KiB, not 6,000 B.
    p, d = c.prefill(), c.decode(pool=8192, alignment=4096)
    for tid in ("a", "b", "c"):
        p.offer(tid, 2000)
    assert prepared(d) == ["a", "b"] and c.state("c") is S.WAITING_CREDIT
    assert c.pool(d) == (8192, 8192, 1)
    d.ready("a")
    d.done("a")
    assert prepared(d) == ["c"]
    assert c.pool(d) == (8192, 8192, 0)


def test_credit_returns_on_abort_and_serves_the_next(c: FakeCluster) -> None:
    p, d = c.prefill(), c.decode(pool=100)
    p.offer("a", 100)
    p.offer("b", 100)
    d.take()
    p.abort("a", "client went away")
    assert p.take() == []
    got = d.take()
    assert Abort(transfer_id="a", reason="client went away") in got
    assert [m.transfer_id for m in got if isinstance(m, Prepare)] == ["b"]
    assert c.state("b") is S.PREPARING and c.pool(d) == (100, 100, 0)


def test_a_claim_into_its_blocks_takes_no_room_and_is_prepared_at_its_offer_whatever_its_size(c: FakeCluster) -> None:
    """D receives straight into its cache blocks (its Expect says so): the pool is neither
    reserved nor waited for, by a transfer larger than the pool as by one that would
    queue behind another; the broker's credit stays with the transfers that use the pool."""
    p, d = c.prefill(), c.decode(pool=100)
    p.offer("big", 80, decode="d")  # holds 80 of the pool
    assert prepared(d) == ["big"] and c.pool(d) == (100, 80, 0)
    d.expect("a", nbytes=150, into_blocks=True)
    d.expect("b", nbytes=60, into_blocks=True)
    d.expect("c", nbytes=60)  # into the pool: waits for room
    assert c.pool(d) == (100, 80, 1) and d.take() == []
    p.offer("a", 150)
    p.offer("b", 60)
    assert prepared(d) == ["a", "b"] and c.pool(d) == (100, 80, 1)
    assert (c.state("a"), c.state("b"), c.state("c")) == (S.PREPARING, S.PREPARING, S.EXPECTED)
    for tid in ("a", "b"):
        d.ready(tid)
        d.done(tid)
    assert c.pool(d) == (100, 80, 1)
    d.ready("big")
    d.done("big")
    assert c.pool(d) == (100, 60, 0)  # c's claim has its room now


def test_an_offer_routed_before_its_claim_into_the_blocks_stops_waiting_for_room_or_gives_it_back(
        c: FakeCluster) -> None:
    """A router that sends P the request first: each Offer comes before D's claim, routed
    on its own word. When the claim says the KV goes straight into D's blocks, an Offer
    queued for room is prepared at once, and one holding room gives it back to the next."""
    p, d = c.prefill(), c.decode(pool=100)
    p.offer("big", 80, decode="d")
    p.offer("a", 60, decode="d")  # queued: no room beside big
    p.offer("b", 60, decode="d")  # queued behind a
    assert prepared(d) == ["big"] and c.state("a") is S.WAITING_CREDIT and c.pool(d) == (100, 80, 2)
    d.expect("a", nbytes=60, into_blocks=True)
    assert prepared(d) == ["a"] and c.state("a") is S.PREPARING and c.pool(d) == (100, 80, 1)
    assert {t.transfer_id: t.in_place for t in c.status().transfers} == {"big": False, "a": True, "b": False}
    d.expect("big", nbytes=80, into_blocks=True)  # holds 80 it will never use: b gets it
    assert prepared(d) == ["b"] and c.pool(d) == (100, 60, 0)
    for tid in ("a", "big", "b"):
        d.ready(tid)
        d.done(tid)
    assert c.pool(d) == (100, 0, 0)


def test_a_claim_into_the_blocks_after_ds_ready_keeps_the_room_its_receive_was_posted_into(c: FakeCluster) -> None:
    """Routed on the Offer's word, D answered the Prepare with a receive into its pool: a
    claim that comes after that Ready saying "into the blocks" gives no room back, so the
    next Offer waits until the first transfer's bytes have left the pool."""
    p, d = c.prefill(), c.decode(pool=100)
    p.offer("t1", 100)
    assert prepared(d) == ["t1"]
    d.ready("t1", nbytes=100)
    assert p.take_one(Go).transfer_id == "t1"
    d.expect("t1", 100, into_blocks=True)
    assert c.pool(d) == (100, 100, 0)
    assert {t.transfer_id: t.in_place for t in c.status().transfers} == {"t1": False}
    p.offer("t2", 100)
    assert d.take() == [] and c.state("t2") is S.WAITING_CREDIT
    d.done("t1", nbytes=100)
    assert p.take_one(Release) == Release(transfer_id="t1") and prepared(d) == ["t2"]


@pytest.mark.parametrize("into_blocks", [True, False])
def test_an_offer_larger_than_the_pool_of_a_peer_that_takes_only_its_own_waits_for_its_claim(
        c: FakeCluster, into_blocks: bool) -> None:
    """A router that sends P the request before D: the Offer comes first, naming D, and is
    larger than D's pool. It waits for D's claim, which says whether the room is needed at
    all: into the blocks it is prepared at once; through the pool it is refused, naming
    the sizes (at the Offer, for a peer that takes anything, as before)."""
    p, d = c.prefill(), c.decode(pool=100, claims_only=True)
    p.offer("big", 150, decode="d")
    assert c.state("big") is S.UNROUTED and p.take() == [] and d.take() == []
    assert "larger than its pool" in c.status().transfers[0].waiting_for
    d.expect("big", nbytes=150, into_blocks=into_blocks)
    if into_blocks:
        assert prepared(d) == ["big"] and c.pool(d) == (100, 0, 0)
        d.ready("big")
        d.done("big")
        assert [type(m) for m in p.take()] == [Go, Release]
    else:
        assert "150" in p.take_one(Abort).reason and "holds only 100" in d.take_one(Abort).reason
    assert c.broker.transfers == {}


def test_an_oversize_offer_whose_decode_peer_never_claims_it_ends_with_its_lease_naming_the_pool(
        c: FakeCluster) -> None:
    p, d = c.prefill(), c.decode(pool=100, claims_only=True)
    p.offer("big", 150, decode="d")
    c.advance(CONFIG.transfer_lease_s + 0.1, keep_alive=[p, d])
    reason = p.take_one(Abort).reason
    assert "150 bytes" in reason and "d:0" in reason and "raise the decode pool size" in reason
    assert c.broker.transfers == {}


def test_an_offer_planned_as_a_lane_of_some_heads_takes_room_even_if_claimed_into_blocks(c: FakeCluster) -> None:
    """A lane of some of the source rank's heads is joined in D's pool, so a claim into
    the blocks does not spare its room: the Offer waits for credit as any other."""
    p = c.prefill(world_size=1, kv_heads=8)
    d0 = c.decode("d", pool=100, world_size=2, kv_heads=8)
    c.decode("d", pool=100, rank=1, world_size=2, kv_heads=8)
    d0.expect("a", nbytes=150, into_blocks=True)
    p.offer("a", 300)  # about half of it for each decode rank: more than each pool holds
    aborts = p.take()
    assert aborts and all(isinstance(m, Abort) and "pool of d:" in m.reason and "holds only 100" in m.reason
                          for m in aborts), aborts


def test_transfer_larger_than_the_pool_is_aborted_at_once(c: FakeCluster) -> None:
    p, d = c.prefill(), c.decode(pool=100)
    p.offer("big", 150)
    abort = p.take_one(Abort)
    assert abort.transfer_id == "big" and "150" in abort.reason and "100" in abort.reason
    assert d.take() == [] and c.broker.transfers == {} and c.pool(d) == (100, 0, 0)


def test_credit_wait_deadline_aborts_both_sides(c: FakeCluster) -> None:
    p, d = c.prefill(), c.decode(pool=100)
    p.offer("a", 100)
    p.offer("b", 50)
    d.take()
    c.advance(9.9)
    assert c.state("b") is S.WAITING_CREDIT and p.take() == [] and d.take() == []
    assert c.broker.next_deadline() == pytest.approx(10.0)
    c.advance(0.1)
    assert c.state("b") is None and c.state("a") is S.PREPARING
    for peer in (p, d):
        abort = peer.take_one(Abort)
        assert abort.transfer_id == "b" and "d:0" in abort.reason and "50" in abort.reason


@pytest.mark.parametrize("state", [S.PREPARING, S.SENDING])
def test_transfer_lease_expiry_aborts_and_returns_credit(c: FakeCluster, state: TransferState) -> None:
    p, d = c.prefill(), c.decode(pool=100)
    p.offer("t1", 80)
    d.take()
    if state is S.SENDING:
        d.ready("t1")
        p.take()
    c.advance(29.0)
    assert c.state("t1") is state
    c.advance(1.0)
    assert c.state("t1") is None and c.pool(d) == (100, 0, 0)
    for peer in (p, d):
        assert "lease" in peer.take_one(Abort).reason
    assert c.status().counters["aborted"] == 1


def test_peer_lease_expiry_evicts(c: FakeCluster) -> None:
    p, _ = c.prefill(), c.decode(pool=100)
    c.advance(4.0, keep_alive=[p])
    assert {x.peer_id for x in c.status().peers} == {"p:0", "d:0"}
    c.advance(1.0, keep_alive=[p])  # d's lease of 5 s ends
    assert [x.peer_id for x in c.status().peers] == ["p:0"] and c.status().pools == []
    assert c.status().counters["evicted"] == 1
    c.advance(5.0, keep_alive=False)
    assert c.status().peers == [] and c.broker.next_deadline() is None
    refused(c, p.identity, Heartbeat(), "not_registered")


def test_heartbeat_keeps_the_lease(c: FakeCluster) -> None:
    p = c.prefill()
    c.now = 4.0
    p.heartbeat(seq=1)
    assert c.broker.next_deadline() == 9.0
    c.now = 8.9
    c.tick()
    assert [x.peer_id for x in c.status().peers] == ["p:0"]
    c.now = 9.0
    c.tick()
    assert c.status().peers == []


def test_a_broker_that_did_not_run_ends_nothing_before_its_peers_had_a_heartbeat_to_be_heard(c: FakeCluster) -> None:
    """The broker process stopped for 20 s (a starved host, a stopped process). What its
    peers sent meanwhile waits in its socket's queue: its first tick after must not take
    that for silence, evicting every peer and aborting every transfer. A peer that died
    meanwhile is evicted one heartbeat after, not a whole lease later."""
    p, d = c.prefill(), c.decode(pool=100)
    p.offer("a", 60)  # preparing: its transfer lease ends at 30
    p.offer("b", 60)  # waiting for credit until 10
    d.expect_from("e", "q")  # prefill instance q is not registered: ends at 5
    p.offer("x", 10)
    p.abort("x", "its request was cancelled")  # remembered until 30, for late messages
    d.take()
    c.now = 4.0
    c.tick()
    c.now = 34.5  # every deadline above has passed, none of them in time the broker ran
    c.broker.resume(c.now)
    c.tick()
    assert {x.peer_id for x in c.status().peers} == {"p:0", "d:0"}
    assert (c.state("a"), c.state("b"), c.state("e")) == (S.PREPARING, S.WAITING_CREDIT, S.EXPECTED)
    assert p.take() == [] and d.take() == []
    d.ready("a")  # a message that waited in the queue: the transfer goes on
    assert p.take_one(Go).transfer_id == "a"
    d.expect("x")  # a late claim still gets the ending it would have got before the stall
    assert "cancelled" in d.take_one(Abort).reason and c.state("x") is None
    assert c.broker.next_deadline() == pytest.approx(34.5 + CONFIG.heartbeat_s)
    c.advance(CONFIG.heartbeat_s, keep_alive=[d])  # p died while the broker was away
    assert [x.peer_id for x in c.status().peers] == ["d:0"]
    ended = {m.transfer_id: m.reason for m in d.take() if isinstance(m, Abort)}
    assert "p:0 was lost" in ended["a"] and "p:0 was lost" in ended["b"]
    assert "lease of 30 s ended" in ended["e"]  # the deadlines that had passed end now too
    assert c.broker.transfers == {}
    assert c.status().counters["stalls"] == 1


# -- lost peers and retries ----------------------------------------------------------


@pytest.mark.parametrize("how", ["goodbye", "lease"])
@pytest.mark.parametrize("state", [S.WAITING_CREDIT, S.PREPARING, S.SENDING])
def test_decode_lost_mid_transfer_is_rerouted(c: FakeCluster, state: TransferState, how: str) -> None:
    p, d1, d2 = c.prefill(), c.decode("d1", pool=100), c.decode("d2", pool=200)
    if state is S.WAITING_CREDIT:
        p.offer("t0", 100, decode="d1")
    p.offer("t1", 60, decode="d1")
    d1.take()
    if state is S.SENDING:
        d1.ready("t1")
        assert p.take_one(Go).attempt == 0
    assert c.state("t1") is state
    if how == "goodbye":
        d1.goodbye()
    else:
        c.advance(5.0, keep_alive=[p, d2])
    prepares = [m for m in d2.take() if isinstance(m, Prepare) and m.transfer_id == "t1"]
    assert prepares == [Prepare(transfer_id="t1", nbytes=60, source="p:0", attempt=1)]
    assert p.take() == []  # no Release, no Abort: the staged copy is sent again
    d2.ready("t1")
    go = p.take_one(Go)
    assert (go.decode, go.attempt, go.endpoints) == ("d2:0", 1, {"tcp": "tcp://d2-0:7000"})
    d2.done("t1")
    assert isinstance(p.take_one(Release), Release)
    assert c.status().counters["retried"] == (2 if state is S.WAITING_CREDIT else 1)
    assert c.status().counters["offered"] == (2 if state is S.WAITING_CREDIT else 1)


def test_decode_lost_with_no_other_decode_waits_unrouted(c: FakeCluster) -> None:
    p, d1 = c.prefill(), c.decode("d1", pool=100)
    p.offer("t1", 60)
    d1.goodbye()
    assert c.state("t1") is S.UNROUTED and p.take() == []
    d2 = c.register("d2", "decode", pool=100)
    assert [type(m) for m in d2.take()] == [Registered, Prepare]


def test_max_attempts_reached_aborts() -> None:
    c = FakeCluster(BrokerConfig(peer_lease_s=5.0, max_attempts=2))
    p, d1, d2, d3 = c.prefill(), c.decode("d1"), c.decode("d2"), c.decode("d3")
    p.offer("t1", 10, decode="d1")
    d1.goodbye()
    assert c.broker.transfers[("t1", 0)].attempt == 1
    routed = c.broker.transfers[("t1", 0)].decode
    [lost] = [x for x in (d2, d3) if x.peer_id == routed]
    [other] = [x for x in (d2, d3) if x is not lost]
    other.take()
    lost.goodbye()
    abort = p.take_one(Abort)
    assert "2 attempts" in abort.reason and lost.peer_id in abort.reason
    assert other.take() == [] and c.broker.transfers == {}


def test_max_attempts_one_never_retries() -> None:
    c = FakeCluster(BrokerConfig(max_attempts=1))
    p, d1, d2 = c.prefill(), c.decode("d1"), c.decode("d2")
    p.offer("t1", 10, decode="d1")
    d1.goodbye()
    assert isinstance(p.take_one(Abort), Abort) and d2.take() == []


@pytest.mark.parametrize("state", [S.WAITING_CREDIT, S.PREPARING, S.SENDING])
def test_prefill_lost_aborts_on_the_decode_side(c: FakeCluster, state: TransferState) -> None:
    p, d = c.prefill(), c.decode(pool=100)
    if state is S.WAITING_CREDIT:
        c.prefill("q").offer("t0", 100)
    p.offer("t1", 60)
    if state is S.SENDING:
        d.ready("t1")
    assert c.state("t1") is state
    d.take()
    p.goodbye()
    abort = d.take_one(Abort)
    assert abort.transfer_id == "t1" and "p:0" in abort.reason
    assert c.state("t1") is None and c.pool(d)[1] == (100 if state is S.WAITING_CREDIT else 0)


def test_decode_lost_while_expected_drops_the_expectation(c: FakeCluster) -> None:
    d = c.decode()
    d.expect("t1")
    d.goodbye()
    assert c.broker.transfers == {}


# -- registration --------------------------------------------------------------------


def test_incompatible_decode_is_refused_naming_the_fields(c: FakeCluster) -> None:
    c.prefill(compat_hash="h1", compat={"model": "llama", "dtype": "bfloat16", "block_size": "16"})
    err = refused(
        c,
        b"d/0",
        Register(
            role="decode",
            instance_id="d",
            pool_capacity=100,
            compat_hash="h2",
            compat={"model": "llama", "dtype": "float16", "block_size": "16"},
        ),
        "refused",
    )
    assert "dtype: float16 vs bfloat16" in err.detail and "model:" not in err.detail and "block_size" not in err.detail
    assert c.status().pools == []


@pytest.mark.parametrize(("groups", "what"), [(True, "a hybrid model"), (False, "KV head count vLLM does not report")])
def test_hybrid_or_headless_decode_of_another_tp_size_is_refused_naming_the_tp_sizes(
    c: FakeCluster, groups: bool, what: str
) -> None:
    """A model that moves between equal TP sizes only (its fields hold the TP size): a
    decode instance of another TP size is told to serve the same TP size, not a diff."""
    def fields(tp: int) -> dict[str, str]:
        return {"model": "gemma", "world_size": str(tp), "num_kv_heads": str(4 // tp),
                **({"kv_groups": "64:0,2;0:1,3"} if groups else {})}

    c.prefill(compat_hash="h1", compat=fields(1))
    err = refused(
        c, b"d/0",
        Register(role="decode", instance_id="d", world_size=2, pool_capacity=100, compat_hash="h2", compat=fields(2)),
        "refused",
    )
    assert err.detail.startswith("decode instance d (TP 2) cannot pair with prefill instance p (TP 1): ")
    assert what in err.detail and err.detail.endswith("serve both with the same tensor-parallel size")
    assert c.status().pools == []


def test_mismatched_ranks_of_one_instance_are_refused(c: FakeCluster) -> None:
    c.prefill(world_size=2, compat_hash="h1", compat={"num_layers": "32"})
    err = refused(
        c,
        b"p/1",
        Register(role="prefill", instance_id="p", rank=1, world_size=2, compat_hash="h2", compat={"num_layers": "28"}),
        "refused",
    )
    assert "num_layers: 28 vs 32" in err.detail
    err = refused(
        c, b"p/1", Register(role="prefill", instance_id="p", rank=1, world_size=4, compat_hash="h1"), "refused"
    )
    assert "world_size" in err.detail
    refused(
        c,
        b"p/1",
        Register(role="decode", instance_id="p", rank=1, world_size=2, compat_hash="h1", pool_capacity=1),
        "refused",
    )
    c.prefill(rank=1, world_size=2, compat_hash="h1")


def test_bad_registrations_are_refused(c: FakeCluster) -> None:
    refused(c, b"x", Register(role="prefill", instance_id="p", rank=2, world_size=2), "refused", contains="world_size")
    refused(c, b"x", Register(role="decode", instance_id="d"), "refused", contains="pool_capacity")
    c2 = FakeCluster(BrokerConfig(max_peers=1))
    c2.prefill()
    refused(c2, b"x", Register(role="prefill", instance_id="q"), "refused", contains="max-peers")


def test_peer_ids_fit_the_wire_limits(c: FakeCluster) -> None:
    # The broker sends peer ids back (Registered, Prepare.source, Go.decode, Relay.sender),
    # so every id it accepts must be one a peer can decode.
    refused(c, b"x", Register(role="prefill", instance_id="p" * 128), "refused", contains="instance")
    p = c.prefill("p" * 100, rank=123, world_size=124)
    assert p.peer_id == "p" * 100 + ":123"


def test_reregistration_of_a_prefill_aborts_its_transfers(c: FakeCluster) -> None:
    p, d = c.prefill(), c.decode(pool=100)
    p.offer("t1", 60)
    d.take()
    p2 = c.register("p", "prefill", identity=b"p-restarted")
    assert isinstance(p2.take_one(Registered), Registered)
    assert "registered again" in d.take_one(Abort).reason
    assert c.broker.transfers == {} and c.pool(d) == (100, 0, 0)
    refused(c, p.identity, Offer(transfer_id="t2", nbytes=1), "not_registered")


def test_reregistration_of_a_decode_reroutes_its_transfers(c: FakeCluster) -> None:
    p, d1, d2 = c.prefill(), c.decode("d1", pool=100), c.decode("d2", pool=100)
    p.offer("t1", 60, decode="d1")
    d1.take()
    d1b = c.register("d1", "decode", pool=100, identity=b"d1-restarted")
    assert [type(m) for m in d1b.take()] == [Registered]
    assert d2.take_one(Prepare).attempt == 1 and p.take() == []
    assert c.pool(d1b) == (100, 0, 0)


def test_one_socket_registering_as_another_peer_evicts_the_first(c: FakeCluster) -> None:
    p, d = c.prefill(), c.decode(pool=100)
    p.offer("t1", 60)
    d.take()
    q = c.register("q", "prefill", identity=p.identity)
    assert isinstance(q.take_one(Registered), Registered)
    assert isinstance(d.take_one(Abort), Abort)
    assert sorted(x.peer_id for x in c.status().peers) == ["d:0", "q:0"]


# -- small messages ------------------------------------------------------------------


def test_heartbeat_is_echoed_and_records_pool_free(c: FakeCluster) -> None:
    p, d = c.prefill(), c.decode(pool=100)
    p.heartbeat(seq=7)
    assert p.take() == [Heartbeat(seq=7)]
    d.heartbeat(seq=8, pool_free=42)
    assert d.take() == [Heartbeat(seq=8)] and c.broker.peers["d:0"].pool.reported_free == 42  # type: ignore[union-attr]


def test_heartbeat_from_an_unregistered_identity(c: FakeCluster) -> None:
    refused(c, b"nobody", Heartbeat(seq=1), "not_registered", contains="Register")


def test_relay_is_forwarded_with_the_sender(c: FakeCluster) -> None:
    p, d = c.prefill(), c.decode()
    p.relay("d:0", "nccl/p:0->d:0", b"\x01\x02")
    assert p.take() == []
    assert d.take() == [Relay(to="d:0", key="nccl/p:0->d:0", payload=b"\x01\x02", sender="p:0")]
    d.send(Relay(to="p:0", key="k", sender="forged"))
    assert p.take_one(Relay).sender == "d:0"


def test_status_request_needs_no_registration(c: FakeCluster) -> None:
    c.prefill()
    c.deliver(b"cli", StatusRequest())
    [st_] = c.inboxes[b"cli"]
    assert st_ == c.status()


# -- a front end cancels a request --------------------------------------------------


def cancel(c: FakeCluster, tid: str, reason: str = "the client left") -> Cancelled:
    """A Cancel from a front end that never registered; its one answer."""
    c.deliver(b"gateway", Cancel(transfer_id=tid, reason=reason))
    [answer] = c.inboxes.pop(b"gateway")
    assert isinstance(answer, Cancelled)
    return answer


def test_a_cancel_frees_p_and_d_at_once_wherever_nothing_moves_yet(c: FakeCluster) -> None:
    """The gateway gave up on requests that no decode instance took (it refused them, the
    client left): P's staged copies and D's credit come back now, not at D's load deadline
    or the transfer lease, and D's waiting loads fail now."""
    p, d = c.prefill(), c.decode(pool=100, claims_only=True)
    d2 = c.decode("d2", pool=100, claims_only=True)
    d.expect("expected")  # D holds the request; no Offer yet
    p.offer("unrouted", 10)  # names no instance, and two could hold it
    p.offer("parked", 60, decode="d")  # granted on the Offer's word: D has no request for it
    d.expect("waiting")
    p.offer("waiting", 60)  # D's pool is full: it waits for credit
    assert prepared(d) == ["parked"] and c.pool(d) == (100, 60, 1)
    assert (c.state("expected"), c.state("unrouted"), c.state("waiting")) == (S.EXPECTED, S.UNROUTED, S.WAITING_CREDIT)

    assert cancel(c, "expected") == Cancelled(transfer_id="expected", ended=1, left=0)
    assert aborted(d) == ["expected"] and p.take() == []
    assert cancel(c, "unrouted") == Cancelled(transfer_id="unrouted", ended=1)
    assert aborted(p) == ["unrouted"] and d.take() == [] and d2.take() == []
    assert cancel(c, "waiting") == Cancelled(transfer_id="waiting", ended=1)
    assert aborted(p) == ["waiting"] and aborted(d) == ["waiting"] and c.pool(d) == (100, 60, 0)
    assert cancel(c, "parked", "decode instance d answered 400").ended == 1
    [abort] = [m for m in d.take() if isinstance(m, Abort)]
    assert abort.reason == "the request was cancelled (decode instance d answered 400)"
    assert aborted(p) == ["parked"]
    assert c.broker.transfers == {} and c.pool(d) == (100, 0, 0)
    assert c.status().counters["cancelled"] == 4


def test_a_cancel_leaves_a_transfer_that_moves_or_is_granted_to_its_claimant(c: FakeCluster) -> None:
    """Once its Go is out, or once the decode peer holding the request has its credit (its
    receive may be posted), a transfer ends within moments on its own: a Cancel leaves it
    alone, and it completes as if no Cancel had come."""
    p, d = c.prefill(), c.decode(pool=100)
    d.expect("claimed")
    p.offer("claimed", 10)
    p.offer("sending", 10, decode="d")
    assert prepared(d) == ["claimed", "sending"]
    d.ready("sending")
    p.take()
    before = snapshot(c.broker, c.now)
    assert cancel(c, "claimed") == Cancelled(transfer_id="claimed", ended=0, left=1)
    assert cancel(c, "sending") == Cancelled(transfer_id="sending", ended=0, left=1)
    assert p.take() == [] and d.take() == [] and snapshot(c.broker, c.now) == before
    d.ready("claimed")
    d.done("claimed")
    d.done("sending")
    assert [type(m) for m in p.take()] == [Go, Release, Release] and c.broker.transfers == {}


def test_a_cancel_before_the_offer_or_the_expect_answers_them_at_once(c: FakeCluster) -> None:
    """P refused the prompt, or the client left before either instance got far: a later
    Offer (P saved the KV after all) gets the Abort at once, so P frees it; so does a
    later Expect. Every rank's, with a tensor-parallel pair. A delivered transfer keeps its
    ending: P's Offer sent again still gets its Release."""
    p0, p1 = c.prefill(world_size=2), c.prefill(rank=1, world_size=2)
    d0, d1 = c.decode(world_size=2), c.decode(rank=1, world_size=2)
    assert cancel(c, "t1", "prefill instance p answered 400") == Cancelled(transfer_id="t1")
    p0.offer("t1", 10)
    assert aborted(p0) == ["t1"] and d0.take() == [] and c.state("t1") is None
    d1.expect("t1")
    assert aborted(d1) == ["t1"] and c.state("t1", rank=1) is None
    p0.offer("t2", 10)
    assert prepared(d0) == ["t2"]
    d0.ready("t2")
    d0.done("t2")
    p0.take()
    cancel(c, "t2")
    p0.offer("t2", 10)
    assert p0.take_one(Release) == Release(transfer_id="t2")
    assert p1.take() == [] and d0.take() == []


def test_abort_for_a_finished_transfer_is_harmless(c: FakeCluster) -> None:
    p, d = c.prefill(), c.decode()
    before = snapshot(c.broker, c.now)
    p.abort("gone")
    assert p.take() == [] and d.take() == [] and snapshot(c.broker, c.now) == before


# -- bad messages change nothing -------------------------------------------------------


@pytest.fixture
def busy() -> tuple[FakeCluster, FakePeer, FakePeer, FakePeer]:
    """A cluster with transfers expected, waiting, preparing and sending, and a clock that moved."""
    c = FakeCluster()
    p, d, d2 = c.prefill(), c.decode(pool=100), c.decode("d2", pool=100)
    d2.expect("expected")
    p.offer("sending", 50, decode="d")
    d.ready("sending")
    p.offer("preparing", 50, decode="d")
    p.offer("waiting", 10, decode="d")
    c.advance(2.0)
    for x in (p, d, d2):
        x.take()
    return c, p, d, d2


def test_bad_messages_get_an_error_and_change_nothing(busy: tuple[FakeCluster, FakePeer, FakePeer, FakePeer]) -> None:
    c, p, d, d2 = busy
    c.now += 1.0  # leases are not renewed by a refused message either
    refused(c, d.identity, Ready(transfer_id="nope", nbytes=1), "protocol", contains="no such transfer")
    refused(c, d.identity, Done(transfer_id="nope"), "protocol")
    refused(c, d2.identity, Done(transfer_id="sending"), "protocol", contains="d2:0 is not part of it")
    refused(c, p.identity, Done(transfer_id="sending"), "protocol", contains="only a decode peer")
    refused(c, d2.identity, Ready(transfer_id="preparing", nbytes=1), "protocol", contains="not part of it")
    refused(c, d.identity, Ready(transfer_id="preparing", offset=40, nbytes=11), "protocol", contains="40+11")
    refused(c, d.identity, Ready(transfer_id="sending", nbytes=1), "protocol", contains="state sending")
    refused(c, d.identity, Offer(transfer_id="new", nbytes=1), "protocol", contains="only a prefill peer")
    refused(c, d.identity, Offer(transfer_id="preparing", nbytes=1), "protocol")
    refused(c, p.identity, Offer(transfer_id="waiting", nbytes=1), "protocol")
    refused(c, p.identity, Expect(transfer_id="x"), "protocol", contains="only a decode peer")
    refused(c, d2.identity, Abort(transfer_id="preparing"), "protocol", contains="not part of it")
    refused(c, p.identity, Abort(transfer_id="expected"), "protocol", contains="only a decode peer")
    refused(c, d.identity, Abort(transfer_id="expected"), "protocol", contains="d:0 is not part of it")
    refused(c, p.identity, Relay(to="ghost:0", key="k"), "unknown_peer")
    broker_to_peer: tuple[Message, ...] = (
        Registered(peer_id="p:0", heartbeat_s=1.0, lease_s=5.0),
        Prepare(transfer_id="preparing", nbytes=1, source="p:0"),
        Go(transfer_id="sending", decode="d:0", endpoints={}, nbytes=1),
        Release(transfer_id="sending"),
        Error(code="x"),
        Status(),
    )
    for msg in broker_to_peer:
        refused(c, p.identity, msg, "unexpected", contains="broker-to-peer")
        refused(c, d.identity, msg, "unexpected")
    before_register: tuple[Message, ...] = (
        Offer(transfer_id="t", nbytes=1),
        Expect(transfer_id="preparing"),
        Ready(transfer_id="preparing", nbytes=1),
        Done(transfer_id="sending"),
        Abort(transfer_id="sending"),
        Heartbeat(),
        Goodbye(),
        Relay(to="d:0", key="k"),
        Go(transfer_id="sending", decode="d:0", endpoints={}, nbytes=1),
    )
    for msg in before_register:
        refused(c, b"stranger", msg, "not_registered")


def test_busy_broker_refuses_new_transfers() -> None:
    c = FakeCluster(BrokerConfig(max_transfers=1))
    p, d = c.prefill(), c.decode()
    p.offer("a", 10)
    refused(c, p.identity, Offer(transfer_id="b", nbytes=10), "busy")
    refused(c, d.identity, Expect(transfer_id="b"), "busy")


# -- the transition table, walked ------------------------------------------------------


def in_state(state: TransferState) -> tuple[FakeCluster, FakePeer, FakePeer]:
    """A cluster holding transfer "t" (rank 0) in `state`, and the prefill and decode
    peers that a message of each role is sent from."""
    c = FakeCluster()
    if state is S.UNROUTED:
        p = c.prefill("p", compat_hash="h")
        c.prefill("q", compat_hash="x")
        d = c.decode("d", compat_hash="x")  # no decode peer can take p's transfers
        p.offer("t", 10)
    else:
        p, d = c.prefill(), c.decode(pool=100)
        if state is S.EXPECTED:
            d.expect("t")
        elif state is S.WAITING_CREDIT:
            p.offer("head", 100)
            p.offer("t", 10)
        else:
            p.offer("t", 10)
            if state is S.SENDING:
                d.ready("t")
    assert c.state("t") is state
    c.advance(1.0)
    p.take()
    d.take()
    return c, p, d


def message(kind: type, tid: str) -> Message:
    if kind is Offer:  # not the Offer `in_state` made: the same one again is a no-op
        return Offer(transfer_id=tid, nbytes=11)
    if kind is Ready:
        return Ready(transfer_id=tid, nbytes=10)
    return kind(transfer_id=tid)


WALK = [
    (state, kind, role) for state in S for kind in (Offer, Expect, Ready, Done, Abort) for role in ("prefill", "decode")
]


@pytest.mark.parametrize(("state", "kind", "role"), WALK, ids=[f"{s.value}-{k.__name__}-{r}" for s, k, r in WALK])
def test_transition_table(state: TransferState, kind: type, role: str) -> None:
    c, p, d = in_state(state)
    sender = p if role == "prefill" else d
    allowed = TRANSITIONS[state].get(kind) in (role, "any")
    if not allowed:
        with pytest.raises(ProtocolViolation):
            check_transition(state, kind, role, "t")
        err = refused(c, sender.identity, message(kind, "t"), ProtocolViolation.code)
        assert kind.__name__ in err.detail and err.transfer_id == "t"
        return
    c.now += 1.0
    check_transition(state, kind, role, "t")
    sender.send(message(kind, "t"))
    assert not any(isinstance(m, Error) for m in sender.inbox)
    assert c.broker.peers[sender.peer_id].lease_until == c.now + 5.0
    assert c.state("t") is not state or kind is Expect  # it moved (an Expect may keep it waiting)


def test_table_covers_every_state() -> None:
    assert set(TRANSITIONS) == set(S)
    assert HOLDS_CREDIT <= set(S)


# -- properties ------------------------------------------------------------------------

IDENTITIES = [b"s0", b"s1", b"s2", b"s3", b"s4", b"s5", b"stranger"]
INSTANCES = ["a", "b", "c", "d", "e"]
TIDS = [f"t{i}" for i in range(8)]

tids = st.sampled_from(TIDS)
sizes = st.integers(0, 250)
pids = st.sampled_from([f"{i}:{r}" for i in INSTANCES for r in (0, 1)] + ["ghost:0"])
garbage = st.one_of(
    st.builds(Registered, peer_id=pids, heartbeat_s=st.just(1.0), lease_s=st.just(5.0)),
    st.builds(Prepare, transfer_id=tids, nbytes=sizes, source=pids, attempt=st.integers(0, 3)),
    st.builds(Go, transfer_id=tids, decode=pids, endpoints=st.just({}), offset=sizes, nbytes=sizes),
    st.builds(Release, transfer_id=tids),
    st.builds(Error, code=st.sampled_from(["protocol", "x"]), transfer_id=tids),
    st.builds(Status),
    st.builds(StatusRequest),
    st.builds(Relay, to=pids, key=st.text(max_size=8), payload=st.binary(max_size=8), sender=pids),
    st.builds(Ready, transfer_id=tids, offset=sizes, nbytes=sizes),
    st.builds(Done, transfer_id=tids, nbytes=sizes),
    st.builds(Abort, transfer_id=tids, reason=st.text(max_size=20)),
    st.builds(Expect, transfer_id=tids),
    st.builds(Offer, transfer_id=tids, nbytes=sizes, decode=st.sampled_from(["", *INSTANCES])),
    st.builds(Heartbeat, seq=st.integers(0, 3), pool_free=st.integers(-1, 300)),
)
# Mostly small steps, so peers live long enough to finish transfers; sometimes a lease or more.
clock_steps = st.one_of(
    st.floats(0, 2, allow_nan=False),
    st.sampled_from([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.9, 5.0, 6.0, 10.0, 30.0, 100.0]),
)


class BrokerMachine(RuleBasedStateMachine):
    """Random peers, messages, garbage and clock jumps; every table stays consistent."""

    def __init__(self) -> None:
        super().__init__()
        self.c = FakeCluster(CONFIG)

    @property
    def b(self) -> Broker:
        return self.c.broker

    def send(self, identity: bytes, msg: Message) -> None:
        before = snapshot(self.b, self.c.now)
        effects = self.c.deliver(identity, msg)
        errors = [e for e in effects if isinstance(e, Send) and isinstance(e.msg, Error)]
        if errors:  # a refused message changes nothing
            assert [e.identity for e in errors] == [identity]
            assert snapshot(self.b, self.c.now) == before
        self.c.inboxes.clear()

    def who(self, data: st.DataObject, role: str | None = None) -> bytes:
        """Mostly a registered peer (of `role`, if given); sometimes any identity at all."""
        live = sorted(p.identity for p in self.b.peers.values() if role in (None, p.role))
        if live and data.draw(st.integers(0, 7)) > 0:
            return data.draw(st.sampled_from(live))
        return data.draw(st.sampled_from(IDENTITIES))

    def pick(self, data: st.DataObject, states: Iterable[TransferState]) -> Transfer | None:
        keys = sorted(k for k, t in self.b.transfers.items() if t.state in set(states))
        return self.b.transfers[data.draw(st.sampled_from(keys))] if keys else None

    @initialize(p=st.integers(1, 2), d=st.integers(1, 3), capacity=st.integers(20, 200))
    def start(self, p: int, d: int, capacity: int) -> None:
        for i in range(p + d):
            role: Literal["prefill", "decode"] = "prefill" if i < p else "decode"
            reg = Register(role=role, instance_id=INSTANCES[i], compat_hash="h1", pool_capacity=capacity)
            self.send(f"{INSTANCES[i]}/0".encode(), reg)

    @rule(
        data=st.data(),
        instance=st.sampled_from([*INSTANCES, "x" * 127]),
        rank=st.sampled_from([0, 0, 0, 1, 1, 2]),
        world_size=st.sampled_from([1, 1, 2]),
        role=st.sampled_from(["prefill", "decode"]),
        capacity=st.integers(0, 200),
        compat_hash=st.sampled_from(["h1", "h1", "h1", "h2"]),
        incarnation=st.sampled_from(["", "", "restarted"]),
        claims_only=st.booleans(),
        kv_heads=st.sampled_from([0, 0, 2]),
    )
    def register(
        self, data: st.DataObject, instance: str, rank: int, world_size: int, role: str, capacity: int,
        compat_hash: str, incarnation: str, claims_only: bool, kv_heads: int,
    ) -> None:
        reg = Register(
            role=role,  # type: ignore[arg-type]
            instance_id=instance,
            rank=rank,
            world_size=world_size,
            pool_capacity=capacity,
            compat_hash=compat_hash,
            compat={"dtype": compat_hash},
            incarnation=incarnation,
            claims_only=claims_only,
            kv_heads=kv_heads,  # with heads, instances of TP 1 and 2 pair by lanes
        )
        own = f"{instance}/{rank}".encode()  # mostly its own socket; sometimes one another peer holds
        self.send(data.draw(st.sampled_from([own] * 3 + IDENTITIES)), reg)

    @rule(data=st.data(), n=st.integers(1, 3))
    def offer(self, data: st.DataObject, n: int) -> None:
        decodes = sorted({p.reg.instance_id for p in self.b.peers.values() if p.role == "decode"})
        for _ in range(n):
            hint = data.draw(st.sampled_from(["", "", *INSTANCES, "ghost"]))
            chosen = data.draw(st.booleans())
            if decodes and chosen:  # the proxy chose a live decode instance
                hint = data.draw(st.sampled_from(decodes))
            nbytes = data.draw(st.integers(0, 100) | sizes)
            self.send(self.who(data, "prefill"), Offer(transfer_id=data.draw(tids), nbytes=nbytes, decode=hint))

    @rule(data=st.data(), how=st.integers(0, 2))
    def expect(self, data: st.DataObject, how: int) -> None:
        if how == 0:  # the request turns up on D while its transfer waits for a route or credit
            t = self.pick(data, [S.WAITING_CREDIT]) or self.pick(data, [S.UNROUTED])
            if t is not None:
                own = self.b.peers[t.decode].identity if t.decode else None
                for i in range(data.draw(st.integers(1, 2))):
                    mine = own is not None and i == 0 and data.draw(st.booleans())
                    self.send(own if mine else self.who(data, "decode"), Expect(transfer_id=t.transfer_id))  # type: ignore[arg-type]
            return
        t = self.pick(data, list(S)) if how == 1 else None
        # Now and then the request names its prefill instance: one registered, or one that is not.
        named = sorted({p.reg.instance_id for p in self.b.peers.values() if p.role == "prefill"} | {"p-absent"})
        prefill = data.draw(st.sampled_from(["", *named]))
        # Mostly the claim says the room it needs (the Offer's size, or another), reserved at once.
        nbytes = data.draw(st.sampled_from([0, t.nbytes if t else 0]) | st.integers(0, 100) | sizes)
        # Now and then it receives straight into its blocks: no room held, whatever its size.
        self.send(self.who(data, "decode"), Expect(transfer_id=t.transfer_id if t else data.draw(tids), prefill=prefill,
                                                  nbytes=nbytes, into_blocks=data.draw(st.booleans())))

    @rule(data=st.data(), offer=st.booleans())
    def late_message(self, data: st.DataObject, offer: bool) -> None:
        """A decode peer's request, or a prefill peer's Offer sent again, turns up after its
        transfer ended: the broker answers with that ending and makes no transfer for it."""
        role = "prefill" if offer else "decode"
        peers = {p.reg.rank: p for p in self.b.peers.values() if p.role == role}
        ended = {**self.b.aborted, **self.b.delivered}
        # Ended whole: a lane of it still alive (into a decode rank that is not registered)
        # makes an Offer sent again a protocol error, not a late message.
        keys = sorted(k for k, (until, _) in ended.items() if until > self.c.now and k[0] not in self.b.by_tid)
        keys = [k for k in keys if k[1] in peers]
        if not keys:
            return
        tid, rank = data.draw(st.sampled_from(keys))
        peer = peers[rank]
        msg: Message = Offer(transfer_id=tid, nbytes=1) if offer else Expect(transfer_id=tid)
        effects = self.c.deliver(peer.identity, msg)
        if (tid, rank) in self.b.delivered:
            want: Message = Release(transfer_id=tid) if offer else Abort(transfer_id=tid, reason=ended[(tid, rank)][1])
        else:
            want = Abort(transfer_id=tid, reason=ended[(tid, rank)][1][:2000])
        assert [(e.identity, e.msg) for e in effects if isinstance(e, Send)] == [(peer.identity, want)]
        assert (tid, rank) not in self.b.transfers
        self.c.inboxes.clear()

    @rule(data=st.data())
    def progress(self, data: st.DataObject) -> None:
        """D answers a Prepare with Ready, or a Go with Done; sometimes out of turn or out of range."""
        t = self.pick(data, [S.PREPARING, S.SENDING])
        if t is None:
            return
        identity = self.b.peers[t.decode].identity if data.draw(st.integers(0, 7)) else self.who(data)  # type: ignore[index]
        ready = (t.state is S.PREPARING) == (data.draw(st.integers(0, 7)) > 0)
        if ready:
            offset = data.draw(st.integers(0, t.nbytes + 1))
            nbytes = data.draw(st.integers(0, t.nbytes + 1 - offset))
            self.send(identity, Ready(transfer_id=t.transfer_id, offset=offset, nbytes=nbytes))
        else:
            self.send(identity, Done(transfer_id=t.transfer_id, nbytes=t.nbytes))

    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        t = self.pick(data, list(S))
        if t is not None:
            parts = [self.b.peers[x].identity for x in (t.prefill, t.decode, t.expected_by) if x]
            identity = data.draw(st.sampled_from(parts)) if data.draw(st.integers(0, 3)) else self.who(data)
            self.send(identity, Abort(transfer_id=t.transfer_id, reason="gave up"))

    @rule(data=st.data(), identity=st.sampled_from([b"gateway", *IDENTITIES]))
    def cancel(self, data: st.DataObject, identity: bytes) -> None:
        """A front end gives up on a request, from any socket: what nothing moves for ends;
        what moves, or is granted to the peer holding its request, goes on untouched."""
        t = self.pick(data, list(S))
        tid = t.transfer_id if t is not None and data.draw(st.booleans()) else data.draw(tids)
        before = {k: (x.state, x.decode, x.expected_by) for k, x in self.b.transfers.items() if k[0] == tid}
        # the lanes into one decode rank end together, or none of them does
        moving = {(x.rank, x.decode_tp) for k, x in self.b.transfers.items()
                  if k[0] == tid and not cancellable(x.state, x.expected_by is not None)}
        stay = {k for k, x in self.b.transfers.items() if k[0] == tid and (x.rank, x.decode_tp) in moving}
        effects = self.c.deliver(identity, Cancel(transfer_id=tid))
        [answer] = [e.msg for e in effects if isinstance(e, Send) and e.identity == identity and isinstance(e.msg, Cancelled)]
        after = {k: (x.state, x.decode, x.expected_by) for k, x in self.b.transfers.items() if k[0] == tid}
        assert after == {k: v for k, v in before.items() if k in stay}
        assert (answer.ended, answer.left) == (len(before) - len(after), len(after))
        self.c.inboxes.clear()

    @rule(data=st.data(), msg=garbage, goodbye=st.integers(0, 7))
    def noise(self, data: st.DataObject, msg: Message, goodbye: int) -> None:
        """Garbage, stray and broker-to-peer messages from anyone; now and then a Goodbye."""
        self.send(self.who(data), Goodbye() if goodbye == 7 else msg)

    @rule(dt=clock_steps, alive=st.integers(0, 3))
    def tick(self, dt: float, alive: int) -> None:
        self.c.now += dt
        if alive:  # mostly, every peer heartbeats in time; sometimes none do
            for p in list(self.b.peers.values()):
                self.send(p.identity, Heartbeat())
        self.c.tick()  # checks that no peer, transfer or credit wait outlived `now`
        self.c.inboxes.clear()

    @rule(away=st.floats(1.0, 60.0))
    def stall(self, away: float) -> None:
        """The broker did not run for a while; its peers' messages waited in its queue."""
        self.c.now += away
        self.b.resume(self.c.now)
        self.c.tick()
        self.c.inboxes.clear()

    @invariant()
    def consistent(self) -> None:
        check_invariants(self.b)

    def teardown(self) -> None:
        self.c.now += 1e6
        self.c.tick()
        assert self.b.peers == {} and self.b.by_identity == {} and self.b.transfers == {}
        self.c.now += CONFIG.transfer_lease_s  # what is kept for late Expects ends a lease later
        self.c.tick()
        assert not self.b.aborted and not self.b.delivered and not self.b.lost


BrokerMachine.TestCase.settings = settings(
    max_examples=300,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestBrokerMachine = BrokerMachine.TestCase
