"""The scheduler half with a hybrid model's KV cache groups: each group's block ids are
followed on their own, through chunked prefills, and handed to the worker per group."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from connector.scheduler import LoadSpec, tokens_digest
from tests.connector.test_scheduler import BS, CachedReqs, FakeSchedulerOutput, NewReq, req, scheduler


@dataclass
class GroupBlocks:
    groups: tuple[list[int], ...]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return tuple(list(ids) for ids in self.groups)


def test_hybrid_consumer_loads_into_every_groups_blocks_null_blocks_included() -> None:
    s = scheduler("consumer")
    r = req("r1", 150)  # 5 blocks; a 64-token window retires the first 2 of its group
    assert s.get_num_new_matched_tokens(r, 0) == (150, True)
    s.update_state_after_alloc(r, GroupBlocks(([0, 0, 21, 23, 25, 27], [20, 22, 24, 26, 28, 30])), 150)
    load = s.build_connector_meta(FakeSchedulerOutput()).loads["t-1"]
    assert load == LoadSpec(req_id="r1", block_ids=[0, 0, 21, 23, 25], groups=[[0, 0, 21, 23, 25], [20, 22, 24, 26, 28]],
                            num_cached_blocks=0, num_tokens=150, tokens=tokens_digest(r))


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 300), st.integers(1, 3), st.data())
def test_hybrid_producer_follows_each_groups_blocks_through_a_chunked_prefill(n: int, groups: int, data) -> None:
    """Chunks of any size; each step adds each group's new blocks (as vLLM's
    scheduler_output does); the save names every group's first blocks_for(n) ids."""
    s = scheduler("producer")
    r = req("r1", n)
    s.update_state_after_alloc(r, GroupBlocks(tuple([] for _ in range(groups))), 0)
    held = [[] for _ in range(groups)]
    next_id = iter(range(1, 10_000))
    computed, step = 0, 0
    saves = {}
    while computed < n:
        chunk = data.draw(st.integers(1, n - computed))
        need = -(-(computed + chunk) // BS)
        new = tuple([next(next_id) for _ in range(need - len(held[g]))] for g in range(groups))
        for g in range(groups):
            held[g] += new[g]
        if step == 0:
            out = FakeSchedulerOutput(scheduled_new_reqs=[NewReq("r1", new, computed)], num_scheduled_tokens={"r1": chunk})
        else:
            out = FakeSchedulerOutput(
                scheduled_cached_reqs=CachedReqs(req_ids=["r1"], new_block_ids=[new], num_computed_tokens=[computed]),
                num_scheduled_tokens={"r1": chunk},
            )
        saves = s.build_connector_meta(out).saves
        computed, step = computed + chunk, step + 1
        assert bool(saves) == (computed >= n)  # staged in the step that completes the prompt, once
    save = saves["t-1"]
    blocks = -(-n // BS)
    assert save.block_ids == held[0][:blocks]
    assert save.groups == ([ids[:blocks] for ids in held] if groups > 1 else [])


def test_hybrid_connector_declares_that_it_supports_vllms_hybrid_manager() -> None:
    base = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base")
    from connector.connector import KVBrokerConnector

    assert base.supports_hma(KVBrokerConnector)
    s = scheduler("producer")
    r = req("r9", 40)
    s.update_state_after_alloc(r, GroupBlocks(([1, 2], [3, 4])), 0)
    assert s.request_finished(r, ([1, 2], [3, 4])) == (False, {"transfer_id": "t-1", "prefill_instance_id": "inst"})
