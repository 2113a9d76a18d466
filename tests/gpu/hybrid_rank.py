"""A hybrid model on a GPU over the nccl transport: a Gemma-3-like model's KV, one
instance's worker half, and (run as a script) the prefill instance in a process of its own.

The model has four layers in two KV cache groups: the even layers slide over `WINDOW`
tokens (group 0), the odd ones attend to all (group 1), and layers 2j and 2j+1 share one
flash-attn NHD cache tensor ``[2, NUM_BLOCKS, bs, H, D]``, as under vLLM's hybrid KV cache
manager (a block id is one group's at a time: here group 0's are odd, group 1's even).
Transfer i's KV is random, seeded by i (`model_kv`), `ROWS` blocks of `TOKENS` tokens, of
which the window group keeps the last ``ROWS - RETIRED``.

As a script, the prefill instance registers, says so on stdout, and waits for a line on
stdin (the decode instance registered and expects every transfer); it runs transfer 0's
step (`prefill_step`), waits for another line (transfer 0 landed: the pair's
communicator is built), runs the others' steps, and waits until each was released. One
JSON line of results on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from connector.config import parse_config
from connector.scheduler import KvBrokerMetadata, LoadSpec, SaveSpec
from connector.worker import ConnectorWorker
from protocols.logs import configure_logging
from tests.hybrid_engine import hybrid_info
from tests.support import wait_until
from workers.groups import NULL_BLOCK

LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
GROUP = {name: i % 2 for i, name in enumerate(LAYERS)}  # 0: sliding window, 1: full attention
HEADS, BLOCK_SIZE, HEAD_SIZE, NUM_BLOCKS, WINDOW = 2, 16, 64, 128, 40
ROWS = 6
TOKENS = ROWS * BLOCK_SIZE - 5  # 91: the window group retires (91 - 40 + 1) // 16 blocks
RETIRED = (TOKENS - WINDOW + 1) // BLOCK_SIZE
assert RETIRED == 3


def model_kv(i: int) -> dict[str, torch.Tensor]:
    """Transfer i's KV on the CPU: ``[2, ROWS, bs, H, D]`` a layer."""
    g = torch.Generator().manual_seed(2000 + i)
    return {n: torch.randn(2, ROWS, BLOCK_SIZE, HEADS, HEAD_SIZE, generator=g).to(torch.bfloat16) for n in LAYERS}


