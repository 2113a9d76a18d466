"""The seed fix on two GPUs: staged KV survives reuse of P's blocks; the NCCL transport's
timeouts abort and rebuild; and the staging layout round-trips.

The two-GPU tests run P on cuda:0 and D on cuda:1 in spawned processes. Each P step
runs heavy compute, writes the prompt's KV into its blocks, stages them, and at once
overwrites the blocks as the next request would; D checks every received block against
the prompt's KV, which both sides derive from one seed. The unsafe variants break the
ordering on purpose and must be able to fail, or the safe run proves nothing.

Set KVB_TEST_OUT to a directory to get each scenario's numbers as JSON there.
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import time
import traceback
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from workers.gpu_staging import PagedKv, Stager, pipeline_bounds
from workers.pool import BufferPool

two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"
)
one_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _direct_available() -> bool:
    from workers.transports import nccl_lib

    return nccl_lib.load() is not None


def _driver_available() -> bool:
    from workers.transports import cuda_ipc

    return cuda_ipc.driver() is not None


# Every communicator backend: "direct" (the ctypes NCCL binding), "torch" (ProcessGroupNCCL)
# and "ipc" (copy kernels over CUDA IPC, both GPUs on this host).
BACKENDS = [
    pytest.param("direct", marks=pytest.mark.skipif(not _direct_available(), reason="no loadable libnccl")),
    "torch",
    pytest.param("ipc", marks=pytest.mark.skipif(not _driver_available(), reason="no CUDA driver")),
]

LAYERS, BLOCKS, BLOCK, HEADS, DIM = 4, 64, 16, 8, 128
REQ_P = [3, 17, 18, 40, 41, 42, 9, 60]  # the request's blocks on P (the same every time)
REQ_D = [50, 2, 33, 34, 7, 8, 61, 20]  # where D puts them


def _cache(device: torch.device | str, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (2, BLOCKS, BLOCK, HEADS, DIM)
    return [torch.randn(shape, generator=g).to(torch.bfloat16).to(device) for _ in range(LAYERS)]


def _prompt_kv(device: torch.device | str) -> torch.Tensor:
    """The prompt's KV, ``[layers, 2, n, block, heads, dim]``, identical on P and D."""
    g = torch.Generator().manual_seed(1234)
    return torch.randn(LAYERS, 2, len(REQ_P), BLOCK, HEADS, DIM, generator=g).to(torch.bfloat16).to(device)


# -- CPU: layout -----------------------------------------------------------------------


def test_pipeline_bounds_cover_and_ramp() -> None:
    mib = 1 << 20
    assert pipeline_bounds(0, 2 * mib) == []
    assert pipeline_bounds(40, 2 * mib) == [40]  # first + last chunk or less: one piece
    # The defaults for Llama-3-8B-like KV (2 MiB a block): 2048 and 8192 tokens.
    assert pipeline_bounds(128, 2 * mib) == [48, 96, 120, 128]
    assert pipeline_bounds(512, 2 * mib) == [48, 192, 408, 480, 504, 512]
    for first, last, growth in ((128, 32, 4), (64, 32, 4), (256, 32, 4), (128, 16, 4), (32, 32, 2)):
        f, b = first // 2, last // 2
        for n in list(range(1, 300)) + [512, 1000, 4096]:
            ends = pipeline_bounds(n, 2 * mib, first_nbytes=first * mib, last_nbytes=last * mib, growth=growth)
            assert ends[-1] == n and ends == sorted(set(ends))
            sizes = [y - x for x, y in zip([0] + ends, ends)]
            if n <= f + b:
                assert sizes == [n]
                continue
            # The last chunk stays small (a short scatter after the last byte) and the
            # first one near `first` (a tiny remainder may fold into it).
            assert b <= sizes[-1] < f + b and f <= sizes[0] < f + b
            assert max(sizes) <= 512 + b
            # No dip: a middle chunk smaller than both neighbours would be an op for nothing.
            assert not any(sizes[k] < min(sizes[k - 1], sizes[k + 1]) and sizes[k] < min(f, b)
                           for k in range(1, len(sizes) - 1))


