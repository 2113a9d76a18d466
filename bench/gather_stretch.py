"""What materializing the KV costs P's forward pass on a GPU: the gathers' stretch.

P's `save_kv_layer` gathers each layer's blocks of the step's requests into staging on
the compute stream before it returns (the seed's invariant: the KV is copied in stream
order before any send is posted), so those copies lengthen the forward pass. Here, on
one GPU, without a peer: a forward pass of 32 layers, each a share of `--prefill-ms`
of sleep kernel (GPU time that leaves the SMs and memory free), alone; then with each
layer's gather after it (`PagedKv.gather_layer_at`, one kernel for every request of the
step, as P runs it); then with a copy of the same bytes on a second stream beside it, as
the sends' copies run on one GPU. The baseline is a plain `copy_` of the step's bytes,
in the same run: the gathers' rate against it says how close they are to the memory's.

Llama-3-8B-shaped KV (32 layers, 8 KV heads, head 128, bf16, block 16), `--requests`
requests of each `--tokens` length in one step. Prints a table (median of `--reps`, GPU
time by CUDA events); `--json PATH` writes the rows. Needs a CUDA GPU and Triton.

Usage: python bench/gather_stretch.py [--tokens 512,2048] [--requests 1,8] [--prefill-ms 20] [--reps 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from connector_path import gpu_ms as _gpu_ms  # noqa: E402
from workers.gpu_staging import PagedKv  # noqa: E402

LAYERS, HEADS, DIM, BLOCK = 32, 8, 128, 16


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="512,2048", help="each request's prompt length")
    ap.add_argument("--requests", default="1,8", help="requests saved in one step")
    ap.add_argument("--prefill-ms", type=float, default=20.0)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench/gather_stretch.py needs a CUDA GPU", file=sys.stderr)
        return 2
    tokens = [int(t) for t in args.tokens.split(",")]
    counts = [int(k) for k in args.requests.split(",")]
    dev = torch.device("cuda:0")
    torch.cuda.set_device(dev)
    num_blocks = max(counts) * max(tokens) // BLOCK * 2
    caches = [torch.randn(2, num_blocks, BLOCK, HEADS, DIM, device=dev, dtype=torch.bfloat16) for _ in range(LAYERS)]
    paged = PagedKv(caches)
    paged.precompile()
    cycles = int(1_000_000 / _gpu_ms(lambda: torch.cuda._sleep(1_000_000), 3) * args.prefill_ms / LAYERS)
    side = torch.cuda.Stream(dev)
    rows: list[dict[str, Any]] = []
    for k in counts:
        for tok in tokens:
            n = k * tok // BLOCK
            nbytes = n * paged.staged_block_nbytes
            ids = paged.block_ids(torch.randperm(num_blocks)[:n].tolist())
            staging = torch.empty(nbytes // 8, dtype=torch.int64, device=dev)
            src, dst = torch.empty_like(staging), torch.empty_like(staging)
            share = nbytes // 8 // LAYERS

            def gathers() -> None:
                for layer in range(LAYERS):
                    paged.gather_layer_at(layer, ids, staging, 0)

            def forward(gather: bool, beside: bool) -> None:
                if beside:  # the sends: a layer's bytes at a time on their own stream
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(side):
                        for _ in range(LAYERS):
                            dst[:share].copy_(src[:share])
                for layer in range(LAYERS):
                    torch.cuda._sleep(cycles)
                    if gather:
                        paged.gather_layer_at(layer, ids, staging, 0)
                if beside:
                    torch.cuda.current_stream().wait_stream(side)

            g = _gpu_ms(gathers, args.reps)
            plain = _gpu_ms(lambda: dst.copy_(src), args.reps)
            alone = _gpu_ms(lambda: forward(False, False), args.reps)
            with_gathers = _gpu_ms(lambda: forward(True, False), args.reps)
            with_sends = _gpu_ms(lambda: forward(True, True), args.reps)
            rows.append({"requests": k, "tokens": tok, "MiB": nbytes / 2**20, "gathers_ms": round(g, 3),
                         "gathers_GBps": round(nbytes / g / 1e6), "plain_copy_ms": round(plain, 3),
                         "plain_copy_GBps": round(nbytes / plain / 1e6), "vs_plain": round(plain / g, 3),
                         "forward_ms": round(alone, 3), "stretch_gathers_ms": round(with_gathers - alone, 3),
                         "stretch_gathers_and_sends_ms": round(with_sends - alone, 3)})
    print(f"{'requests':>9}{'tokens':>8}{'MiB':>7}{'gathers ms':>12}{'GB/s':>7}{'copy_ ms':>10}{'GB/s':>7}"
          f"{'x copy_':>9}{'forward ms':>12}{'+gathers':>10}{'+sends':>9}")
    for r in rows:
        print(f"{r['requests']:>9}{r['tokens']:>8}{r['MiB']:>7.0f}{r['gathers_ms']:>12.3f}{r['gathers_GBps']:>7}"
              f"{r['plain_copy_ms']:>10.3f}{r['plain_copy_GBps']:>7}{r['vs_plain']:>9.3f}{r['forward_ms']:>12.3f}"
              f"{r['stretch_gathers_ms']:>10.3f}{r['stretch_gathers_and_sends_ms']:>9.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": vars(args), "rows": rows, "torch": torch.__version__,
                       "device": torch.cuda.get_device_name(0)}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
