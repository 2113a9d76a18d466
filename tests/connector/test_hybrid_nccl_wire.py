"""A hybrid model over the nccl transport's link, with no GPU: prefill and decode
`ConnectorWorker`s of a Gemma-3-like model (a sliding-window group and a full-attention
group whose layers share cache tensors) with flash-attn NHD shaped caches
``[2, blocks, bs, H, D]`` on the CPU, a real broker process between them, and their
`NcclLink` replaced by the in-process wire of `tests/connector/test_hetero_nccl_lanes.py`
(the k-th send of a pair paired with its k-th receive, the bytes copied in the chunks
each side derived on its own).

What runs for real is the staged path a hybrid model takes over nccl: P gathers each
layer from its own group's blocks (a sliding-window group only inside its window) into
its staging, sends the byte range D's Ready names through the link's `send`, D receives
it into a lease through `ticket`/`post_recv`/`wait` and scatters each layer into its own
group's block ids in `get_finished`. The GPU run of the same path:
tests/gpu/test_connector_hybrid.py.
"""

from __future__ import annotations

import time

import pytest
import torch

from connector.config import EngineInfo, parse_config
from connector.nccl_link import chunks
from connector.scheduler import KvBrokerMetadata, LoadSpec, SaveSpec
from connector.worker import ConnectorWorker, compat_fields
from tests.connector.test_hetero_nccl_lanes import Wire, on_wire
from tests.hybrid_engine import hybrid_info
from tests.support import BrokerProcess, engine_step_pause, wait_until
from workers.groups import NULL_BLOCK, KvGroups
from workers.layout import CacheSpec, detect_layout

LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
BLOCK, HEADS, HEAD_SIZE, NUM_BLOCKS, WINDOW = 16, 2, 32, 48, 40
# Gemma-3's pattern: even layers slide over WINDOW tokens, odd ones attend to all.
LAYER_GROUPS = {name: i % 2 for i, name in enumerate(LAYERS)}


def info() -> EngineInfo:
    return hybrid_info(LAYER_GROUPS, block_size=BLOCK, heads=HEADS, head_size=HEAD_SIZE, window=WINDOW,
                       backend="FLASH_ATTN")


