"""The connector's worker half on two GPUs, transport "nccl", against a real broker process.

As `tests/connector/test_worker.py` does on the CPU, these drive the hooks vLLM calls
(bind, save_kv_layer, wait_for_save, start_load_kv, get_finished) in vLLM's order, with
no vLLM: a prefill worker whose KV cache lives on cuda:0 and a decode worker whose cache
lives on cuda:1, talking only through the broker (which also relays the communicator's
rendezvous) and NCCL. The KV is flash-attn shaped (``[2, num_blocks, bs, H, D]`` a layer).

With ``KVBROKER_NCCL_BACKEND=ipc`` they run over the ipc backend, and on a host with one
GPU both workers then keep their caches on cuda:0 (the backend copies between two
caches of one GPU as between two GPUs).
"""

from __future__ import annotations

import itertools
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
import torch

from connector import consumer, nccl_link
from workers import gpu_staging
from workers.transports.bell import Ringer
from workers.transports.cuda_ipc import IpcCommunicator
from connector.scheduler import KvBrokerMetadata, SaveSpec
from connector.worker import ConnectorWorker
from protocols.errors import TransferFailed
from protocols.messages import Go
from tests.connector.test_save_race import Blocks, defer_gathers, save_race
from tests.connector.test_worker import (
    LAYERS,
    FakeSpec,
    load,
    make_worker,
    run_steps,
    stage,
)
from tests.support import BrokerProcess, wait_until

_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
# "ipc" or "ipc,<fallback>": between two workers of one host both build ipc.
_OVER_IPC = os.environ.get("KVBROKER_NCCL_BACKEND", "").split(",")[0] == "ipc"
_ONE_GPU_IPC = _GPUS == 1 and _OVER_IPC
P_GPU, D_GPU = "cuda:0", "cuda:0" if _ONE_GPU_IPC else "cuda:1"
two_gpus = pytest.mark.skipif(_GPUS < 2 and not _ONE_GPU_IPC, reason="needs 2 CUDA GPUs (or 1 with the ipc backend)")
pytestmark = [pytest.mark.gpu, two_gpus]

BLOCKS = 64


def gpu_caches(device: str, seed: int) -> dict[str, torch.Tensor]:
    spec = FakeSpec()
    g = torch.Generator().manual_seed(seed)
    shape = (2, BLOCKS, spec.block_size, spec.num_kv_heads, spec.head_size)
    return {name: torch.randn(shape, generator=g).to(torch.bfloat16).to(device) for name in LAYERS}


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[BrokerProcess]:
    b = BrokerProcess(tmp_path, "--heartbeat", "0.2", "--peer-lease", "2")
    b.start()
    yield b
    b.kill()


def leases_come_back(*workers: ConnectorWorker, timeout: float = 10) -> None:
    """Wait until every staging and receive lease of `workers` is back in its pool; D's
    `get_finished` returns receive leases whose scatter has run."""
    def settled() -> bool:
        for w in workers:
            if w.consumer is not None:
                w.get_finished(set())
        return all(w.pool is not None and w.pool.statistics().leases == 0 for w in workers)

    wait_until(settled, timeout, "every staging and receive lease back in its pool")


