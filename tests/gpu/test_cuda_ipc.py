"""The ipc communicator backend on GPUs: what it refuses, and what an abort leaves.

The connector's race tests (test_connector_nccl.py) run over this backend on one GPU,
where a staged transfer goes as one op straight into D's blocks; these cover what only
this backend has: the same-host check at rendezvous, sizes and block counts that
differ, the copy gated off once the receiver gave up, no NCCL memory per pair, and P
and D on one GPU."""

from __future__ import annotations

import threading
import time
import traceback
from typing import Any

import numpy as np
import pytest
import torch

from protocols.errors import RecvTimeout, RendezvousError
from tests.gpu.test_communicators import REQ_D, Ops, _cache, _report, _run_pair, _setup
from tests.support import wait_until

two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"
)
one_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _ipc_cache() -> Any:
    import multiprocessing as mp

    from workers.transports.nccl_comm import CommunicatorCache, QueueRendezvous

    ctx = mp.get_context("spawn")
    return CommunicatorCache("d:0", "cuda:0", QueueRendezvous(ctx.Queue(), ctx.Queue(), timeout_s=1), backend="ipc")


@pytest.mark.gpu
@one_gpu
def test_a_peer_on_another_host_or_without_the_page_is_refused_with_what_to_use() -> None:
    from workers.transports.cuda_driver import boot_id
    from workers.transports.cuda_ipc import connect_ipc

    cache = _ipc_cache()
    info = {"backend": "ipc", "page": "/dev/shm/kvbroker-ipc-none", "boot": "another-boot", "nonce": "n", "for": ""}
    with pytest.raises(RendezvousError, match="different hosts.*use the direct backend between hosts"):
        connect_ipc(cache, "p:0", info)
    with pytest.raises(RendezvousError, match="both workers need the same /dev/shm, or use the direct backend"):
        connect_ipc(cache, "p:0", {**info, "boot": boot_id()})


def _times_out(done: Any, seconds: float) -> bool:
    """Whether a receive's completion missed a deadline `seconds` away (which aborts its communicator)."""
    try:
        done.wait(time.monotonic() + seconds)
    except RecvTimeout:
        return True
    return False


def _mismatch_worker(role: str, dev: int, outbox: Any, inbox: Any, results: Any, cfg: dict[str, Any]) -> None:
    try:
        device, _, cache, transport = _setup(role, dev, outbox, inbox, {"backend": "ipc"})
        res: dict[str, Any] = {}
        if role == "P":
            x = torch.ones(2 << 20, dtype=torch.uint8, device=device)
            try:
                transport.send_tensors("D", [x]).wait(time.monotonic() + 10.0)
                res["error"] = "the send of the wrong size went through"
            except ValueError as exc:
                res["message"] = str(exc)
            res["stats"] = cache.statistics().__dict__
        else:
            y = torch.zeros(1 << 20, dtype=torch.uint8, device=device)
            res["timed_out"] = _times_out(transport.recv_tensors("P", [y]), 3.0)
            res["untouched"] = bool((y == 0).all())
        cache.close()
        results.put((role, res))
    except BaseException:  # noqa: BLE001 - reported to the test process
        results.put((role, {"error": traceback.format_exc()}))


@pytest.mark.gpu
@two_gpus
def test_sizes_that_differ_fail_the_send_naming_both() -> None:
    out = _run_pair(_mismatch_worker, {}, timeout_s=120.0)
    _report("ipc_size_mismatch", out)
    assert "takes 1048576 bytes, but the send has 2097152" in out["P"]["message"]
    assert out["P"]["stats"]["aborted"] == 1  # the sender's communicator is gone
    assert out["D"]["timed_out"] and out["D"]["untouched"]


