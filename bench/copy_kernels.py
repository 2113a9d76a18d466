"""The ipc backend's copy into D's blocks (`ipc_blocks`), alone on one GPU and beside matrix multiplies.

The kernel runs on `COPY_PROGRAMS` programs, so its rate is bound by the loads each
program keeps in flight: its step (`_COPY_BLOCK` words) and warps (`_COPY_WARPS`). This
times the shipped step against the one before it (2,048 words, 8 warps), with torch's
`copy_` of the same bytes on every SM as the baseline, for Llama-3-8B-shaped KV (32
layers, K and V rows of 32 KiB a block of 16 tokens), from staging into blocks at random
places of a cache. Then eight such sends of 2,048 tokens on a second stream beside 20 ms
of bf16 matrix multiplies: how much longer the multiplies took, and when the copies ended.
Beside the kernel, the same send made by the copy engines ("engines"): one
`cuMemcpyBatchAsync` of the send's 32 KiB rows, with the host's time to build its
arrays and to make the call.

    python bench/copy_kernels.py [--json out.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from connector_path import gpu_ms  # noqa: E402
from workers.transports import cuda_ipc  # noqa: E402

ROW_WORDS, PRE, LAYERS, TOKENS_A_BLOCK = 4096, 2, 32, 16
CACHE_BLOCKS = 4200
REPS = 20
SHAPES = {"shipped": (cuda_ipc._COPY_BLOCK, cuda_ipc._COPY_WARPS), "previous": (2048, 8)}
ENGINES = "engines"  # the arm that names no kernel shape
ROW_BYTES = ROW_WORDS * 8


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", _MemLocation),
                ("dstLocHint", _MemLocation), ("flags", ctypes.c_uint)]


class _Engines:
    """A send's rows copied by the copy engines: one `cuMemcpyBatchAsync` a send (CUDA
    12.8+). The batch reads its sources in stream order and both ends are this device."""

    def __init__(self, ordinal: int) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        vp, sp = ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)
        self.fn = getattr(lib, "cuMemcpyBatchAsync_v2", None)
        self.fail_idx = self.fn is None  # the first version also reports the failing copy
        if self.fn is None:
            self.fn = getattr(lib, "cuMemcpyBatchAsync", None)
        if self.fn is None:
            raise SystemExit("libcuda has no cuMemcpyBatchAsync: the copy-engine arm needs CUDA 12.8+")
        self.fn.argtypes = [vp, vp, vp, ctypes.c_size_t, ctypes.POINTER(_MemcpyAttributes), sp, ctypes.c_size_t,
                            *([sp] if self.fail_idx else []), vp]
        self.fn.restype = ctypes.c_int
        assert ctypes.sizeof(_MemcpyAttributes) == 24
        here = _MemLocation(1, ordinal)  # CU_MEM_LOCATION_TYPE_DEVICE
        # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM; CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE
        self.attrs = _MemcpyAttributes(1, here, here, 1)
        self.attr_idx = (ctypes.c_size_t * 1)(0)
        self.failed = ctypes.c_size_t()
        self.sizes: dict[int, np.ndarray] = {}
        self.host_arrays_ms: list[float] = []
        self.host_call_ms: list[float] = []

    def send(self, src: np.ndarray, dst: np.ndarray, stream: torch.cuda.Stream) -> None:
        n = src.size
        sizes = self.sizes.setdefault(n, np.full(n, ROW_BYTES, dtype=np.uint64))
        t1 = time.perf_counter()
        extra = (ctypes.byref(self.failed),) if self.fail_idx else ()
        rc = self.fn(dst.ctypes.data, src.ctypes.data, sizes.ctypes.data, n, ctypes.byref(self.attrs),
                     self.attr_idx, 1, *extra, ctypes.c_void_p(stream.cuda_stream))
        t2 = time.perf_counter()
        if rc:
            raise SystemExit(f"cuMemcpyBatchAsync failed: CUDA error {rc}")
        self.host_call_ms.append((t2 - t1) * 1e3)


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
        self.engines = _Engines(device.index or 0)
        self.host_ids = {n: ids.cpu().numpy().astype(np.uint64) for n, ids in self.ids.items()}
        self.layer_ptrs = np.array([c.data_ptr() for c in self.cache], dtype=np.uint64)

    def rows(self, blocks: int) -> tuple[np.ndarray, np.ndarray]:
        """Each row's source in staging (block, layer, K/V) and its place in the cache, as
        the kernel maps them."""
        t0 = time.perf_counter()
        i = np.arange(blocks, dtype=np.uint64)[:, None, None]
        layer = np.arange(LAYERS, dtype=np.uint64)[None, :, None]
        kv = np.arange(PRE, dtype=np.uint64)[None, None, :]
        src = np.uint64(self.staging.data_ptr()) + ((i * LAYERS + layer) * PRE + kv) * np.uint64(ROW_BYTES)
        ids = self.host_ids[blocks][:, None, None]
        dst = self.layer_ptrs[layer] + (kv * np.uint64(CACHE_BLOCKS) + ids) * np.uint64(ROW_BYTES)
        src, dst = np.ascontiguousarray(src.reshape(-1)), np.ascontiguousarray(dst.reshape(-1))
        self.engines.host_arrays_ms.append((time.perf_counter() - t0) * 1e3)
        return src, dst
        torch.cuda.synchronize(device)

    def send(self, blocks: int, stream: torch.cuda.Stream, shape: tuple[int, int] | None) -> None:
        if shape is None:
            self.engines.send(*self.rows(blocks), stream)
            return
        self.seq += 1
        c = self.counters.data_ptr()
        args = cuda_ipc.block_args(self.seq, src=self.staging.data_ptr(), layers=self.layers.data_ptr(),
                                   ids=self.ids[blocks].data_ptr(), num_cache_blocks=CACHE_BLOCKS, ready=c,
                                   arrived=c + 8, tally=c + 16, shape=(blocks, LAYERS, PRE, ROW_WORDS * 8))
        with torch.cuda.stream(stream):
            self.kernel[(cuda_ipc.block_grid(cuda_ipc.COPY_PROGRAMS, args),)](
                *args, BLOCK=shape[0], ABORT_AT=cuda_ipc.ABORT, num_warps=shape[1])

    def check(self, blocks: int, shape: tuple[int, int] | None) -> None:
        for c in self.cache:
            c.zero_()
        torch.cuda.synchronize(self.device)  # the zeroing before the copy on another stream
        self.send(blocks, torch.cuda.Stream(self.device), shape)
        torch.cuda.synchronize(self.device)
        staged = self.staging[: blocks * LAYERS * PRE * ROW_WORDS].view(blocks, LAYERS, PRE, ROW_WORDS)
        for layer in range(LAYERS):
            for p in range(PRE):
                if not torch.equal(self.cache[layer][p][self.ids[blocks]], staged[:, layer, p]):
                    raise SystemExit(f"the copy {shape or ENGINES} put other bytes in layer {layer}")


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

    arms: dict[str, tuple[int, int] | None] = {**SHAPES, ENGINES: None}

    def once(arm: str | None) -> tuple[float, float]:
        torch.cuda.synchronize(dev)
        e[0].record(compute)
        with torch.cuda.stream(compute):
            for _ in range(n):
                torch.mm(a, b, out=out)
        e[1].record(compute)
        if arm is not None:
            side.wait_event(e[0])
            for _ in range(8):
                bench.send(128, side, arms[arm])
            e[2].record(side)
        torch.cuda.synchronize(dev)
        return e[0].elapsed_time(e[1]), e[0].elapsed_time(e[2]) if arm is not None else 0.0

    alone: list[float] = []
    added: dict[str, list[float]] = {name: [] for name in arms}
    ends: dict[str, list[float]] = {name: [] for name in arms}
    names = list(arms)
    for r in range(rounds):
        base = once(None)[0]
        alone.append(base)
        for name in names[r % len(names):] + names[: r % len(names)]:
            took, end = once(name)
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
    arms: dict[str, tuple[int, int] | None] = {**SHAPES, ENGINES: None}
    for arm in arms.values():
        bench.check(128, arm)
    rows: list[dict[str, Any]] = []
    print(f"{'tokens':>7} {'MiB':>6} {'copy_ ms':>9} {'shipped ms':>11} {'TB/s':>6} {'previous ms':>12} {'TB/s':>6}"
          f" {'x previous':>11} {'engines ms':>11} {'TB/s':>6} {'host ms':>8}")
    for blocks in (32, 128, 512):
        nbytes = blocks * LAYERS * PRE * ROW_WORDS * 8
        src = bench.staging[: nbytes // 8]
        dst = torch.empty_like(src)
        # Not the legacy default stream: the batched copy refuses it.
        current = torch.cuda.Stream(device)
        with torch.cuda.stream(current):
            for arm in arms.values():  # compiled before they are timed
                bench.send(blocks, current, arm)
            base = gpu_ms(lambda: dst.copy_(src), REPS)
            bench.engines.host_arrays_ms.clear()
            bench.engines.host_call_ms.clear()
            ms = {name: gpu_ms(lambda arm=arm: bench.send(blocks, current, arm), REPS)
                  for name, arm in arms.items()}
        host = statistics.median(bench.engines.host_arrays_ms) + statistics.median(bench.engines.host_call_ms)
        row = {"tokens": blocks * TOKENS_A_BLOCK, "MiB": nbytes >> 20, "copy_ms": round(base, 4),
               **{f"{name}_ms": round(v, 4) for name, v in ms.items()},
               **{f"{name}_TBps": round(nbytes / v / 1e9, 3) for name, v in ms.items()},
               "programs": cuda_ipc.COPY_PROGRAMS, "x_previous": round(ms["previous"] / ms["shipped"], 3),
               "engines_host_arrays_ms": round(statistics.median(bench.engines.host_arrays_ms), 4),
               "engines_host_call_ms": round(statistics.median(bench.engines.host_call_ms), 4)}
        rows.append(row)
        print(f"{row['tokens']:>7} {row['MiB']:>6} {base:>9.3f} {ms['shipped']:>11.3f} {row['shipped_TBps']:>6.2f}"
              f" {ms['previous']:>12.3f} {row['previous_TBps']:>6.2f} {row['x_previous']:>11.2f}"
              f" {ms[ENGINES]:>11.3f} {row['engines_TBps']:>6.2f} {host:>8.3f}")
    beside = beside_gemm(bench)
    print(f"8 x 2,048 tokens beside {beside['gemm_alone_ms']:.2f} ms of matrix multiplies: " + "; ".join(
        f"{name}: multiplies +{beside[name]['stretch_ms']:.2f} ms, copies end at {beside[name]['copies_end_ms']:.2f}"
        for name in arms))
    result = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__, "rows": rows,
              "beside_gemm": beside}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
