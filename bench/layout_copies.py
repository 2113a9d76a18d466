"""The connector's per-layer block copies on the CPU: staging gathers and scatters.

P's `save_kv_layer` gathers a request's blocks of one layer into block-major staging
(`workers.layout.gather_layer_into_staging`) and D scatters them back
(`scatter_layer_from_staging`), on vLLM's own thread. Rows are copied as the widest
integer words they allow; the baseline, in the same run, is the same indexed copies on
the bytes as uint8, as they were first written.

Layouts: vLLM's CPU cache ``[blocks, H, bs, 2D]`` and the GPU ``kv_first`` shape
``[2, blocks, bs, H, D]`` (held on the CPU here), 8 KV heads, head 128, block 16, bf16.

A second table times D's scatter of a short request (1 and 8 blocks of 32 layers, the
CPU layout), where the host's cost per call outweighs the bytes: every layer at once
(`scatter_layers_from_staging`, what D runs) against a call per layer, in the same run.

Prints both tables (median of `--reps`); `--json PATH` writes the rows.

Usage: python bench/layout_copies.py [--layers 8] [--blocks 128] [--reps 7] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, Callable

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from workers.layout import (  # noqa: E402
    CacheSpec,
    detect_layout,
    gather_layer_into_staging,
    scatter_layer_from_staging,
    scatter_layers_from_staging,
    staging_view,
)
from workers.layout import _blocks, _staging_slice  # noqa: E402  (the baseline's views)

HEADS, DIM, BLOCK = 8, 128, 16


def _timed(fn: Callable[[], None], reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _short_scatters(spec: CacheSpec, reps: int, layers: int = 32) -> list[dict[str, Any]]:
    """D's scatter of a request of a few blocks: every layer at once against a call per layer."""
    g = torch.Generator().manual_seed(1)
    caches = [torch.randn((64, HEADS, BLOCK, 2 * DIM), generator=g).to(torch.bfloat16) for _ in range(layers)]
    lay = detect_layout(caches[0], spec)
    out = []
    for n in (1, 8):
        staging = staging_view(torch.empty(n * layers * lay.block_nbytes, dtype=torch.uint8), n, layers,
                               lay.block_nbytes)
        ids = torch.randperm(64, generator=g)[:n].tolist()

        def at_once() -> None:
            scatter_layers_from_staging(staging, [(c, lay) for c in caches], ids)

        def per_layer() -> None:
            for i, c in enumerate(caches):
                scatter_layer_from_staging(staging, i, c, lay, ids)

        at_once()
        per_layer()
        t_once, t_each = _timed(at_once, reps), _timed(per_layer, reps)
        out.append({"blocks": n, "layers": layers, "at_once_ms": round(t_once * 1e3, 3),
                    "per_layer_ms": round(t_each * 1e3, 3), "x_per_layer": round(t_each / t_once, 2)})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=128, help="blocks a request moves")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    spec = CacheSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=DIM)
    cache_blocks = 4 * args.blocks
    g = torch.Generator().manual_seed(0)
    rows: list[dict[str, Any]] = []
    for shape in ((cache_blocks, HEADS, BLOCK, 2 * DIM), (2, cache_blocks, BLOCK, HEADS, DIM)):
        caches = [torch.randn(shape, generator=g).to(torch.bfloat16) for _ in range(args.layers)]
        lay = detect_layout(caches[0], spec)
        n = args.blocks
        buf = torch.empty(n * args.layers * lay.block_nbytes, dtype=torch.uint8)
        staging = staging_view(buf, n, args.layers, lay.block_nbytes)
        ids = torch.randperm(cache_blocks, generator=g)[:n]
        ids_list = ids.tolist()

        def ours_gather() -> None:
            for i, c in enumerate(caches):
                gather_layer_into_staging(staging, i, c, lay, ids_list)

        def ours_scatter() -> None:
            for i, c in enumerate(caches):
                scatter_layer_from_staging(staging, i, c, lay, ids_list)

        def bytes_gather() -> None:
            for i, c in enumerate(caches):
                src = _blocks(c, lay)
                torch.index_select(src, 0, ids, out=_staging_slice(staging, i, n, lay).view(n, *src.shape[1:]))

        def bytes_scatter() -> None:
            for i, c in enumerate(caches):
                dst = _blocks(c, lay)
                dst.index_copy_(0, ids, _staging_slice(staging, i, n, lay).view(n, *dst.shape[1:]))

        for op, ours, base in (("gather", ours_gather, bytes_gather), ("scatter", ours_scatter, bytes_scatter)):
            ours()  # warm up both
            base()
            t_ours, t_base = _timed(ours, args.reps), _timed(base, args.reps)
            rows.append({"layout": lay.kind, "op": op, "MiB": buf.numel() / 2**20,
                         "words_ms": round(t_ours * 1e3, 3), "uint8_ms": round(t_base * 1e3, 3),
                         "words_GBps": round(buf.numel() / t_ours / 1e9, 2),
                         "uint8_GBps": round(buf.numel() / t_base / 1e9, 2),
                         "x_uint8": round(t_base / t_ours, 2)})
    print(f"{'layout':<10}{'op':<9}{'MiB':>6}{'words ms':>10}{'uint8 ms':>10}{'words GB/s':>12}{'x uint8':>9}")
    for r in rows:
        print(f"{r['layout']:<10}{r['op']:<9}{r['MiB']:>6.0f}{r['words_ms']:>10.2f}{r['uint8_ms']:>10.2f}"
              f"{r['words_GBps']:>12.2f}{r['x_uint8']:>9.2f}")
    short = _short_scatters(spec, args.reps * 5)
    print(f"\n{'blocks':>6}{'layers':>7}{'at once ms':>12}{'per layer ms':>14}{'x per layer':>13}")
    for r in short:
        print(f"{r['blocks']:>6}{r['layers']:>7}{r['at_once_ms']:>12.3f}{r['per_layer_ms']:>14.3f}{r['x_per_layer']:>13.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "short_scatters": short, "threads": torch.get_num_threads(),
                       "torch": torch.__version__}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