def _block_worker(role: str, dev: int, outbox: Any, inbox: Any, results: Any, cfg: dict[str, Any]) -> None:
    """P sends a staged transfer of 8 blocks as one block op; D's receive gives up after
    `cfg["wait_s"]` and reports whether its cache stayed as it was. `cfg["case"]`:
    "count" (D's receive takes 7 blocks: P's send must refuse it), "tag" (D's receive of
    8 blocks names another transfer than P's send: P's send must refuse it), "gave_up" (P's send
    follows a step whose layers are counted gathered only after D gave up: it must end
    without writing), or "int32_ids" (D's block ids are int32 on its GPU and a step of GPU work
    follows them: the blocks must land where the ids say)."""
    from workers.gpu_staging import PagedKv, StepLayers
    from workers.pool import BufferPool
    from workers.transports.ipc_mailbox import UNTAGGED, transfer_tag

    try:
        device, rdv, cache, ops = _setup(role, dev, outbox, inbox, {"backend": "ipc"})
        paged = PagedKv(_cache(device, seed=dev))
        pool = BufferPool(paged.staged_block_nbytes * 8, device=device)
        # "tag": each side names its own transfer; otherwise neither names one
        tag = transfer_tag(f"req-{role}") if cfg["case"] == "tag" else UNTAGGED
        res: dict[str, Any] = {}
        if role == "P":
            staged = pool.acquire_nowait(paged.staged_block_nbytes * 8).tensor
            paged.gather(paged.block_ids(list(range(8))), paged.staging_view(staged, 8))
            if cfg["case"] in ("int32_ids", "count", "tag"):
                comm = cache.get("D", initiator=True)
                try:
                    with comm.lock:
                        work = comm.send_blocks(comm.next_send, paged, staged.data_ptr(), 8, after=[ops._now()],
                                                keep=[staged], tag=tag)
                    comm.completion([work], ops.stream, "send").wait(time.monotonic() + 30.0)
                    res["sent"] = [r[:, :8].cpu().numpy() for r in paged.rows]
                except ValueError as exc:
                    res["message"] = str(exc)
                res["stats"] = cache.statistics().__dict__
            else:
                comm = cache.get("D", initiator=True)
                step = StepLayers(paged.num_layers)
                with comm.lock:
                    work = comm.send_blocks(comm.next_send, paged, staged.data_ptr(), 8, keep=[staged], feed=step)
                rdv.receive("D", "test/gave-up")
                for layer in range(paged.num_layers):
                    step.gathered(layer, torch.cuda.current_stream(device))
                res["send_ended"] = wait_until(work.event.query, 30, "P's block send to end after D gave up")
                rdv.publish("D", "test/ended", b"1")
        else:
            before = torch.stack(paged.rows).clone()
            n = 7 if cfg["case"] == "count" else 8
            if cfg["case"] == "int32_ids":
                # The receive waits for what made the ids, and converts them to int64 after
                # that, not behind the step queued on the current stream meanwhile.
                comm = cache.get("P", initiator=False)
                ids = torch.tensor(REQ_D[:n], dtype=torch.int32, device=device)
                made = torch.cuda.Event()
                made.record()
                torch.cuda._sleep(200_000_000)  # an engine step, about 0.1 s
                work = comm.post_blocks(paged, ids, after=[made])
                wait_until(work.event.query, cfg["wait_s"], "D's block receive to end")
                res["landed"] = [r[:, REQ_D[:n]].cpu().numpy() for r in paged.rows]
            else:
                comm = cache.get("P", initiator=False)
                work = comm.post_blocks(paged, paged.block_ids(REQ_D[:n]), after=[ops._now()], tag=tag)
                res["timed_out"] = _times_out(comm.completion([work], ops.stream, "recv"), cfg["wait_s"])
            if cfg["case"] == "gave_up":
                rdv.publish("P", "test/gave-up", b"1")
                rdv.receive("P", "test/ended")
            torch.cuda.synchronize(device)
            res["untouched"] = bool(torch.equal(torch.stack(paged.rows), before))
        cache.close()
        results.put((role, res))
    except BaseException:  # noqa: BLE001 - reported to the test process
        results.put((role, {"error": traceback.format_exc()}))


@pytest.mark.gpu
@one_gpu
def test_block_ids_of_another_dtype_on_the_gpu_land_where_they_say() -> None:
    """The receive converts them on the current stream behind an engine step; the ids'
    copy to P must wait for that conversion, not only for what made them."""
    out = _run_pair(_block_worker, {"one_gpu": True, "case": "int32_ids", "wait_s": 30.0}, timeout_s=120.0)
    assert len(out["D"]["landed"]) == len(out["P"]["sent"]) > 0
    for layer, (sent, got) in enumerate(zip(out["P"]["sent"], out["D"]["landed"])):
        assert np.array_equal(got, sent), f"layer {layer}: the blocks hold other bytes"


@pytest.mark.gpu
@one_gpu
def test_block_counts_that_differ_fail_the_send_naming_both() -> None:
    out = _run_pair(_block_worker, {"one_gpu": True, "case": "count", "wait_s": 3.0}, timeout_s=120.0)
    _report("ipc_block_count_mismatch", out)
    assert "takes 7 blocks, but this send is a staged transfer of 8 blocks" in out["P"]["message"]
    assert out["P"]["stats"]["aborted"] == 1
    assert out["D"]["timed_out"] and out["D"]["untouched"]


