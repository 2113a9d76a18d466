"""The peer in the same run: NIXL moving the same KV on the same GPU(s) as bench/connector_path.py.

vLLM's NixlConnector moves a request's KV this way: once P has computed the prompt, D's
worker READs P's blocks straight out of P's paged cache into its own, one descriptor
per block, per layer, per K and V (both caches registered with NIXL up front, the
descriptor lists prepared once, `make_prepped_xfer` with the request's block indices,
`transfer`, then `check_xfer_state` until DONE). This times exactly that, P and D in
processes of their own, Llama-3-8B-shaped KV (32 layers, 8 KV heads, head 128, bf16),
flash-attn shaped caches (``[2, num_blocks, block, H, D]`` a layer):

* block16       vLLM's default block of 16 tokens: 64 descriptors a block of the prompt
* block64       the same with blocks of 64 tokens (a quarter of the descriptors)
* per_layer     the floor: one region per layer (the request's K and V of that layer
                lying back to back on both sides), 32 descriptors a request
* raw           one device-to-device copy of all the request's bytes on D's GPU

The clock runs from D's `make_prepped_xfer` to `check_xfer_state` saying DONE (what
vLLM's start_load_kv to get_finished costs past its own bookkeeping); D's blocks are
compared with P's once per row. With one GPU both caches live on cuda:0 and UCX moves
the bytes over CUDA IPC within it (UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on is set unless the
environment says otherwise: without it UCX falls back to TCP); with two, P's are on
cuda:0 and D's on cuda:1.

`--against PATH` reads bench/connector_path.py's JSON of the same run and prints the
connector's time beside NIXL's, with their ratio. NIXL is not a dependency of kvbroker:
install it for this benchmark only (`pip install 'kvbroker[bench-gpu]'`, or nixl-cu13).

Usage: python bench/nixl_peer.py [--tokens 512,2048,8192] [--iters 20] [--against PATH] [--json PATH]
"""

from __future__ import annotations

import argparse
import importlib
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from typing import Any

LAYERS, HEADS, DIM = 32, 8, 128
DTYPE_BYTES = 2  # bf16
DEADLINE_S = 60.0
VARIANTS = ("block16", "block64", "per_layer")


