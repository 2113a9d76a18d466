"""The scheduler half with fake vLLM objects: what it claims, records and hands to the worker.

The fakes carry only the attributes the scheduler half reads; the call sequences follow
vLLM 0.32's scheduler (tests/e2e checks the real thing).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from connector.config import ConnectorConfig
from connector.scheduler import (
    MAX_TRANSFER_ID,
    ConnectorScheduler,
    KvBrokerMetadata,
    LoadSpec,
    SaveSpec,
    refusal_key,
    tokens_digest,
)
from protocols import grants

BS = 32


@dataclass
class FakeRequest:
    request_id: str
    num_prompt_tokens: int
    kv_transfer_params: dict[str, Any] | None = None
    prompt_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        if self.prompt_token_ids is None:
            self.prompt_token_ids = [7] * self.num_prompt_tokens


@dataclass
class FakeBlocks:
    ids: list[int]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (list(self.ids),)


@dataclass
class NewReq:
    req_id: str
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int


@dataclass
class CachedReqs:
    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[tuple[list[int], ...] | None] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    resumed_req_ids: set[str] = field(default_factory=set)


@dataclass
class FakeSchedulerOutput:
    scheduled_new_reqs: list[NewReq] = field(default_factory=list)
    scheduled_cached_reqs: CachedReqs = field(default_factory=CachedReqs)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    finished_req_ids: set[str] = field(default_factory=set)

    @property
    def total_num_scheduled_tokens(self) -> int:  # as vLLM's SchedulerOutput has it
        return sum(self.num_scheduled_tokens.values())


def scheduler(role: str, instance: str = "inst", key: bytes | None = None, now: float = 1e9) -> ConnectorScheduler:
    config = ConnectorConfig(broker="tcp://127.0.0.1:7100", role=role, instance_id=instance, grant_key=key)  # type: ignore[arg-type]
    return ConnectorScheduler(config, BS, tp_size=2, wall=lambda: now)


def req(rid: str, n: int, tid: str | None = "t-1", **params: Any) -> FakeRequest:
    return FakeRequest(rid, n, None if tid is None else {"transfer_id": tid, **params})


# -- consumer -------------------------------------------------------------------------------


def test_a_step_that_schedules_no_tokens_is_marked_idle_for_the_worker() -> None:
    s = scheduler("consumer")
    r = req("r1", 100)
    s.get_num_new_matched_tokens(r, 0)
    s.update_state_after_alloc(r, FakeBlocks([7, 8, 9, 10]), 100)
    # The step that hands the load over runs no model: its request waits for the KV.
    meta = s.build_connector_meta(FakeSchedulerOutput())
    assert meta.idle and set(meta.loads) == {"t-1"}
    busy = s.build_connector_meta(FakeSchedulerOutput(num_scheduled_tokens={"r2": 1}))
    assert not busy.idle


def test_consumer_claims_prompt_past_local_hit_async() -> None:
    s = scheduler("consumer")
    r = req("r1", 100)
    assert s.get_num_new_matched_tokens(r, 0) == (100, True)
    assert s.get_num_new_matched_tokens(r, 64) == (36, True)  # asked again after a failed allocation
    s.update_state_after_alloc(r, FakeBlocks([7, 8, 9, 10]), 36)
    meta = s.build_connector_meta(FakeSchedulerOutput())
    assert meta.loads == {
        "t-1": LoadSpec(req_id="r1", block_ids=[7, 8, 9, 10], num_cached_blocks=2, num_tokens=100, tokens=tokens_digest(r))
    }
    assert meta.saves == {}
    # Drained: the next step carries nothing.
    assert s.build_connector_meta(FakeSchedulerOutput()).loads == {}


def test_consumer_load_names_the_prefill_instance_when_the_proxy_did() -> None:
    s = scheduler("consumer")
    for rid, params, want in (
        ("r1", {"prefill_instance_id": "prefill-0"}, "prefill-0"),
        ("r2", {}, ""),
        ("r3", {"prefill_instance_id": 7}, ""),  # unusable: ignored, the request still loads
    ):
        r = req(rid, 40, tid=f"t-{rid}", **params)
        assert s.get_num_new_matched_tokens(r, 0) == (40, True)
        s.update_state_after_alloc(r, FakeBlocks([1, 2]), 40)
        assert s.build_connector_meta(FakeSchedulerOutput()).loads[f"t-{rid}"].prefill == want


def test_consumer_claims_once_then_computes_locally() -> None:
    s = scheduler("consumer")
    r = req("r1", 70)
    assert s.get_num_new_matched_tokens(r, 0) == (70, True)
    s.update_state_after_alloc(r, FakeBlocks([1, 2, 3]), 70)
    s.build_connector_meta(FakeSchedulerOutput())
    # After the load, vLLM calls update_state_after_alloc again with no external tokens.
    s.update_state_after_alloc(r, FakeBlocks([1, 2, 3]), 0)
    assert s.build_connector_meta(FakeSchedulerOutput()).loads == {}
    # A failed load with policy "recompute" (or a preemption) asks again: compute locally.
    assert s.get_num_new_matched_tokens(r, 0) == (0, False)
    assert s.request_finished(r, [1, 2, 3]) == (False, None)
    # Once finished, the state is gone (a new request may reuse the id).
    assert s.get_num_new_matched_tokens(r, 0) == (70, True)


def test_consumer_blocks_cover_whole_prompt_only() -> None:
    s = scheduler("consumer")
    r = req("r1", 33)  # two blocks, the second holds one token
    assert s.get_num_new_matched_tokens(r, 0) == (33, True)
    s.update_state_after_alloc(r, FakeBlocks([4, 5, 6]), 33)  # a lookahead block is not ours to write
    assert s.build_connector_meta(FakeSchedulerOutput()).loads["t-1"].block_ids == [4, 5]


def test_plain_and_malformed_requests_run_as_plain() -> None:
    s = scheduler("consumer")
    for r in (
        req("a", 50, tid=None),
        FakeRequest("b", 50, {"other": 1}),
        req("c", 50, tid=""),
        req("d", 50, tid="x" * 129),
        FakeRequest("e", 50, {"transfer_id": 5}),
    ):
        assert s.get_num_new_matched_tokens(r, 0) == (0, False)
        s.update_state_after_alloc(r, FakeBlocks([1, 2]), 0)
    meta = s.build_connector_meta(FakeSchedulerOutput())
    assert meta.loads == {} and meta.saves == {}


def test_consumer_never_claims_on_a_producer() -> None:
    s = scheduler("producer")
    assert s.get_num_new_matched_tokens(req("r1", 100), 0) == (0, False)


def test_unallocated_claim_records_nothing() -> None:
    s = scheduler("consumer")
    r = req("r1", 64)
    s.get_num_new_matched_tokens(r, 0)
    s.request_finished(r, [])  # aborted while still waiting for blocks
    s.update_state_after_alloc(r, FakeBlocks([1, 2]), 64)
    assert s.build_connector_meta(FakeSchedulerOutput()).loads == {}


# -- producer -------------------------------------------------------------------------------


def test_producer_saves_full_blocks_when_prompt_completes() -> None:
    s = scheduler("producer")
    r = req("r1", 70, decode_instance_id="d-7")
    s.update_state_after_alloc(r, FakeBlocks([3, 4, 5]), 0)
    out = FakeSchedulerOutput(scheduled_new_reqs=[NewReq("r1", ([3, 4, 5],), 32)], num_scheduled_tokens={"r1": 38})
    meta = s.build_connector_meta(out)
    digest = tokens_digest(r)
    assert len(digest) == 24 and digest != tokens_digest(FakeRequest("x", 70, prompt_token_ids=[8] * 70))
    assert meta.saves == {"t-1": SaveSpec(req_id="r1", block_ids=[3, 4, 5], num_tokens=70, decode="d-7", tokens=digest)}
    assert meta.loads == {}
    # Blocks are freed at once: the KV is staged during the step.
    assert s.request_finished(r, [3, 4, 5]) == (False, {"transfer_id": "t-1", "prefill_instance_id": "inst"})


def test_producer_waits_for_last_chunk_of_chunked_prefill() -> None:
    s = scheduler("producer")
    r = req("r1", 100)
    s.update_state_after_alloc(r, FakeBlocks([1, 2]), 0)
    first = FakeSchedulerOutput(scheduled_new_reqs=[NewReq("r1", ([1, 2],), 0)], num_scheduled_tokens={"r1": 64})
    assert s.build_connector_meta(first).saves == {}
    second = FakeSchedulerOutput(
        scheduled_cached_reqs=CachedReqs(req_ids=["r1"], new_block_ids=[([9, 10],)], num_computed_tokens=[64]),
        num_scheduled_tokens={"r1": 36},
    )
    assert s.build_connector_meta(second).saves["t-1"].block_ids == [1, 2, 9, 10]
    # Staged once: later decode steps of the same request add nothing.
    third = FakeSchedulerOutput(
        scheduled_cached_reqs=CachedReqs(req_ids=["r1"], new_block_ids=[None], num_computed_tokens=[100]),
        num_scheduled_tokens={"r1": 1},
    )
    assert s.build_connector_meta(third).saves == {}


def test_producer_duplicate_transfer_id_in_one_step() -> None:
    """Same prompt: staged once. Different prompts: neither (D must not get the wrong KV)."""
    for other_prompt, staged in (([7] * 40, ["a"]), ([9] * 40, [])):
        s = scheduler("producer")
        a, b = req("a", 40), FakeRequest("b", 40, {"transfer_id": "t-1"}, prompt_token_ids=other_prompt)
        for r, blocks in ((a, [1, 2]), (b, [3, 4])):
            s.update_state_after_alloc(r, FakeBlocks(blocks), 0)
        out = FakeSchedulerOutput(
            scheduled_new_reqs=[NewReq("a", ([1, 2],), 0), NewReq("b", ([3, 4],), 0)],
            num_scheduled_tokens={"a": 40, "b": 40},
        )
        meta = s.build_connector_meta(out)
        assert [spec.req_id for spec in meta.saves.values()] == staged
        # Neither staged: the transfer the router named is cancelled for its decode side.
        assert list(meta.cancels) == ([] if staged else ["t-1"])


def test_producer_ignores_plain_requests_and_unfinished_ones_report_nothing() -> None:
    s = scheduler("producer")
    plain = req("p", 40, tid=None)
    s.update_state_after_alloc(plain, FakeBlocks([1, 2]), 0)
    out = FakeSchedulerOutput(scheduled_new_reqs=[NewReq("p", ([1, 2],), 0)], num_scheduled_tokens={"p": 40})
    assert s.build_connector_meta(out).saves == {}
    assert s.request_finished(plain, [1, 2]) == (False, None)
    # A request aborted before its prompt was computed still returns its transfer id, and
    # the next step's worker cancels it: a decode instance given the same id waits for it.
    r = req("r", 40)
    s.update_state_after_alloc(r, FakeBlocks([5, 6]), 0)
    assert s.request_finished(r, [5, 6]) == (False, {"transfer_id": "t-1", "prefill_instance_id": "inst"})
    cancels = s.build_connector_meta(FakeSchedulerOutput()).cancels
    assert list(cancels) == ["t-1"] and "finished before its prompt was computed" in cancels["t-1"]
    assert s.build_connector_meta(FakeSchedulerOutput()).cancels == {}


# -- router protocols -------------------------------------------------------------------------

# What vLLM's toy proxy, llm-d's sidecar (nixlv2), vllm-router and Dynamo send P.
NIXL_P = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def prefill_once(s: ConnectorScheduler, r: FakeRequest, blocks: list[int]) -> KvBrokerMetadata:
    """P allocates and computes the whole prompt in one step."""
    s.update_state_after_alloc(r, FakeBlocks(blocks), 0)
    out = FakeSchedulerOutput(scheduled_new_reqs=[NewReq(r.request_id, (blocks,), 0)],
                              num_scheduled_tokens={r.request_id: r.num_prompt_tokens})
    return s.build_connector_meta(out)


def decode_claim(s: ConnectorScheduler, r: FakeRequest, blocks: list[int]) -> KvBrokerMetadata:
    """D claims the whole prompt and gets its blocks."""
    assert s.get_num_new_matched_tokens(r, 0) == (r.num_prompt_tokens, True)
    s.update_state_after_alloc(r, FakeBlocks(blocks), r.num_prompt_tokens)
    return s.build_connector_meta(FakeSchedulerOutput())


def test_sequential_protocol_p_names_the_transfer_and_d_loads_what_the_router_forwards() -> None:
    p, d = scheduler("producer", "prefill-0"), scheduler("consumer", "decode-0")
    r = FakeRequest("cmpl-1-0", 70, dict(NIXL_P))
    meta = prefill_once(p, r, [3, 4, 5])
    ((tid, save),) = meta.saves.items()
    assert tid.startswith("kv-") and len(tid) == 35
    assert save == SaveSpec(req_id="cmpl-1-0", block_ids=[3, 4, 5], num_tokens=70, tokens=tokens_digest(r))
    freed, params = p.request_finished(r, [3, 4, 5])
    assert freed is False
    assert params == {
        "do_remote_prefill": True, "do_remote_decode": False, "transfer_id": tid,
        "prefill_instance_id": "prefill-0", "remote_engine_id": "prefill-0", "remote_request_id": "cmpl-1-0",
        "remote_block_ids": [], "remote_host": "", "remote_port": 0, "tp_size": 2,
    }
    # The router forwards them unchanged (through JSON) with the full request.
    rd = FakeRequest("cmpl-2-0", 70, json.loads(json.dumps(params)))
    assert decode_claim(d, rd, [9, 10, 11]).loads == {
        tid: LoadSpec(req_id="cmpl-2-0", block_ids=[9, 10, 11], num_cached_blocks=0, num_tokens=70,
                      tokens=tokens_digest(rd), prefill="prefill-0")
    }


def test_each_sequential_request_gets_its_own_transfer_id_kept_across_a_preemption() -> None:
    p = scheduler("producer")
    rs = [FakeRequest(f"r{i}", 40, dict(NIXL_P)) for i in range(20)]
    for r in rs:
        p.update_state_after_alloc(r, FakeBlocks([1, 2]), 0)
        p.update_state_after_alloc(r, FakeBlocks([1, 2]), 0)  # allocated again after a preemption
    tids = [p.request_finished(r, [1, 2])[1]["transfer_id"] for r in rs]  # type: ignore[index]
    assert len(set(tids)) == 20


def test_a_sequential_request_that_ended_before_its_prompt_ran_tells_d_to_compute() -> None:
    p, d = scheduler("producer"), scheduler("consumer")
    r = FakeRequest("r1", 40, dict(NIXL_P))
    p.update_state_after_alloc(r, FakeBlocks([1, 2]), 0)
    _, params = p.request_finished(r, [1, 2])  # aborted before its step
    assert params is not None and params["do_remote_prefill"] is False
    assert p.build_connector_meta(FakeSchedulerOutput()).cancels == {}  # P named it: no D holds a claim
    assert d.get_num_new_matched_tokens(FakeRequest("r2", 40, params), 0) == (0, False)


def test_concurrent_protocol_p_and_d_get_one_transfer_id_at_once() -> None:
    p, d = scheduler("producer", "prefill-0"), scheduler("consumer", "decode-0")
    rp = FakeRequest("p1", 70, {"do_remote_decode": True, "transfer_id": "mc-1"})
    rd = FakeRequest("d1", 70, {"do_remote_prefill": True, "transfer_id": "mc-1", "remote_engine_id": "prefill-0",
                                "remote_bootstrap_addr": "10.0.0.1:8998"})
    assert list(decode_claim(d, rd, [1, 2, 3]).loads) == ["mc-1"]
    assert list(prefill_once(p, rp, [4, 5, 6]).saves) == ["mc-1"]
    assert p.request_finished(rp, [4, 5, 6])[1]["transfer_id"] == "mc-1"  # type: ignore[index]
    assert d.request_finished(rd, [1, 2, 3]) == (False, None)


def test_do_remote_prefill_without_a_usable_transfer_id_is_a_load_failure_at_once() -> None:
    d = scheduler("consumer")
    for i, params in enumerate((
        {"do_remote_prefill": True, "remote_engine_id": "prefill-0"},  # a router that dropped the id
        {"do_remote_prefill": True, "transfer_id": ""},
        {"do_remote_prefill": True, "transfer_id": "x" * (MAX_TRANSFER_ID + 1)},
        {"do_remote_prefill": True, "transfer_id": ["t-1"]},
    )):
        r = FakeRequest(f"r{i}", 40, params)
        loads = decode_claim(d, r, [1, 2]).loads
        spec = loads[refusal_key(f"r{i}")]
        assert spec.refused.startswith("do_remote_prefill came without a usable transfer_id") and spec.block_ids == [1, 2]
        assert len(refusal_key(f"r{i}").encode()) > MAX_TRANSFER_ID  # never mistaken for a transfer id
        # vLLM then recomputes (policy "recompute") and asks again: computed locally.
        assert d.get_num_new_matched_tokens(r, 0) == (0, False)


def test_do_remote_prefill_false_or_garbage_is_a_plain_request() -> None:
    d = scheduler("consumer")
    for params in ({"do_remote_prefill": False, "transfer_id": "t"}, {"do_remote_prefill": "yes", "transfer_id": "t"},
                   {"do_remote_decode": True}, {"do_remote_prefill": None}):
        assert d.get_num_new_matched_tokens(FakeRequest("r", 40, params), 0) == (0, False)


def test_two_requests_loading_one_transfer_in_one_step_the_second_fails() -> None:
    d = scheduler("consumer")
    a, b = req("a", 40), req("b", 40)
    for r in (a, b):
        d.get_num_new_matched_tokens(r, 0)
    d.update_state_after_alloc(a, FakeBlocks([1, 2]), 40)
    d.update_state_after_alloc(b, FakeBlocks([3, 4]), 40)
    loads = d.build_connector_meta(FakeSchedulerOutput()).loads
    assert loads["t-1"].req_id == "a"
    assert loads[refusal_key("b")].refused == "transfer_id 't-1' is refused: another request on this instance is loading it"


# -- signed grants ---------------------------------------------------------------------------

KEY = b"grant-key-0123456789"


def granted_params(now: float = 1e9, key: bytes = KEY) -> tuple[str, dict[str, Any], FakeRequest]:
    p = scheduler("producer", "prefill-0", key=key, now=now)
    r = FakeRequest("p1", 70, dict(NIXL_P))
    (tid,) = prefill_once(p, r, [1, 2, 3]).saves
    params = p.request_finished(r, [1, 2, 3])[1]
    assert params is not None
    return tid, params, r


def test_a_granted_transfer_loads_and_every_bad_grant_is_a_load_failure() -> None:
    tid, params, rp = granted_params()
    ttl = ConnectorConfig(broker="", role="producer", instance_id="").staging_ttl_s
    assert params["grant"].startswith(f"v1.{int(1e9 + ttl)}.{tokens_digest(rp)}.")

    def outcome(p: dict[str, Any], now: float = 1e9 + 5, key: bytes | None = KEY, prompt: list[int] | None = None) -> str:
        d = scheduler("consumer", "decode-0", key=key, now=now)
        r = FakeRequest("d1", 70, p, prompt_token_ids=prompt)
        loads = decode_claim(d, r, [7, 8, 9]).loads
        return "loaded" if tid in loads else loads[refusal_key("d1")].refused

    assert outcome(params) == "loaded"
    version, until, digest, mac = params["grant"].split(".")
    bad = {
        "tampered": {**params, "grant": f"{version}.{int(until) + 999}.{digest}.{mac}"},
        "another id": {**params, "transfer_id": "kv-guessed"},
        "another prefill": {**params, "remote_engine_id": "prefill-9"},
        "missing": {k: v for k, v in params.items() if k != "grant"},
    }
    reasons = {name: outcome(p) for name, p in bad.items()}
    reasons["expired"] = outcome(params, now=1e9 + ttl + 2)
    reasons["wrong key"] = outcome(params, key=b"another-key-0123456789")
    reasons["another prompt"] = outcome(params, prompt=[8] * 70)
    assert all(r != "loaded" for r in reasons.values()), reasons
    assert reasons["missing"].endswith("the request carries no grant, and this instance loads only granted transfers")
    assert reasons["expired"].endswith("its grant expired 2 s ago")
    assert reasons["another prompt"].endswith("its grant was made for another prompt")
    assert reasons["wrong key"].startswith(f"transfer_id {tid!r} is refused: its grant does not verify")
    # Without a key of its own, D ignores grants (and a producer without one makes none).
    assert outcome(bad["missing"], key=None) == "loaded"


def test_native_requests_are_granted_too() -> None:
    p = scheduler("producer", "prefill-0", key=KEY)
    r = req("p1", 40, decode_instance_id="decode-0")
    prefill_once(p, r, [1, 2])
    params = p.request_finished(r, [1, 2])[1]
    assert params is not None and set(params) == {"transfer_id", "prefill_instance_id", "grant"}
    assert grants.verify(KEY, params["grant"], transfer_id="t-1", prefill="prefill-0", prompt=tokens_digest(r),
                         now=1e9) is None


# -- whatever a client sends ----------------------------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
KNOWN = ("transfer_id", "do_remote_decode", "do_remote_prefill", "remote_engine_id", "prefill_instance_id",
         "decode_instance_id", "remote_block_ids", "remote_host", "remote_port", "grant", "tp_size")
VALUES = st.one_of(
    JSON, st.sampled_from(["t-1", "", "x" * 100_000, "prefill-0"]), st.just(True), st.just(list(range(100_000))),
    st.integers(min_value=-(2**70), max_value=2**70),
)
PARAMS = st.one_of(
    st.none(), JSON, st.dictionaries(st.one_of(st.sampled_from(KNOWN), st.text(max_size=12)), VALUES, max_size=8),
)


@settings(max_examples=300, deadline=None)
@given(params=PARAMS, key=st.sampled_from([None, KEY]), n=st.integers(1, 200), hit=st.integers(0, 200))
def test_any_kv_transfer_params_run_plain_or_load_or_fail_at_once_and_never_raise(
    params: Any, key: bytes | None, n: int, hit: int
) -> None:
    """Every hook with whatever params a client can put in a request: no exception, a
    claim is always followed by exactly one load or refusal (so the request cannot wait
    forever), and P returns only values it made itself, small and JSON-safe."""
    hit = min(hit, n) // BS * BS
    p, d = scheduler("producer", "prefill-0", key=key), scheduler("consumer", "decode-0", key=key)
    r = FakeRequest("r", n, params)
    blocks = list(range(-(-n // BS) + 1))
    num, load_async = d.get_num_new_matched_tokens(r, hit)
    assert (num, load_async) in ((0, False), (n - hit, True))
    d.update_state_after_alloc(r, FakeBlocks(blocks), num or 0)
    loads = d.build_connector_meta(FakeSchedulerOutput()).loads
    assert len(loads) == (1 if num else 0)
    for k, spec in loads.items():
        assert spec.req_id == "r" and (spec.refused != "") == (k == refusal_key("r"))
        assert len(k.encode()) <= MAX_TRANSFER_ID or spec.refused
        assert len(spec.prefill) <= MAX_TRANSFER_ID and len(spec.refused) < 1024
    assert d.request_finished(r, blocks) == (False, None)

    p.update_state_after_alloc(r, FakeBlocks(blocks), 0)
    saves = p.build_connector_meta(FakeSchedulerOutput(scheduled_new_reqs=[NewReq("r", (blocks,), 0)],
                                                      num_scheduled_tokens={"r": n})).saves
    _, answer = p.request_finished(r, blocks)
    assert (answer is None) == (not saves)
    if answer is not None:
        assert len(json.dumps(answer)) < 1024
        assert answer["transfer_id"] in saves and answer["prefill_instance_id"] == "prefill-0"
        assert set(answer) <= {*KNOWN, "remote_request_id"}