@pytest.mark.gpu
@one_gpu
def test_a_block_send_for_another_transfer_than_its_receive_fails_naming_it() -> None:
    """Both of 8 blocks, so the size cannot tell: the receive names its transfer, and the
    send refuses a receive for another one instead of writing that request's blocks."""
    out = _run_pair(_block_worker, {"one_gpu": True, "case": "tag", "wait_s": 3.0}, timeout_s=120.0)
    _report("ipc_block_tag_mismatch", out)
    assert "is for another transfer than this send of 8 blocks" in out["P"]["message"]
    assert out["P"]["stats"]["aborted"] == 1
    assert out["D"]["timed_out"] and out["D"]["untouched"]


@pytest.mark.gpu
@one_gpu
def test_a_block_send_whose_receiver_gave_up_writes_nothing() -> None:
    out = _run_pair(_block_worker, {"one_gpu": True, "case": "gave_up", "wait_s": 1.0}, timeout_s=120.0)
    _report("ipc_block_abort_gate", out)
    assert out["D"]["timed_out"] and out["P"]["send_ended"]
    assert out["D"]["untouched"], "the block send wrote into blocks its receiver had given up"


SIDE_BY_SIDE_D = [REQ_D, [1, 3, 5, 9, 11, 13, 15, 17], [40, 41, 42, 43, 44, 45, 46, 47]]  # D's blocks, by request


def _side_by_side_worker(role: str, dev: int, outbox: Any, inbox: Any, results: Any, cfg: dict[str, Any]) -> None:
    """P posts three whole staged sends to D, each following a step of its own, the first
    one's layers never counted gathered until the other two have landed: each send is
    launched as its own layers are, so the two later ones must land while the first
    still waits (on one stream they would queue behind it, as the copies of a step's
    requests once did). Then the first's layers are counted and it lands; D reports the
    blocks of all three."""
    from workers.gpu_staging import PagedKv, StepLayers
    from workers.pool import BufferPool

    try:
        device, rdv, cache, ops = _setup(role, dev, outbox, inbox, {"backend": "ipc"})
        paged = PagedKv(_cache(device, seed=dev))
        n = len(SIDE_BY_SIDE_D)
        res: dict[str, Any] = {}
        if role == "P":
            pool = BufferPool(paged.staged_block_nbytes * 8 * n, device=device)
            staged = []
            for k in range(n):  # request k: P's blocks 8k .. 8k + 7
                lease = pool.acquire_nowait(paged.staged_block_nbytes * 8).tensor
                paged.gather(paged.block_ids(list(range(8 * k, 8 * k + 8))), paged.staging_view(lease, 8))
                staged.append(lease)
            torch.cuda.current_stream(device).synchronize()
            comm = cache.get("D", initiator=True)
            sends = []
            with comm.lock:
                for lease in staged:
                    step = StepLayers(paged.num_layers)
                    sends.append((step, comm.send_blocks(comm.next_send, paged, lease.data_ptr(), 8, keep=[lease],
                                                         feed=step)))
            compute = torch.cuda.current_stream(device)
            for step, _ in sends[1:]:
                for layer in range(paged.num_layers):
                    step.gathered(layer, compute)
            res["later_landed"] = bool(wait_until(lambda: all(w.event.query() for _, w in sends[1:]), 30,
                                                  "the later sends to land while the first waits for its layers"))
            res["first_waited"] = not sends[0][1].event.query()
            for layer in range(paged.num_layers):
                sends[0][0].gathered(layer, compute)
            wait_until(sends[0][1].event.query, 30, "the first send to land once staged")
            res["sent"] = [[r[:, 8 * k : 8 * k + 8].cpu().numpy() for r in paged.rows] for k in range(n)]
            rdv.receive("D", "test/landed")
        else:
            comm = cache.get("P", initiator=False)
            works = [comm.post_blocks(paged, paged.block_ids(ids), after=[ops._now()]) for ids in SIDE_BY_SIDE_D]
            for work in works:
                wait_until(work.event.query, 60, "D's block receives to end")
            res["landed"] = [[r[:, ids].cpu().numpy() for r in paged.rows] for ids in SIDE_BY_SIDE_D]
            rdv.publish("P", "test/landed", b"1")
        cache.close()
        results.put((role, res))
    except BaseException:  # noqa: BLE001 - reported to the test process
        results.put((role, {"error": traceback.format_exc()}))


