"""The connector's worker half with prefill and decode instances of different TP sizes:
each rank a `ConnectorWorker` with its own heads of a CPU-layout cache, a real broker
process between them, bytes over tcp. Each decode rank must load exactly its heads."""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest
import torch

from connector.config import EngineInfo, parse_config
from connector.scheduler import KvBrokerMetadata, LoadSpec, SaveSpec
from connector.worker import ConnectorWorker
from protocols.heads import rank_heads
from tests.support import BrokerProcess, engine_step_pause, wait_until

pytestmark = pytest.mark.slow

LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
HEADS, BLOCK, HEAD_SIZE, NUM_BLOCKS = 4, 32, 64, 16


@dataclass(frozen=True)
class Spec:
    num_kv_heads: int
    block_size: int = BLOCK
    head_size: int = HEAD_SIZE
    use_mla: bool = False


def model(seed: int) -> dict[str, torch.Tensor]:
    """Every head of the model's cache, CPU layout [blocks, heads, block_size, 2 * head_size]."""
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD_SIZE, generator=g).to(torch.bfloat16) for n in LAYERS}


def rank_worker(broker: str, role: str, instance: str, rank: int, tp: int, caches: dict[str, torch.Tensor],
                **extra: object) -> ConnectorWorker:
    config = parse_config(
        {"broker": broker, "instance_id": instance, "pool_bytes": 1 << 22, "staging_bytes": 1 << 22, **extra},
        kv_role="kv_producer" if role == "p" else "kv_consumer", engine_id=None,
    )
    spec = Spec(num_kv_heads=next(iter(caches.values())).shape[1])
    info = EngineInfo(model="tiny", spec=spec, block_size=BLOCK, backend="CPU_ATTN/test", world_size=tp, rank=rank,
                      kv_heads=HEADS)
    worker = ConnectorWorker(config, info)
    worker.register_kv_caches(caches)
    return worker


def heads_of(caches: dict[str, torch.Tensor], tp: int, rank: int) -> dict[str, torch.Tensor]:
    a, b = rank_heads(HEADS, tp, rank)
    return {n: c[:, a:b].clone() for n, c in caches.items()}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 2), (2, 1)])
def test_hetero_connector_ranks_load_exactly_their_heads(broker: BrokerProcess, p_tp: int, d_tp: int) -> None:
    whole = model(seed=3)
    p_caches = [heads_of(whole, p_tp, r) for r in range(p_tp)]
    d_caches = [heads_of(model(seed=4), d_tp, r) for r in range(d_tp)]  # other bytes before the load
    d_before = [{n: c.clone() for n, c in dc.items()} for dc in d_caches]
    ps = [rank_worker(broker.endpoint, "p", "p", r, p_tp, p_caches[r]) for r in range(p_tp)]
    ds = [rank_worker(broker.endpoint, "d", "d", r, d_tp, d_caches[r], load_timeout_s=20.0) for r in range(d_tp)]
    try:
        p_blocks, d_blocks, cached = [3, 7, 1, 12], [5, 2, 9, 14], 1
        for d in ds:  # the request reaches D (the gateway sends to both at once)
            d.bind(KvBrokerMetadata(loads={"t1": LoadSpec(req_id="r1", block_ids=d_blocks, num_cached_blocks=cached,
                                                          num_tokens=4 * BLOCK - 5, prefill="p")}))
            d.start_load_kv()
            d.clear()
        for p, caches in zip(ps, p_caches):  # one prefill step on every rank
            p.bind(KvBrokerMetadata(saves={"t1": SaveSpec(req_id="r1", block_ids=p_blocks, num_tokens=4 * BLOCK - 5,
                                                          decode="d")}))
            for name in LAYERS:
                p.save_kv_layer(name, caches[name])
            p.wait_for_save()
            p.clear()
        deadline = time.monotonic() + 60
        for d in ds:
            finished: set[str] = set()
            while "r1" not in finished:
                assert time.monotonic() < deadline, "no decode rank reported the load"
                finished |= d.get_finished(set())[1] or set()
                assert d.get_block_ids_with_load_errors() == set()
                engine_step_pause()
        for r, dc in enumerate(d_caches):
            a, b = rank_heads(HEADS, d_tp, r)
            for name in LAYERS:
                for pb, db in zip(p_blocks[cached:], d_blocks[cached:]):
                    assert torch.equal(bits(dc[name][db]), bits(whole[name][pb, a:b])), (r, name, db)
                untouched = [x for x in range(NUM_BLOCKS) if x not in d_blocks[cached:]]
                assert torch.equal(bits(dc[name][untouched]), bits(d_before[r][name][untouched]))
        plan_lanes = 2  # 1 -> 2: one lane into each D rank; 2 -> 1: two lanes into D rank 0
        wait_until(lambda: broker.status()["counters"]["completed"] == plan_lanes, 10, "the lanes' Dones")
        wait_until(lambda: all(p.statistics()["staged_now"] == 0 for p in ps), 10, "every prefill rank released")
        assert sum(d.statistics()["loaded"] for d in ds) == d_tp
    finally:
        for w in ds + ps:
            w.close()


def test_hetero_a_lost_prefill_rank_fails_the_load_and_frees_every_lease(broker: BrokerProcess) -> None:
    """P TP 2 -> D TP 1: P rank 1 leaves before it offers. D's one rank cannot have all
    its heads, so its load fails at once (not at its deadline), its blocks are reported,
    P rank 0 frees the copy it staged, and D's pool is whole again."""
    whole = model(seed=5)
    p_caches = [heads_of(whole, 2, r) for r in range(2)]
    d_caches = heads_of(model(seed=6), 1, 0)
    p0, p1 = (rank_worker(broker.endpoint, "p", "p", r, 2, p_caches[r]) for r in range(2))
    d = rank_worker(broker.endpoint, "d", "d", 0, 1, d_caches, load_timeout_s=30.0)
    try:
        d.bind(KvBrokerMetadata(loads={"t2": LoadSpec(req_id="r2", block_ids=[4, 5], num_cached_blocks=0,
                                                      num_tokens=2 * BLOCK - 3, prefill="p")}))
        d.start_load_kv()
        d.clear()
        p0.bind(KvBrokerMetadata(saves={"t2": SaveSpec(req_id="r2", block_ids=[1, 2], num_tokens=2 * BLOCK - 3,
                                                       decode="d")}))
        for name in LAYERS:
            p0.save_kv_layer(name, p_caches[0][name])
        p0.wait_for_save()
        p0.clear()
        wait_until(lambda: any(t["transfer_id"] == "t2" for t in broker.status()["transfers"]), 10, "t2 at the broker")
        p1.close()  # says goodbye: its lane will never come
        t0 = time.monotonic()
        errors: set[int] = set()
        finished: set[str] = set()
        while "r2" not in finished:
            assert time.monotonic() - t0 < 20, "the load did not fail"
            finished |= d.get_finished(set())[1] or set()
            errors |= d.get_block_ids_with_load_errors()
            engine_step_pause()
        assert errors == {4, 5}
        wait_until(lambda: p0.statistics()["staged_now"] == 0, 10, "P rank 0 to free its copy")
        assert d.pool is not None
        wait_until(lambda: d.pool.statistics().reserved == 0, 10, "D's leases to go back")
        assert d.statistics()["failed"] == 1 and d.statistics()["loaded"] == 0
    finally:
        for w in (d, p0, p1):
            w.close()