def test_adaptive_gather_programs_follow_the_chunk_ratio() -> None:
    from workers.transports.nccl import GATHER_PROGRAMS, gather_programs_for

    # A chunk 4x its predecessor must be gathered ~4x faster than the wire: the cap.
    assert gather_programs_for(4.0, GATHER_PROGRAMS) == GATHER_PROGRAMS
    assert gather_programs_for(4.0, None) > GATHER_PROGRAMS
    # Smaller or equal chunks need a fraction of it, never below the floor.
    assert gather_programs_for(0.25, GATHER_PROGRAMS) == 16
    assert 16 < gather_programs_for(1.0, GATHER_PROGRAMS) < GATHER_PROGRAMS
    ratios = [0.1 * k for k in range(1, 60)]
    got = [gather_programs_for(r, GATHER_PROGRAMS) for r in ratios]
    assert got == sorted(got) and all(16 <= g <= GATHER_PROGRAMS for g in got)


def test_pipeline_bounds_back_growth() -> None:
    mib = 1 << 20
    # A slower front ramp (capped gathers) and the back ramp at its own growth.
    ends = pipeline_bounds(512, 2 * mib, first_nbytes=64 * mib, last_nbytes=16 * mib, growth=2, back_growth=4)
    sizes = [y - x for x, y in zip([0] + ends, ends)]
    assert ends[-1] == 512 and sizes[:2] == [32, 64] and sizes[-3:] == [128, 32, 8]
    assert pipeline_bounds(512, 2 * mib, growth=3, back_growth=None) == pipeline_bounds(
        512, 2 * mib, growth=3, back_growth=3)


@pytest.mark.parametrize("block_dim", [0, 1])
def test_gather_scatter_roundtrip_cpu(block_dim: int) -> None:
    shape = (BLOCKS, 2, BLOCK, HEADS, DIM) if block_dim == 0 else (2, BLOCKS, BLOCK, HEADS, DIM)
    src = [torch.randn(shape).to(torch.bfloat16) for _ in range(LAYERS)]
    dst = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(LAYERS)]
    p, d = PagedKv(src, block_dim=block_dim), PagedKv(dst, block_dim=block_dim)
    stager = Stager(p, BufferPool(p.staged_block_nbytes * 16))
    staged = stager.stage(REQ_P, bounds=[3, 8])
    # Block-major: staged block i holds every layer of P's block REQ_P[i].
    row = staged.words.view(len(REQ_P), LAYERS, -1)
    want = src[2].select(block_dim, REQ_P[5]).reshape(-1).view(torch.int64)
    assert torch.equal(row[5, 2], want)
    d.scatter(d.block_ids(REQ_D), staged.words)
    for s, t in zip(src, dst):
        idx = (slice(None),) * block_dim
        assert torch.equal(t[idx + (REQ_D,)], s[idx + (REQ_P,)])
    staged.release()


# -- one GPU: the Triton gather equals the per-layer one --------------------------------


def test_side_gathers_on_a_cpu_cache_stage_the_same_bytes() -> None:
    """`gather_layer(side=True)` is a GPU overlap; on a CPU cache it stages exactly what
    the plain path does, and `fence` has nothing to wait for."""
    kv = _cache("cpu")
    paged = PagedKv(kv)
    stagers = [Stager(paged, BufferPool(paged.staged_block_nbytes * 16)) for _ in range(2)]
    staged = [st.begin(REQ_P) for st in stagers]
    for layer in range(LAYERS):
        stagers[0].gather_layer(staged[0], layer)
        stagers[1].gather_layer(staged[1], layer, side=True)
    stagers[1].fence(staged[1])
    assert torch.equal(staged[0].tensor, staged[1].tensor)
    assert staged[1].event_for(len(REQ_P)) is None and staged[1]._side is None