@pytest.mark.gpu
@one_gpu
def test_whole_staged_sends_copy_side_by_side_each_once_its_layers_are_staged() -> None:
    out = _run_pair(_side_by_side_worker, {"one_gpu": True}, timeout_s=120.0)
    assert out["P"]["later_landed"] and out["P"]["first_waited"], out["P"]
    for k, (sent, got) in enumerate(zip(out["P"]["sent"], out["D"]["landed"])):
        for layer, (want, have) in enumerate(zip(sent, got)):
            assert np.array_equal(have, want), f"request {k}, layer {layer}: the blocks hold other bytes"


def _gate_worker(role: str, dev: int, outbox: Any, inbox: Any, results: Any, cfg: dict[str, Any]) -> None:
    """P posts a send whose copy is held behind ~3 s of GPU work; D gives its receive up
    after 1 s. When P's copy finally runs, D's buffer must stay as D left it."""
    try:
        device, rdv, cache, transport = _setup(role, dev, outbox, inbox, {"backend": "ipc"})
        comm = cache.get("D" if role == "P" else "P", initiator=role == "P")
        res: dict[str, Any] = {"comm_mem_bytes": comm.mem_bytes}
        if role == "P":
            x = torch.full((8 << 20,), 7, dtype=torch.uint8, device=device)
            rdv.receive("D", "test/posted")  # D's receive is announced: its `ready` is written
            slow = torch.cuda.Stream(device)
            with torch.cuda.stream(slow):
                torch.cuda._sleep(int(3 * torch.cuda.get_device_properties(device).clock_rate * 1000))
                held = torch.cuda.Event()
                held.record(slow)
            work = comm.post([("send", x)], slow, [held])
            res["send_ended"] = wait_until(work.event.query, 30, "P's held send to end (its stream hung on the abort)")
            rdv.publish("D", "test/sent", b"1")
        else:
            y = torch.zeros(8 << 20, dtype=torch.uint8, device=device)
            torch.cuda.synchronize(device)
            done = transport.recv_tensors("P", [y])
            rdv.publish("P", "test/posted", b"1")
            res["timed_out"] = _times_out(done, 1.0)
            rdv.receive("P", "test/sent")  # P's held copy has run (or been skipped) by now
            torch.cuda.synchronize(device)
            res["untouched"] = bool((y == 0).all())
            res["stats"] = cache.statistics().__dict__
        cache.close()
        results.put((role, res))
    except BaseException:  # noqa: BLE001 - reported to the test process
        results.put((role, {"error": traceback.format_exc()}))


@pytest.mark.gpu
@two_gpus
def test_a_send_whose_receiver_gave_up_writes_nothing() -> None:
    out = _run_pair(_gate_worker, {}, timeout_s=120.0)
    _report("ipc_abort_gate", out)
    assert out["D"]["timed_out"] and out["D"]["stats"]["aborted"] == 1
    assert out["P"]["send_ended"]  # P's stream did not hang on the abort
    assert out["D"]["untouched"], "the copy landed in a buffer its receiver had given up"
    assert out["P"]["comm_mem_bytes"] == 0 and out["D"]["comm_mem_bytes"] == 0


@pytest.mark.gpu
@one_gpu
@pytest.mark.parametrize("ends", ["two processes", "one process"])
def test_both_ends_on_one_gpu_in_two_processes_or_in_one(ends: str) -> None:
    """In one process CUDA cannot open its own IPC handles: the backend then uses the
    peer's addresses as they are (the vLLM connector's GPU tests run P and D so)."""
    cfg = {"backend": "ipc", "other_host": False, "devices": {"P": 0, "D": 0}, "sends": 50}
    out = _run_pair_sides(cfg, in_threads=ends == "one process")
    assert out["D"]["exact"] == 50 and out["D"]["backend"] == "ipc"
    assert out["D"]["same_process"] is (ends == "one process")


