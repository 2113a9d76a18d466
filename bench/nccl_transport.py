"""End-to-end KV transfer over NCCL between two GPUs, against two baselines.

P runs on cuda:0 and D on cuda:1, in two processes. The KV is shaped like Llama-3-8B
(32 layers, 8 KV heads, head 128, bf16, 16-token blocks: 2 MiB per block, 128 KiB per
token). For each prompt length it times, P's clock start to D's clock end (both
`time.perf_counter`, i.e. CLOCK_MONOTONIC, shared by processes on one host):

* raw          one NCCL send/recv of the same bytes as one contiguous tensor, receive
               posted in advance: the ceiling.
* ours_full    gather on P in block chunks (one kernel each), each chunk's send
               posted right after its gather; the handshake (the Offer leaves before
               the first gather, so the round trip overlaps it); receive into a pool
               lease; scatter into D's blocks, chunk by chunk as receives complete.
* ours_staged  the same with the gather already done: in vLLM, `save_kv_layer`
               gathers each layer while the forward pass runs, so after the last layer
               the critical path is this (plus the last layer's gather, ~1/32 of it).
* ours_data    ours_staged without the handshake (D's receive posted in advance): the
               data path alone.
* ours_full_1  ours_full without pipelining (one chunk): what the pipelining buys.
* per_layer    vLLM's P2pNcclConnector pattern: for each layer, extract its blocks,
               a ZMQ PUT and its ack, one NCCL send and a stream synchronize; D
               allocates, receives and injects each layer.

The handshake here is a pluggable `Handshake`; `PipeHandshake` is one round trip over
a multiprocessing pipe. The broker's Offer/Prepare/Ready/Go path adds about 0.1 ms
more; in vLLM it overlaps the forward pass unless the prompt is short.

Usage: python bench/nccl_transport.py [--tokens 512,2048,8192] [--iters 20] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from typing import Any, Protocol

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from workers.gpu_staging import PagedKv, Stager, pipeline_bounds  # noqa: E402
from workers.pool import BufferPool  # noqa: E402

LAYERS, HEADS, DIM, BLOCK = 32, 8, 128, 16
DEADLINE_S = 30.0


class Handshake(Protocol):
    """P announces a transfer (`offer`, no wait) and later waits for D's go-ahead
    (`wait_ready`); D takes the offer (`accept`) and answers once its pool has room
    (`ready`). The broker's Offer -> Prepare -> Ready -> Go has this shape."""

    def offer(self, transfer_id: str, nbytes: int) -> None: ...

    def wait_ready(self, transfer_id: str) -> None: ...

    def accept(self) -> tuple[str, int]: ...

    def ready(self, transfer_id: str) -> None: ...


class PipeHandshake:
    """One control round trip over a `multiprocessing` connection."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn

    def offer(self, transfer_id: str, nbytes: int) -> None:
        self.conn.send(("offer", transfer_id, nbytes))

    def wait_ready(self, transfer_id: str) -> None:
        kind, tid = self.conn.recv()
        assert kind == "ready" and tid == transfer_id

    def accept(self) -> tuple[str, int]:
        kind, tid, nbytes = self.conn.recv()
        assert kind == "offer"
        return tid, nbytes

    def ready(self, transfer_id: str) -> None:
        self.conn.send(("ready", transfer_id))


def _deadline() -> float:
    return time.monotonic() + DEADLINE_S


class _Side:
    """One process's state: caches, pools, transport and the control links."""

    def __init__(self, role: str, dev: int, outbox: Any, inbox: Any, conn: Any, barrier: Any, cfg: dict) -> None:
        from workers.transports.nccl import CommunicatorCache, NcclTransport, QueueRendezvous

        torch.cuda.set_device(dev)
        self.role, self.conn, self.barrier, self.cfg = role, conn, barrier, cfg
        self.peer = "D" if role == "P" else "P"
        self.device = torch.device("cuda", dev)
        self.cache = CommunicatorCache(role, self.device, QueueRendezvous(outbox, inbox), capacity=2)
        self.transport = NcclTransport(self.cache)
        self.hs = PipeHandshake(conn)
        nb = cfg["cache_blocks"]
        g = torch.Generator(device=self.device).manual_seed(dev)
        self.kv = [
            torch.randn(2, nb, BLOCK, HEADS, DIM, device=self.device, generator=g, dtype=torch.bfloat16)
            for _ in range(LAYERS)
        ]
        self.paged = PagedKv(self.kv)
        cap = max(cfg["max_blocks"] * self.paged.staged_block_nbytes, 1 << 20)
        self.pool = BufferPool(cap, device=self.device)
        self.stager = Stager(self.paged, self.pool)
        self.raw = torch.empty(cap, dtype=torch.uint8, device=self.device)
        self.comm_mem_mib = 0.0

    def connect(self) -> None:
        comm = self.cache.get(self.peer, initiator=self.role == "P")
        self.comm_mem_mib = round(comm.mem_bytes / 2**20, 1)
        # One full-size exchange, posted by both sides at once, before anything is timed.
        if self.role == "P":
            self.transport.send_tensors("D", [self.raw]).wait(_deadline())
        else:
            self.transport.recv_tensors("P", [self.raw]).wait(_deadline())