@pytest.mark.gpu
@one_gpu
@pytest.mark.parametrize("streaming", [False, True])
def test_triton_and_per_layer_gather_agree(streaming: bool) -> None:
    kv = _cache("cuda")
    fast, slow = PagedKv(kv, use_triton=None), PagedKv(kv, use_triton=False)
    fast.streaming = streaming  # the cache hints change where lines live, never the bytes
    ids = fast.block_ids(REQ_P)
    a = torch.empty(len(REQ_P) * fast.staged_block_nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    fast.gather(ids, fast.staging_view(a, len(REQ_P)))
    slow.gather(ids, slow.staging_view(b, len(REQ_P)))
    assert torch.equal(a, b)
    for programs in (1, 3, 1000):  # a capped grid loops over the rows it does not cover at once
        c = torch.zeros_like(a)
        fast.gather(ids, fast.staging_view(c, len(REQ_P)), programs=programs)
        assert torch.equal(c, b), programs
        out = _cache("cuda", seed=7)
        back = PagedKv(out)
        back.streaming = streaming
        back.scatter(ids, fast.staging_view(a, len(REQ_P)), programs=programs)
        for s, t in zip(kv, out):
            assert torch.equal(s[:, REQ_P], t[:, REQ_P])
    # One layer at a time (what save_kv_layer does), into and out of the same block-major rows.
    e = torch.zeros_like(a)
    for layer in range(fast.num_layers):
        fast.gather_layer(layer, ids, fast.staging_view(e, len(REQ_P)))
    assert torch.equal(e, b)
    out = _cache("cuda", seed=8)
    back = PagedKv(out)
    back.streaming = streaming
    for layer in range(back.num_layers):
        back.scatter_layer(layer, ids, back.staging_view(e, len(REQ_P)))
    for src, dst in zip(kv, out):
        assert torch.equal(src[:, REQ_P], dst[:, REQ_P])
    print(f"triton gather used: {fast.use_triton}, compiled-kernel launch: {fast._launch and fast._launch.fast}")


def _precompiled(device: str) -> tuple[list[torch.Tensor], list[torch.Tensor], PagedKv]:
    """A cache on `device`, a copy of it as it was, and its `PagedKv` after `precompile`."""
    kv = _cache(device)
    before = [t.clone() for t in kv]
    paged = PagedKv(kv)
    if not paged.use_triton:
        pytest.skip("no Triton here")
    paged.precompile()
    return kv, before, paged


@pytest.mark.gpu
@one_gpu
def test_precompile_compiles_every_copy_and_leaves_the_cache_alone() -> None:
    """`precompile` compiles each copy a transfer launches (gather and scatter, whole
    blocks and one layer, with and without cache hints): a first compile loads a module,
    which on D waited for a receive posted just before it. Block 0 goes out and back."""
    kv, before, paged = _precompiled("cuda")
    assert paged.streaming
    assert all(torch.equal(a, b) for a, b in zip(before, kv))
    assert len(paged._launch.compiled) >= 8, paged._launch.compiled.keys()
    known = set(paged._launch.compiled)
    ids = paged.block_ids(REQ_P)
    staging = torch.empty(len(REQ_P) * paged.staged_block_nbytes, dtype=torch.uint8, device="cuda")
    paged.gather(ids, paged.staging_view(staging, len(REQ_P)))
    paged.scatter(ids, paged.staging_view(staging, len(REQ_P)), programs=64)
    paged.gather_layer(3, ids, paged.staging_view(staging, len(REQ_P)))
    paged.scatter_layer(3, ids, paged.staging_view(staging, len(REQ_P)))
    torch.cuda.synchronize()
    assert set(paged._launch.compiled) == known  # nothing new compiled on the transfer's path
    assert all(torch.equal(a, b) for a, b in zip(before, kv))


@pytest.mark.gpu
@two_gpus
def test_a_cache_registered_from_another_gpus_thread_compiles_for_its_own_gpu() -> None:
    """Two workers in one process (cuda:0 current while D's cache on cuda:1 is made and
    precompiled): the check and every compile run on the cache's GPU, the fast launch
    is on, the cache is unchanged, and a transfer's copies there compile nothing new and
    stage the same bytes as torch's."""
    torch.cuda.set_device(0)
    kv, before, paged = _precompiled("cuda:1")
    assert torch.cuda.current_device() == 0
    assert paged._launch.fast
    assert all(torch.equal(a, b) for a, b in zip(before, kv))
    known = set(paged._launch.compiled)
    ids = paged.block_ids(REQ_P)
    with torch.cuda.device(1):
        staging = torch.empty(len(REQ_P) * paged.staged_block_nbytes, dtype=torch.uint8, device="cuda:1")
        paged.gather(ids, paged.staging_view(staging, len(REQ_P)))
        torch.cuda.synchronize()
    assert set(paged._launch.compiled) == known
    reference = PagedKv(kv, use_triton=False)
    expect = torch.empty_like(staging)
    reference.gather(ids, reference.staging_view(expect, len(REQ_P)))
    torch.cuda.synchronize(1)
    assert torch.equal(staging, expect)


# -- two GPUs ---------------------------------------------------------------------------


def _run_pair(target: Any, cfg: dict[str, Any], timeout_s: float = 300.0) -> dict[str, dict[str, Any]]:
    """P on cuda:0 and D on cuda:1 (or both on cuda:0 with ``cfg["one_gpu"]``), each in a
    spawned process; returns each side's result. Results are plain values (arrays, not
    tensors: a tensor travels as a handle to its sender's memory, unreadable once the
    sender exits); one that cannot be read fails the test with its cause."""
    ctx = mp.get_context("spawn")
    p_to_d, d_to_p, results = ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = [
        ctx.Process(target=target, args=("P", 0, p_to_d, d_to_p, results, cfg)),
        ctx.Process(target=target, args=("D", 0 if cfg.get("one_gpu") else 1, d_to_p, p_to_d, results, cfg)),
    ]
    for proc in procs:
        proc.start()
    out: dict[str, dict[str, Any]] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < 2 and time.monotonic() < deadline:
            try:
                role, res = results.get(timeout=1.0)
                out[role] = res
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs) and results.empty():
                    break
    finally:
        for proc in procs:
            proc.join(timeout=max(1.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
    for role in ("P", "D"):
        assert role in out, f"{role} gave no result (exit codes {[p.exitcode for p in procs]}); got {out}"
        assert "error" not in out[role], f"{role} failed:\n{out[role]['error']}"
    return out


def _setup(role: str, dev: int, outbox: Any, inbox: Any, cfg: dict[str, Any]) -> tuple[Any, ...]:
    from workers.transports.nccl import CommunicatorCache, NcclTransport, QueueRendezvous

    torch.cuda.set_device(dev)
    device = torch.device("cuda", dev)
    rdv = QueueRendezvous(outbox, inbox, timeout_s=60.0)
    cache = CommunicatorCache(role, device, rdv, capacity=cfg.get("capacity", 4), backend=cfg.get("backend"))
    transport = NcclTransport(cache, gather_programs=cfg.get("gather_programs", 32),
                              unsafe_skip_event_wait=cfg.get("skip_event_wait", False))
    return device, rdv, cache, transport


def _count_posts() -> dict[str, int]:
    """Tally the direct backend's send and receive enqueues by whether they kept the GIL."""
    from workers.transports import nccl_lib

    lib, tally = nccl_lib.load(), {"held": 0, "free": 0}
    if lib is None:
        return tally

    def counted(fn: Any) -> Any:
        def call(*args: Any, **kw: Any) -> None:
            tally["held" if kw.get("held", args[5] if len(args) > 5 else False) else "free"] += 1
            fn(*args, **kw)
        return call

    lib.send, lib.recv = counted(lib.send), counted(lib.recv)  # type: ignore[method-assign]
    return tally


def _race_worker(role: str, dev: int, outbox: Any, inbox: Any, results: Any, cfg: dict[str, Any]) -> None:
    try:
        posts = _count_posts()
        device, rdv, _, transport = _setup(role, dev, outbox, inbox, cfg)
        bounds = cfg.get("bounds")  # chunked: chunk events on P, per-chunk receive and scatter on D
        handshake = cfg.get("ready", False)  # D sends Ready, then posts; P sends only after Ready
        kv = _cache(device, seed=dev)
        paged = PagedKv(kv)
        prompt = _prompt_kv(device)
        pool = BufferPool(paged.staged_block_nbytes * 16, device=device)
        # Held for the whole run, so every transfer's lease starts past the pool's first
        # byte: gathers, sends and receives address a lease as pool + offset.
        pad = pool.acquire_nowait(paged.staged_block_nbytes) if cfg.get("offset_leases") else None
        res: dict[str, Any] = {}
        if role == "P":
            if cfg.get("spill"):  # a GPU pool too small for the request: it stages in pinned memory
                small = BufferPool(paged.staged_block_nbytes, device=device)
                pinned = BufferPool(paged.staged_block_nbytes * 16, pin_memory=True)
                stager = Stager(paged, small, pinned)
            else:
                stager = Stager(paged, pool)
            spilled = 0
            ids = paged.block_ids(REQ_P)
            a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
            c = torch.empty_like(a)
            side = torch.cuda.Stream(device)
            for i in range(cfg["iters"]):
                for _ in range(cfg["matmuls"]):  # the model's earlier layers: keeps the stream busy
                    torch.mm(a, a, out=c)
                for layer in range(LAYERS):  # this step writes the prompt's KV into its blocks
                    kv[layer].index_copy_(1, ids, prompt[layer])
                ready = (lambda i=i: rdv.receive("D", f"ready/{i}")) if handshake else None
                done = None
                if cfg.get("stage_on_side_stream"):
                    with torch.cuda.stream(side):  # WRONG on purpose: not in compute-stream order
                        staged = stager.stage(ids, bounds=bounds)
                elif cfg.get("layerwise_side"):  # save_kv_layer's gathers on the side stream, then the fence
                    staged = stager.begin(ids)
                    if stager._side is not None:  # still busy with an earlier request's copies
                        with torch.cuda.stream(stager._side):
                            torch.cuda._sleep(cfg.get("side_busy_cycles", 2_000_000))
                    for layer in range(LAYERS):
                        torch.mm(a, a, out=c)  # the layer's own compute, which the copy overlaps
                        stager.gather_layer(staged, layer, side=True)
                    if not cfg.get("skip_fence"):  # WRONG on purpose without it: nothing orders the reuse
                        stager.fence(staged)
                elif cfg.get("pipelined"):  # gathers interleaved with sends, later ones capped
                    staged = stager.begin(ids)
                    assert pad is None or staged.lease.offset > 0
                    done = transport.gather_and_send("D", stager, staged, bounds=bounds, before_send=ready,
                                                     ready_at=cfg.get("ready_at", 0))
                else:
                    staged = stager.stage(ids, bounds=bounds)
                spilled += not staged.on_gpu
                for layer in range(LAYERS):  # the next step reuses the blocks at once
                    kv[layer].index_fill_(1, ids, -7.0)
                if done is None:
                    if ready is not None:
                        ready()
                    done = transport.send_staged("D", staged, bounds=bounds)
                done.wait(time.monotonic() + 30.0)
                staged.tensor.fill_(0x55)  # another request reuses this staging memory
                staged.release()
                torch.cuda.current_stream().synchronize()
            res = {"iters": cfg["iters"], "spilled": spilled}
        else:
            ids = paged.block_ids(REQ_D)
            nbytes = len(REQ_D) * paged.staged_block_nbytes
            mismatches, bad_blocks = 0, 0
            for i in range(cfg["iters"]):
                for layer in range(LAYERS):
                    kv[layer].index_fill_(1, ids, 3.0)  # so a missing write cannot pass
                lease = pool.acquire_nowait(nbytes)
                assert pad is None or lease.offset > 0
                posted = []
                if cfg.get("landing"):  # the first chunk's receive, posted before D's Ready
                    comm = transport.cache.get("P", initiator=False)
                    first = bounds[0] * paged.staged_block_nbytes
                    posted = [comm.post_range("recv", lease.base, lease.offset, first, transport.stream)]
                if handshake:
                    rdv.publish("P", f"ready/{i}", b"1")
                # Either form of the buffer: a lease (the lean path) or its tensor.
                done = transport.recv_staged("P", lease if pad is not None else lease.tensor, paged, ids, bounds=bounds,
                                             posted=posted)
                done.wait(time.monotonic() + 30.0)
                got = torch.stack([kv[layer][:, ids] for layer in range(LAYERS)])
                if not torch.equal(got, prompt):
                    mismatches += 1
                    bad_blocks += int((got != prompt).flatten(3).any(-1).any(0).any(0).sum())
                lease.release()
            res = {"iters": cfg["iters"], "mismatches": mismatches, "bad_blocks": bad_blocks}
        res["posts"] = posts
        torch.cuda.synchronize()
        transport.cache.close()
        results.put((role, res))
    except BaseException:
        results.put((role, {"error": traceback.format_exc()}))


def _report(name: str, data: dict[str, Any]) -> None:
    print(f"{name}: {json.dumps(data)}")
    out = os.environ.get("KVB_TEST_OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "gpu_tests.jsonl"), "a") as f:
            f.write(json.dumps({"name": name, **data}) + "\n")


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("backend", BACKENDS)
def test_repeated_prompt_survives_block_reuse(backend: str) -> None:
    """1,000 identical prompts, blocks overwritten right after staging: zero mismatches."""
    out = _run_pair(_race_worker, {"iters": 1000, "matmuls": 6, "backend": backend})
    res = out["D"]
    _report(f"safe[{backend}]", res)
    assert res["mismatches"] == 0
    if backend == "direct":
        # Every transfer's op after the pair's first kept the GIL; the warm-up exchange at
        # the build (a send and a receive) and the first transfer's op let go of it.
        for side in out.values():
            assert side["posts"] == {"held": 999, "free": 3}, side["posts"]


# P's pipeline with the Ready handshake, three chunks, every lease past its pool's first byte.
_CHUNKED_READY = {"iters": 300, "matmuls": 2, "bounds": [1, 3, 8], "ready": True, "pipelined": True,
                  "gather_programs": 3, "offset_leases": True}


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("backend", BACKENDS)
def test_chunked_pipeline_with_ready_handshake(backend: str) -> None:
    """P's pipeline (`gather_and_send`: chunk k's send after chunk k's gather event, the
    gathers after the first on a capped grid), D's Ready sent before it posts, chunk k
    scattered as soon as chunk k arrives: 300 repeated prompts, blocks overwritten right
    after the call, zero mismatches. The first iteration also builds the communicator
    after Ready."""
    res = _run_pair(_race_worker, {**_CHUNKED_READY, "backend": backend}, timeout_s=90.0)["D"]
    _report(f"safe_chunked_ready[{backend}]", res)
    assert res["mismatches"] == 0


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("backend", BACKENDS)
def test_first_chunk_into_a_receive_posted_ahead(backend: str) -> None:
    """D posts the first chunk's receive before it sends Ready (`recv_staged`'s
    `posted`), and P sends that chunk as soon as it is gathered, waiting for Ready only
    before the second (`ready_at=1`): 300 repeated prompts, blocks overwritten right
    after the call, zero mismatches."""
    cfg = {**_CHUNKED_READY, "backend": backend, "landing": True, "ready_at": 1}
    res = _run_pair(_race_worker, cfg, timeout_s=90.0)["D"]
    _report(f"safe_posted_ahead[{backend}]", res)
    assert res["mismatches"] == 0


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("backend", BACKENDS)
def test_side_stream_layer_gathers_survive_block_reuse(backend: str) -> None:
    """`save_kv_layer` with `side=True`: each layer's gather runs on the stager's side
    stream, overlapping the next layer's compute, and `fence` orders the compute
    stream's reuse of the blocks after them: 1,000 repeated prompts, zero mismatches,
    with the side stream still busy (about 1 ms) with earlier copies each time. Without
    the fence the same run must be able to fail, or the fence proves nothing."""
    res = _run_pair(_race_worker, {"iters": 1000, "matmuls": 2, "layerwise_side": True, "backend": backend})["D"]
    _report(f"safe_side_layers[{backend}]", res)
    unfenced = _run_pair(_race_worker, {"iters": 200, "matmuls": 2, "layerwise_side": True, "skip_fence": True,
                                        "backend": backend})["D"]
    _report(f"unsafe_side_layers_no_fence[{backend}]", unfenced)
    assert res["mismatches"] == 0
    assert unfenced["mismatches"] > 0, "the unfenced run never raced: the fence is untested"


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("backend", BACKENDS)
def test_spilled_staging_survives_block_reuse(backend: str) -> None:
    """P's GPU staging pool holds one block, so every request spills to pinned memory
    (gathered through a GPU scratch buffer, sent through a bounce buffer), in P's
    pipeline with the Ready handshake: 200 repeated prompts, zero mismatches."""
    cfg = {"iters": 200, "matmuls": 2, "bounds": [1, 3, 8], "ready": True, "pipelined": True, "spill": True,
           "backend": backend}
    res = _run_pair(_race_worker, cfg, timeout_s=90.0)
    _report(f"safe_spilled[{backend}]", {**res["D"], "spilled": res["P"]["spilled"]})
    assert res["P"]["spilled"] == cfg["iters"]
    assert res["D"]["mismatches"] == 0


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("backend", BACKENDS)
def test_unsafe_variants_can_fail(backend: str) -> None:
    """Without the event wait, or with staging off the compute stream, corruption shows."""
    skip = _run_pair(_race_worker, {"iters": 200, "matmuls": 6, "skip_event_wait": True, "backend": backend})["D"]
    _report(f"unsafe_skip_event_wait[{backend}]", skip)
    side = _run_pair(_race_worker, {"iters": 200, "matmuls": 6, "stage_on_side_stream": True, "backend": backend})["D"]
    _report(f"unsafe_stage_on_side_stream[{backend}]", side)
    assert skip["mismatches"] > 0 or side["mismatches"] > 0, "the race never showed: the safe test proves nothing"


def _timeout_worker(role: str, dev: int, outbox: Any, inbox: Any, results: Any, cfg: dict[str, Any]) -> None:
    from protocols.errors import RecvTimeout

    try:
        device, rdv, cache, transport = _setup(role, dev, outbox, inbox, {"capacity": 1, "backend": cfg["backend"]})
        mib = lambda: torch.cuda.mem_get_info(device)[0] / 2**20  # noqa: E731
        x = torch.arange(1 << 20, device=device, dtype=torch.int32)
        res: dict[str, Any] = {}
        free0 = mib()
        if role == "P":
            cache.get("D", initiator=True)
            rdv.receive("D", "test/aborted")  # D timed out and aborted its side
            cache.discard("D")
            transport.send_tensors("D", [x]).wait(time.monotonic() + 30.0)
            transport.send_tensors("D2", [x * 2]).wait(time.monotonic() + 30.0)  # evicts "D"
            res = {"stats": cache.statistics().__dict__}
            cache.close()
        else:
            comm = cache.get("P", initiator=False)
            res["comm_mem_mib"] = round(comm.mem_bytes / 2**20, 1)
            y = torch.zeros_like(x)
            t0 = time.monotonic()
            try:
                transport.recv_tensors("P", [y]).wait(time.monotonic() + 2.0)
                res["timed_out"] = False
            except RecvTimeout:
                res["timed_out"] = True
            res["timeout_after_s"] = round(time.monotonic() - t0, 2)
            res["freed_by_abort_mib"] = round(mib() - (free0 - res["comm_mem_mib"]), 1)
            rdv.publish("P", "test/aborted", b"1")
            transport.recv_tensors("P", [y]).wait(time.monotonic() + 30.0)  # rebuilt communicator
            res["rebuilt_ok"] = bool(torch.equal(y, x))
            # P's second peer "D2" lives here too, with its own cache; P evicts "D" for it.
            from workers.transports.nccl import CommunicatorCache, NcclTransport

            other = NcclTransport(CommunicatorCache("D2", device, rdv, capacity=1, backend=cfg["backend"]))
            other.recv_tensors("P", [y]).wait(time.monotonic() + 30.0)
            res["second_comm_mem_mib"] = round(other.cache.get("P", initiator=False).mem_bytes / 2**20, 1)
            res["evicted_ok"] = bool(torch.equal(y, x * 2))
            res["stats"] = cache.statistics().__dict__
            res["mem_in_use_mib"] = round(free0 - mib(), 1)
            other.cache.close()
            cache.close()
        torch.cuda.synchronize()
        results.put((role, res))
    except BaseException:
        results.put((role, {"error": traceback.format_exc()}))


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("backend", BACKENDS)
def test_timeout_aborts_then_rebuilds_and_evicts(backend: str) -> None:
    out = _run_pair(_timeout_worker, {"backend": backend}, timeout_s=120.0)
    _report(f"timeout_abort_rebuild[{backend}]", {"P": out["P"], "D": out["D"]})
    d = out["D"]
    assert d["timed_out"] and d["timeout_after_s"] < 10
    assert d["rebuilt_ok"] and d["evicted_ok"]
    assert d["stats"]["aborted"] == 1
    assert out["P"]["stats"]["evicted"] == 1 and out["P"]["stats"]["size"] == 1


# -- through a real broker ---------------------------------------------------------------


class _Inbox:
    """A broker client's handler: rendezvous data goes to the rendezvous, every other
    message to a queue the worker's own thread reads with a deadline."""

    def __init__(self) -> None:
        import queue

        self.msgs: Any = queue.SimpleQueue()
        self.rendezvous: Any = None

    async def on_prepare(self, msg: Any) -> None:
        self.msgs.put(msg)

    async def on_go(self, msg: Any) -> None:
        self.msgs.put(msg)

    async def on_release(self, msg: Any) -> None:
        self.msgs.put(msg)

    async def on_abort(self, msg: Any) -> None:
        self.msgs.put(msg)

    async def on_relay(self, msg: Any) -> None:
        await self.rendezvous.on_relay(msg)

    def next(self, kind: type, transfer_id: str, timeout_s: float = 30.0) -> Any:
        msg = self.msgs.get(timeout=timeout_s)
        assert isinstance(msg, kind) and msg.transfer_id == transfer_id, f"wanted {kind.__name__} {transfer_id}, got {msg}"
        return msg


def _brokered_worker(role: str, dev: int, _out: Any, _in: Any, results: Any, cfg: dict[str, Any]) -> None:
    """Every transfer brokered end to end: Expect, Offer, Prepare, Ready, Go, Done, Release
    through a real broker process, which also relays the communicator's rendezvous."""
    try:
        from protocols.messages import Go, Prepare, Register, Release
        from workers.client import BrokerClient, ClientConfig, SyncBrokerClient
        from workers.rendezvous import BrokerRendezvous
        from workers.transports.nccl import CommunicatorCache, NcclTransport

        torch.cuda.set_device(dev)
        device = torch.device("cuda", dev)
        kv = _cache(device, seed=dev)
        paged = PagedKv(kv)
        prompt = _prompt_kv(device)
        pool = BufferPool(paged.staged_block_nbytes * 16, device=device)
        nbytes = len(REQ_P) * paged.staged_block_nbytes
        bounds = cfg["bounds"]
        inbox = _Inbox()
        decode = role == "D"
        reg = Register(role="decode" if decode else "prefill", instance_id="d" if decode else "p",
                       pool_capacity=pool.capacity if decode else 0, compat_hash="gpu-test")
        sync = SyncBrokerClient(BrokerClient(ClientConfig(broker=cfg["endpoint"]), reg, inbox))
        try:
            inbox.rendezvous = BrokerRendezvous(sync, timeout_s=60.0)
            cache = CommunicatorCache(sync.registered.peer_id, device, inbox.rendezvous, capacity=2,
                                      backend=cfg["backend"])
            transport = NcclTransport(cache)
            res: dict[str, Any] = {"peer": sync.registered.peer_id}
            times: list[float] = []
            if not decode:
                stager, ids = Stager(paged, pool), paged.block_ids(REQ_P)
                for i in range(cfg["iters"]):
                    tid = f"t{i}"
                    for layer in range(LAYERS):  # this step writes the prompt's KV into its blocks
                        kv[layer].index_copy_(1, ids, prompt[layer])
                    t0 = time.perf_counter()
                    staged = stager.stage(ids, bounds=bounds)  # save: gathers on the compute stream
                    for layer in range(LAYERS):  # the next step reuses the blocks at once
                        kv[layer].index_fill_(1, ids, -7.0)
                    sync.offer(tid, nbytes, decode="d")
                    go = inbox.next(Go, tid)
                    done = transport.send_staged(go.decode, staged, bounds=bounds, transfer_id=tid)
                    done.wait(time.monotonic() + 30.0)
                    inbox.next(Release, tid)  # D has checked and reported Done
                    times.append(time.perf_counter() - t0)
                    staged.release()
                res["released"] = len(times)
            else:
                ids = paged.block_ids(REQ_D)
                mismatches = 0
                for i in range(cfg["iters"]):
                    tid = f"t{i}"
                    for layer in range(LAYERS):
                        kv[layer].index_fill_(1, ids, 3.0)  # so a missing write cannot pass
                    sync.expect(tid, prefill="p")
                    prep = inbox.next(Prepare, tid)
                    lease = pool.acquire_nowait(prep.nbytes)
                    sync.call(sync.client.ready, tid, prep.nbytes)
                    done = transport.recv_staged(prep.source, lease, paged, ids, bounds=bounds, transfer_id=tid)
                    done.wait(time.monotonic() + 30.0)
                    got = torch.stack([kv[layer][:, ids] for layer in range(LAYERS)])
                    mismatches += not torch.equal(got, prompt)
                    lease.release()
                    sync.call(sync.client.done, tid, prep.nbytes)
                res["mismatches"] = mismatches
            res["stats"] = dataclasses.asdict(cache.statistics())
            if times:
                res["median_ms"] = round(sorted(times)[len(times) // 2] * 1e3, 3)
            cache.close()
        finally:
            sync.close()
        results.put((role, res))
    except BaseException:
        results.put((role, {"error": traceback.format_exc()}))


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("backend", BACKENDS)
def test_brokered_transfers_and_rendezvous(backend: str, tmp_path: Any) -> None:
    """Through a real `kvbroker serve` process: the communicator is built from rendezvous
    data the broker relays, and 100 repeated prompts each go Expect -> Offer -> Prepare ->
    Ready -> Go -> send/receive over NCCL -> Done -> Release, P's blocks overwritten right
    after each save: zero mismatches, every staging buffer released."""
    from tests.support import BrokerProcess

    broker = BrokerProcess(tmp_path)
    broker.start()
    try:
        cfg = {"iters": 100, "bounds": [1, 3, 8], "backend": backend, "endpoint": broker.endpoint}
        out = _run_pair(_brokered_worker, cfg, timeout_s=120.0)
    finally:
        assert broker.stop() == 0
    _report(f"brokered[{backend}]", {"P": out["P"], "D": out["D"]})
    assert out["P"]["peer"] == "p:0" and out["D"]["peer"] == "d:0"
    assert out["D"]["mismatches"] == 0
    assert out["P"]["released"] == 100
    # One communicator each side, built once from the relayed rendezvous data.
    assert out["P"]["stats"]["created"] == 1 and out["D"]["stats"]["created"] == 1
    log = (tmp_path / "broker-1.log").read_text()
    assert log.count('"transfer.done"') == 100, log[-2000:]
