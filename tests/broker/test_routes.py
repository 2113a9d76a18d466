"""The gateway's choice of prefill and decode instance (`gateway.routes`), without sockets."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.metrics import gateway_metrics
from gateway.routes import Router, Upstream
from protocols.messages import PeerInfo, PoolInfo, Status


def up(name: str) -> Upstream:
    return Upstream(instance_id=name, role="prefill" if name.startswith("p") else "decode", host="127.0.0.1", port=1)


def status(*names: str, free: dict[str, int] | None = None, transfers: dict[str, int] | None = None) -> Status:
    """The broker's status with `names` registered (rank 0 each), decode pools' free bytes,
    and each instance's transfers in flight."""
    peers = [PeerInfo(peer_id=f"{n}:0", role=up(n).role, instance_id=n, rank=0, endpoints={}, lease_left_s=1.0,
                      transfers=(transfers or {}).get(n, 0))
             for n in names]
    pools = [PoolInfo(peer_id=f"{n}:0", capacity=100, reserved=100 - f, free=f, waiting=0) for n, f in (free or {}).items()]
    return Status(peers=peers, pools=pools)


def router(*names: str, **kw: float) -> Router:
    return Router([up(n) for n in names], **kw)


@pytest.mark.parametrize(
    "spec, words",
    [
        ("p0", "INSTANCE_ID=http://HOST:PORT"),
        ("=http://h:1", "INSTANCE_ID=http://HOST:PORT"),
        ("p0=https://h:1", "https is not spoken"),
        ("p0=http://h:1/v1", "no path"),
        ("p0=http://h:99999", "port must be a number"),
    ],
)
def test_a_bad_instance_spec_says_what_it_must_look_like(spec: str, words: str) -> None:
    with pytest.raises(ValueError, match=words):
        Upstream.parse("prefill", spec)


def test_an_instance_spec_names_the_instance_and_its_server() -> None:
    assert Upstream.parse("decode", "decode-0=http://10.0.0.2:8200") == Upstream("decode-0", "decode", "10.0.0.2", 8200)
    assert Upstream.parse("decode", "d=http://h").port == 80


def test_a_router_needs_both_roles_and_distinct_names() -> None:
    with pytest.raises(ValueError, match="no decode instance given; name at least one with --decode"):
        router("p0")
    with pytest.raises(ValueError, match="'p0' is given twice"):
        Router([up("p0"), up("p0"), up("d0")])


def test_only_registered_instances_are_picked_while_the_status_is_fresh() -> None:
    r = router("p0", "p1", "d0", "d1", stale_s=5)
    r.observe(status("p1", "d0"), now=0)
    for _ in range(4):
        route = r.route(now=1)
        assert route is not None and (route.prefill.instance_id, route.decode.instance_id) == ("p1", "d0")
    # A stale status filters nothing: every configured instance takes turns again.
    picked = {r.pick("decode", now=6).instance_id for _ in range(2)}  # type: ignore[union-attr]
    assert picked == {"d0", "d1"}


def test_with_no_registered_instance_of_a_role_the_given_ones_take_requests_and_the_reason_names_them() -> None:
    """A broker that has just restarted lists no one yet: requests go to the instances
    given, and once one of a role registers again, it takes that role's requests."""
    r = router("p0", "d0", "d1")
    assert r.degraded(now=0) == "no status from the broker yet; requests go to every instance given."
    r.observe(status("p0"), now=0)
    route = r.route(now=0)
    assert route is not None and route.prefill.instance_id == "p0" and route.decode.instance_id in ("d0", "d1")
    assert r.degraded(now=0) == (
        "no decode instance is registered at the broker (given: d0, d1); requests go to those given until one "
        "registers: start one whose kv_connector_extra_config names this broker and one of these instance_ids."
    )
    r.observe(status(), now=1)
    assert r.route(now=1) is not None and "no prefill instance" in (r.degraded(now=1) or "")
    r.observe(status("p0", "d1"), now=2)
    assert r.degraded(now=2) is None
    assert r.degraded(now=9) == "the broker has not answered for 7 s; requests go to every instance given until it does."
    assert {r.pick("decode", now=2).instance_id for _ in range(3)} == {"d1"}  # type: ignore[union-attr]
    # Excluded (it failed this request), the registered one leaves the unregistered one.
    assert r.pick("decode", now=2, exclude=["d1"]).instance_id == "d0"  # type: ignore[union-attr]
    assert r.route(now=2, exclude=["p0"]) is None  # no prefill instance left at all


