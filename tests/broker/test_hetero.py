"""The broker core with prefill and decode instances of different TP sizes: lanes per
(P rank, D rank) pair, each D rank's pool credited for its own lanes."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker.transfers import TransferState, lane_id
from protocols.heads import lanes, rank_heads
from protocols.messages import Abort, Cancel, Error, Expect, Go, Layout, Prepare, Registered, Release

from .fake_cluster import CONFIG, FakeCluster, FakePeer

S = TransferState


@pytest.fixture
def c() -> FakeCluster:
    return FakeCluster()


LAYOUT = Layout(kind="kv_first", dtype="bfloat16", num_layers=2, num_blocks=4, block_nbytes=64)


def instance(c: FakeCluster, name: str, role: str, tp: int, *, heads: int = 4, pool: int = 1000,
             replicated: bool = False, claims_only: bool = False) -> list[FakePeer]:
    peers = []
    for r in range(tp):
        if role == "prefill":
            peers.append(c.prefill(name, rank=r, world_size=tp, kv_heads=heads, kv_replicated=replicated))
        else:
            peers.append(c.decode(name, pool=pool, rank=r, world_size=tp, kv_heads=heads, kv_replicated=replicated,
                                  claims_only=claims_only))
    return peers


def test_hetero_p_tp1_to_d_tp2_splits_heads_and_releases_once(c: FakeCluster) -> None:
    [p] = instance(c, "p", "prefill", 1)
    d0, d1 = instance(c, "d", "decode", 2)
    p.offer("t", 512, layout=LAYOUT, decode="d")
    half = Layout(kind="kv_first", dtype="bfloat16", num_layers=2, num_blocks=4, block_nbytes=32)
    assert d0.take_one(Prepare) == Prepare(transfer_id="t", nbytes=256, layout=half, source="p:0", head_start=0,
                                           head_stop=2)
    assert d1.take_one(Prepare) == Prepare(transfer_id="t", nbytes=256, layout=half, source="p:0", head_start=2,
                                           head_stop=4)
    assert c.pool(d0) == (1000, 256, 0) and c.pool(d1) == (1000, 256, 0)
    d1.ready("t", source="p:0")
    d0.ready("t", offset=64, source="p:0")  # D rank 0 holds the first block already
    gos = p.take()
    assert [(g.decode, g.offset, g.nbytes, g.head_start, g.head_stop) for g in gos if isinstance(g, Go)] == [
        ("d:1", 0, 256, 2, 4), ("d:0", 64, 192, 0, 2)]
    d0.done("t", 192, source="p:0")
    assert p.take() == []  # its staging still serves D rank 1
    d1.done("t", 256, source="p:0")
    assert p.take_one(Release) == Release(transfer_id="t")
    assert c.broker.transfers == {} and c.pool(d0)[1] == c.pool(d1)[1] == 0
    assert c.status().counters["completed"] == 2


def test_hetero_p_tp2_to_d_tp1_merges_two_lanes_into_one_rank(c: FakeCluster) -> None:
    p0, p1 = instance(c, "p", "prefill", 2)
    [d] = instance(c, "d", "decode", 1)
    p1.offer("t", 256, layout=LAYOUT, decode="d")
    p0.offer("t", 256, layout=LAYOUT, decode="d")
    preps = d.take()
    assert sorted((m.source, m.nbytes, m.head_start, m.head_stop) for m in preps if isinstance(m, Prepare)) == [
        ("p:0", 256, 0, 2), ("p:1", 256, 2, 4)]
    assert c.pool(d) == (1000, 512, 0)
    d.ready("t", source="p:1")
    assert p1.take_one(Go).head_start == 2 and p0.take() == []
    d.ready("t", source="p:0")
    assert p0.take_one(Go).head_stop == 2
    d.done("t", 256, source="p:0")
    assert p0.take_one(Release) == Release(transfer_id="t") and p1.take() == []
    assert c.pool(d) == (1000, 256, 0)
    d.done("t", 256, source="p:1")
    assert p1.take_one(Release) == Release(transfer_id="t")
    assert c.pool(d) == (1000, 0, 0)


def test_hetero_expect_before_offer_plans_lanes_from_the_named_prefill(c: FakeCluster) -> None:
    p0, p1 = instance(c, "p", "prefill", 2)
    [d] = instance(c, "d", "decode", 1, claims_only=True)
    d.expect_from("t", "p")
    assert {k: t.state for k, t in c.broker.transfers.items()} == {
        ("t", lane_id(0, 0)): S.EXPECTED, ("t", lane_id(1, 0)): S.EXPECTED}
    p0.offer("t", 100)
    p1.offer("t", 100)
    assert sorted(m.source for m in d.take() if isinstance(m, Prepare)) == ["p:0", "p:1"]


def test_hetero_unnamed_instances_plan_against_the_one_tp_size_registered(c: FakeCluster) -> None:
    """No instance named: every decode instance runs TP 2, so the Offer is planned for it."""
    [p] = instance(c, "p", "prefill", 1)
    d0, d1 = instance(c, "d", "decode", 2)
    p.offer("t", 100)
    assert [m.head_start for m in d0.take()] == [0] and [m.head_start for m in d1.take()] == [2]


def test_hetero_an_instance_that_registers_again_with_another_tp_size_gets_lanes_for_it(c: FakeCluster) -> None:
    """The lanes between two registrations are worked out once (`Handshake._lanes`): a
    decode instance back with another TP size is a new registration, planned anew."""
    [p] = instance(c, "p", "prefill", 1)
    [d] = instance(c, "d", "decode", 1)
    p.offer("t1", 100, decode="d")
    assert [(m.head_start, m.head_stop) for m in d.take() if isinstance(m, Prepare)] == [(0, 0)]
    d.ready("t1")
    d.done("t1", 100)
    d.goodbye()
    d0, d1 = instance(c, "d", "decode", 2)
    p.offer("t2", 100, decode="d")
    assert [m.head_start for m in d0.take() if isinstance(m, Prepare)] == [0]
    assert [m.head_start for m in d1.take() if isinstance(m, Prepare)] == [2]


def test_hetero_a_decode_instance_of_another_size_than_planned_is_refused_for_it(c: FakeCluster) -> None:
    [p] = instance(c, "p", "prefill", 1)
    instance(c, "a", "decode", 2, claims_only=True)
    b0, b1, b2, b3 = instance(c, "b", "decode", 4, claims_only=True)
    p.offer("t", 100)  # two sizes registered and none named: planned as equal TP
    b0.expect("t")
    [abort] = [m for m in b0.take() if isinstance(m, Abort)]
    assert "runs TP 4, but the transfer's lanes were planned for TP 1" in abort.reason


def test_hetero_registration_refuses_heads_that_cannot_split(c: FakeCluster) -> None:
    instance(c, "p", "prefill", 2, heads=6)
    peer = c.register("d", "decode", pool=100, rank=0, world_size=4, kv_heads=6)
    [err] = peer.take()
    assert isinstance(err, Error) and err.code == "refused"
    assert err.detail == (
        "prefill instance p (TP 2) cannot feed decode instance d (TP 4): 6 KV heads do not split over 4 ranks "
        "(neither count divides the other) on the decode side; serve both with TP sizes that divide the model's "
        "KV heads, or with equal TP")
    # without a head count, only equal TP pairs
    c2 = FakeCluster()
    c2.prefill("p", world_size=2, rank=0)
    lone = c2.register("d", "decode", pool=100, world_size=1)
    [err] = lone.take()
    assert isinstance(err, Error) and "prefill TP 2 and decode TP 1 must be equal" in err.detail
    ok = c2.register("e", "decode", pool=100, world_size=2, rank=1)
    assert isinstance(ok.take_one(Registered), Registered)


def test_hetero_a_lost_prefill_rank_aborts_every_lane_into_its_decode_rank(c: FakeCluster) -> None:
    """D rank 0 needs both P ranks' heads: losing P rank 1 ends P rank 0's lane to it too,
    and P rank 0, whose staging then serves nobody, is told."""
    p0, p1 = instance(c, "p", "prefill", 2)
    [d] = instance(c, "d", "decode", 1)
    p0.offer("t", 100, decode="d")
    p1.offer("t", 100, decode="d")
    d.take()
    p1.goodbye()
    assert [type(m) for m in d.take()] == [Abort] and [type(m) for m in p0.take()] == [Abort]
    assert c.broker.transfers == {} and c.pool(d) == (1000, 0, 0)


def test_hetero_one_decode_rank_failing_leaves_the_others_lanes(c: FakeCluster) -> None:
    [p] = instance(c, "p", "prefill", 1)
    d0, d1 = instance(c, "d", "decode", 2)
    p.offer("t", 100, decode="d")
    d0.take(), d1.take()
    d1.abort("t", "load failed")
    assert p.take() == []  # the lane to D rank 0 still needs its staging
    d0.ready("t", source="p:0")
    assert p.take_one(Go).decode == "d:0"
    d0.done("t", 50, source="p:0")
    assert p.take_one(Release) == Release(transfer_id="t")


def test_hetero_a_lane_too_big_for_its_ranks_pool_leaves_p_the_staging_its_other_lane_needs(c: FakeCluster) -> None:
    """The Offer's lane into D rank 0 is aborted as it routes (its pool is too small);
    the lane into rank 1 goes on, so P is not told to drop the staging that lane sends."""
    [p] = instance(c, "p", "prefill", 1)
    d0 = c.decode("d", pool=100, rank=0, world_size=2, kv_heads=4)
    d1 = c.decode("d", pool=1000, rank=1, world_size=2, kv_heads=4)
    p.offer("t", 400, decode="d")
    assert p.take() == [] and d0.take() == []
    assert d1.take_one(Prepare).nbytes == 200
    d1.ready("t", source="p:0")
    assert p.take_one(Go).decode == "d:1"
    d1.done("t", 200, source="p:0")
    assert p.take_one(Release) == Release(transfer_id="t")
    assert c.broker.transfers == {}


def test_hetero_a_decode_instance_registering_while_lanes_wait_routes_only_those_left(c: FakeCluster) -> None:
    """Two unequal Offers of P's ranks wait for a decode instance; the one that comes holds
    room for the smaller lane only. Routing the larger aborts both lanes into that rank,
    and the registration routes nothing more (it once routed the dropped lane and failed)."""
    instance(c, "dA", "decode", 1, claims_only=True)
    instance(c, "dB", "decode", 1, claims_only=True)
    p0, p1 = instance(c, "p", "prefill", 2)
    p0.offer("t", 400)
    p1.offer("t", 100)
    assert {t.state for t in c.broker.transfers.values()} == {S.UNROUTED}
    [dc] = instance(c, "dC", "decode", 1, pool=200)
    assert [type(m) for m in p0.take()] == [Abort] and [type(m) for m in p1.take()] == [Abort]
    assert c.broker.transfers == {} and c.pool(dc) == (200, 0, 0)


def test_hetero_claims_planned_against_a_guessed_prefill_size_move_onto_the_offers_lanes(c: FakeCluster) -> None:
    """Prefill instances of TP 1 and TP 2 are registered and D's claims name neither: they
    are planned as from TP 2. The Offer comes from the TP 1 instance; D rank 1's claim moves
    onto its real lane, with its room, and nothing is left behind to hold room or end later."""
    [p] = instance(c, "p", "prefill", 1)
    instance(c, "q", "prefill", 2)
    d0, d1 = instance(c, "d", "decode", 2, claims_only=True)
    d0.expect("t", 200)
    d1.expect("t", 200)
    assert c.pool(d0) == c.pool(d1) == (1000, 200, 0)
    p.offer("t", 400)
    assert c.pool(d0) == c.pool(d1) == (1000, 200, 0)
    for d in (d0, d1):
        prepare = d.take_one(Prepare)
        d.ready("t", source=prepare.source)
    for go in [m for m in p.take() if isinstance(m, Go)]:
        {"d:0": d0, "d:1": d1}[go.decode].done("t", go.nbytes, source="p:0")
    assert p.take_one(Release) == Release(transfer_id="t")
    assert c.broker.transfers == {} and c.pool(d0) == c.pool(d1) == (1000, 0, 0)
    c.advance(CONFIG.transfer_lease_s + 1)
    assert d0.take() == [] and d1.take() == []


def test_hetero_an_offer_sent_again_for_other_lanes_leaves_p_the_staging_its_live_lane_needs(c: FakeCluster) -> None:
    """P's Offer went to a decode instance of TP 2, and D rank 0 gave its lane up while rank
    1's waits. P's Offer sent again, planned now for an instance of TP 1 (whose one lane
    is the one that ended), is answered with no Abort: the staged copy still serves rank
    1's lane, whose own end tells P."""
    [p] = instance(c, "p", "prefill", 1)
    d0 = c.decode("d", pool=1000, rank=0, world_size=2, kv_heads=4)
    c.decode("e", pool=1000, rank=0, world_size=1, kv_heads=4)
    p.offer("t", 400, decode="d")
    assert d0.take_one(Prepare).nbytes == 200 and c.state("t", lane_id(0, 1)) is S.UNROUTED
    d0.abort("t", "load failed")
    assert p.take() == []
    p.offer("t", 400, decode="e")
    assert p.take() == [] and c.state("t", lane_id(0, 1)) is S.UNROUTED


