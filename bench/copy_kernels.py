"""The ipc backend's copy into D's blocks (`ipc_blocks`), alone on one GPU and beside matrix multiplies.

The kernel runs on `COPY_PROGRAMS` programs, so its rate is bound by the loads each
program keeps in flight: its step (`_COPY_BLOCK` words) and warps (`_COPY_WARPS`). This
times the shipped step against the one before it (2,048 words, 8 warps), with torch's
`copy_` of the same bytes on every SM as the baseline, for Llama-3-8B-shaped KV (32
layers, K and V rows of 32 KiB a block of 16 tokens), from staging into blocks at random
places of a cache. Then eight such sends of 2,048 tokens on a second stream beside 20 ms
of bf16 matrix multiplies: how much longer the multiplies took, and when the copies ended.

    python bench/copy_kernels.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from connector_path import gpu_ms  # noqa: E402
from workers.transports import cuda_ipc  # noqa: E402

ROW_WORDS, PRE, LAYERS, TOKENS_A_BLOCK = 4096, 2, 32, 16
CACHE_BLOCKS = 4200
REPS = 20
SHAPES = {"shipped": (cuda_ipc._COPY_BLOCK, cuda_ipc._COPY_WARPS), "previous": (2048, 8)}


class _Bench:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cache = [torch.zeros(PRE, CACHE_BLOCKS, ROW_WORDS, dtype=torch.int64, device=device)
                      for _ in range(LAYERS)]
        self.layers = torch.tensor([c.data_ptr() for c in self.cache], dtype=torch.int64, device=device)
        self.counters = torch.zeros(8, dtype=torch.int64, device=device)
        self.counters[0] = 1 << 40  # `ready`: every send may copy
        most = 512
        self.staging = torch.randint(0, 1 << 40, (most * LAYERS * PRE * ROW_WORDS,), dtype=torch.int64, device=device)
        g = torch.Generator().manual_seed(0)
        self.ids = {n: torch.randperm(CACHE_BLOCKS, generator=g)[:n].to(device) for n in (32, 128, 512)}
        self.kernel = cuda_ipc._blocks_kernel()
        self.seq = 0
        torch.cuda.synchronize(device)

    def send(self, blocks: int, stream: torch.cuda.Stream, shape: tuple[int, int]) -> None:
        self.seq += 1
        c = self.counters.data_ptr()
        args = cuda_ipc.block_args(self.seq, src=self.staging.data_ptr(), layers=self.layers.data_ptr(),
                                   ids=self.ids[blocks].data_ptr(), num_cache_blocks=CACHE_BLOCKS, ready=c,
                                   arrived=c + 8, tally=c + 16, shape=(blocks, LAYERS, PRE, ROW_WORDS * 8))
        with torch.cuda.stream(stream):
            self.kernel[(cuda_ipc.block_grid(cuda_ipc.COPY_PROGRAMS, args),)](
                *args, BLOCK=shape[0], ABORT_AT=cuda_ipc.ABORT, num_warps=shape[1])

    def check(self, blocks: int, shape: tuple[int, int]) -> None:
        for c in self.cache:
            c.zero_()
        torch.cuda.synchronize(self.device)  # the zeroing before the copy on another stream
        self.send(blocks, torch.cuda.Stream(self.device), shape)
        torch.cuda.synchronize(self.device)
        staged = self.staging[: blocks * LAYERS * PRE * ROW_WORDS].view(blocks, LAYERS, PRE, ROW_WORDS)
        for layer in range(LAYERS):
            for p in range(PRE):
                if not torch.equal(self.cache[layer][p][self.ids[blocks]], staged[:, layer, p]):
                    raise SystemExit(f"the copy with step {shape} put other bytes in layer {layer}")


def beside_gemm(bench: _Bench, rounds: int = 11) -> dict[str, Any]:
    """20 ms of matrix multiplies on one stream, alone and with eight sends of 2,048
    tokens on another started with them, for each kernel step, alternated in every
    round (a GPU's clocks drift within a call): medians, ms, of the multiplies alone,
    of what each step's copies added to them, and of when those copies ended."""
    dev = bench.device
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=dev)
    b = torch.randn_like(a)
    out = torch.empty_like(a)
    compute, side = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    e = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    with torch.cuda.stream(compute):
        torch.mm(a, b, out=out)
        e[0].record(compute)
        for _ in range(10):
            torch.mm(a, b, out=out)
        e[1].record(compute)
    torch.cuda.synchronize(dev)
    n = max(1, round(20 / (e[0].elapsed_time(e[1]) / 10)))

    def once(shape: tuple[int, int] | None) -> tuple[float, float]:
        torch.cuda.synchronize(dev)
        e[0].record(compute)
        with torch.cuda.stream(compute):
            for _ in range(n):
                torch.mm(a, b, out=out)
        e[1].record(compute)
        if shape is not None:
            side.wait_event(e[0])
            for _ in range(8):
                bench.send(128, side, shape)
            e[2].record(side)
        torch.cuda.synchronize(dev)
        return e[0].elapsed_time(e[1]), e[0].elapsed_time(e[2]) if shape is not None else 0.0

    alone: list[float] = []
    added: dict[str, list[float]] = {name: [] for name in SHAPES}
    ends: dict[str, list[float]] = {name: [] for name in SHAPES}
    names = list(SHAPES)
    for r in range(rounds):
        base = once(None)[0]
        alone.append(base)
        for name in names[r % 2:] + names[: r % 2]:
            took, end = once(SHAPES[name])
            added[name].append(took - base)
            ends[name].append(end)
    return {"gemm_alone_ms": round(statistics.median(alone), 3),
            **{name: {"stretch_ms": round(statistics.median(added[name]), 3),
                      "copies_end_ms": round(statistics.median(ends[name]), 3)} for name in names}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no GPU: nothing to time")
        return 0
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    bench = _Bench(device)
    for shape in SHAPES.values():
        bench.check(128, shape)
    rows: list[dict[str, Any]] = []
    print(f"{'tokens':>7} {'MiB':>6} {'copy_ ms':>9} {'shipped ms':>11} {'TB/s':>6} {'previous ms':>12} {'TB/s':>6}"
          f" {'x previous':>11}")
    for blocks in (32, 128, 512):
        nbytes = blocks * LAYERS * PRE * ROW_WORDS * 8
        src = bench.staging[: nbytes // 8]
        dst = torch.empty_like(src)
        current = torch.cuda.current_stream(device)
        for shape in SHAPES.values():  # compiled before they are timed
            bench.send(blocks, current, shape)
        base = gpu_ms(lambda: dst.copy_(src), REPS)
        ms = {name: gpu_ms(lambda shape=shape: bench.send(blocks, current, shape), REPS)
              for name, shape in SHAPES.items()}
        row = {"tokens": blocks * TOKENS_A_BLOCK, "MiB": nbytes >> 20, "copy_ms": round(base, 4),
               **{f"{name}_ms": round(v, 4) for name, v in ms.items()},
               **{f"{name}_TBps": round(nbytes / v / 1e9, 3) for name, v in ms.items()},
               "programs": cuda_ipc.COPY_PROGRAMS, "x_previous": round(ms["previous"] / ms["shipped"], 3)}
        rows.append(row)
        print(f"{row['tokens']:>7} {row['MiB']:>6} {base:>9.3f} {ms['shipped']:>11.3f} {row['shipped_TBps']:>6.2f}"
              f" {ms['previous']:>12.3f} {row['previous_TBps']:>6.2f} {row['x_previous']:>11.2f}")
    beside = beside_gemm(bench)
    print(f"8 x 2,048 tokens beside {beside['gemm_alone_ms']:.2f} ms of matrix multiplies: " + "; ".join(
        f"{name}: multiplies +{beside[name]['stretch_ms']:.2f} ms, copies end at {beside[name]['copies_end_ms']:.2f}"
        for name in SHAPES))
    result = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__, "rows": rows,
              "beside_gemm": beside}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
