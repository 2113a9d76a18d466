"""The connector's worker half with a hybrid model: two KV cache groups (sliding window
and full attention) whose layers share cache tensors, as vLLM's hybrid manager lays them
out, with a real broker process between P and D and bytes over tcp. Each layer must load
from and into its own group's blocks, a sliding-window group moves only the blocks its
window still holds, and neither side touches the null block."""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest
import torch

from connector.config import ConfigError, kv_cache_spec_of, kv_groups_of, parse_config
from connector.scheduler import KvBrokerMetadata, LoadSpec, SaveSpec, refusal_key
from connector.worker import ConnectorWorker
from protocols.errors import Refused
from tests.hybrid_engine import hybrid_info
from tests.support import BrokerProcess, engine_step_pause, wait_until
from workers.groups import NULL_BLOCK

pytestmark = pytest.mark.slow

LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
BLOCK, HEADS, HEAD_SIZE, NUM_BLOCKS, WINDOW = 32, 2, 64, 40, 64
# Gemma-3's pattern: even layers slide over WINDOW tokens, odd ones attend to all.
LAYER_GROUPS = {name: i % 2 for i, name in enumerate(LAYERS)}


def caches(seed: int) -> dict[str, torch.Tensor]:
    """Layer 2i (window group) and 2i+1 (full group) share one tensor, as under vLLM's hybrid
    manager: a block id is one group's at a time, so the groups' ids never collide."""
    g = torch.Generator().manual_seed(seed)
    shared = [torch.randn(NUM_BLOCKS, HEADS, BLOCK, 2 * HEAD_SIZE, generator=g).to(torch.bfloat16) for _ in range(2)]
    return {name: shared[i // 2] for i, name in enumerate(LAYERS)}


def worker(broker: str, role: str, cache: dict[str, torch.Tensor], window: int = WINDOW, world_size: int = 1,
           **extra: object) -> ConnectorWorker:
    config = parse_config(
        {"broker": broker, "instance_id": role, "pool_bytes": 1 << 22, "staging_bytes": 1 << 22, **extra},
        kv_role="kv_producer" if role == "p" else "kv_consumer", engine_id=None,
    )
    info = hybrid_info(LAYER_GROUPS, block_size=BLOCK, heads=HEADS, head_size=HEAD_SIZE, window=window,
                       backend="CPU_ATTN/test", world_size=world_size)
    w = ConnectorWorker(config, info)
    w.register_kv_caches(cache)
    return w


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize("cached", [0, 1])
def test_hybrid_each_layer_loads_its_groups_blocks_inside_the_window(broker: BrokerProcess, cached: int) -> None:
    num_tokens = 150  # 5 blocks; the window group retires (150 - 64 + 1) // 32 = 2 of them
    p_cache, d_cache = caches(1), caches(2)
    d_before = {n: t.clone() for n, t in d_cache.items()}
    p_groups = [[NULL_BLOCK, 3, 5, 7, 9], [2, 4, 6, 8, 10]]  # P retired a window block mid-prefill
    d_groups = [[NULL_BLOCK, NULL_BLOCK, 21, 23, 25], [20, 22, 24, 26, 28]]  # vLLM allocates nulls for those
    p = worker(broker.endpoint, "p", p_cache)
    d = worker(broker.endpoint, "d", d_cache, load_timeout_s=20.0)
    try:
        d.bind(KvBrokerMetadata(loads={"h1": LoadSpec(req_id="r1", block_ids=d_groups[0], groups=d_groups,
                                                      num_cached_blocks=cached, num_tokens=num_tokens, prefill="p")}))
        d.start_load_kv()
        d.clear()
        p.bind(KvBrokerMetadata(saves={"h1": SaveSpec(req_id="r1", block_ids=p_groups[0], groups=p_groups,
                                                      num_tokens=num_tokens, decode="d")}))
        for name in LAYERS:
            p.save_kv_layer(name, p_cache[name])
        p.wait_for_save()
        p.clear()
        finished: set[str] = set()
        deadline = time.monotonic() + 30
        while "r1" not in finished:
            assert time.monotonic() < deadline, "D did not report the load"
            finished |= d.get_finished(set())[1] or set()
            assert d.get_block_ids_with_load_errors() == set()
            engine_step_pause()
        written: set[tuple[int, int]] = set()  # (tensor, block)
        for i, name in enumerate(LAYERS):
            g = LAYER_GROUPS[name]
            for row in range(cached, 5):
                if g == 0 and row < 2:
                    continue  # outside the window: neither sent nor written
                pb, db = p_groups[g][row], d_groups[g][row]
                assert torch.equal(bits(d_cache[name][db]), bits(p_cache[name][pb])), (name, row)
                written.add((i // 2, db))
        for i in (0, 2):  # nothing else changed: the null block, the prefix hit, other blocks
            name = LAYERS[i]
            for b in range(NUM_BLOCKS):
                if (i // 2, b) not in written:
                    assert torch.equal(bits(d_cache[name][b]), bits(d_before[name][b])), (name, b)
        cell = p.block_nbytes
        full_rows, window_rows = 5 - cached, 5 - max(cached, 2)
        assert d.statistics()["bytes"] == (2 * full_rows + 2 * window_rows) * cell  # not 4 layers x 5 blocks
        wait_until(lambda: broker.status()["counters"]["completed"] == 1, 10, "the broker's Done")
        wait_until(lambda: p.statistics()["staged_now"] == 0, 10, "P to release its copy")
    finally:
        d.close()
        p.close()


def test_hybrid_failed_load_is_reported_by_request_not_by_block_ids(broker: BrokerProcess) -> None:
    """vLLM refuses block-level load errors from several KV cache groups (a block id names
    a block only within its group): a hybrid model's failed load comes back by request."""
    d = worker(broker.endpoint, "d", caches(6), load_timeout_s=20.0)
    try:
        groups = [[NULL_BLOCK, 5, 7], [4, 6, 8]]
        spec = LoadSpec(req_id="r2", block_ids=groups[0], groups=groups, num_cached_blocks=0, num_tokens=80,
                        refused="do_remote_prefill came without a usable transfer_id")
        d.bind(KvBrokerMetadata(loads={refusal_key("r2"): spec}))
        d.start_load_kv()
        d.clear()
        finished: set[str] = set()
        failed: set[str] = set()
        deadline = time.monotonic() + 10
        while "r2" not in finished:
            assert time.monotonic() < deadline, "the refused load was not reported"
            finished |= d.get_finished(set())[1] or set()
            failed |= d.get_failed_requests()
            assert d.get_block_ids_with_load_errors() == set()
            engine_step_pause()
        assert failed == {"r2"} and d.statistics()["failed"] == 1
        assert d.get_failed_requests() == set()  # reported once
    finally:
        d.close()


def test_hybrid_peers_whose_windows_differ_are_refused(broker: BrokerProcess) -> None:
    p = worker(broker.endpoint, "p", caches(3))
    try:
        with pytest.raises(Refused, match="kv_groups"):
            worker(broker.endpoint, "d", caches(4), window=128)
    finally:
        p.close()


def test_hybrid_peers_of_different_tp_sizes_are_refused_with_one_sentence(broker: BrokerProcess) -> None:
    """Lanes do not cut a hybrid model's staged rows (they differ in width): a decode
    instance of another TP size is refused at registration, told what to change."""
    p = worker(broker.endpoint, "p", caches(3))
    try:
        with pytest.raises(Refused, match=r"decode instance d \(TP 2\) cannot pair with prefill instance p \(TP 1\): "
                                          r"a hybrid model \(several KV cache groups\) moves between equal TP sizes "
                                          r"only; serve both with the same tensor-parallel size"):
            worker(broker.endpoint, "d", caches(4), world_size=2)
    finally:
        p.close()


@dataclass(frozen=True)
class _Group:
    kv_cache_spec: object
    layer_names: tuple[str, ...] = ()


@dataclass(frozen=True)
class _CacheConfig:
    kv_cache_groups: list[_Group]


def test_hybrid_kv_cache_groups_are_read_and_attention_free_ones_refused_with_one_sentence() -> None:
    kvi = pytest.importorskip("vllm.v1.kv_cache_interface")
    full = kvi.FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=torch.bfloat16)
    window = kvi.SlidingWindowSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=torch.bfloat16,
                                   sliding_window=WINDOW)
    one = _CacheConfig([_Group(full, ("a", "b"))])
    assert kv_cache_spec_of(one) is full and kv_groups_of(one) is None
    two = _CacheConfig([_Group(window, ("l0", "l2")), _Group(full, ("l1", "l3"))])
    assert kv_cache_spec_of(two) is window
    assert kv_groups_of(two) == ({"l0": 0, "l2": 0, "l1": 1, "l3": 1}, (WINDOW, 0))
    with pytest.raises(ConfigError, match=r"^this model keeps no KV cache \(an attention-free model\)"):
        kv_cache_spec_of(_CacheConfig([]))
    mamba = type("MambaSpec", (), {"block_size": BLOCK})()
    with pytest.raises(ConfigError, match=r"^the KVBrokerConnector moves full and sliding-window attention, but this "
                                          r"model keeps a KV cache group of MambaSpec \(layers m0\); serve it"):
        kv_cache_spec_of(_CacheConfig([_Group(full, ("l1",)), _Group(mamba, ("m0",))]))
    other = kvi.FullAttentionSpec(block_size=2 * BLOCK, num_kv_heads=HEADS, head_size=HEAD_SIZE, dtype=torch.bfloat16)
    with pytest.raises(ConfigError, match=r"different block sizes \(\[32, 64\]\)"):
        kv_groups_of(_CacheConfig([_Group(window, ("l0",)), _Group(other, ("l1",))]))
