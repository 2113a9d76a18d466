"""A decode request in the router protocols' form, through vLLM's real scheduler.

vLLM's `Scheduler` (the one `vllm serve` runs in its engine core) with the
KVBrokerConnector's scheduler half, for the tiny model's config and no model run: each
step is `schedule()`, then `update_from_output()` with what the worker half reports
(`finished_recving`, `invalid_block_ids`; the worker half's own tests run it against a
real broker). What is checked is vLLM's side of the contract: the request waits in
WAITING_FOR_REMOTE_KVS while the engine schedules others, its blocks enter the prefix
cache only once loaded (a failed load leaves nothing behind for the next request with
that prompt), and an abort during the wait frees its blocks once the worker half
reports it, with the connector's state gone.
"""

from __future__ import annotations

from collections.abc import Iterator
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.skipif(find_spec("vllm") is None, reason="vLLM is not installed")]

BLOCK = 32
NUM_BLOCKS = 64
PREFILL = "prefill-0"


@pytest.fixture(scope="module")
def vllm_config(tiny_model_dir: Path) -> Any:
    from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig

    return VllmConfig(
        model_config=ModelConfig(model=str(tiny_model_dir), skip_tokenizer_init=True, max_model_len=256,
                                 dtype="bfloat16", seed=0, enforce_eager=True),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=1024, max_model_len=256,
                                         is_encoder_decoder=False),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVBrokerConnector", kv_connector_module_path="connector", kv_role="kv_consumer",
            kv_load_failure_policy="recompute",
            # The scheduler half never talks to the broker: this address is never dialled.
            kv_connector_extra_config={"broker": "tcp://127.0.0.1:9", "instance_id": "decode-s"},
        ),
        device_config=DeviceConfig("cpu"),
    )


@pytest.fixture
def sched(vllm_config: Any) -> Iterator[Any]:
    import torch
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=32, dtype=torch.bfloat16)
    kv_cache_config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[],
                                    kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])
    vllm_config.cache_config.num_gpu_blocks = NUM_BLOCKS
    s = Scheduler(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                  structured_output_manager=StructuredOutputManager(vllm_config), block_size=BLOCK)
    yield s
    s.shutdown()


