"""Heterogeneous TP on GPUs, transport "nccl": prefill and decode instances of different
TP sizes, each rank a `ConnectorWorker` with its heads of a flash-attn shaped cache, in
a process of its own (the instance of two ranks runs them as child processes, the
other one runs in the test's), a real broker process between them (lanes, tickets,
credits, the communicators' rendezvous). With ``KVBROKER_NCCL_BACKEND=ipc`` every rank
keeps its cache on cuda:0 (the ipc backend copies between two caches of one GPU as
between two processes' GPUs); otherwise each rank needs a GPU of its own.

Each transfer's KV is written into P's blocks before its step, and each layer's blocks
are overwritten on the compute stream right after its `save_kv_layer` returns (the
seed's race): every decode rank's blocks after its prefix hit must hold exactly its
heads of what P held at the call, and its prefix-held blocks must be unchanged.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from connector.worker import ConnectorWorker
from protocols.heads import lanes
from tests.gpu.hetero_rank import HEADS, PER_TRANSFER, caches, check, load_all, prefill_step, worker
from tests.support import BrokerProcess, env, wait_until

_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
_OVER_IPC = os.environ.get("KVBROKER_NCCL_BACKEND", "").split(",")[0] == "ipc"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_GPUS == 0, reason="needs a CUDA GPU")]

RANK = Path(__file__).with_name("hetero_rank.py")
TRANSFERS = 8


def devices(p_tp: int, d_tp: int) -> tuple[list[str], list[str]]:
    """Each rank's GPU: all cuda:0 over ipc, else one each (skips where there are too few)."""
    if _OVER_IPC:
        return ["cuda:0"] * p_tp, ["cuda:0"] * d_tp
    if _GPUS < p_tp + d_tp:
        pytest.skip(f"needs {p_tp + d_tp} CUDA GPUs (or 1 with KVBROKER_NCCL_BACKEND=ipc)")
    return [f"cuda:{r}" for r in range(p_tp)], [f"cuda:{p_tp + r}" for r in range(d_tp)]


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[BrokerProcess]:
    b = BrokerProcess(tmp_path, "--heartbeat", "0.2", "--peer-lease", "5")
    b.start()
    yield b
    b.kill()


def spawn(broker: BrokerProcess, role: str, rank: int, tp: int, device: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, str(RANK), "--broker", broker.endpoint, "--role", role, "--rank", str(rank), "--tp", str(tp),
           "--transfers", str(TRANSFERS), "--device", device]
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env())


def tell(procs: list[subprocess.Popen[str]]) -> None:
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()


def completed(broker: BrokerProcess) -> int:
    return int(broker.status()["counters"]["completed"])


CHECKED = 2 * sum(PER_TRANSFER - i % 2 for i in range(TRANSFERS))  # layers x blocks after each prefix hit


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 2), (2, 1)])
def test_hetero_tp_over_nccl_each_decode_rank_gets_exactly_its_heads(
    broker: BrokerProcess, p_tp: int, d_tp: int
) -> None:
    """P TP 1 -> D TP 2 (P rank 0, here, feeds D's two rank processes half its heads
    each) and P TP 2 -> D TP 1 (D rank 0, here, joins the lanes of P's two rank
    processes). Eight transfers, every other one with a one-block prefix hit; the first
    goes alone (it builds every pair's communicator), the other seven back to back. Every
    D rank's blocks after its hit hold exactly its heads of what P's blocks held at
    save_kv_layer, its prefix-held blocks are unchanged, the broker counts every lane
    completed, and every staging and receive lease goes back."""
    p_dev, d_dev = devices(p_tp, d_tp)
    plan = lanes(HEADS, p_tp, d_tp)
    children = ([spawn(broker, "decode", r, d_tp, d_dev[r]) for r in range(d_tp)] if d_tp > 1 else
                [spawn(broker, "prefill", r, p_tp, p_dev[r]) for r in range(p_tp)])
    here: list[ConnectorWorker] = []
    try:
        for r, proc in enumerate(children):
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert json.loads(line or "{}") == {"registered": True}, (r, proc.stderr.read() if proc.stderr else "")
        if d_tp > 1:  # this process: P rank 0
            kv = caches(p_dev[0], 1, 0, seed=40)
            p = worker(broker.endpoint, "p", 0, 1, kv, load_timeout_s=60)
            here.append(p)
            tell(children)  # the decode ranks load every transfer
            prefill_step(p, kv, 1, 0, 0)
            wait_until(lambda: completed(broker) == len(plan), 120, "the first transfer's lanes")
            for i in range(1, TRANSFERS):
                prefill_step(p, kv, 1, 0, i)
            results = [finish(proc) for proc in children]
            want = {"checked": CHECKED, "mismatched": 0, "cached_changed": 0, "errors": 0, "loaded": TRANSFERS}
            assert results == [want] * d_tp, results
            wait_until(lambda: p.statistics()["staged_now"] == 0, 20, "the prefill rank released")
            assert p.pool is not None
            wait_until(lambda: p.pool.statistics().leases == 0, 20, "P's staging back in its pool")
        else:  # this process: D rank 0
            kv = caches(d_dev[0], 1, 0, seed=50)
            before = {n: t.cpu() for n, t in kv.items()}
            d = worker(broker.endpoint, "d", 0, 1, kv, load_timeout_s=60)
            here.append(d)
            load_all(d, TRANSFERS)
            finished: set[str] = set()
            errors: set[int] = set()

            def step() -> bool:  # one empty engine step
                finished.update(d.get_finished(set())[1] or set())
                errors.update(d.get_block_ids_with_load_errors())
                return True

            tell(children)  # the prefill ranks run transfer 0's step
            wait_until(lambda: step() and completed(broker) == len(plan), 120, "the first transfer's lanes")
            tell(children)  # and the others'
            want = {f"req-h{i}" for i in range(TRANSFERS)}
            wait_until(lambda: step() and want <= finished, 120, "every load reported")
            assert errors == set(), d.statistics()
            counts = check(d, kv, before, 1, 0, TRANSFERS)
            assert counts == {"checked": CHECKED, "mismatched": 0, "cached_changed": 0}, counts
            results = [finish(proc) for proc in children]
            assert results == [{"staged": TRANSFERS, "released": TRANSFERS, "aborted": 0}] * p_tp, results

            def leases_back() -> bool:  # a receive lease goes back once the scatter that read it ran
                step()
                return d.pool is not None and d.pool.statistics().leases == 0

            wait_until(leases_back, 20, "D's receive leases back in its pool")
        wait_until(lambda: completed(broker) == TRANSFERS * len(plan), 20, "every lane's Done")
    finally:
        for proc in children:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for w in here:
            w.close()


def finish(proc: subprocess.Popen[str]) -> dict[str, int]:
    """A rank process's results, once it exited cleanly."""
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err[-4000:]
    return json.loads(out.strip().splitlines()[-1])