def nixl_module() -> Any:
    """NIXL's Python API, or None: the `nixl` meta package or `nixl_cu13`."""
    for name in ("nixl._api", "nixl_cu13", "nixl_cu12"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    return None


def _block_bytes(block: int) -> int:
    """One block of one layer, K or V alone."""
    return block * HEADS * DIM * DTYPE_BYTES


def _device(role: str) -> str:
    import torch

    return "cuda:0" if role == "P" or torch.cuda.device_count() == 1 else "cuda:1"


def _caches(role: str, block: int, num_blocks: int, seed: int) -> list[Any]:
    import torch

    g = torch.Generator(device=_device(role)).manual_seed(seed)
    shape = (2, num_blocks, block, HEADS, DIM)
    return [torch.randn(shape, device=_device(role), generator=g, dtype=torch.bfloat16) for _ in range(LAYERS)]


def _block_descs(caches: list[Any], block: int, num_blocks: int, device: int) -> list[tuple[int, int, int]]:
    """Every block of every layer, K and V: the descriptor list vLLM's NixlConnector
    prepares once per side; descriptor (layer, kv, b) sits at index ((layer * 2) + kv) * num_blocks + b."""
    size = _block_bytes(block)
    return [(cache.data_ptr() + (kv * num_blocks + b) * size, size, device)
            for cache in caches for kv in (0, 1) for b in range(num_blocks)]


def _indices(ids: list[int], num_blocks: int) -> Any:
    import numpy as np

    return np.array([(layer * 2 + kv) * num_blocks + b for layer in range(LAYERS) for kv in (0, 1) for b in ids],
                    dtype=np.int32)


def _side(role: str, conn: Any, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """One NIXL agent: P registers its memory and answers D's checks; D reads and times."""
    os.environ.setdefault("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "on")
    import torch

    api = nixl_module()
    torch.cuda.set_device(_device(role))
    dev = torch.device(_device(role)).index or 0
    agent = api.nixl_agent(f"{role}-{os.getpid()}", api.nixl_agent_config(backends=["UCX"]))
    rows: list[dict[str, Any]] = []
    for variant in cfg["variants"]:
        block = 64 if variant == "block64" else 16
        for tok in cfg["tokens"]:
            n = tok // block
            num_blocks = 2 * n + 8  # room to put the request anywhere
            if variant == "per_layer":  # the request's K and V back to back, one region a layer
                regions = [torch.randn(2 * n * _block_bytes(block) // DTYPE_BYTES, device=_device(role),
                                       dtype=torch.bfloat16) for _ in range(LAYERS)]
                mine = [(t.data_ptr(), t.numel() * DTYPE_BYTES, dev) for t in regions]
            else:
                regions = _caches(role, block, num_blocks, seed=1 if role == "P" else 2)
                mine = _block_descs(regions, block, num_blocks, dev)
            reg = agent.register_memory(regions)
            torch.cuda.synchronize()
            # One side sends first: the lists run to megabytes, and a pipe's send blocks
            # until the other side reads.
            if role == "P":
                conn.send((agent.get_agent_metadata(), mine))
                theirs_md, theirs = conn.recv()
            else:
                theirs_md, theirs = conn.recv()
                conn.send((agent.get_agent_metadata(), mine))
            remote = agent.add_remote_agent(theirs_md)
            if role == "P":
                _serve_checks(conn, regions, variant)
            else:
                rows.append(_read(agent, conn, cfg, regions, variant, tok, block, n, num_blocks, mine, theirs, remote))
                conn.send("done")
            agent.remove_remote_agent(remote)
            agent.deregister_memory(reg)
            del regions
    return rows


def _read(agent: Any, conn: Any, cfg: dict[str, Any], regions: list[Any], variant: str, tok: int, block: int,
          n: int, num_blocks: int, mine: list[tuple[int, int, int]], theirs: list[tuple[int, int, int]],
          remote: str) -> dict[str, Any]:
    """D: one row, READs of a request from P timed as vLLM's NixlConnector issues them."""
    import torch

    local_side = agent.prep_xfer_dlist("NIXL_INIT_AGENT", mine, "VRAM")
    remote_side = agent.prep_xfer_dlist(remote, theirs, "VRAM")
    every = list(range(LAYERS))
    local_idx: Any = every
    remote_idx: Any = every
    src: list[int] | None = None
    dst: list[int] | None = None
    took: list[float] = []
    exact = None
    g = torch.Generator().manual_seed(tok)
    for it in range(cfg["warmup"] + cfg["iters"]):
        if variant != "per_layer":  # another request's blocks each time, as in a real cache
            perm = torch.randperm(num_blocks, generator=g).tolist()
            src, dst = perm[:n], perm[n : 2 * n]
            local_idx, remote_idx = _indices(dst, num_blocks), _indices(src, num_blocks)
        t0 = time.perf_counter()
        handle = agent.make_prepped_xfer("READ", local_side, local_idx, remote_side, remote_idx,
                                         notif_msg=f"t{tok}-{it}".encode())
        state = agent.transfer(handle)
        deadline = time.monotonic() + DEADLINE_S
        while state == "PROC":
            if time.monotonic() > deadline:
                raise TimeoutError(f"NIXL's READ of {tok} tokens ({variant}) did not end in {DEADLINE_S} s")
            state = agent.check_xfer_state(handle)
        t1 = time.perf_counter()
        if state != "DONE":
            raise RuntimeError(f"NIXL's READ of {tok} tokens ({variant}) ended in state {state}")
        agent.release_xfer_handle(handle)
        if it >= cfg["warmup"]:
            took.append(t1 - t0)
        if it == cfg["warmup"]:
            exact = _check(conn, regions, variant, dst, src)
    agent.release_dlist_handle(local_side)
    agent.release_dlist_handle(remote_side)
    raw = _raw(regions, n, block, cfg["iters"]) if variant == "block16" else None
    nbytes = LAYERS * 2 * n * _block_bytes(block)
    return {"variant": variant, "tokens": tok, "block": block, "MiB": nbytes / 2**20,
            "descriptors": LAYERS * 2 * n if variant != "per_layer" else LAYERS,
            "nixl_ms": round(statistics.median(took) * 1e3, 3), "nixl_min_ms": round(min(took) * 1e3, 3),
            "nixl_max_ms": round(max(took) * 1e3, 3), "raw_ms": None if raw is None else round(raw * 1e3, 3),
            "iters": len(took), "exact": exact}


def _check(conn: Any, regions: list[Any], variant: str, dst: list[int] | None, src: list[int] | None) -> bool:
    """D: whether what it read equals P's bytes (P sends every eighth layer's)."""
    conn.send(("check", src))
    want = conn.recv()
    for layer, expect in want.items():
        got = regions[layer] if variant == "per_layer" else regions[layer][:, dst]
        if not (_host_words(got) == expect).all():
            return False
    return True


def _host_words(t: Any) -> Any:
    """A bf16 tensor's bits as a numpy array (numpy has no bf16)."""
    import torch

    return t.contiguous().view(torch.int16).cpu().numpy()


def _raw(regions: list[Any], n: int, block: int, iters: int) -> float:
    """One copy of the request's bytes on D's GPU, device to device: the ceiling."""
    import torch

    nbytes = LAYERS * 2 * n * _block_bytes(block)
    a = torch.empty(nbytes, dtype=torch.uint8, device=regions[0].device)
    b = torch.empty_like(a)
    took = []
    for _ in range(iters + 2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        b.copy_(a)
        torch.cuda.synchronize()
        took.append(time.perf_counter() - t0)
    return statistics.median(took[2:])


def _serve_checks(conn: Any, regions: list[Any], variant: str) -> Any:
    """P: answers D's check requests until D says the row is done."""
    while True:
        msg = conn.recv()
        if msg == "done":
            return msg
        _, src = msg
        layers = range(0, LAYERS, 8)
        conn.send({layer: _host_words(regions[layer] if variant == "per_layer" else regions[layer][:, src])
                   for layer in layers})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="512,2048,8192")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"any of {', '.join(VARIANTS)}")
    ap.add_argument("--against", default="", help="bench/connector_path.py's JSON of the same run, to compare")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    if nixl_module() is None:
        print("nixl is not installed here: this benchmark needs NIXL's Python API "
              "(pip install 'kvbroker[bench-gpu]', or nixl-cu13 for CUDA 13); kvbroker itself does not.", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print("bench/nixl_peer.py needs a CUDA GPU.", file=sys.stderr)
        return 2
    variants = [v for v in args.variants.split(",") if v]
    if unknown := [v for v in variants if v not in VARIANTS]:
        print(f"unknown variant {unknown[0]!r}; use any of {', '.join(VARIANTS)}.", file=sys.stderr)
        return 2
    cfg = {"tokens": [int(t) for t in args.tokens.split(",")], "iters": args.iters, "warmup": args.warmup,
           "variants": variants}
    ctx = mp.get_context("spawn")
    conn_p, conn_d = ctx.Pipe()
    results = ctx.Queue()
    procs = [ctx.Process(target=_run, args=("P", conn_p, cfg, results)),
             ctx.Process(target=_run, args=("D", conn_d, cfg, results))]
    try:
        for proc in procs:
            proc.start()
        rows = results.get(timeout=900)
        for proc in procs:
            proc.join(timeout=60)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
    if isinstance(rows, str):
        print(f"NIXL failed: {rows}", file=sys.stderr)
        return 1
    connector = _connector_rows(args.against)
    _print(rows, connector)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": cfg, "rows": rows, "against": connector, "torch": torch.__version__,
                       "device": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(),
                       "ucx_cuda_ipc_get_zcopy": os.environ.get("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "on")}, f, indent=1)
    return 0


def _run(role: str, conn: Any, cfg: dict[str, Any], results: Any) -> None:
    try:
        rows = _side(role, conn, cfg)
        if role == "D":
            results.put(rows)
    except BaseException as exc:  # noqa: BLE001 - reported to the main process
        results.put(f"{role}: {exc!r}")
        raise


def _connector_rows(path: str) -> dict[int, float]:
    """Tokens -> the connector's median ms, from connector_path.py's JSON (one request in flight)."""
    if not path or not os.path.exists(path):
        return {}
    with open(path) as f:
        data = json.load(f)
    return {r["tokens"]: r["connector_ms"] for r in data["rows"] if r.get("inflight", 1) == 1}


def _print(rows: list[dict[str, Any]], connector: dict[int, float]) -> None:
    raw = {r["tokens"]: r["raw_ms"] for r in rows if r["raw_ms"] is not None}
    head = f"{'variant':<10}{'tokens':>7}{'MiB':>7}{'descs':>8}{'NIXL ms':>10}{'min':>8}{'max':>8}{'raw ms':>8}"
    head += f"{'x raw':>7}{'exact':>7}"
    if connector:
        head += f"{'kvbroker ms':>13}{'NIXL/kvb':>10}"
    print(head)
    for r in rows:
        base = raw.get(r["tokens"])
        line = (f"{r['variant']:<10}{r['tokens']:>7}{r['MiB']:>7.0f}{r['descriptors']:>8}{r['nixl_ms']:>10.3f}"
                f"{r['nixl_min_ms']:>8.3f}{r['nixl_max_ms']:>8.3f}{base or 0:>8.3f}"
                f"{(base / r['nixl_ms']) if base else 0:>7.3f}{str(r['exact']):>7}")
        if connector:
            ours = connector.get(r["tokens"])
            line += f"{ours or 0:>13.3f}{(r['nixl_ms'] / ours) if ours else 0:>10.3f}"
        print(line)


if __name__ == "__main__":
    raise SystemExit(main())