def request(rid: str, prompt: list[int], params: dict[str, Any] | None) -> Any:
    """A request as vLLM's engine core makes it (block hashes for the prefix cache included)."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    sp.extra_args = {"kv_transfer_params": params}
    return Request(request_id=rid, prompt_token_ids=prompt, sampling_params=sp, pooling_params=None,
                   block_hasher=get_request_block_hasher(BLOCK, hash_fn))


def forwarded(tid: str, req: str = "cmpl-p-0") -> dict[str, Any]:
    """What a prefill instance returns in the sequential protocol and the router forwards."""
    return {"do_remote_prefill": True, "do_remote_decode": False, "transfer_id": tid, "prefill_instance_id": PREFILL,
            "remote_engine_id": PREFILL, "remote_request_id": req, "remote_block_ids": [], "remote_host": "",
            "remote_port": 0, "tp_size": 1}


def prompt(n: int, salt: int) -> list[int]:
    return [3 + (salt * 131 + j * 13 + (j * j) % 7) % 509 for j in range(n)]


def step(s: Any, *, recving: set[str] = frozenset(), invalid: set[int] = frozenset()) -> Any:
    """One engine step: schedule, then the model's and the worker half's output."""
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    so = s.schedule()
    ids = list(so.num_scheduled_tokens)
    out = ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                            sampled_token_ids=[[7] for _ in ids],
                            kv_connector_output=KVConnectorOutput(finished_recving=set(recving),
                                                                  invalid_block_ids=set(invalid)))
    s.update_from_output(so, out)
    return so


def local_hit(s: Any, tokens: list[int], rid: str) -> int:
    """Tokens of `tokens` that a new request would find in the prefix cache now."""
    return int(s.kv_cache_manager.get_computed_blocks(request(rid, tokens, None))[1])


def halves(s: Any) -> Any:
    return s.connector._scheduler


def test_a_forwarded_request_waits_for_its_kv_while_others_run_and_caches_only_once_loaded(sched: Any) -> None:
    from vllm.v1.request import RequestStatus

    s, tokens = sched, prompt(100, 1)
    loading = request("d-1", tokens, forwarded("kv-1"))
    s.add_request(loading)
    so = step(s)
    assert loading.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    (spec,) = so.kv_connector_metadata.loads.values()
    assert list(so.kv_connector_metadata.loads) == ["kv-1"]
    assert (spec.prefill, spec.num_tokens, spec.num_cached_blocks, len(spec.block_ids)) == (PREFILL, 100, 0, 4)
    assert "d-1" not in so.num_scheduled_tokens  # nothing computed locally
    # Asynchronous: a plain request arriving meanwhile runs while d-1 waits.
    s.add_request(request("plain-1", prompt(40, 2), None))
    for _ in range(3):
        so = step(s)
        assert "plain-1" in so.num_scheduled_tokens and "d-1" not in so.num_scheduled_tokens
        assert loading.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    # Not in the prefix cache while its KV is in flight: no one may read those blocks yet.
    assert local_hit(s, tokens, "probe-1") == 0
    step(s, recving={"d-1"})  # the worker half reports the load done
    so = step(s)
    assert so.num_scheduled_tokens["d-1"] == 1  # only the last prompt token is computed
    assert loading.num_computed_tokens == 100
    assert local_hit(s, tokens, "probe-2") == 96  # loaded blocks now serve others
    assert halves(s)._loading == {"d-1"}
    s.finish_requests("d-1", RequestStatus.FINISHED_ABORTED)
    assert not halves(s)._loading and not halves(s)._claims


def test_a_failed_load_is_recomputed_locally_and_leaves_nothing_in_the_prefix_cache(sched: Any) -> None:
    from vllm.v1.request import RequestStatus

    s, tokens = sched, prompt(90, 3)
    r = request("d-2", tokens, forwarded("kv-2"))
    s.add_request(r)
    so = step(s)
    blocks = so.kv_connector_metadata.loads["kv-2"].block_ids
    step(s, recving={"d-2"}, invalid=set(blocks))  # e.g. P died: every block failed
    assert local_hit(s, tokens, "probe-3") == 0  # the failed blocks were never cached
    so = step(s)
    assert so.num_scheduled_tokens["d-2"] == 90  # the whole prompt, computed here
    assert not so.kv_connector_metadata.loads  # claimed once, never again
    assert r.status == RequestStatus.RUNNING


def test_params_without_a_usable_id_fail_the_load_at_once_and_the_request_is_computed(sched: Any) -> None:
    from connector.scheduler import refusal_key

    s, tokens = sched, prompt(70, 4)
    s.add_request(request("d-3", tokens, {**forwarded("kv-3"), "transfer_id": None}))
    so = step(s)
    spec = so.kv_connector_metadata.loads[refusal_key("d-3")]
    assert spec.refused.startswith("do_remote_prefill came without a usable transfer_id")
    # What the worker half reports for it in that very step (tests/connector checks it does).
    step(s, recving={"d-3"}, invalid=set(spec.block_ids))
    so = step(s)
    assert so.num_scheduled_tokens["d-3"] == 70


def test_an_abort_during_the_wait_frees_the_blocks_once_the_worker_half_lets_go(sched: Any) -> None:
    from vllm.v1.request import RequestStatus

    s = sched
    free_before = s.kv_cache_manager.block_pool.get_num_free_blocks()
    s.add_request(request("d-4", prompt(120, 5), forwarded("kv-4")))
    step(s)
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == free_before - 4
    s.finish_requests("d-4", RequestStatus.FINISHED_ABORTED)
    assert not halves(s)._loading and not halves(s)._claims  # the connector forgot it
    # The worker half may still be writing those blocks: vLLM holds them until it reports.
    so = step(s)
    assert "d-4" in so.finished_req_ids  # which tells the worker half to end the load
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == free_before - 4
    step(s, recving={"d-4"})
    assert s.kv_cache_manager.block_pool.get_num_free_blocks() == free_before
    assert "d-4" not in s.requests
