"""The ipc backend's cost per op against the direct NCCL backend's, on 2 GPUs of one host.

P sends `--ops` chunks of `--mib` MiB each, back to back, to D, with D's receives
posted first; each row times P's posts to D seeing the last one land (median of
`--iters`), for each copy grid of `--programs` (`ipc@G`) and over NCCL (`nccl`).

Usage: python bench/ipc_ops.py [--ops 4] [--mib 16,64] [--programs 32,64,132] [--iters 30]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch
import torch.multiprocessing as mp

VARIANTS = ("ipc", "nccl")


def _worker(role: str, dev: int, outbox: Any, inbox: Any, results: Any, cfg: dict[str, Any]) -> None:
    try:
        from workers.transports.nccl import CommunicatorCache, QueueRendezvous

        torch.cuda.set_device(dev)
        device = torch.device("cuda", dev)
        rdv = QueueRendezvous(outbox, inbox, timeout_s=60.0)
        out: dict[str, float] = {}
        for variant in cfg["variants"]:
            backend = "direct" if variant == "nccl" else "ipc"
            for programs in cfg["programs"] if backend == "ipc" else [0]:
                from workers.transports import cuda_ipc

                cuda_ipc.COPY_PROGRAMS = programs or cuda_ipc.COPY_PROGRAMS
                cache = CommunicatorCache(role, device, rdv, backend=backend)
                comm = cache.get("D" if role == "P" else "P", initiator=role == "P")
                for mib in cfg["mib"]:
                    n = mib << 20
                    buf = torch.ones(cfg["ops"] * n, dtype=torch.uint8, device=device)
                    times = []
                    for _ in range(cfg["iters"] + 3):
                        torch.cuda.synchronize(device)
                        if role == "D":
                            works = [comm.post_range("recv", buf, k * n, n, torch.cuda.current_stream(device))
                                     for k in range(cfg["ops"])]
                            rdv.publish("P", "posted", b"1")
                            done = comm.completion(works, torch.cuda.current_stream(device), "recv")
                            done.wait(time.monotonic() + 30)
                            landed = time.monotonic()
                            rdv.receive("P", "sent")  # lockstep: the next round starts with both sides idle
                            rdv.publish("P", "landed", str(landed).encode())
                        else:
                            rdv.receive("D", "posted")
                            t0 = time.monotonic()
                            works = [comm.post_range("send", buf, k * n, n, torch.cuda.current_stream(device))
                                     for k in range(cfg["ops"])]
                            comm.completion(works, torch.cuda.current_stream(device), "send").wait(
                                time.monotonic() + 30)
                            sent = time.monotonic()
                            rdv.publish("D", "sent", b"1")
                            t1 = max(sent, float(rdv.receive("D", "landed")))
                            times.append((t1 - t0) * 1e3)
                    if role == "P":
                        label = variant if backend != "ipc" else f"{variant}@{programs}"
                        out[f"{label} {mib}"] = statistics.median(times[3:])
                        results.put(("row", {f"{label} {mib}": out[f"{label} {mib}"]}))
                cache.close()
        results.put((role, out))
    except BaseException:  # noqa: BLE001 - reported to the parent
        results.put((role, {"error": traceback.format_exc()}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", type=int, default=4)
    ap.add_argument("--mib", default="16,64")
    ap.add_argument("--programs", default="32,64,132")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    cfg = {"ops": args.ops, "mib": [int(m) for m in args.mib.split(",")], "iters": args.iters,
           "programs": [int(p) for p in args.programs.split(",")], "variants": args.variants.split(",")}
    ctx = mp.get_context("spawn")
    p_to_d, d_to_p, results = ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=("P", 0, p_to_d, d_to_p, results, cfg)),
             ctx.Process(target=_worker, args=("D", 1, d_to_p, p_to_d, results, cfg))]
    for p in procs:
        p.start()
    got: dict[str, dict[str, Any]] = {"row": {}}
    while "P" not in got or "D" not in got:
        role, res = results.get(timeout=600)
        got.setdefault(role, {}).update(res)
    for p in procs:
        p.join(30)
    for role in ("P", "D"):
        if "error" in got[role]:
            print(f"{role} failed:\n{got[role]['error']}")
    rows = got["row"]
    print(f"{'row':28} {'ms':>8} {'GB/s':>8}   ({args.ops} ops a transfer)")
    for key, ms in rows.items():
        if key == "error":
            continue
        label, mib = key.rsplit(" ", 1)
        print(f"{label:22} {mib:>5} {ms:8.3f} {args.ops * int(mib) * 2**20 / ms / 1e6:8.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"cfg": cfg, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