def test_a_registered_instance_that_failed_lately_still_comes_before_an_unregistered_one() -> None:
    r = router("p0", "d0", "d1", "d2", down_s=5)
    r.observe(status("p0", "d0", "d1"), now=0)
    r.finished(up("d0"), now=0, failed=True)
    assert r.pick("decode", now=1).instance_id == "d1"  # type: ignore[union-attr]
    assert r.pick("decode", now=1, exclude=["d1"]).instance_id == "d0"  # type: ignore[union-attr]
    assert r.usable("decode", now=1) == {"d1"} and r.usable("decode", now=5) == {"d0", "d1"}


def test_each_route_takes_its_transfer_id_from_the_one_function_that_makes_them() -> None:
    ids = iter(["t-1", "t-2"])
    r = Router([up("p0"), up("d0")], new_transfer_id=lambda: next(ids))
    assert [r.route(now=0).transfer_id for _ in range(2)] == ["t-1", "t-2"]  # type: ignore[union-attr]
    assert router("p0", "d0").route(now=0).transfer_id.startswith("gw-")  # type: ignore[union-attr]


def test_a_decode_instance_with_a_full_pool_is_passed_over_for_one_with_room() -> None:
    r = router("p0", "d0", "d1")
    r.observe(status("p0", "d0", "d1", free={"d0": 0, "d1": 10}), now=0)
    assert [r.pick("decode", now=0).instance_id for _ in range(3)] == ["d1"] * 3  # type: ignore[union-attr]
    # With equal load, the one with more room wins.
    r.observe(status("p0", "d0", "d1", free={"d0": 50, "d1": 10}), now=1)
    assert r.pick("decode", now=1).instance_id == "d0"  # type: ignore[union-attr]


def test_the_instance_with_fewest_requests_in_flight_wins_and_equals_take_turns() -> None:
    r = router("p0", "d0", "d1", "d2")
    assert [r.pick("decode", now=0).instance_id for _ in range(6)] == ["d0", "d1", "d2"] * 2  # type: ignore[union-attr]
    r.started(up("d0"))
    r.started(up("d1"))
    assert r.pick("decode", now=0).instance_id == "d2"  # type: ignore[union-attr]
    r.finished(up("d0"), now=0)
    assert r.in_flight(up("d0")) == 0
    r.finished(up("d0"), now=0)  # never below zero
    assert r.in_flight(up("d0")) == 0


def test_transfers_another_gateway_sent_count_against_an_instance_while_the_status_is_fresh() -> None:
    """Two gateways in front of the same servers: this one has nothing in flight, but the
    broker holds 3 transfers for d0 (the other gateway's requests): d1 gets the next
    ones until its own requests here outnumber them; a stale status no longer counts."""
    r = router("p0", "d0", "d1", stale_s=5)
    r.observe(status("p0", "d0", "d1", transfers={"d0": 3}), now=0)
    picks = []
    for _ in range(4):
        d = r.pick("decode", now=1)
        assert d is not None
        picks.append(d.instance_id)
        r.started(d)
    assert picks == ["d1", "d1", "d1", "d0"]  # d1 at 0, 1, 2 own requests, then 3 against d0's 3: d0's turn
    assert r.pick("decode", now=1).instance_id == "d1"  # type: ignore[union-attr]  # 3 each, d1 picked longer ago
    fresh = router("p0", "d0", "d1", stale_s=5)
    fresh.observe(status("p0", "d0", "d1", transfers={"d0": 3}), now=0)
    assert fresh.pick("decode", now=10).instance_id == "d0"  # type: ignore[union-attr]  # stale: turns only