@pytest.mark.parametrize(("p_tp", "d_tp"), [(2, 4), (4, 1)])
def test_hetero_mla_takes_one_prefill_copy_per_decode_rank(c: FakeCluster, p_tp: int, d_tp: int) -> None:
    ps = instance(c, "p", "prefill", p_tp, heads=1, replicated=True)
    ds = instance(c, "d", "decode", d_tp, heads=1, replicated=True)
    for p in ps:
        p.offer("t", 100, decode="d")
    for r, d in enumerate(ds):
        [prep] = d.take()
        assert isinstance(prep, Prepare) and prep.source == f"p:{r % p_tp}" and prep.nbytes == 100
    unused = [p for p in ps if p.reg.rank >= d_tp]  # replicas nobody needs: released at once
    for p in unused:
        assert p.take_one(Release) == Release(transfer_id="t")


def test_hetero_a_cancel_ends_a_decode_ranks_lanes_together(c: FakeCluster) -> None:
    p0, p1 = instance(c, "p", "prefill", 2)
    [d] = instance(c, "d", "decode", 1, pool=300)
    p0.offer("t", 200, decode="d")
    p1.offer("t", 200, decode="d")  # waits for credit while p0's lane holds it
    d.ready("t", source="p:0")  # p0's lane moves
    c.deliver(b"gw", Cancel(transfer_id="t"))
    assert len(c.broker.transfers) == 2  # one lane moves: the rank's lanes go on together
    assert c.state("t", lane_id(1, 0)) is S.WAITING_CREDIT


