"""Heterogeneous TP on GPUs, transport "nccl": prefill and decode instances of different
TP sizes, each rank a `ConnectorWorker` with its heads of a flash-attn shaped cache, a
real broker process between them (lanes, tickets, credits, the communicators'
rendezvous). With ``KVBROKER_NCCL_BACKEND=ipc`` every rank keeps its cache on cuda:0 (the
ipc backend copies between two caches of one GPU as between two GPUs); otherwise each
rank needs a GPU of its own.

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
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from connector.scheduler import KvBrokerMetadata, SaveSpec
from connector.worker import ConnectorWorker
from protocols.heads import lanes, rank_heads
from tests.gpu.hetero_rank import (
    LAYERS,
    PER_TRANSFER,
    BLOCK_SIZE,
    caches,
    check,
    load_all,
    model_kv,
    worker,
)
from tests.support import BrokerProcess, env, wait_until

_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
_OVER_IPC = os.environ.get("KVBROKER_NCCL_BACKEND", "").split(",")[0] == "ipc"
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_GPUS == 0, reason="needs a CUDA GPU")]

RANK = Path(__file__).with_name("hetero_rank.py")
TRANSFERS = 8
PREFILL_BLOCKS = [3, 17, 40, 9]  # every transfer's: P reuses its blocks at once


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


def prefill_all(ps: list[ConnectorWorker], p_caches: list[dict[str, torch.Tensor]], p_tp: int,
                broker: BrokerProcess, per_transfer: int, step: Callable[[], bool]) -> None:
    """One prefill step a transfer on every P rank, each layer's blocks overwritten on the
    compute stream right after its save_kv_layer returns. The first transfer goes alone
    (`per_transfer` lanes completed at the broker before the next): it builds every
    pair's communicator, and the rest run on them. `step`: the decode ranks' engine
    steps of this process, meanwhile."""
    for i in range(TRANSFERS):
        if i == 1:
            wait_until(lambda: step() and broker.status()["counters"]["completed"] == per_transfer, 120,
                       "the first transfer's lanes, which build the communicators")
        model = model_kv(i)
        for r, (p, kv) in enumerate(zip(ps, p_caches)):
            a, b = rank_heads(4, p_tp, r)
            for n in LAYERS:
                kv[n][:, PREFILL_BLOCKS] = model[n][:, :, :, a:b].to(kv[n].device)
            p.bind(KvBrokerMetadata(saves={f"h{i}": SaveSpec(
                req_id=f"req-h{i}", block_ids=PREFILL_BLOCKS, num_tokens=PER_TRANSFER * BLOCK_SIZE - 5,
                decode="d")}))
            for n in LAYERS:
                p.save_kv_layer(n, kv[n])
                kv[n][:, PREFILL_BLOCKS] = -7.0  # the next layer's step writes these blocks at once
            p.wait_for_save()
            p.clear()


def settled(ps: list[ConnectorWorker], ds: list[ConnectorWorker], broker: BrokerProcess, lanes_done: int) -> None:
    wait_until(lambda: broker.status()["counters"]["completed"] == lanes_done, 20, "every lane's Done")
    wait_until(lambda: all(p.statistics()["staged_now"] == 0 for p in ps), 20, "every prefill rank released")

    def leases_back() -> bool:
        for d in ds:
            d.get_finished(set())  # a receive lease goes back once the scatter that read it ran
        return all(w.pool is not None and w.pool.statistics().leases == 0 for w in ps + ds)

    wait_until(leases_back, 20, "every staging and receive lease back in its pool")


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 2), (2, 1)])
def test_hetero_tp_over_nccl_each_decode_rank_gets_exactly_its_heads(
    broker: BrokerProcess, p_tp: int, d_tp: int
) -> None:
    """Every rank a worker of this process: P TP 1 -> D TP 2 (P rank 0 feeds both D ranks
    half its heads each), and P TP 2 -> D TP 1 (D rank 0 joins two lanes)."""
    p_dev, d_dev = devices(p_tp, d_tp)
    p_caches = [caches(p_dev[r], p_tp, r, seed=10 + r) for r in range(p_tp)]
    d_caches = [caches(d_dev[r], d_tp, r, seed=20 + r) for r in range(d_tp)]
    d_before = [{n: t.cpu() for n, t in kv.items()} for kv in d_caches]
    ds = [worker(broker.endpoint, "d", r, d_tp, d_caches[r], load_timeout_s=60) for r in range(d_tp)]
    ps = [worker(broker.endpoint, "p", r, p_tp, p_caches[r], load_timeout_s=60) for r in range(p_tp)]
    finished: list[set[str]] = [set() for _ in ds]
    errors: set[int] = set()

    def step() -> bool:  # one empty engine step on every decode rank
        for k, d in enumerate(ds):
            finished[k] |= d.get_finished(set())[1] or set()
            errors.update(d.get_block_ids_with_load_errors())
        return True

    try:
        for d in ds:
            load_all(d, TRANSFERS)
        prefill_all(ps, p_caches, p_tp, broker, len(lanes(4, p_tp, d_tp)), step)
        want = {f"req-h{i}" for i in range(TRANSFERS)}
        wait_until(lambda: step() and all(want <= f for f in finished), 120, "every decode rank's loads reported")
        assert errors == set(), [d.statistics() for d in ds]
        for r, d in enumerate(ds):
            counts = check(d, d_caches[r], d_before[r], d_tp, r, TRANSFERS)
            assert counts == {"checked": 2 * sum(PER_TRANSFER - i % 2 for i in range(TRANSFERS)), "mismatched": 0,
                              "cached_changed": 0}, (r, counts)
        settled(ps, ds, broker, TRANSFERS * len(lanes(4, p_tp, d_tp)))
        assert sum(d.statistics()["loaded"] for d in ds) == TRANSFERS * d_tp
    finally:
        for w in ds + ps:
            w.close()


def test_hetero_tp_over_nccl_with_decode_ranks_in_processes_of_their_own(broker: BrokerProcess) -> None:
    """P TP 1 in this process, D's two ranks as two processes (on one GPU over ipc): P
    rank 0 sends each of them half its heads, over a communicator per pair."""
    p_dev, d_dev = devices(1, 2)
    procs = [subprocess.Popen([sys.executable, str(RANK), "--broker", broker.endpoint, "--rank", str(r), "--tp", "2",
                               "--transfers", str(TRANSFERS), "--device", d_dev[r]],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env())
             for r in range(2)]
    p_caches = [caches(p_dev[0], 1, 0, seed=30)]
    ps: list[ConnectorWorker] = []
    try:
        for r, proc in enumerate(procs):
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert json.loads(line or "{}") == {"registered": True}, (r, proc.stderr.read() if proc.stderr else "")
        ps.append(worker(broker.endpoint, "p", 0, 1, p_caches[0], load_timeout_s=60))
        for proc in procs:  # both decode ranks registered: their loads may go
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        prefill_all(ps, p_caches, 1, broker, 2, lambda: True)
        results = []
        for r, proc in enumerate(procs):
            out, err = proc.communicate(timeout=180)
            assert proc.returncode == 0, (r, err[-4000:])
            results.append(json.loads(out.strip().splitlines()[-1]))
        want = {"checked": 2 * sum(PER_TRANSFER - i % 2 for i in range(TRANSFERS)), "mismatched": 0,
                "cached_changed": 0, "errors": 0, "loaded": TRANSFERS}
        assert results == [want, want], results
        wait_until(lambda: broker.status()["counters"]["completed"] == 2 * TRANSFERS, 20, "every lane's Done")
        wait_until(lambda: ps[0].statistics()["staged_now"] == 0, 20, "the prefill rank released")
        wait_until(lambda: ps[0].pool is not None and ps[0].pool.statistics().leases == 0, 20, "P's staging back")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for p in ps:
            p.close()
