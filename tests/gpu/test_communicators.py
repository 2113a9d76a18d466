"""The communicator backends on GPUs: raw sends and receives as the connector's link posts
them, a timeout that aborts, rebuilds and evicts, and the harness the ipc tests share.

The two-GPU tests run P on cuda:0 and D on cuda:1 in spawned processes, paired through
`QueueRendezvous`. The connector's own path (staging in `save_kv_layer`, the race with
P's next step) is tested in test_connector_nccl.py.

Set KVB_TEST_OUT to a directory to get each scenario's numbers as JSON there.
"""

from __future__ import annotations

import json
import os
import queue
import time
import traceback
from collections.abc import Sequence
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp

from workers.transports import nccl_lib
from workers.transports.cuda_driver import driver

two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"
)

# Every communicator backend: "direct" (the ctypes NCCL binding), "torch" (ProcessGroupNCCL)
# and "ipc" (copy kernels over CUDA IPC, both GPUs on this host).
BACKENDS = [
    pytest.param("direct", marks=pytest.mark.skipif(nccl_lib.load() is None, reason="no loadable libnccl")),
    "torch",
    pytest.param("ipc", marks=pytest.mark.skipif(driver() is None, reason="no CUDA driver")),
]

LAYERS, BLOCKS, BLOCK, HEADS, DIM = 4, 64, 16, 8, 128
REQ_D = [50, 2, 33, 34, 7, 8, 61, 20]  # where D puts a request's blocks


def _cache(device: torch.device | str, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (2, BLOCKS, BLOCK, HEADS, DIM)
    return [torch.randn(shape, generator=g).to(torch.bfloat16).to(device) for _ in range(LAYERS)]


class Ops:
    """Raw sends and receives on a cache's communicators, posted as the connector's link
    posts a transfer's ops: on a stream of the link's, after an event at the current
    stream's tail (what wrote the tensors, or still reads them)."""

    def __init__(self, cache: Any) -> None:
        self.cache = cache
        self.stream = torch.cuda.Stream(cache.device)

    def _now(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.cache.device))
        return event

    def send_tensors(self, peer: str, tensors: Sequence[torch.Tensor]) -> Any:
        comm = self.cache.get(peer, initiator=True)
        work = comm.post([("send", t) for t in tensors], self.stream, [self._now()])
        return comm.completion([work], self.stream, "send")

    def recv_tensors(self, peer: str, tensors: Sequence[torch.Tensor]) -> Any:
        comm = self.cache.get(peer, initiator=False)
        work = comm.post([("recv", t) for t in tensors], self.stream, [self._now()])
        return comm.completion([work], self.stream, "recv")


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
    from workers.transports.nccl_comm import CommunicatorCache, QueueRendezvous

    torch.cuda.set_device(dev)
    device = torch.device("cuda", dev)
    rdv = QueueRendezvous(outbox, inbox, timeout_s=60.0)
    cache = CommunicatorCache(role, device, rdv, capacity=cfg.get("capacity", 4), backend=cfg.get("backend"))
    return device, rdv, cache, Ops(cache)


def _report(name: str, data: dict[str, Any]) -> None:
    print(f"{name}: {json.dumps(data)}")
    out = os.environ.get("KVB_TEST_OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "gpu_tests.jsonl"), "a") as f:
            f.write(json.dumps({"name": name, **data}) + "\n")


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
            from workers.transports.nccl_comm import CommunicatorCache

            other = Ops(CommunicatorCache("D2", device, rdv, capacity=1, backend=cfg["backend"]))
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
