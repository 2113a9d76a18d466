"""The seed's bug, on the connector's own path: P's blocks are overwritten right after
`save_kv_layer` returns, and D must still get what they held when it was called.

vLLM frees a finished prefill's blocks at once and the next step may write other KV into
them; a connector that read the blocks later (the seed copied them from another thread
after the step) sent that other KV for repeated prompts. Here every step of P saves
several requests on the same block ids, and right after each layer's `save_kv_layer`
the test writes other values into those blocks (on the GPU: on the compute stream, as
the next step's kernels would). D compares every block it loaded with what P's cache
held at the call.

The negative control is an unsafe twin of P injected from the test: its
`save_kv_layer` only remembers the call and copies the blocks at `wait_for_save`, after
the overwrite (as the seed's background copy did). It must corrupt, or the safe run
would prove nothing. `save_race` is shared with the GPU runs of the same test
(tests/gpu/test_connector_nccl.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from connector.producer import ProducerSide
from connector.scheduler import KvBrokerMetadata, LoadSpec, SaveSpec
from connector.worker import ConnectorWorker
from tests.connector.test_worker import LAYERS, FakeSpec, make_caches, make_worker, run_steps
from tests.support import BrokerProcess

pytestmark = pytest.mark.slow

# The blocks of one request, in P's cache or D's: cache[ids] on the CPU, cache[:, ids] on the GPU.
Take = Callable[[torch.Tensor, list[int]], torch.Tensor]
Put = Callable[[torch.Tensor, list[int], Any], None]


@dataclass(frozen=True)
class Blocks:
    take: Take
    put: Put


CPU_BLOCKS = Blocks(take=lambda t, ids: t[ids], put=lambda t, ids, v: t.__setitem__(ids, v))
# A tiny CPU cache: 1 KiB a block and layer, so a thousand transfers take seconds.
TINY = FakeSpec(block_size=16, num_kv_heads=1, head_size=16)


def defer_gathers(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, torch.Tensor]]:
    """The unsafe twin: P's `save_kv_layer` copies nothing when called; the copies run in
    `wait_for_save`, after whatever the step wrote into the blocks meanwhile."""
    deferred: list[tuple[str, torch.Tensor]] = []
    real_save, real_wait = ProducerSide.save_kv_layer, ProducerSide.wait_for_save

    def save_kv_layer(self: ProducerSide, layer_name: str, kv_layer: torch.Tensor) -> None:
        deferred.append((layer_name, kv_layer))

    def wait_for_save(self: ProducerSide) -> None:
        for layer_name, kv_layer in deferred:
            real_save(self, layer_name, kv_layer)
        deferred.clear()
        real_wait(self)

    monkeypatch.setattr(ProducerSide, "save_kv_layer", save_kv_layer)
    monkeypatch.setattr(ProducerSide, "wait_for_save", wait_for_save)
    return deferred


def save_race(p: ConnectorWorker, d: ConnectorWorker, pc: dict[str, torch.Tensor], dc: dict[str, torch.Tensor], *,
              blocks: Blocks, block_size: int, transfers: int, per_step: int, blocks_per: int, d_blocks: int,
              decode: str, tag: str, sync: Callable[[], None] = lambda: None) -> int:
    """`transfers` requests from P to D, `per_step` a step, each of `blocks_per` blocks on
    the same block ids of P every step; each layer's blocks written with new KV right
    before its `save_kv_layer` and overwritten right after it. Returns how many
    transfers left D with other bytes than P's blocks held at the call (every load must
    succeed)."""
    mismatched = 0
    srcs = [list(range(j * blocks_per, (j + 1) * blocks_per)) for j in range(per_step)]
    for step in range(transfers // per_step):
        tids = [f"{tag}{step}.{j}" for j in range(per_step)]
        at = (step * per_step * blocks_per) % (d_blocks - per_step * blocks_per + 1)  # D's blocks move around
        dsts = [list(range(at + j * blocks_per, at + (j + 1) * blocks_per)) for j in range(per_step)]
        tokens = blocks_per * block_size - 3
        d.bind(KvBrokerMetadata(loads={
            tid: LoadSpec(req_id=f"req-{tid}", block_ids=dst, num_cached_blocks=0, num_tokens=tokens)
            for tid, dst in zip(tids, dsts)}))
        d.start_load_kv()
        d.clear()
        p.bind(KvBrokerMetadata(saves={
            tid: SaveSpec(req_id=f"req-{tid}", block_ids=src, num_tokens=tokens, decode=decode)
            for tid, src in zip(tids, srcs)}))
        saved: dict[str, list[torch.Tensor]] = {}
        for name in LAYERS:
            cache = pc[name]
            for src in srcs:  # this step's forward pass writes the layer's KV
                blocks.put(cache, src, torch.randn_like(blocks.take(cache, src)))
            saved[name] = [blocks.take(cache, src).clone() for src in srcs]
            p.save_kv_layer(name, cache)
            for src in srcs:  # the next step writes other KV into the same blocks at once
                blocks.put(cache, src, -7.0)
        p.wait_for_save()
        p.clear()
        _, errors, _ = run_steps(d, {f"req-{tid}" for tid in tids}, timeout=30)
        assert not errors, f"step {step} failed to load: {d.statistics()}"
        sync()
        for j, dst in enumerate(dsts):
            mismatched += any(not torch.equal(blocks.take(dc[name], dst).cpu(), saved[name][j].cpu())
                              for name in LAYERS)
    return mismatched


@pytest.fixture
def pair(broker: BrokerProcess) -> Iterator[tuple[ConnectorWorker, ConnectorWorker, dict, dict]]:
    pc, dc = make_caches(num_blocks=32, spec=TINY, seed=41), make_caches(num_blocks=64, spec=TINY, seed=42)
    p = make_worker(broker.endpoint, "p", "p0", pc, spec=TINY)
    d = make_worker(broker.endpoint, "d", "d0", dc, spec=TINY)
    try:
        yield p, d, pc, dc
    finally:
        p.close()
        d.close()


def test_a_thousand_transfers_over_tcp_are_exact_whatever_p_writes_after_each_save(pair: Any) -> None:
    p, d, pc, dc = pair
    mismatched = save_race(p, d, pc, dc, blocks=CPU_BLOCKS, block_size=TINY.block_size, transfers=1000, per_step=8, blocks_per=2, d_blocks=64,
                           decode="d0", tag="race")
    assert mismatched == 0
    assert d.statistics()["loaded"] == 1000 and d.statistics()["failed"] == 0


def test_the_unsafe_twin_that_copies_at_wait_for_save_corrupts(pair: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    p, d, pc, dc = pair
    defer_gathers(monkeypatch)
    mismatched = save_race(p, d, pc, dc, blocks=CPU_BLOCKS, block_size=TINY.block_size, transfers=40, per_step=8, blocks_per=2, d_blocks=64,
                           decode="d0", tag="unsafe")
    assert mismatched == 40, "the deferred copies read the overwritten blocks: the race test can fail"
