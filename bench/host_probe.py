"""Host cost of the CUDA calls on a transfer's critical path, by how long the thread was idle.

P's steps before its first send (an event record, a copy kernel's launch, a pool
lease, a few tensor views) each cost microseconds when run back to back, and several
times more in the end-to-end benchmark, where P sleeps between iterations. This
measures the same calls on one GPU after each kind of gap: none (back to back), a
spin of 50 us or 2 ms (the thread busy, as an engine's is), and a sleep of 0.1, 1 or
5 ms (the thread idle). Median of `--rounds` per cell, in microseconds.

Usage: python bench/host_probe.py [--rounds 200] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Any, Callable

import torch

def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


GAPS: dict[str, Callable[[], None]] = {
    "none": lambda: None,
    "spin_50us": lambda: _spin(50e-6),
    "spin_2ms": lambda: _spin(2e-3),
    "sleep_0.1ms": lambda: time.sleep(1e-4),
    "sleep_1ms": lambda: time.sleep(1e-3),
    "sleep_5ms": lambda: time.sleep(5e-3),
}


def _calls(dev: torch.device) -> dict[str, Callable[[], Any]]:
    x = torch.zeros(1, device=dev)
    big = torch.empty(64 << 20, dtype=torch.uint8, device=dev)
    stream = torch.cuda.current_stream(dev)
    ev = torch.cuda.Event()
    ev.record(stream)
    return {
        "perf_counter": time.perf_counter,
        "event_new_record": lambda: torch.cuda.Event().record(stream),
        "event_record": lambda: ev.record(stream),
        "event_query": ev.query,
        "event_object": torch.cuda.Event,
        # As a chunk's gather is followed by its event: a new event, or one made earlier.
        "add+event_new": lambda: (x.add_(1), torch.cuda.Event().record(stream)),
        "add+event_reuse": lambda: (x.add_(1), ev.record(stream)),
        "add_kernel": lambda: x.add_(1),
        "view_slice": lambda: big[1024:2048].view(torch.int32),
        "empty_small": lambda: torch.empty(16, device=dev),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda", 0)
    calls = _calls(dev)
    for fn in calls.values():  # warm up: handles, kernels and caches exist before timing
        for _ in range(20):
            fn()
    torch.cuda.synchronize(dev)
    table: dict[str, dict[str, float]] = {}
    for gap_name, gap in GAPS.items():
        row = {}
        for name, fn in calls.items():
            samples = []
            for _ in range(args.rounds):
                gap()
                t0 = time.perf_counter()
                fn()
                samples.append((time.perf_counter() - t0) * 1e6)
            row[name] = round(statistics.median(samples), 2)
            torch.cuda.synchronize(dev)
        table[gap_name] = row
    names = list(calls)
    print(f"{'gap':<14}" + "".join(f"{n:>18}" for n in names))
    for gap_name, row in table.items():
        print(f"{gap_name:<14}" + "".join(f"{row[n]:>18.2f}" for n in names))
    info = {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
            "affinity": len(os.sched_getaffinity(0)), "gpu": torch.cuda.get_device_name(dev)}
    print(json.dumps(info))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"us": table, **info}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