def nhd_caches(seed: int) -> dict[str, torch.Tensor]:
    """Layer 2i (window group) and 2i+1 (full group) share one flash-attn NHD tensor, as
    under vLLM's hybrid manager: a block id is one group's at a time."""
    g = torch.Generator().manual_seed(seed)
    shared = [torch.randn(2, NUM_BLOCKS, BLOCK, HEADS, HEAD_SIZE, generator=g).to(torch.bfloat16) for _ in range(2)]
    return {name: shared[i // 2] for i, name in enumerate(LAYERS)}


def worker(broker: str, role: str, cache: dict[str, torch.Tensor], **extra: object) -> ConnectorWorker:
    config = parse_config(
        {"broker": broker, "instance_id": role, "pool_bytes": 1 << 22, "staging_bytes": 1 << 22, **extra},
        kv_role="kv_producer" if role == "p" else "kv_consumer", engine_id=None,
    )
    w = ConnectorWorker(config, info())
    w.register_kv_caches(cache)
    return w


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def test_hybrid_over_nccl_the_fields_hold_the_groups_the_tp_size_and_the_chunk_plan() -> None:
    """P and D of a hybrid model over nccl must agree on the groups, the TP size (its rows
    differ in width, which lanes do not cut) and how a transfer is cut into chunks."""
    cache = nhd_caches(0)[LAYERS[0]]
    layout = detect_layout(cache, CacheSpec(BLOCK, HEADS, HEAD_SIZE))
    groups = KvGroups(layer_group=(0, 1, 0, 1), windows=(WINDOW, 0), block_size=BLOCK)
    fields = compat_fields(info(), layout, len(LAYERS), "nccl", groups)
    assert fields["kv_groups"] == groups.describe() == f"{WINDOW}:0,2;0:1,3"
    assert fields["world_size"] == "1" and "kv_heads" not in fields
    assert fields["transport"].startswith("nccl, chunks") and fields["layout"] == "kv_first"


@pytest.mark.slow
def test_hybrid_over_the_nccl_link_each_layer_lands_in_its_groups_blocks(broker: BrokerProcess) -> None:
    """Three transfers of 7 blocks (100 tokens: the window group retires
    (100 - 40 + 1) // 16 = 3 of them), D with prefix hits of 0, 1 and 4 blocks, P's
    blocks overwritten right after each layer's save: each layer lands in its own group's
    blocks, a window layer only in the blocks inside its window, nothing else on D
    changes (the null block, the prefix hit, other blocks), the transfer went as one
    chunked receive into a lease (never into the blocks) of exactly the live cells,
    both sides derived the same chunks, and every lease came back."""
    wire = Wire()
    p_cache, d_cache = nhd_caches(1), nhd_caches(2)
    p = on_wire(wire, worker(broker.endpoint, "p", p_cache))
    d = on_wire(wire, worker(broker.endpoint, "d", d_cache, load_timeout_s=20.0))
    num_tokens, rows, retired = 100, 7, 3
    assert p.chunk_nbytes == p.block_nbytes == d.chunk_nbytes  # chunks of whole cells: rows differ in width
    try:
        for i, cached in enumerate([0, 1, 4]):
            tid = f"t{i}"
            # P retired one window block mid-prefill (its null block), and holds the rest; the
            # groups' ids never meet (odd and even), as the block pool hands a block to one group.
            p_groups = [[NULL_BLOCK, 13 + 2 * i, 3, 5, 7, 9, 11], [2, 4, 6, 8, 10, 12 + 2 * i, 40]]
            # D was given null blocks for every retired window row (vLLM allocates those so).
            d_groups = [[NULL_BLOCK] * retired + [21, 23, 25, 27 + 2 * i], [20, 22, 24, 26, 28, 30, 32 + 2 * i]]
            g = torch.Generator().manual_seed(100 + i)
            for n, cache in p_cache.items():  # this prompt's KV, in P's blocks
                ids = p_groups[LAYER_GROUPS[n]]
                live = [b for b in ids if b != NULL_BLOCK]
                cache[:, live] = torch.randn(2, len(live), BLOCK, HEADS, HEAD_SIZE, generator=g).to(torch.bfloat16)
            want = {n: {row: p_cache[n][:, p_groups[LAYER_GROUPS[n]][row]].clone() for row in range(rows)
                        if p_groups[LAYER_GROUPS[n]][row] != NULL_BLOCK} for n in LAYERS}
            d_before = {n: t.clone() for n, t in d_cache.items()}
            d.bind(KvBrokerMetadata(loads={tid: LoadSpec(req_id=f"r{i}", block_ids=d_groups[0], groups=d_groups,
                                                         num_cached_blocks=cached, num_tokens=num_tokens,
                                                         prefill="p")}))
            d.start_load_kv()
            d.clear()
            p.bind(KvBrokerMetadata(saves={tid: SaveSpec(req_id=f"r{i}", block_ids=p_groups[0], groups=p_groups,
                                                         num_tokens=num_tokens, decode="d")}))
            for name in LAYERS:
                p.save_kv_layer(name, p_cache[name])
                p_cache[name][:, p_groups[LAYER_GROUPS[name]][1:]] = -7.0  # the next step writes these at once
            p.wait_for_save()
            p.clear()
            finished: set[str] = set()
            deadline = time.monotonic() + 30
            while f"r{i}" not in finished:
                assert time.monotonic() < deadline, f"D did not report {tid}: {d.statistics()}"
                finished |= d.get_finished(set())[1] or set()
                assert d.get_failed_requests() == set() and d.get_block_ids_with_load_errors() == set()
                engine_step_pause()
            written: set[tuple[int, int]] = set()  # (tensor, block)
            for j, name in enumerate(LAYERS):
                grp = LAYER_GROUPS[name]
                first = max(cached, retired if grp == 0 else 0)
                for row in range(first, rows):
                    db = d_groups[grp][row]
                    assert torch.equal(bits(d_cache[name][:, db]), bits(want[name][row])), (tid, name, row)
                    written.add((j // 2, db))
            for j in (0, 2):
                name = LAYERS[j]
                for b in range(NUM_BLOCKS):
                    if (j // 2, b) not in written:
                        assert torch.equal(bits(d_cache[name][:, b]), bits(d_before[name][:, b])), (tid, name, b)
            cells = 2 * (rows - cached) + 2 * (rows - max(cached, retired))
            ops = sorted(op[0] for op in wire.ops if op[1] == tid)
            assert ops == ["recv", "send"]  # one of each
            assert not any(op[4] for op in wire.ops if op[1] == tid)  # from and into leases, never blocks
            sent = wire.sent[("p:0", "d:0")][i]
            assert sent.data.numel() == cells * p.block_nbytes
            assert sent.plan == chunks(cells * p.block_nbytes, p.block_nbytes)
        assert wire.unpaired == []
        wait_until(lambda: broker.status()["counters"]["completed"] == 3, 10, "the broker's Dones")
        wait_until(lambda: p.statistics()["staged_now"] == 0, 10, "P to release its copies")
        for w in (p, d):
            assert w.pool is not None
            wait_until(lambda w=w: w.pool.statistics().reserved == 0, 10, "every lease back in its pool")
        assert d.statistics()["loaded"] == 3 and d.statistics()["failed"] == 0
    finally:
        d.close()
        p.close()