# -- credit conservation across rank pairs -------------------------------------------------


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    heads=st.sampled_from([4, 8]),
    p_tp=st.sampled_from([1, 2, 4]),
    d_tp=st.sampled_from([1, 2, 4]),
    pool=st.integers(100, 900),
    transfers=st.integers(1, 4),
    steps=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 99)), max_size=60),
)
def test_hetero_credit_is_conserved_across_rank_pairs(
    heads: int, p_tp: int, d_tp: int, pool: int, transfers: int, steps: list[tuple[int, int]]
) -> None:
    """Random Offers, Readies, Dones, Aborts, lost peers and clock jumps between a P and a
    D instance of any TP sizes: the cluster checks after every message that each D rank's
    pool holds exactly its granted lanes' credit; a Done ends one lane; at the end every
    pool is whole again, and each D rank got each of its heads from exactly one lane."""
    c = FakeCluster()
    ps = instance(c, "p", "prefill", p_tp, heads=heads)
    ds = instance(c, "d", "decode", d_tp, heads=heads, pool=pool)
    got: dict[tuple[str, int], list[tuple[int, int]]] = {}
    tids = [f"t{i}" for i in range(transfers)]
    for tid in tids:
        for p in ps:
            p.offer(tid, 64 * heads // p_tp, decode="d")
    for kind, pick in steps:
        live = sorted(c.broker.transfers)
        if kind == 5:
            c.advance(0.5 + pick / 10)
            continue
        if not live:
            break
        t = c.broker.transfers[live[pick % len(live)]]
        d = ds[t.rank]
        source = f"p:{t.source_rank}"
        if kind <= 2 and t.state is S.PREPARING:
            d.ready(t.transfer_id, source=source)
        elif kind <= 3 and t.state is S.SENDING:
            got.setdefault((t.transfer_id, t.rank), []).append(t.heads)
            d.done(t.transfer_id, t.nbytes, source=source)
        elif kind == 4 and pick % 7 == 0:
            d.abort(t.transfer_id, "gave up")
    # drive what is left to its end
    for _ in range(4 * len(tids) * max(p_tp, d_tp)):
        for key in sorted(c.broker.transfers):
            t = c.broker.transfers.get(key)
            if t is None:
                continue
            source = f"p:{t.source_rank}"
            if t.state is S.PREPARING:
                ds[t.rank].ready(t.transfer_id, source=source)
            elif t.state is S.SENDING:
                got.setdefault((t.transfer_id, t.rank), []).append(t.heads)
                ds[t.rank].done(t.transfer_id, t.nbytes, source=source)
    c.advance(100.0)
    assert c.broker.transfers == {}
    for d in ds:
        assert c.pool(d) == (pool, 0, 0)
    plan = lanes(heads, p_tp, d_tp)
    for (tid, rank), runs in got.items():
        if p_tp == d_tp:
            assert runs == [(0, 0)]
            continue
        want = [(lane.start, lane.stop) for lane in plan if lane.rank == rank]
        assert len(runs) == len(set(runs)) and set(runs) <= set(want)
        if len(runs) == len(want):  # delivered in full: exactly its heads, each once
            assert sorted(h for a, b in runs for h in range(a, b)) == list(range(*rank_heads(heads, d_tp, rank)))


@settings(max_examples=30, deadline=None)
@given(heads=st.sampled_from([4, 8]), p_tp=st.sampled_from([1, 2, 4]), d_tp=st.sampled_from([1, 2, 4]),
       head_bytes=st.integers(1, 40))
def test_hetero_each_decode_ranks_claim_reserves_exactly_what_its_lanes_offers_take(
    heads: int, p_tp: int, d_tp: int, head_bytes: int
) -> None:
    """Each D rank claims the bytes of its own heads (its Expect's `nbytes`, every lane
    into it together); the broker cuts that per lane by heads as it cuts P's Offers, so
    each lane's Offer finds its room held to the byte and is prepared at once."""
    c = FakeCluster()
    ps = instance(c, "p", "prefill", p_tp, heads=heads)
    ds = instance(c, "d", "decode", d_tp, heads=heads, pool=10_000)
    for d in ds:
        d.send(Expect(transfer_id="t", prefill="p", nbytes=head_bytes * heads // d_tp))
        assert c.pool(d) == (10_000, head_bytes * heads // d_tp, 0)
        assert d.take() == []
    claimed = {key: t.reserved for key, t in c.broker.transfers.items()}  # each lane's room, from the claims
    for p in ps:
        p.offer("t", head_bytes * heads // p_tp, decode="d")
    for d in ds:
        preps = [m for m in d.take() if isinstance(m, Prepare)]
        assert sum(m.nbytes for m in preps) == head_bytes * heads // d_tp
        assert c.pool(d) == (10_000, head_bytes * heads // d_tp, 0)
    assert all(t.state is S.PREPARING for t in c.broker.transfers.values())
    assert {key: t.nbytes for key, t in c.broker.transfers.items()} == claimed