@pytest.mark.parametrize("copies", ["kernel", "index", "mixed"])
def test_repeated_prompts_move_over_nccl_with_blocks_reused_at_once(broker: BrokerProcess, copies: str) -> None:
    """60 transfers, P's blocks refilled before and overwritten right after each step
    (the seed's race), every other one with a one-block prefix hit on D: D's blocks after
    its hit hold exactly what P saved, its prefix-cached block is never written, and
    every staging and receive lease goes back to its pool. `copies`: the transport's
    Triton kernel (the default on a GPU), index_select/index_copy_ (without Triton), or
    P handed another view of one layer's cache (that layer copied by index_select, the
    rest by the kernel)."""
    pc, dc = gpu_caches(P_GPU, 1), gpu_caches(D_GPU, 2)
    p = make_worker(broker.endpoint, "p", "p0", pc, transport="nccl")
    d = make_worker(broker.endpoint, "d", "d0", dc, transport="nccl")
    assert p.paged is not None and d.paged is not None  # Triton is there on the GPU host
    if copies == "index":
        p.paged = d.paged = None
    mismatches, times = 0, []
    try:
        for i in range(60):
            src, dst, cached = [3, 17, 40, 9], [50, 2, 33, 21], i % 2
            for t in pc.values():  # this prompt's KV, new each time
                t[:, src] = torch.randn_like(t[:, src])
            saved = {n: t[:, src].clone() for n, t in pc.items()}
            kept = {n: t[:, dst[:cached]].clone() for n, t in dc.items()}
            t0 = time.monotonic()
            load(d, f"t{i}", dst, cached=cached)
            if copies == "mixed":
                p.bind(KvBrokerMetadata(saves={f"t{i}": SaveSpec(
                    req_id=f"req-t{i}", block_ids=src, num_tokens=len(src) * 32 - 5, decode="d0")}))
                for k, name in enumerate(LAYERS):
                    p.save_kv_layer(name, pc[name].view(pc[name].shape) if k == 0 else pc[name])
                p.wait_for_save()
                p.clear()
            else:
                stage(p, pc, f"t{i}", src, decode="d0")
            for t in pc.values():  # the next step writes these blocks at once
                t[:, src] = -7.0
            finished, errors, _ = run_steps(d, {f"req-t{i}"}, timeout=30)
            times.append(time.monotonic() - t0)
            assert not errors, f"transfer t{i} failed to load: {d.statistics()}"
            torch.cuda.synchronize(D_GPU)
            for n, t in dc.items():
                mismatches += not torch.equal(t[:, dst[cached:]].cpu(), saved[n][:, cached:].cpu())
                assert torch.equal(t[:, dst[:cached]], kept[n]), "a prefix-cached block was written"
        assert mismatches == 0
        stats = {"p": p.statistics(), "d": d.statistics()}
        assert stats["d"]["loaded"] == 60 and stats["d"]["failed"] == 0, stats
        assert p.pool is not None and d.pool is not None

        leases_come_back(p, d)
        assert p.nccl is not None and d.nccl is not None
        assert p.nccl.cache.statistics().created == 1 and d.nccl.cache.statistics().created == 1
        print("nccl connector transfer ms, median:", round(sorted(times)[len(times) // 2] * 1e3, 2))
    finally:
        p.close()
        d.close()


GPU_BLOCKS = Blocks(take=lambda t, ids: t[:, ids], put=lambda t, ids, v: t.__setitem__((slice(None), ids), v))


@pytest.mark.parametrize("twin", ["shipped", "unsafe"])
def test_a_thousand_transfers_are_exact_whatever_p_writes_after_each_save(
    broker: BrokerProcess, monkeypatch: pytest.MonkeyPatch, twin: str
) -> None:
    """The seed's race on the connector's path (tests/connector/test_save_race.py): 1,000
    transfers, eight a step on the same block ids of P, each layer's blocks overwritten
    on the compute stream right after its `save_kv_layer` returns; D's blocks hold what
    P's held at the call, every one. The unsafe twin (P's copies deferred to
    `wait_for_save`, injected here) corrupts every transfer."""
    if twin == "unsafe":
        defer_gathers(monkeypatch)
    pc, dc = gpu_caches(P_GPU, 15), gpu_caches(D_GPU, 16)
    p = make_worker(broker.endpoint, "p", "p0", pc, transport="nccl")
    d = make_worker(broker.endpoint, "d", "d0", dc, transport="nccl")
    transfers = 1000 if twin == "shipped" else 80
    try:
        t0 = time.monotonic()
        mismatched = save_race(p, d, pc, dc, blocks=GPU_BLOCKS, block_size=FakeSpec().block_size, transfers=transfers,
                               per_step=8, blocks_per=4, d_blocks=BLOCKS, decode="d0", tag=twin,
                               sync=lambda: torch.cuda.synchronize(D_GPU))
        assert p.nccl is not None
        backends = sorted({c.backend for c in p.nccl.cache._comms.values()})
        print(f"save race, {twin}: {transfers} transfers, {mismatched} mismatched, "
              f"{time.monotonic() - t0:.1f} s, over {backends}")
        if twin == "shipped":
            assert mismatched == 0
            assert d.statistics()["loaded"] == transfers and d.statistics()["failed"] == 0
        else:
            assert mismatched == transfers, "the deferred copies read the overwritten blocks: the race test can fail"
        leases_come_back(p, d)
    finally:
        p.close()
        d.close()


def test_two_transfers_of_one_step_to_one_decode_peer(broker: BrokerProcess) -> None:
    """Two saves in one step, both to the same decode peer: D receives them one after the
    other (NCCL pairs ops by posting order), and each lands in its own blocks."""
    pc, dc = gpu_caches(P_GPU, 3), gpu_caches(D_GPU, 4)
    p = make_worker(broker.endpoint, "p", "p0", pc, transport="nccl")
    d = make_worker(broker.endpoint, "d", "d0", dc, transport="nccl")
    try:
        for round_ in range(5):
            a, b = f"a{round_}", f"b{round_}"
            saved = {n: (t[:, [1, 2]].clone(), t[:, [5, 6, 7]].clone()) for n, t in pc.items()}
            load(d, a, [10, 11], cached=0)
            load(d, b, [20, 21, 22], cached=0)
            specs = {
                a: SaveSpec(req_id=f"req-{a}", block_ids=[1, 2], num_tokens=2 * 32 - 5, decode="d0"),
                b: SaveSpec(req_id=f"req-{b}", block_ids=[5, 6, 7], num_tokens=3 * 32 - 5, decode="d0"),
            }
            p.bind(KvBrokerMetadata(saves=specs))
            for name in LAYERS:
                p.save_kv_layer(name, pc[name])
            p.wait_for_save()
            p.clear()
            for t in pc.values():
                t[:, [1, 2, 5, 6, 7]] = torch.randn_like(t[:, [1, 2, 5, 6, 7]])  # reused at once
            _, errors, _ = run_steps(d, {f"req-{a}", f"req-{b}"}, timeout=30)
            assert not errors
            torch.cuda.synchronize(D_GPU)
            for n, t in dc.items():
                assert torch.equal(t[:, [10, 11]].cpu(), saved[n][0].cpu())
                assert torch.equal(t[:, [20, 21, 22]].cpu(), saved[n][1].cpu())
    finally:
        p.close()
        d.close()


@pytest.mark.parametrize("mixed", [False, True])
def test_a_step_of_four_saves_is_staged_back_to_back_and_lands_whole(broker: BrokerProcess, mixed: bool) -> None:
    """Four saves of one step are staged in adjacent leases cut from one (so each layer is
    gathered for all four by one kernel), sent one by one to one decode peer, and each
    lands in its own blocks, whatever P writes into its blocks right after the step.
    `mixed`: one layer is handed over as another view of its cache, so that layer is
    copied request by request and the others together."""
    pc, dc = gpu_caches(P_GPU, 5), gpu_caches(D_GPU, 6)
    p = make_worker(broker.endpoint, "p", "p0", pc, transport="nccl")
    d = make_worker(broker.endpoint, "d", "d0", dc, transport="nccl")
    assert p.paged is not None and p.producer is not None
    srcs = [[1, 2], [5, 6, 7], [9], [12, 13, 14, 15]]
    dsts = [[30, 31], [40, 41, 42], [45], [50, 51, 52, 53]]
    every = [b for s in srcs for b in s]
    try:
        for round_ in range(10):
            tids = [f"s{round_}.{j}" for j in range(len(srcs))]
            for t in pc.values():  # these prompts' KV, new each round
                t[:, every] = torch.randn_like(t[:, every])
            saved = {n: [t[:, s].clone() for s in srcs] for n, t in pc.items()}
            for tid, dst in zip(tids, dsts):
                load(d, tid, dst, cached=0)
            p.bind(KvBrokerMetadata(saves={
                tid: SaveSpec(req_id=f"req-{tid}", block_ids=src, num_tokens=len(src) * 32 - 5, decode="d0")
                for tid, src in zip(tids, srcs)}))
            for k, name in enumerate(LAYERS):
                p.save_kv_layer(name, pc[name].view(pc[name].shape) if mixed and k == 0 else pc[name])
            with p.lock:  # staged at the first layer's save, held until D's Done
                leases = [p.producer._staged[tid].lease for tid in tids]
            assert [a.offset + a.nbytes for a in leases[:-1]] == [b.offset for b in leases[1:]], "not back to back"
            p.wait_for_save()
            p.clear()
            for t in pc.values():  # the next step writes these blocks at once
                t[:, every] = -7.0
            _, errors, _ = run_steps(d, {f"req-{tid}" for tid in tids}, timeout=30)
            assert not errors, d.statistics()
            torch.cuda.synchronize(D_GPU)
            for n, t in dc.items():
                for j, dst in enumerate(dsts):
                    assert torch.equal(t[:, dst].cpu(), saved[n][j].cpu()), f"round {round_}, save {j}, {n}"
        leases_come_back(p, d)
    finally:
        p.close()
        d.close()


def test_an_abort_mid_receive_ends_it_and_the_next_transfer_rebuilds(broker: BrokerProcess) -> None:
    """A transfer is aborted while D's NCCL receive for it is posted (P's step missed a
    layer after the Go): D's load fails at once, not at its deadline, its communicator is
    aborted so the receive cannot take a later transfer's bytes, and the next transfer
    goes through on a new communicator on both sides (D told P its side was gone)."""
    pc, dc = gpu_caches(P_GPU, 5), gpu_caches(D_GPU, 6)
    p = make_worker(broker.endpoint, "p", "p0", pc, transport="nccl", load_timeout_s=8)
    d = make_worker(broker.endpoint, "d", "d0", dc, transport="nccl", load_timeout_s=8)
    try:
        load(d, "first", [30, 31], cached=0)
        stage(p, pc, "first", [1, 2], decode="d0")
        assert not run_steps(d, {"req-first"}, timeout=30)[1]

        load(d, "cut", [40, 41, 42], cached=0)
        spec = SaveSpec(req_id="req-cut", block_ids=[4, 5, 6], num_tokens=3 * 32 - 5, decode="d0")
        p.bind(KvBrokerMetadata(saves={"cut": spec}))
        p.save_kv_layer(LAYERS[0], pc[LAYERS[0]])  # offered now; the Go comes during the "forward pass"
        assert d.nccl is not None
        comms = d.nccl.cache._comms
        posted = lambda: any(not op.done() for c in list(comms.values()) for op in c._pending)  # noqa: E731
        wait_until(posted, 10, "D's receive for 'cut' to be posted")
        p.wait_for_save()  # the step missed the other layers: P drops and aborts it
        p.clear()
        _, errors, seconds = run_steps(d, {"req-cut"}, timeout=30)
        assert errors == {40, 41, 42} and seconds < 4, (errors, seconds)

        saved = {n: t[:, [7, 8]].clone() for n, t in pc.items()}
        load(d, "after", [50, 51], cached=0)
        stage(p, pc, "after", [7, 8], decode="d0")
        assert not run_steps(d, {"req-after"}, timeout=30)[1]
        torch.cuda.synchronize(D_GPU)
        for n, t in dc.items():
            assert torch.equal(t[:, [50, 51]].cpu(), saved[n].cpu())
        assert p.nccl is not None
        assert d.nccl.cache.statistics().created == 2 and p.nccl.cache.statistics().created == 2
    finally:
        p.close()
        d.close()


def _fail_posts(monkeypatch: pytest.MonkeyPatch, prefix: str) -> None:
    """Make P's link fail to post the send of every transfer named `prefix`*, as a failed
    communicator would: on its Go (`_post_on`) and where D's receive was seen
    (`_post_blocks`), so the link's own cleanup and the producer's ending both run."""
    for name in ("_post_on", "_post_blocks"):
        real = getattr(nccl_link.NcclLink, name)

        def failing(self: nccl_link.NcclLink, comm: object, peer: str, op: str, transfer_id: str, *args: object,
                    __real: object = real, **kwargs: object) -> object:
            if op == "send" and transfer_id.startswith(prefix):
                raise TransferFailed(transfer_id, f"NCCL send with {peer} failed (injected by the test)")
            return __real(self, comm, peer, op, transfer_id, *args, **kwargs)  # type: ignore[operator]

        monkeypatch.setattr(nccl_link.NcclLink, name, failing)


def test_a_send_p_cannot_make_ends_the_transfer_at_once(broker: BrokerProcess,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """P's NCCL send fails to post (the test fails it, as a failed communicator would): P
    aborts the transfer at the broker, so D's load fails at once instead of at its 20 s
    deadline, and D's turn for this producer is free again at once, both for the pair's
    first transfer (its communicator is built, then dropped) and when D's receive was
    posted on one; the next transfer goes through each time."""
    _fail_posts(monkeypatch, "lost")
    pc, dc = gpu_caches(P_GPU, 7), gpu_caches(D_GPU, 8)
    p = make_worker(broker.endpoint, "p", "p0", pc, transport="nccl", load_timeout_s=20)
    d = make_worker(broker.endpoint, "d", "d0", dc, transport="nccl", load_timeout_s=20)
    try:
        for round_, (src, dst) in enumerate((([4, 5], [40, 41]), ([9, 10], [44, 45]))):
            lost = f"lost{round_}"
            load(d, lost, dst, cached=0)
            stage(p, pc, lost, src, decode="d0")
            _, errors, seconds = run_steps(d, {f"req-{lost}"}, timeout=40)
            assert errors == set(dst) and seconds < 4, (round_, errors, seconds)

            ok = f"after{round_}"
            saved = {n: t[:, [7, 8]].clone() for n, t in pc.items()}
            load(d, ok, [50, 51], cached=0)
            stage(p, pc, ok, [7, 8], decode="d0")
            assert not run_steps(d, {f"req-{ok}"}, timeout=10)[1]  # D's turn for p0 came back at once
            torch.cuda.synchronize(D_GPU)
            for n, t in dc.items():
                assert torch.equal(t[:, [50, 51]].cpu(), saved[n].cpu())
        assert p.statistics()["staged_now"] == 0 and p.statistics()["aborted"] == 2
        assert p.nccl is not None and d.nccl is not None
        # Each lost transfer's failed post drops the pair's communicator on both sides (P's
        # link ends the pair, D drops the one its cancelled receive waited on), and the
        # transfer after it builds a new one together.
        assert d.nccl.cache.statistics().created == p.nccl.cache.statistics().created <= 3
    finally:
        p.close()
        d.close()


def _chunks_over_ipc_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """Over the ipc backend a D with the Triton copies receives straight into its blocks;
    this makes it refuse, so transfers go in chunks landed by scatters, as over NCCL."""
    monkeypatch.setattr(IpcCommunicator, "takes_blocks", staticmethod(lambda paged, num_blocks: False))


class _OneAtATime:
    """A receive's chunk op that reads as ended only once the chunks before it landed
    (`landed` counts them): D then lands each chunk on its own, whatever the timing."""

    def __init__(self, op: object, k: int, landed: list[object]) -> None:
        self.op, self.k, self.landed = op, k, landed

    def done(self) -> bool:
        return self.k <= len(self.landed) and self.op.done()  # type: ignore[attr-defined]

    def wait(self, deadline: float) -> None:
        self.op.wait(deadline)  # type: ignore[attr-defined]


def _one_block_chunks(nbytes: int, block_nbytes: int) -> list[tuple[int, int]]:
    """Every staged block its own chunk: the pipelined path on transfers of a few blocks
    (the real plan splits only transfers of more than 112 MiB)."""
    if block_nbytes <= 0 or nbytes % block_nbytes:
        return [(0, 1)]
    return [(k, k + 1) for k in range(nbytes // block_nbytes)]


def test_chunks_are_scattered_as_each_lands(broker: BrokerProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """A transfer in several chunks (one NCCL op each, both sides): D scatters each chunk
    into its blocks as its receive ends, on a stream of its own, ordered after the
    compute stream's point at start_load_kv. 30 transfers of 6 blocks, every other one
    with a two-block prefix hit; P's blocks overwritten right after each step. D's blocks
    after its hit hold exactly what P saved, its prefix-cached blocks are never written,
    every chunk went through `_land` (on its own, or with the chunks that ended while D
    was busy: in order, each block once), and every lease goes back to its pool."""
    monkeypatch.setattr(nccl_link, "chunks", _one_block_chunks)
    _chunks_over_ipc_too(monkeypatch)
    landed: list[tuple[str, int, int]] = []
    real_land = consumer.ConsumerSide._land

    def land(self: consumer.ConsumerSide, load: consumer._Load, b0: int, b1: int, left: int) -> None:
        landed.append((load.transfer_id, b0, b1))
        real_land(self, load, b0, b1, left)

    monkeypatch.setattr(consumer.ConsumerSide, "_land", land)
    pc, dc = gpu_caches(P_GPU, 9), gpu_caches(D_GPU, 10)
    p = make_worker(broker.endpoint, "p", "p0", pc, transport="nccl")
    d = make_worker(broker.endpoint, "d", "d0", dc, transport="nccl")
    assert p.paged is not None and d.paged is not None
    try:
        for i in range(30):
            src, dst, cached = [3, 17, 40, 9, 12, 60], [50, 2, 33, 21, 7, 44], 2 * (i % 2)
            for t in pc.values():
                t[:, src] = torch.randn_like(t[:, src])
            saved = {n: t[:, src].clone() for n, t in pc.items()}
            kept = {n: t[:, dst[:cached]].clone() for n, t in dc.items()}
            load(d, f"c{i}", dst, cached=cached)
            stage(p, pc, f"c{i}", src, decode="d0")
            for t in pc.values():
                t[:, src] = -7.0
            _, errors, _ = run_steps(d, {f"req-c{i}"}, timeout=30)
            assert not errors, f"transfer c{i} failed to load: {d.statistics()}"
            torch.cuda.synchronize(D_GPU)
            for n, t in dc.items():
                assert torch.equal(t[:, dst[cached:]].cpu(), saved[n][:, cached:].cpu()), (i, n)
                assert torch.equal(t[:, dst[:cached]], kept[n]), "a prefix-cached block was written"
            ranges = [(b0, b1) for tid, b0, b1 in landed if tid == f"c{i}"]
            assert ranges[0][0] == 0 and ranges[-1][1] == len(dst) - cached, ranges
            assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges)), ranges
        leases_come_back(p, d)
    finally:
        p.close()
        d.close()


@pytest.mark.parametrize("cut", ["cancel", "raise"])
def test_a_load_cut_after_a_chunk_landed_fails_and_the_next_is_whole(
    broker: BrokerProcess, monkeypatch: pytest.MonkeyPatch, cut: str
) -> None:
    """D's receive is cut short after its first chunk was scattered: the op cancelled (as
    a give-up does), or the scatter of the next chunk failing (its later chunks' receives
    still posted). The load fails with all its blocks reported, its lease goes back only
    after the landed chunk's scatter has run, and the next transfer is whole, on new
    communicators (none of the cut transfer's ops pairs with the next one's). Each chunk
    of the cut transfer lands on its own here (`_OneAtATime`), so the cut comes between
    two chunks whatever the timing."""
    monkeypatch.setattr(nccl_link, "chunks", _one_block_chunks)
    _chunks_over_ipc_too(monkeypatch)
    real_land, real_post_on = consumer.ConsumerSide._land, nccl_link.NcclLink._post_on
    cut_landed: list[object] = []

    def post_on(self: nccl_link.NcclLink, *args: object, **kw: object) -> nccl_link.Posted:
        posted = real_post_on(self, *args, **kw)  # type: ignore[arg-type]
        if posted.transfer_id == "cut" and posted.op == "recv":
            posted.completions = [_OneAtATime(op, k, cut_landed) for k, op in enumerate(posted.completions)]
        return posted

    def land(self: consumer.ConsumerSide, load: consumer._Load, b0: int, b1: int, left: int) -> None:
        if load.transfer_id == "cut" and b0 == 1 and cut == "raise":
            raise RuntimeError("the scatter could not be launched")
        real_land(self, load, b0, b1, left)
        if load.transfer_id == "cut":
            cut_landed.append((b0, b1))
        if load.transfer_id == "cut" and b0 == 0 and cut == "cancel":
            assert self.w.nccl is not None
            self.w.nccl.cancel(load.source, load.transfer_id)

    monkeypatch.setattr(nccl_link.NcclLink, "_post_on", post_on)
    monkeypatch.setattr(consumer.ConsumerSide, "_land", land)
    pc, dc = gpu_caches(P_GPU, 11), gpu_caches(D_GPU, 12)
    p = make_worker(broker.endpoint, "p", "p0", pc, transport="nccl", load_timeout_s=8)
    d = make_worker(broker.endpoint, "d", "d0", dc, transport="nccl", load_timeout_s=8)
    try:
        saved = {n: t[:, [4, 5, 6]].clone() for n, t in pc.items()}
        load(d, "cut", [40, 41, 42], cached=0)
        stage(p, pc, "cut", [4, 5, 6], decode="d0")
        _, errors, seconds = run_steps(d, {"req-cut"}, timeout=30)
        assert errors == {40, 41, 42} and seconds < 6, (errors, seconds)
        torch.cuda.synchronize(D_GPU)
        for n, t in dc.items():  # the chunk that landed holds P's bytes, not garbage
            assert torch.equal(t[:, 40].cpu(), saved[n][:, 0].cpu())
        leases_come_back(d)  # the cut load's receive lease, once its landed chunk's copy ran

        saved = {n: t[:, [7, 8, 9]].clone() for n, t in pc.items()}
        load(d, "after", [50, 51, 52], cached=0)
        stage(p, pc, "after", [7, 8, 9], decode="d0")
        assert not run_steps(d, {"req-after"}, timeout=30)[1]
        torch.cuda.synchronize(D_GPU)
        for n, t in dc.items():
            assert torch.equal(t[:, [50, 51, 52]].cpu(), saved[n].cpu())
        assert p.nccl is not None and d.nccl is not None
        assert d.nccl.cache.statistics().created == 2 and p.nccl.cache.statistics().created == 2
        leases_come_back(p, d, timeout=20)
    finally:
        p.close()
        d.close()


@pytest.mark.skipif(not _OVER_IPC, reason="the ipc backend's own path")
def test_over_ipc_each_transfer_goes_straight_into_the_blocks(broker: BrokerProcess,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Over the ipc backend D posts each transfer as one receive into its blocks: nothing
    is scattered (`_land` never runs), every load lands in place once, with and without a
    prefix hit, and D's blocks hold what P saved, most sent as soon as P saw the receive
    (before the Go); then, with D refusing block receives,
    the same pair moves the next transfers in chunks landed by scatters (P follows D's
    kind)."""
    scattered, in_place = [], []
    real_land, real_in_place = consumer.ConsumerSide._land, consumer.ConsumerSide._landed_in_place

    def land(self: consumer.ConsumerSide, load: consumer._Load, b0: int, b1: int, left: int) -> None:
        scattered.append(load.transfer_id)
        real_land(self, load, b0, b1, left)

    def landed_in_place(self: consumer.ConsumerSide, load: consumer._Load, posted: object, count: int) -> None:
        in_place.append((load.transfer_id, count))
        real_in_place(self, load, posted, count)

    monkeypatch.setattr(consumer.ConsumerSide, "_land", land)
    monkeypatch.setattr(consumer.ConsumerSide, "_landed_in_place", landed_in_place)
    pc, dc = gpu_caches(P_GPU, 13), gpu_caches(D_GPU, 14)
    p = make_worker(broker.endpoint, "p", "p0", pc, transport="nccl")
    d = make_worker(broker.endpoint, "d", "d0", dc, transport="nccl")
    try:
        for i in range(20):
            if i == 10:
                _chunks_over_ipc_too(monkeypatch)
            src, dst, cached = [3, 17, 40, 9, 12], [50, 2, 33, 21, 7], i % 2
            for t in pc.values():
                t[:, src] = torch.randn_like(t[:, src])
            saved = {n: t[:, src].clone() for n, t in pc.items()}
            load(d, f"b{i}", dst, cached=cached)
            stage(p, pc, f"b{i}", src, decode="d0")
            for t in pc.values():
                t[:, src] = -7.0
            if i < 10:  # in its blocks: D told the broker as it landed, before its engine saw it
                wait_until(lambda: p.statistics()["released"] == i + 1, 30, f"b{i}'s release before D's report")
                assert d.statistics()["loaded"] == i
            assert not run_steps(d, {f"req-b{i}"}, timeout=30)[1], f"transfer b{i} failed to load"
            torch.cuda.synchronize(D_GPU)
            for n, t in dc.items():
                assert torch.equal(t[:, dst[cached:]].cpu(), saved[n][:, cached:].cpu()), (i, n)
        assert in_place == [(f"b{i}", 5 - i % 2) for i in range(10)]
        assert sorted(set(scattered)) == sorted(f"b{i}" for i in range(10, 20))
        # After the first built the communicator, D posted each receive into blocks before
        # its Ready, and P started the send on it rather than on the Go (a prefix hit
        # every other time: the receive's size says which tail of the staging to send).
        assert p.statistics().get("sent_on_receive", 0) >= 5, p.statistics()
        leases_come_back(p, d)
    finally:
        p.close()
        d.close()


def waits_on_bells(poller: nccl_link.Poller) -> bool:
    """The poller has looked for every transfer watched so far and now waits only for a
    bell: no look asked for and none timed. `_listening` alone may be left over from
    before the last transfer was watched, and D's receive, posted before the poller's
    first look, would then be found without a ring."""
    with poller._cond:
        return poller._listening and poller._asked == poller._looked and math.isinf(poller._look_at)


@pytest.mark.skipif(not _OVER_IPC, reason="the ipc backend's own path")
@pytest.mark.parametrize("rings", [True, False], ids=["rings", "twin_silent"])
def test_over_ipc_a_claim_long_after_the_offer_still_sends_on_ds_receive(
    broker: BrokerProcess, monkeypatch: pytest.MonkeyPatch, rings: bool
) -> None:
    """As under a proxy that sends the request to P first and to D with P's answer: each
    transfer is staged and offered, P's poller has looked for D's receive and waits on
    its bell, and only then does D claim it. D rings once its receive is posted, and the
    send starts on that receive, before the Go. Here idle, the broker relays D's Ready
    as the Go within a millisecond: the Go is held 10 ms at P (injected), as a busy
    broker or loop would hold it, so the test tells the two apart. The twin's D never
    rings (injected too): P never looks again, and every send waits for its Go. Either
    way D's blocks hold what P saved."""
    real_on_go = ConnectorWorker.on_go

    async def on_go_late(self: ConnectorWorker, msg: Go) -> None:
        await anyio.sleep(0.01)
        await real_on_go(self, msg)

    monkeypatch.setattr(ConnectorWorker, "on_go", on_go_late)
    if not rings:
        monkeypatch.setattr(Ringer, "ring", lambda self: None)
    pc, dc = gpu_caches(P_GPU, 21), gpu_caches(D_GPU, 22)
    p = make_worker(broker.endpoint, "p", "p0", pc, transport="nccl")
    d = make_worker(broker.endpoint, "d", "d0", dc, transport="nccl")
    link = p.nccl
    assert link is not None

    try:
        load(d, "warm", [60], cached=0)  # the first builds the pair's communicator, on its Go
        stage(p, pc, "warm", [1], decode="d0")
        assert not run_steps(d, {"req-warm"}, timeout=30)[1]
        before = p.statistics().get("sent_on_receive", 0)
        for i in range(5):
            src, dst = [3 + i, 17, 40, 9, 12], [50, 2 + i, 33, 21, 7]
            for t in pc.values():
                t[:, src] = torch.randn_like(t[:, src])
            saved = {n: t[:, src].clone() for n, t in pc.items()}
            stage(p, pc, f"c{i}", src, decode="d0")
            for t in pc.values():
                t[:, src] = -7.0
            wait_until(lambda: p.statistics()["offered"] == i + 2 and waits_on_bells(link.poller), 10,
                       f"P's poller to wait on its bell for c{i}'s receive")
            load(d, f"c{i}", dst, cached=0)
            assert not run_steps(d, {f"req-c{i}"}, timeout=30)[1], f"transfer c{i} failed to load"
            torch.cuda.synchronize(D_GPU)
            for n, t in dc.items():
                assert torch.equal(t[:, dst].cpu(), saved[n].cpu()), (i, n)
        on_receive = p.statistics().get("sent_on_receive", 0) - before
        if rings:
            assert on_receive == 5, p.statistics()
        else:
            assert on_receive == 0, p.statistics()
        leases_come_back(p, d)
    finally:
        p.close()
        d.close()


@pytest.mark.skipif(not _OVER_IPC, reason="the ipc backend's own path")
def test_over_ipc_a_load_into_the_blocks_takes_no_pool_room_whatever_its_size(broker: BrokerProcess) -> None:
    """D's receive pool holds two blocks' worth. A one-block transfer builds the pair's
    communicator through it; then each five-block transfer, whose request names its
    prefill instance, goes straight into D's blocks: its Expect says so, the broker
    reserves no room, D leases none, and every one lands whole."""
    pc, dc = gpu_caches(P_GPU, 15), gpu_caches(D_GPU, 16)
    p = make_worker(broker.endpoint, "p", "p0", pc, transport="nccl")
    d = make_worker(broker.endpoint, "d", "d0", dc, transport="nccl", pool_bytes=2 * p.chunk_nbytes)
    try:
        assert d.pool is not None and d.pool.capacity < 5 * p.chunk_nbytes
        load(d, "warm", [60], cached=0, prefill="p0")
        stage(p, pc, "warm", [1], decode="d0")
        assert not run_steps(d, {"req-warm"}, timeout=30)[1]
        for i in range(4):
            src, dst = [3 + i, 17, 40, 9, 12], [50, 2 + i, 33, 21, 7]
            saved = {n: t[:, src].clone() for n, t in pc.items()}
            load(d, f"big{i}", dst, cached=0, prefill="p0")
            stage(p, pc, f"big{i}", src, decode="d0")
            assert not run_steps(d, {f"req-big{i}"}, timeout=30)[1], f"transfer big{i} failed to load"
            torch.cuda.synchronize(D_GPU)
            for n, t in dc.items():
                assert torch.equal(t[:, dst].cpu(), saved[n].cpu()), (i, n)
        leases_come_back(p, d)
    finally:
        p.close()
        d.close()


@pytest.mark.skipif(not _OVER_IPC, reason="the ipc backend's own path")
@pytest.mark.parametrize("twin", ["shipped", "unsafe"])
def test_a_send_posted_during_the_forward_pass_copies_each_layer_once_gathered(
    broker: BrokerProcess, monkeypatch: pytest.MonkeyPatch, twin: str
) -> None:
    """The Go comes while P's forward pass runs (the test waits after the first layer's
    save until P has posted the send): P posts the send into D's blocks at once, and it
    is launched a group of layers at a time, each launch behind an event recorded after
    that group's gathers. Each layer is computed (a few ms of GPU time) before its gather
    and overwritten on the compute stream right after its save; D's blocks hold what
    P's held at each save. The unsafe twin launches the whole copy when the send starts
    following the step, behind no event (injected here): the copy then reads staging the
    gathers have not written yet, and every transfer differs."""
    if twin == "unsafe":
        monkeypatch.setattr(gpu_staging.StepLayers, "follow",
                            lambda self, send: send.launch(self.num_layers, None))
    pc, dc = gpu_caches(P_GPU, 21), gpu_caches(D_GPU, 22)
    p = make_worker(broker.endpoint, "p", "p0", pc, transport="nccl")
    d = make_worker(broker.endpoint, "d", "d0", dc, transport="nccl")
    assert p.producer is not None and p.nccl is not None and d.client is not None
    d_peer = d.client.registered.peer_id
    transfers, mismatched = 10, 0
    try:
        for i in range(transfers):
            tid, src, dst = f"s{i}", [3, 17, 40, 9], [50, 2, 33, 21]
            for t in pc.values():
                t[:, src] = torch.randn_like(t[:, src])
            saved = {n: t[:, src].clone() for n, t in pc.items()}
            comm = p.nccl.cache.current(d_peer)
            posted = comm.sent + 1 if comm is not None else 2  # a new communicator's first send is its warm-up
            load(d, tid, dst, cached=0)
            p.bind(KvBrokerMetadata(saves={tid: SaveSpec(req_id=f"req-{tid}", block_ids=src,
                                                         num_tokens=len(src) * 32 - 5, decode="d0")}))
            for k, name in enumerate(LAYERS):
                torch.cuda._sleep(10_000_000)  # the layer's compute, a few ms, before its gather
                p.save_kv_layer(name, pc[name])
                pc[name][:, src] = -7.0  # the compute stream writes the blocks right after the save
                if k == 0:
                    wait_until(lambda: getattr(p.nccl.cache.current(d_peer), "sent", 0) >= posted, 10,
                               f"{tid}'s send posted during the forward pass")
            p.wait_for_save()
            p.clear()
            assert not run_steps(d, {f"req-{tid}"}, timeout=30)[1], f"transfer {tid} failed to load"
            torch.cuda.synchronize(D_GPU)
            mismatched += any(not torch.equal(t[:, dst].cpu(), saved[n].cpu()) for n, t in dc.items())
        print(f"streamed sends, {twin}: {transfers} transfers, {mismatched} mismatched")
        if twin == "shipped":
            assert mismatched == 0
        else:
            assert mismatched == transfers, "the copy read staging before its gathers: the test can fail"
        leases_come_back(p, d)
    finally:
        p.close()
        d.close()
