"""Heterogeneous TP on GPUs over the nccl transport: the model's KV, one rank's worker
half, and (run as a script) one prefill or decode rank in a process of its own.

The model has `HEADS` KV heads; transfer i's KV over all of them is random, seeded by i
(`model_kv`), flash-attn shaped ``[2, blocks, block_size, heads, head_size]``. A rank's
cache holds its heads (`protocols.heads.rank_heads`) of `NUM_BLOCKS` blocks.

As a script, a rank registers, says so on stdout, and waits for a line on stdin (every
rank of both instances registered). A decode rank then loads every transfer at once
(transfer i into `decode_blocks(i)`, with an i % 2-block prefix hit), steps until each
is reported, and compares its blocks: each one after the hit holds exactly its heads of
the model's KV, each one before it is unchanged. A prefill rank runs transfer 0's step
(`prefill_step`), waits for another line (transfer 0 has landed everywhere: every pair's
communicator is built), runs the others' steps, and waits until each was released. One
JSON line of results on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass

import torch

from connector.config import EngineInfo, parse_config
from connector.scheduler import KvBrokerMetadata, LoadSpec, SaveSpec
from connector.worker import ConnectorWorker
from protocols.heads import rank_heads
from protocols.logs import configure_logging
from tests.support import engine_step_pause, wait_until

LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
HEADS, BLOCK_SIZE, HEAD_SIZE, NUM_BLOCKS, PER_TRANSFER = 4, 16, 64, 64, 4


@dataclass(frozen=True)
class Spec:
    num_kv_heads: int
    block_size: int = BLOCK_SIZE
    head_size: int = HEAD_SIZE
    use_mla: bool = False


def model_kv(i: int) -> dict[str, torch.Tensor]:
    """Transfer i's KV over every head, on the CPU: ``[2, PER_TRANSFER, bs, HEADS, hs]`` a layer."""
    g = torch.Generator().manual_seed(1000 + i)
    return {n: torch.randn(2, PER_TRANSFER, BLOCK_SIZE, HEADS, HEAD_SIZE, generator=g).to(torch.bfloat16)
            for n in LAYERS}


def caches(device: str, tp: int, rank: int, seed: int) -> dict[str, torch.Tensor]:
    """A rank's cache of garbage: every byte a transfer writes counts."""
    a, b = rank_heads(HEADS, tp, rank)
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, b - a, HEAD_SIZE, generator=g).to(torch.bfloat16).to(device)
            for n in LAYERS}


PREFILL_BLOCKS = [3, 17, 40, 9]  # every transfer's: P reuses its blocks at once


def prefill_step(p: ConnectorWorker, kv: dict[str, torch.Tensor], tp: int, rank: int, i: int) -> None:
    """Transfer i's prefill step on one P rank: its heads of the model's KV written into
    its blocks, then saved layer by layer, each layer's blocks overwritten on the compute
    stream right after its save_kv_layer returns (the seed's race)."""
    model = model_kv(i)
    a, b = rank_heads(HEADS, tp, rank)
    for n in LAYERS:
        kv[n][:, PREFILL_BLOCKS] = model[n][:, :, :, a:b].to(kv[n].device)
    p.bind(KvBrokerMetadata(saves={f"h{i}": SaveSpec(
        req_id=f"req-h{i}", block_ids=PREFILL_BLOCKS, num_tokens=PER_TRANSFER * BLOCK_SIZE - 5, decode="d")}))
    for n in LAYERS:
        p.save_kv_layer(n, kv[n])
        kv[n][:, PREFILL_BLOCKS] = -7.0  # the next step writes these blocks at once
    p.wait_for_save()
    p.clear()


def decode_blocks(i: int) -> list[int]:
    """Where decode ranks load transfer i: blocks no other transfer of the run uses, out of order."""
    return [PER_TRANSFER * i + j for j in (2, 0, 3, 1)]


def worker(broker: str, role: str, rank: int, tp: int, kv: dict[str, torch.Tensor], **extra: object) -> ConnectorWorker:
    config = parse_config(
        {"broker": broker, "instance_id": role, "pool_bytes": 1 << 24, "staging_bytes": 1 << 24, "transport": "nccl",
         **extra},
        kv_role="kv_producer" if role == "p" else "kv_consumer", engine_id=None,
    )
    local = next(iter(kv.values())).shape[3]
    info = EngineInfo(model="tiny", spec=Spec(num_kv_heads=local), block_size=BLOCK_SIZE, backend="FLASH_ATTN",
                      world_size=tp, rank=rank, kv_heads=HEADS)
    w = ConnectorWorker(config, info)
    w.register_kv_caches(kv)
    return w


