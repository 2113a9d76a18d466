"""The scheduler half with fake vLLM objects: what it claims, records and hands to the worker.

The fakes carry only the attributes the scheduler half reads; the call sequences follow
vLLM 0.32's scheduler (tests/e2e checks the real thing).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from connector.config import ConnectorConfig
from connector.scheduler import (
    ConnectorScheduler,
    LoadSpec,
    SaveSpec,
    tokens_digest,
)

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


def scheduler(role: str) -> ConnectorScheduler:
    return ConnectorScheduler(ConnectorConfig(broker="tcp://127.0.0.1:7100", role=role, instance_id="inst"), BS)  # type: ignore[arg-type]


def req(rid: str, n: int, tid: str | None = "t-1", **params: Any) -> FakeRequest:
    return FakeRequest(rid, n, None if tid is None else {"transfer_id": tid, **params})


# -- consumer -------------------------------------------------------------------------------


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
        assert [spec.req_id for spec in s.build_connector_meta(out).saves.values()] == staged


def test_producer_ignores_plain_requests_and_unfinished_ones_report_nothing() -> None:
    s = scheduler("producer")
    plain = req("p", 40, tid=None)
    s.update_state_after_alloc(plain, FakeBlocks([1, 2]), 0)
    out = FakeSchedulerOutput(scheduled_new_reqs=[NewReq("p", ([1, 2],), 0)], num_scheduled_tokens={"p": 40})
    assert s.build_connector_meta(out).saves == {}
    assert s.request_finished(plain, [1, 2]) == (False, None)
    # A request aborted before its prompt was computed still returns its transfer id.
    r = req("r", 40)
    s.update_state_after_alloc(r, FakeBlocks([5, 6]), 0)
    assert s.request_finished(r, [5, 6]) == (False, {"transfer_id": "t-1", "prefill_instance_id": "inst"})