def caches(device: str, seed: int) -> dict[str, torch.Tensor]:
    """An instance's cache of garbage, layers 2j and 2j+1 on one tensor: every byte a transfer writes counts."""
    g = torch.Generator().manual_seed(seed)
    shared = [torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, HEADS, HEAD_SIZE, generator=g).to(torch.bfloat16).to(device)
              for _ in range(2)]
    return {n: shared[i // 2] for i, n in enumerate(LAYERS)}


# P's blocks, the same for every transfer (P reuses them at once). Its window group
# retired row 0 mid-prefill (the null block) and still holds rows 1 and 2, outside the
# window once the prompt is computed: neither is sent.
PREFILL_GROUPS = [[NULL_BLOCK, 11, 21, 31, 41, 51], [10, 20, 30, 40, 50, 60]]


def decode_groups(i: int) -> list[list[int]]:
    """Where D loads transfer i: blocks no other transfer uses, out of order; the null
    block for the window group's retired rows, as vLLM allocates a loaded prompt's."""
    base = 12 * i
    return [[NULL_BLOCK] * RETIRED + [base + 3 + 2 * j for j in (1, 0, 2)],
            [base + 2 + 2 * j for j in (2, 0, 5, 3, 1, 4)]]


def cached_blocks(i: int) -> int:
    """Transfer i's prefix hit on D: none, one block, or past the window's retired rows."""
    return (0, 1, 4)[i % 3]


def worker(broker: str, role: str, kv: dict[str, torch.Tensor], **extra: object) -> ConnectorWorker:
    config = parse_config(
        {"broker": broker, "instance_id": role, "pool_bytes": 1 << 24, "staging_bytes": 1 << 24, "transport": "nccl",
         **extra},
        kv_role="kv_producer" if role == "p" else "kv_consumer", engine_id=None,
    )
    info = hybrid_info(GROUP, block_size=BLOCK_SIZE, heads=HEADS, head_size=HEAD_SIZE, window=WINDOW,
                       backend="FLASH_ATTN")
    w = ConnectorWorker(config, info)
    w.register_kv_caches(kv)
    return w


def prefill_step(p: ConnectorWorker, kv: dict[str, torch.Tensor], i: int) -> None:
    """Transfer i's prefill step: the model's KV written into P's blocks of each layer's
    group, then saved layer by layer, each layer's blocks overwritten on the compute
    stream right after its save_kv_layer returns (the seed's race)."""
    model = model_kv(i)
    for n in LAYERS:
        rows = [r for r, b in enumerate(PREFILL_GROUPS[GROUP[n]]) if b != NULL_BLOCK]
        kv[n][:, [PREFILL_GROUPS[GROUP[n]][r] for r in rows]] = model[n][:, rows].to(kv[n].device)
    p.bind(KvBrokerMetadata(saves={f"g{i}": SaveSpec(
        req_id=f"req-g{i}", block_ids=PREFILL_GROUPS[0], groups=PREFILL_GROUPS, num_tokens=TOKENS, decode="d")}))
    for n in LAYERS:
        p.save_kv_layer(n, kv[n])
        kv[n][:, [b for b in PREFILL_GROUPS[GROUP[n]] if b != NULL_BLOCK]] = -7.0  # the next step writes these at once
    p.wait_for_save()
    p.clear()


def load_all(d: ConnectorWorker, transfers: int) -> None:
    """Every transfer's load at once, as the requests reach D."""
    d.bind(KvBrokerMetadata(loads={
        f"g{i}": LoadSpec(req_id=f"req-g{i}", block_ids=decode_groups(i)[0], groups=decode_groups(i),
                          num_cached_blocks=cached_blocks(i), num_tokens=TOKENS, prefill="p")
        for i in range(transfers)}))
    d.start_load_kv()
    d.clear()


def check(kv: dict[str, torch.Tensor], before: dict[str, torch.Tensor], transfers: int) -> dict[str, int]:
    """Compare D's blocks with the model's KV (bits, on the CPU): each layer's rows from
    its group's first live one past the prefix hit hold that layer's KV in that group's
    blocks; every other block of each tensor (the null block, the prefix hit, the other
    group's, the window's retired rows) is unchanged."""
    torch.cuda.synchronize(next(iter(kv.values())).device)
    counts = {"checked": 0, "mismatched": 0, "unchanged": 0, "changed": 0}
    written: set[tuple[int, int]] = set()  # (tensor, block)
    for i in range(transfers):
        model, groups, cached = model_kv(i), decode_groups(i), cached_blocks(i)
        for j, n in enumerate(LAYERS):
            got = kv[n].cpu()
            first = max(cached, RETIRED if GROUP[n] == 0 else 0)
            for row in range(first, ROWS):
                blk = groups[GROUP[n]][row]
                counts["mismatched"] += not torch.equal(_bits(got[:, blk]), _bits(model[n][:, row]))
                counts["checked"] += 1
                written.add((j // 2, blk))
    for j in (0, 2):
        got, was = kv[LAYERS[j]].cpu(), before[LAYERS[j]]
        for blk in range(NUM_BLOCKS):
            if (j // 2, blk) not in written:
                key = "unchanged" if torch.equal(_bits(got[:, blk]), _bits(was[:, blk])) else "changed"
                counts[key] += 1
    return counts


def expected_checks(transfers: int) -> int:
    """Cells `check` compares: two full layers and two window layers a transfer."""
    return sum(2 * (ROWS - cached_blocks(i)) + 2 * (ROWS - max(cached_blocks(i), RETIRED)) for i in range(transfers))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def prefill_main(args: argparse.Namespace) -> dict[str, object]:
    kv = caches(args.device, seed=60)
    p = worker(args.broker, "p", kv, load_timeout_s=60)
    try:
        print(json.dumps({"registered": True}), flush=True)
        sys.stdin.readline()
        prefill_step(p, kv, 0)
        sys.stdin.readline()
        for i in range(1, args.transfers):
            prefill_step(p, kv, i)
        wait_until(lambda: p.statistics()["staged_now"] == 0, 60, "every transfer released")
        assert p.pool is not None
        wait_until(lambda: p.pool.statistics().leases == 0, 20, "the staging back in its pool")
        stats = p.statistics()
        assert p.nccl is not None
        backends = sorted({c.backend for c in p.nccl.cache._comms.values()})
    finally:
        p.close()
    return {**{k: stats[k] for k in ("staged", "released", "aborted")}, "triton_copies": p.paged is not None,
            "backends": backends}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--broker", required=True)
    ap.add_argument("--transfers", type=int, required=True)
    ap.add_argument("--device", default="cuda:0")
    args = ap.parse_args()
    configure_logging("json", "warning", sys.stderr)  # stdout carries the results
    print(json.dumps(prefill_main(args)), flush=True)


if __name__ == "__main__":
    main()