def _ids(side: _Side, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(side.cfg["cache_blocks"], generator=g)[:n]


def _case(side: _Side, name: str, tokens: int, chunking: tuple[int, int] | None) -> list[float]:
    """Run one case for one prompt length; returns P's start times or D's end times."""
    n = tokens // BLOCK
    p_ids = side.paged.block_ids(_ids(side, n, 1))
    d_ids = side.paged.block_ids(_ids(side, n, 2))
    nbytes = n * side.paged.staged_block_nbytes
    bounds = pipeline_bounds(n, side.paged.staged_block_nbytes,
                             edge_nbytes=chunking[0] << 20, cap_nbytes=chunking[1] << 20) if chunking else None
    stamps: list[float] = []
    total = side.cfg["warmup"] + side.cfg["iters"]
    for it in range(total):
        if side.role == "P":
            stamps.append(_p_iter(side, name, p_ids, nbytes, bounds, it))
        else:
            stamps.append(_d_iter(side, name, d_ids, nbytes, bounds, it))
    return stamps[side.cfg["warmup"]:]


def _p_iter(side: _Side, name: str, ids: torch.Tensor, nbytes: int, bounds: Any, it: int) -> float:
    tr, tid = side.transport, f"{name}-{it}"
    staged = None
    if name in ("ours_staged", "ours_data"):
        staged = side.stager.stage(ids, bounds=bounds)
        torch.cuda.synchronize()
    side.barrier.wait()
    t0 = time.perf_counter()
    if name == "raw":
        tr.send_tensors("D", [side.raw[:nbytes]]).wait(_deadline())
    elif name == "per_layer":
        _per_layer_p(side, ids)
    elif staged is None:  # gather on the critical path: interleave chunk gathers and sends
        side.hs.offer(tid, nbytes)  # the round trip overlaps the first gather
        staged = side.stager.begin(ids)
        start, done = 0, None
        for k, end in enumerate(bounds or [staged.num_blocks]):
            side.stager.gather_chunk(staged, end)
            if k == 0:
                side.hs.wait_ready(tid)
            done = tr.send_staged("D", staged, first_block=start, last_block=end, transfer_id=tid)
            start = end
        assert done is not None
        done.wait(_deadline())
    else:
        if name != "ours_data":
            side.hs.offer(tid, nbytes)
            side.hs.wait_ready(tid)
        tr.send_staged("D", staged, bounds=bounds, transfer_id=tid).wait(_deadline())
    if staged is not None:
        staged.release()
    side.conn.recv()  # D finished; keeps iterations apart
    return t0


def _d_iter(side: _Side, name: str, ids: torch.Tensor, nbytes: int, bounds: Any, it: int) -> float:
    tr = side.transport
    done = lease = None
    if name == "raw":
        done = tr.recv_tensors("P", [side.raw[:nbytes]])
    elif name == "ours_data":
        lease = side.pool.acquire_nowait(nbytes)
        done = tr.recv_staged("P", lease.tensor, side.paged, ids, bounds=bounds)
    side.barrier.wait()
    if name == "per_layer":
        _per_layer_d(side, ids)
    elif done is None:
        tid, size = side.hs.accept()
        lease = side.pool.acquire_nowait(size)
        side.hs.ready(tid)
        done = tr.recv_staged("P", lease.tensor, side.paged, ids, bounds=bounds, transfer_id=tid)
    if done is not None:
        done.wait(_deadline())
    t1 = time.perf_counter()
    if lease is not None:
        lease.release()
    side.conn.send("done")
    return t1


# -- the P2pNcclConnector pattern --------------------------------------------------------


def _per_layer_p(side: _Side, ids: torch.Tensor) -> None:
    import msgpack

    sock = side.zmq_sock  # type: ignore[attr-defined]
    for layer in range(LAYERS):
        kv = side.kv[layer][:, ids]  # extract_kv_from_layer: a contiguous copy of the blocks
        ev = torch.cuda.Event()
        ev.record()
        sock.send(msgpack.packb({"cmd": "PUT", "tensor_id": f"req#{layer}", "shape": list(kv.shape),
                                 "dtype": "bfloat16"}))
        assert sock.recv() == b"0"
        side.transport.send_tensors("D", [kv], after=[ev]).wait(_deadline())  # send + synchronize


def _per_layer_d(side: _Side, ids: torch.Tensor) -> None:
    import msgpack

    sock = side.zmq_sock  # type: ignore[attr-defined]
    for layer in range(LAYERS):
        ident, frame = sock.recv_multipart()
        msg = msgpack.unpackb(frame)
        buf = torch.empty(msg["shape"], dtype=getattr(torch, msg["dtype"]), device=side.device)
        sock.send_multipart([ident, b"0"])
        side.transport.recv_tensors("P", [buf]).wait(_deadline())
        torch.cuda.current_stream().wait_stream(side.transport.stream)
        side.kv[layer][:, ids] = buf  # inject into D's paged cache
    torch.cuda.current_stream().synchronize()


def _zmq_setup(side: _Side) -> None:
    import zmq

    ctx = zmq.Context.instance()
    if side.role == "D":
        sock = ctx.socket(zmq.ROUTER)
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        side.conn.send(port)
    else:
        sock = ctx.socket(zmq.DEALER)
        sock.connect(f"tcp://127.0.0.1:{side.conn.recv()}")
    side.zmq_sock = sock  # type: ignore[attr-defined]


# -- micro measurements -----------------------------------------------------------------


def _rtt_us(side: _Side, rounds: int = 200) -> dict[str, float]:
    """Median control round trips: the pipe handshake and a ZMQ PUT/ack."""
    out: dict[str, float] = {}
    for kind in ("pipe", "zmq"):
        samples = []
        for _ in range(rounds):
            if side.role == "P":
                t = time.perf_counter()
                if kind == "pipe":
                    side.hs.offer("x", 1)
                    side.hs.wait_ready("x")
                else:
                    side.zmq_sock.send(b"ping")  # type: ignore[attr-defined]
                    side.zmq_sock.recv()  # type: ignore[attr-defined]
                samples.append((time.perf_counter() - t) * 1e6)
            elif kind == "pipe":
                tid, _ = side.hs.accept()
                side.hs.ready(tid)
            else:
                ident, _ = side.zmq_sock.recv_multipart()  # type: ignore[attr-defined]
                side.zmq_sock.send_multipart([ident, b"0"])  # type: ignore[attr-defined]
        if samples:
            out[f"{kind}_rtt_us"] = round(statistics.median(samples), 1)
    return out


def _copy_rates(side: _Side, tokens: int) -> dict[str, float]:
    """Gather and scatter GB/s on one GPU, Triton (one kernel) and per-layer index_select."""
    n = tokens // BLOCK
    ids = side.paged.block_ids(_ids(side, n, 1))
    out = {}
    buf = side.paged.staging_view(side.raw, n)
    for label, paged in (("triton", side.paged), ("per_layer", PagedKv(side.kv, use_triton=False))):
        if label == "triton" and not paged.use_triton:
            continue
        for op in ("gather", "scatter"):
            fn = getattr(paged, op)
            fn(ids, buf)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            times = []
            for _ in range(10):
                start.record()
                fn(ids, buf)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            ms = statistics.median(times)
            out[f"{op}_{label}_GBps"] = round(n * side.paged.staged_block_nbytes / ms / 1e6, 1)
            out[f"{op}_{label}_ms"] = round(ms, 3)
    return out


# -- driver ------------------------------------------------------------------------------

CASES = ["raw", "ours_full", "ours_staged", "ours_data", "ours_full_1", "per_layer"]


def _plan(cfg: dict) -> list[tuple[str, int, tuple[int, int] | None]]:
    chunk = (cfg["edge_mib"], cfg["cap_mib"])
    plan = []
    for tokens in cfg["tokens"]:
        for case in CASES:
            plan.append((case, tokens, None if case in ("raw", "ours_full_1", "per_layer") else chunk))
        for alt in cfg["sweep"]:
            plan.append(("ours_full", tokens, alt))
    return plan


def _worker(role: str, dev: int, outbox: Any, inbox: Any, conn: Any, barrier: Any, results: Any, cfg: dict) -> None:
    try:
        side = _Side(role, dev, outbox, inbox, conn, barrier, cfg)
        side.connect()
        _zmq_setup(side)
        extra: dict[str, Any] = {"comm_mem_mib": side.comm_mem_mib, **_rtt_us(side)}
        if role == "P":
            extra[f"copy_{max(cfg['tokens'])}"] = _copy_rates(side, max(cfg["tokens"]))
        rows = []
        for case, tokens, chunking in _plan(cfg):
            stamps = _case(side, case, tokens, chunking)
            if role == "D":
                conn.send(stamps)
                continue
            ends = conn.recv()
            ms = [(b - a) * 1e3 for a, b in zip(stamps, ends)]
            label = case if chunking is None or (chunking == (cfg["edge_mib"], cfg["cap_mib"])) \
                else f"{case}@{chunking[0]}/{chunking[1]}"
            rows.append({"case": label, "tokens": tokens, "MiB": tokens * 2 * LAYERS * HEADS * DIM * 2 / 2**20,
                         "ms": round(statistics.median(ms), 3), "ms_min": round(min(ms), 3),
                         "ms_p90": round(sorted(ms)[int(0.9 * (len(ms) - 1))], 3)})
        side.cache.close()
        results.put((role, {"rows": rows, **extra}))
    except BaseException:
        results.put((role, {"error": traceback.format_exc()}))


def _table(rows: list[dict]) -> tuple[str, list[dict]]:
    by = {(r["case"], r["tokens"]): r for r in rows}
    summary, lines = [], []
    for r in rows:
        r["GBps"] = round(r["MiB"] * 2**20 / (r["ms"] * 1e-3) / 1e9, 1)
    head = f"{'case':<22}{'tokens':>7}{'MiB':>7}{'ms':>9}{'GB/s':>8}{'x raw':>8}{'x per-layer':>12}"
    lines.append(head)
    for r in rows:
        raw, pl = by.get(("raw", r["tokens"])), by.get(("per_layer", r["tokens"]))
        r["vs_raw"] = round(raw["ms"] / r["ms"], 3) if raw else None
        r["vs_per_layer"] = round(pl["ms"] / r["ms"], 2) if pl else None
        lines.append(f"{r['case']:<22}{r['tokens']:>7}{r['MiB']:>7.0f}{r['ms']:>9.3f}{r['GBps']:>8.1f}"
                     f"{r['vs_raw']:>8.3f}{r['vs_per_layer']:>12.2f}")
    for tokens in sorted({r["tokens"] for r in rows}):
        s = {"tokens": tokens}
        for case in ("ours_full", "ours_staged", "ours_data"):
            if (case, tokens) in by:
                s[f"{case}_vs_raw"] = by[(case, tokens)]["vs_raw"]
                s[f"{case}_vs_per_layer"] = by[(case, tokens)]["vs_per_layer"]
        summary.append(s)
    return "\n".join(lines), summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="512,2048,8192")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--edge-mib", type=int, default=32, help="first/last pipeline chunk")
    ap.add_argument("--cap-mib", type=int, default=256, help="largest pipeline chunk")
    ap.add_argument("--sweep", default="16/128,64/512", help="other edge/cap pairs for ours_full")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    if torch.cuda.device_count() < 2:
        print("needs 2 CUDA GPUs", file=sys.stderr)
        return 2
    tokens = [int(t) for t in args.tokens.split(",")]
    sweep = [tuple(int(x) for x in s.split("/")) for s in args.sweep.split(",") if s]
    cfg = {"tokens": tokens, "iters": args.iters, "warmup": args.warmup, "edge_mib": args.edge_mib,
           "cap_mib": args.cap_mib, "sweep": sweep, "max_blocks": max(tokens) // BLOCK,
           "cache_blocks": max(2 * max(tokens) // BLOCK, 64)}
    ctx = mp.get_context("spawn")
    p_to_d, d_to_p, results = ctx.Queue(), ctx.Queue(), ctx.Queue()
    conn_p, conn_d = ctx.Pipe()
    barrier = ctx.Barrier(2)
    procs = [ctx.Process(target=_worker, args=("P", 0, p_to_d, d_to_p, conn_p, barrier, results, cfg)),
             ctx.Process(target=_worker, args=("D", 1, d_to_p, p_to_d, conn_d, barrier, results, cfg))]
    for p in procs:
        p.start()
    out: dict[str, Any] = {}
    try:
        while len(out) < 2:
            role, res = results.get(timeout=200)
            out[role] = res
            if "error" in res:
                print(f"{role} failed:\n{res['error']}", file=sys.stderr)
                return 1
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    table, summary = _table(out["P"]["rows"])
    print(table)
    print(json.dumps({k: v for k, v in out["P"].items() if k != "rows"}))
    print("D:", json.dumps({k: v for k, v in out["D"].items() if k != "rows"}))
    report = {"config": cfg, "rows": out["P"]["rows"], "summary": summary,
              "P": {k: v for k, v in out["P"].items() if k != "rows"},
              "D": {k: v for k, v in out["D"].items() if k != "rows"},
              "torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version())),
              "gpu": torch.cuda.get_device_name(0)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