def test_the_metrics_show_the_brokers_transfers_the_router_ranks_by_only_while_its_status_is_fresh() -> None:
    r = router("p0", "d0", "d1", stale_s=5)
    r.observe(status("p0", "d0", "d1", transfers={"d0": 3, "p0": 1}), now=0)
    text = gateway_metrics(Counter(), Counter(), r, now=1)[0].decode()
    for sample in ('kvbroker_gateway_broker_transfers{instance="d0",role="decode"} 3.0',
                   'kvbroker_gateway_broker_transfers{instance="d1",role="decode"} 0.0',
                   'kvbroker_gateway_broker_transfers{instance="p0",role="prefill"} 1.0'):
        assert sample in text, text
    assert "kvbroker_gateway_broker_transfers{" not in gateway_metrics(Counter(), Counter(), r, now=10)[0].decode()


def test_an_instance_that_failed_is_passed_over_for_a_while_unless_it_is_the_only_one() -> None:
    r = router("p0", "d0", "d1", down_s=5)
    r.started(up("d0"))
    r.finished(up("d0"), now=10, failed=True)
    assert {r.pick("decode", now=11).instance_id for _ in range(3)} == {"d1"}  # type: ignore[union-attr]
    assert r.pick("decode", now=11, exclude=["d1"]).instance_id == "d0"  # type: ignore[union-attr]
    assert "d0" in {r.pick("decode", now=15.1).instance_id for _ in range(2)}  # type: ignore[union-attr]
    assert r.pick("decode", now=0, exclude=["d0", "d1"]) is None


NAMES = ["p0", "p1", "p2", "d0", "d1", "d2"]
step = st.one_of(
    st.tuples(st.just("observe"), st.sets(st.sampled_from(NAMES)), st.dictionaries(st.sampled_from(NAMES[3:]), st.integers(0, 3))),
    st.tuples(st.just("start"), st.sampled_from(NAMES)),
    st.tuples(st.just("finish"), st.sampled_from(NAMES), st.booleans()),
    st.tuples(st.just("route"), st.sets(st.sampled_from(NAMES))),
    st.tuples(st.just("wait"), st.floats(0, 10)),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(step, max_size=40))
def test_a_route_is_always_an_allowed_pair(steps: list[tuple]) -> None:
    """Whatever the broker said and whatever failed: a route names one prefill and one
    decode instance, neither excluded; a registered one (while the status is fresh)
    whenever its role has one left; among those, never one that failed lately while
    another could take it; and no route only when `exclude` leaves a role no instance."""
    r = router(*NAMES, stale_s=5, down_s=3)
    now, failed_at, registered, seen_at = 0.0, {}, set(NAMES), None
    for s in steps:
        if s[0] == "observe":
            r.observe(status(*s[1], free=s[2]), now)
            registered, seen_at = set(s[1]), now
        elif s[0] == "start":
            r.started(up(s[1]))
        elif s[0] == "finish":
            r.finished(up(s[1]), now, failed=s[2])
            if s[2]:
                failed_at[s[1]] = now
        elif s[0] == "wait":
            now += s[1]
        else:
            route = r.route(now, exclude=s[1])
            left = {n for n in NAMES if n not in s[1]}
            if route is None:
                assert not any(n.startswith("p") for n in left) or not any(n.startswith("d") for n in left)
                continue
            assert route.prefill.role == "prefill" and route.decode.role == "decode"
            fresh = seen_at is not None and now - seen_at <= 5
            for chosen in (route.prefill, route.decode):
                mine = {n for n in left if n[0] == chosen.instance_id[0]}
                assert chosen.instance_id in mine
                tier = {n for n in mine if not fresh or n in registered} or mine
                assert chosen.instance_id in tier
                healthy = {n for n in tier if now >= failed_at.get(n, -1e9) + 3}
                if healthy:
                    assert chosen.instance_id in healthy
    assert all(r.in_flight(up(n)) >= 0 for n in NAMES)
