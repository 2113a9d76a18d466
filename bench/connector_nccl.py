"""The vLLM connector's own path over NCCL on 2 GPUs, timed end to end against raw NCCL.

`bench/nccl_transport.py` times the transport alone. This times what a request costs on
the connector's path: the worker halves as vLLM drives them (bind, save_kv_layer,
wait_for_save on P; bind, start_load_kv, get_finished on D), P in one process with its
KV cache on cuda:0, D in another with its cache on cuda:1, Llama-3-8B-shaped KV (32
layers, 8 KV heads, head 128, bf16, block 16), through a real `kvbroker serve` (Offer,
Prepare, Ready, Go, Done, Release, and the communicators' rendezvous). No vLLM (the GPU
host has none) and no model: P's forward pass is only its 32 per-layer gathers.

* raw          one NCCL send/recv of the transfer's bytes over the communicators the
               connector built, D's receive posted first: the ceiling.
* connector    D's request is bound (start_load_kv) and P names D as its decode peer;
               the clock runs from P's bind to D's get_finished reporting the request,
               with D's scatter done on its GPU. D's engine steps all along: each step is
               get_finished, then `--step-ms` of GPU work it waits for (a decode step),
               so D's main thread leaves the GIL to the connector's threads as vLLM's
               does while the GPU runs, and the end is seen within one step.

Once per prompt length, D's blocks are compared with P's. Prints a table; `--json PATH`
writes the rows.

Usage: python bench/connector_nccl.py [--tokens 512,2048,8192] [--iters 20] [--step-ms 1] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from connector.config import EngineInfo, parse_config  # noqa: E402
from connector.scheduler import KvBrokerMetadata, LoadSpec, SaveSpec  # noqa: E402
from connector.worker import ConnectorWorker  # noqa: E402
from protocols.logs import configure_logging  # noqa: E402

LAYERS, HEADS, DIM, BLOCK = 32, 8, 128, 16
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
BLOCK_BYTES = LAYERS * 2 * BLOCK * HEADS * DIM * 2  # one block of every layer, K and V
DEADLINE_S = 30.0


@dataclass(frozen=True)
class Spec:
    block_size: int = BLOCK
    num_kv_heads: int = HEADS
    head_size: int = DIM
    use_mla: bool = False


def _worker(endpoint: str, role: str, device: str, cfg: dict) -> tuple[ConnectorWorker, dict[str, torch.Tensor]]:
    g = torch.Generator(device=device).manual_seed(1 if role == "p" else 2)
    caches = {n: torch.randn(2, cfg["num_blocks"], BLOCK, HEADS, DIM, device=device, generator=g,
                             dtype=torch.bfloat16) for n in NAMES}
    config = parse_config(
        {"broker": endpoint, "instance_id": f"{role}0", "transport": "nccl", "pool_bytes": cfg["pool"],
         "staging_bytes": cfg["pool"], "load_timeout_s": DEADLINE_S},
        kv_role="kv_producer" if role == "p" else "kv_consumer", engine_id=None,
    )
    info = EngineInfo(model="llama-3-8b-shaped", spec=Spec(), block_size=BLOCK, backend="FLASH_ATTN/bench")
    worker = ConnectorWorker(config, info)
    worker.register_kv_caches(caches)
    return worker, caches


def _peer_of(worker: ConnectorWorker) -> str:
    assert worker.client is not None and worker.client.registered is not None
    return worker.client.registered.peer_id


def _prefill(endpoint: str, conn: Any, cfg: dict) -> None:
    """P: for each request, tell D, wait until D holds it, then run the step."""
    torch.cuda.set_device(0)
    configure_logging(cfg["log_format"])
    p, caches = _worker(endpoint, "p", "cuda:0", cfg)
    try:
        conn.send(_peer_of(p))
        d_peer = conn.recv()
        g = torch.Generator().manual_seed(0)
        for tok in cfg["tokens"]:
            n = tok // BLOCK
            for it in range(cfg["warmup"] + cfg["iters"]):
                tid = f"t{tok}-{it}"
                src = torch.randperm(cfg["num_blocks"], generator=g)[:n].tolist()
                check = it == cfg["warmup"]
                conn.send((tid, n, check, {name: caches[name][:, src].cpu() for name in NAMES[::8]} if check else None))
                assert conn.recv() == "bound"
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                p.bind(KvBrokerMetadata(saves={tid: SaveSpec(req_id=f"req-{tid}", block_ids=src,
                                                             num_tokens=n * BLOCK - 1, decode="d0")}))
                for name in NAMES:
                    p.save_kv_layer(name, caches[name])
                p.wait_for_save()
                p.clear()
                conn.send(t0)
                assert conn.recv() == "done"
                # raw: the same bytes over the same communicators, D's receive posted first
                assert p.nccl is not None and p.pool is not None
                comm = p.nccl.cache.get(d_peer, initiator=True)
                assert conn.recv() == "posted"
                torch.cuda.synchronize()
                conn.send(time.perf_counter())
                work = comm.post_range("send", p.pool.tensor, 0, n * BLOCK_BYTES, p.nccl.stream)
                comm.completion([work], p.nccl.stream, "send").wait(time.monotonic() + DEADLINE_S, spin_s=DEADLINE_S)
                assert conn.recv() == "done"
        conn.send(None)
    finally:
        p.close()


def _decode(endpoint: str, conn: Any, cfg: dict, results: Any) -> None:
    """D: hold each request, then step until get_finished reports it."""
    torch.cuda.set_device(1)
    configure_logging(cfg["log_format"])
    d, caches = _worker(endpoint, "d", "cuda:1", cfg)
    rows: list[dict[str, Any]] = []
    try:
        p_peer = conn.recv()
        conn.send(_peer_of(d))
        step = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        step[0].record()
        torch.cuda._sleep(1_000_000)
        step[1].record()
        step[1].synchronize()
        cycles = int(1_000_000 * cfg["step_ms"] / step[0].elapsed_time(step[1]))
        g = torch.Generator().manual_seed(1)
        times: dict[int, tuple[list[float], list[float]]] = {t: ([], []) for t in cfg["tokens"]}
        while (msg := conn.recv()) is not None:
            tid, n, check, want = msg
            tok = n * BLOCK
            dst = torch.randperm(cfg["num_blocks"], generator=g)[:n].tolist()
            d.bind(KvBrokerMetadata(loads={tid: LoadSpec(req_id=f"req-{tid}", block_ids=dst, num_cached_blocks=0,
                                                         num_tokens=n * BLOCK - 1)}))
            d.start_load_kv()
            d.clear()
            conn.send("bound")
            t0 = None
            deadline = time.monotonic() + DEADLINE_S
            while True:  # the engine steps all along, before P's step too (as a busy engine does)
                _, recving = d.get_finished(set())
                if recving and f"req-{tid}" in recving:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"D never finished {tid}: {d.statistics()}")
                if t0 is None and conn.poll():
                    t0 = conn.recv()
                torch.cuda._sleep(cycles)
                torch.cuda.current_stream().synchronize()
            if d.get_block_ids_with_load_errors():
                raise RuntimeError(f"{tid} failed to load: {d.statistics()}")
            torch.cuda.current_stream().synchronize()  # the scatter get_finished enqueued
            t1 = time.perf_counter()
            took = t1 - (t0 if t0 is not None else conn.recv())
            if check:
                for name, got in want.items():
                    assert torch.equal(caches[name][:, dst].cpu(), got), f"{tid}: {name} differs"
            conn.send("done")
            # raw
            assert d.nccl is not None and d.pool is not None
            comm = d.nccl.cache.get(p_peer, initiator=False)
            work = comm.post_range("recv", d.pool.tensor, 0, n * BLOCK_BYTES, d.nccl.stream)
            done = comm.completion([work], d.nccl.stream, "recv")
            conn.send("posted")
            r0 = conn.recv()
            done.wait(time.monotonic() + DEADLINE_S, spin_s=DEADLINE_S)
            raw = time.perf_counter() - r0
            conn.send("done")
            if int(tid.rsplit("-", 1)[1]) >= cfg["warmup"]:
                times[tok][0].append(took)
                times[tok][1].append(raw)
        for tok, (conn_s, raw_s) in times.items():
            r, c = statistics.median(raw_s) * 1e3, statistics.median(conn_s) * 1e3
            rows.append({"tokens": tok, "MiB": tok // BLOCK * BLOCK_BYTES / 2**20, "raw_ms": round(r, 3),
                         "connector_ms": round(c, 3), "connector_min_ms": round(min(conn_s) * 1e3, 3),
                         "connector_max_ms": round(max(conn_s) * 1e3, 3), "vs_raw": round(r / c, 3),
                         "iters": len(conn_s), "stats": d.statistics()})
        results.put(rows)
    except BaseException as exc:
        results.put(repr(exc))
        raise
    finally:
        d.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="512,2048,8192")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--step-ms", type=float, default=1.0, help="D's engine step: GPU time it waits for")
    ap.add_argument("--log-format", default="console", choices=("console", "json"),
                    help="the workers' logs (json: microsecond timestamps, for `kvbroker trace`)")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    if torch.cuda.device_count() < 2:
        print("needs 2 CUDA GPUs", file=sys.stderr)
        return 2
    from nccl_transport import _start_broker  # the same `kvbroker serve` launcher

    tokens = [int(t) for t in args.tokens.split(",")]
    cfg = {"tokens": tokens, "iters": args.iters, "warmup": args.warmup, "step_ms": args.step_ms,
           "log_format": args.log_format,
           "num_blocks": 2 * max(tokens) // BLOCK, "pool": max(tokens) // BLOCK * BLOCK_BYTES + (64 << 20)}
    broker, endpoint = _start_broker()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    conn_p, conn_d = ctx.Pipe()
    procs = [ctx.Process(target=_prefill, args=(endpoint, conn_p, cfg)),
             ctx.Process(target=_decode, args=(endpoint, conn_d, cfg, results))]
    try:
        for proc in procs:
            proc.start()
        rows = results.get(timeout=600)
        for proc in procs:
            proc.join(timeout=60)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        broker.terminate()
        broker.wait(timeout=10)
    if isinstance(rows, str):
        print(f"D failed: {rows}", file=sys.stderr)
        return 1
    print(f"{'tokens':>7}{'MiB':>7}{'raw ms':>9}{'connector ms':>14}{'min':>8}{'max':>8}{'x raw':>8}")
    for r in rows:
        print(f"{r['tokens']:>7}{r['MiB']:>7.0f}{r['raw_ms']:>9.3f}{r['connector_ms']:>14.3f}"
              f"{r['connector_min_ms']:>8.3f}{r['connector_max_ms']:>8.3f}{r['vs_raw']:>8.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": cfg, "rows": rows, "torch": torch.__version__,
                       "gpu": torch.cuda.get_device_name(0)}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