def load_all(d: ConnectorWorker, transfers: int) -> None:
    """Every transfer's load at once, as the requests reach D (the gateway sends to P and D together)."""
    d.bind(KvBrokerMetadata(loads={
        f"h{i}": LoadSpec(req_id=f"req-h{i}", block_ids=decode_blocks(i), num_cached_blocks=i % 2,
                          num_tokens=PER_TRANSFER * BLOCK_SIZE - 5, prefill="p")
        for i in range(transfers)}))
    d.start_load_kv()
    d.clear()


def check(d: ConnectorWorker, kv: dict[str, torch.Tensor], before: dict[str, torch.Tensor], tp: int, rank: int,
          transfers: int) -> dict[str, int]:
    """Compare a decode rank's blocks with the model's KV (bits, on the CPU)."""
    a, b = rank_heads(HEADS, tp, rank)
    torch.cuda.synchronize(next(iter(kv.values())).device)
    counts = {"checked": 0, "mismatched": 0, "cached_changed": 0}
    for i in range(transfers):
        model, ids, cached = model_kv(i), decode_blocks(i), i % 2
        for n in LAYERS:
            got = kv[n].cpu()
            for k, blk in enumerate(ids):
                if k < cached:
                    counts["cached_changed"] += not torch.equal(_bits(got[:, blk]), _bits(before[n][:, blk]))
                else:
                    counts["mismatched"] += not torch.equal(_bits(got[:, blk]), _bits(model[n][:, k, :, a:b]))
                    counts["checked"] += 1
    return counts


def step_until_loaded(d: ConnectorWorker, transfers: int, timeout: float) -> set[int]:
    """Empty decode steps until every transfer is reported; the load errors seen."""
    want = {f"req-h{i}" for i in range(transfers)}
    finished: set[str] = set()
    errors: set[int] = set()
    deadline = time.monotonic() + timeout
    while not want <= finished:
        if time.monotonic() > deadline:
            raise AssertionError(f"no report for {sorted(want - finished)} within {timeout} s: {d.statistics()}")
        finished |= d.get_finished(set())[1] or set()
        errors |= d.get_block_ids_with_load_errors()
        engine_step_pause()
    return errors


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def prefill_main(args: argparse.Namespace) -> dict[str, int]:
    kv = caches(args.device, args.tp, args.rank, seed=40 + args.rank)
    p = worker(args.broker, "p", args.rank, args.tp, kv, load_timeout_s=60)
    try:
        print(json.dumps({"registered": True}), flush=True)
        sys.stdin.readline()
        prefill_step(p, kv, args.tp, args.rank, 0)
        sys.stdin.readline()
        for i in range(1, args.transfers):
            prefill_step(p, kv, args.tp, args.rank, i)
        wait_until(lambda: p.statistics()["staged_now"] == 0, 120, "every transfer released")
        assert p.pool is not None
        wait_until(lambda: p.pool.statistics().leases == 0, 20, "the staging back in its pool")
        stats = p.statistics()
    finally:
        p.close()
    return {k: stats[k] for k in ("staged", "released", "aborted")}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--broker", required=True)
    ap.add_argument("--role", choices=["prefill", "decode"], required=True)
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--tp", type=int, required=True)
    ap.add_argument("--transfers", type=int, required=True)
    ap.add_argument("--device", default="cuda:0")
    args = ap.parse_args()
    configure_logging("json", "warning", sys.stderr)  # stdout carries the results
    if args.role == "prefill":
        print(json.dumps(prefill_main(args)), flush=True)
        return
    kv = caches(args.device, args.tp, args.rank, seed=50 + args.rank)
    before = {n: t.cpu() for n, t in kv.items()}
    d = worker(args.broker, "d", args.rank, args.tp, kv, load_timeout_s=60)
    try:
        print(json.dumps({"registered": True}), flush=True)
        sys.stdin.readline()
        load_all(d, args.transfers)
        errors = step_until_loaded(d, args.transfers, timeout=120)
        counts = check(d, kv, before, args.tp, args.rank, args.transfers)
        counts |= {"errors": len(errors), "loaded": d.statistics()["loaded"]}
    finally:
        d.close()
    print(json.dumps(counts), flush=True)


if __name__ == "__main__":
    main()