def _pair_side(role: str, outbox: Any, inbox: Any, results: Any, cfg: dict[str, Any]) -> None:
    """`cfg["sends"]` (20) sends of distinct tensors over `cfg["backend"]`; D counts the
    exact ones, and may run as if on another host (only where P and D are two processes).
    Each side reports what it built, or why it could not."""
    try:
        from workers.transports import cuda_ipc
        from workers.transports.nccl_comm import CommunicatorCache, QueueRendezvous

        if role == "D" and cfg["other_host"]:
            cuda_ipc.boot_id = lambda: "another-host"  # this process alone: P keeps the real one
        device = torch.device("cuda", cfg["devices"][role])
        torch.cuda.set_device(device)
        stepping = threading.Event()
        if cfg.get("busy") == role:  # an engine steps on the same stream while the pair is built
            threading.Thread(target=_engine_steps, args=(device, stepping), daemon=True).start()
        cache = CommunicatorCache(role, device, QueueRendezvous(outbox, inbox, timeout_s=60),
                                  backend=cfg["backend"], connect_timeout_s=60)
        transport = Ops(cache)
        res: dict[str, Any] = {"exact": 0}
        start = time.monotonic()
        try:
            for i in range(cfg.get("sends", 20)):
                if i == 1:
                    stepping.set()  # built: the engine stops
                x = torch.arange(1 << 20, device=device, dtype=torch.int32) * (i + 1)
                if role == "P":
                    transport.send_tensors("D", [x]).wait(time.monotonic() + 30)
                else:
                    y = torch.zeros_like(x)
                    transport.recv_tensors("P", [y]).wait(time.monotonic() + 30)
                    res["exact"] += bool(torch.equal(y, x))
        except RendezvousError as exc:
            res["refused"], res["refused_after_s"] = str(exc), time.monotonic() - start
        comm = cache.current("D" if role == "P" else "P")
        res["backend"] = None if comm is None else comm.backend
        res["same_process"] = getattr(comm, "same_process", None)
        res["fast_launch"] = comm._copy.fast if comm is not None and comm.backend == "ipc" else None
        cache.close()
        results.put((role, res))
    except BaseException:  # noqa: BLE001 - reported to the test
        results.put((role, {"error": traceback.format_exc()}))


def _engine_steps(device: torch.device, stop: threading.Event) -> None:
    """1 ms steps of GPU work on the current stream, each waited for, until `stop`."""
    torch.cuda.set_device(device)
    while not stop.is_set():
        torch.cuda._sleep(2_000_000)
        torch.cuda.current_stream(device).synchronize()


def _run_pair_sides(cfg: dict[str, Any], *, in_threads: bool = False) -> dict[str, Any]:
    """`_pair_side` for P and D, in two processes (or two threads of this one)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    to_d, to_p, results = ctx.Queue(), ctx.Queue(), ctx.Queue()
    kind: Any = threading.Thread if in_threads else ctx.Process
    workers = [kind(target=_pair_side, args=("P", to_d, to_p, results, cfg)),
               kind(target=_pair_side, args=("D", to_p, to_d, results, cfg))]
    for w in workers:
        w.start()
    out = dict(results.get(timeout=150) for _ in workers)
    for w in workers:
        w.join(30)
    assert "error" not in out["P"] and "error" not in out["D"], out
    return out


@pytest.mark.gpu
@one_gpu
def test_ipc_with_a_fallback_builds_ipc_on_one_host() -> None:
    """Also: D's GPU is busy with an engine step while the pair is built. The copy
    kernel's launch check must not race that step's stream (it once zeroed its output
    there, after the copy, and turned D's fast launches off)."""
    out = _run_pair_sides({"backend": "ipc,direct", "other_host": False, "devices": {"P": 0, "D": 0}, "busy": "D"})
    assert out["P"]["backend"] == out["D"]["backend"] == "ipc"
    assert out["D"]["exact"] == 20
    assert out["D"]["fast_launch"] == out["P"]["fast_launch"], "the busy side's launch check came out otherwise"


@pytest.mark.gpu
@one_gpu
def test_ipc_to_another_host_fails_on_both_sides_at_once_naming_the_fallback() -> None:
    """D declines, so P fails with D's reason at once, not at its 60 s connect deadline."""
    out = _run_pair_sides({"backend": "ipc", "other_host": True, "devices": {"P": 0, "D": 0}})
    for role in ("P", "D"):
        assert "D and P run on different hosts" in out[role].get("refused", ""), out
        assert "KVBROKER_NCCL_BACKEND=ipc,direct" in out[role]["refused"]
        assert out[role]["refused_after_s"] < 30, out
        assert out[role]["backend"] is None


@pytest.mark.gpu
@two_gpus
def test_ipc_with_a_fallback_builds_direct_nccl_to_another_host() -> None:
    out = _run_pair_sides({"backend": "ipc,direct", "other_host": True, "devices": {"P": 0, "D": 1}})
    assert out["P"]["backend"] == out["D"]["backend"] == "direct"
    assert out["D"]["exact"] == 20 and "refused" not in out["P"]
