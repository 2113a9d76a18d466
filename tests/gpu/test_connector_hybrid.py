"""A hybrid model on one GPU over the nccl transport's ipc backend: a Gemma-3-like model
(a sliding-window KV cache group and a full-attention one, their layers sharing flash-attn
NHD cache tensors; `tests/gpu/hybrid_rank.py`), the prefill instance in a process of its
own, the decode instance in the test's, a real broker process between them (tickets,
credits, the communicator's rendezvous).

Each transfer's KV is written into P's blocks before its step, and each layer's blocks are
overwritten on the compute stream right after its `save_kv_layer` returns (the seed's
race): D's blocks of each layer's group after its prefix hit, inside the group's window,
must hold exactly what P held at the call, and no other block of D may change. Both
instances take the staged path (torch copies, never the copy kernel or a receive
straight into the blocks: a hybrid model's rows differ in width). The CPU run of the same
path, on an in-process wire: tests/connector/test_hybrid_nccl_wire.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.gpu.hybrid_rank import caches, check, expected_checks, load_all, worker
from tests.support import BrokerProcess, env, wait_until

_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_GPUS == 0, reason="needs a CUDA GPU")]

RANK = Path(__file__).with_name("hybrid_rank.py")
TRANSFERS = 6


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[BrokerProcess]:
    b = BrokerProcess(tmp_path, "--heartbeat", "0.2", "--peer-lease", "5")
    b.start()
    yield b
    b.kill()


def completed(broker: BrokerProcess) -> int:
    return int(broker.status()["counters"]["completed"])


def test_hybrid_over_nccl_ipc_each_layer_lands_in_its_groups_blocks_inside_the_window(
    broker: BrokerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Six transfers of 6 blocks (91 tokens: the window group keeps the last 3), with
    prefix hits of 0, 1 and 4 blocks on D; the first goes alone (it builds the pair's
    communicator), the other five back to back. Every checked cell holds P's KV at
    save_kv_layer, nothing else on D changed, the broker counts every transfer
    completed, and every staging and receive lease goes back."""
    monkeypatch.setenv("KVBROKER_NCCL_BACKEND", "ipc")  # both instances on one GPU, as two processes
    child_env = env() | {"KVBROKER_NCCL_BACKEND": "ipc"}
    cmd = [sys.executable, str(RANK), "--broker", broker.endpoint, "--transfers", str(TRANSFERS), "--device", "cuda:0"]
    child = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=child_env)
    d = None
    try:
        assert child.stdout is not None and child.stdin is not None
        line = child.stdout.readline()
        assert json.loads(line or "{}") == {"registered": True}, child.stderr.read() if child.stderr else ""
        kv = caches("cuda:0", seed=70)
        before = {n: t.cpu() for n, t in kv.items()}
        d = worker(broker.endpoint, "d", kv, load_timeout_s=60)
        assert d.paged is None and d.chunk_nbytes == d.block_nbytes  # the staged path, chunks of whole cells
        load_all(d, TRANSFERS)
        finished: set[str] = set()
        errors: set[int] = set()
        failed: set[str] = set()

        def step() -> bool:  # one empty engine step
            finished.update(d.get_finished(set())[1] or set())
            errors.update(d.get_block_ids_with_load_errors())
            failed.update(d.get_failed_requests())
            return True

        child.stdin.write("go\n")  # P runs transfer 0's step
        child.stdin.flush()
        wait_until(lambda: step() and completed(broker) == 1, 60, "the first transfer")
        child.stdin.write("go\n")  # and the others'
        child.stdin.flush()
        want = {f"req-g{i}" for i in range(TRANSFERS)}
        wait_until(lambda: step() and (want <= finished or bool(failed)), 60, "every load reported")
        assert failed == set() and errors == set(), d.statistics()
        counts = check(kv, before, TRANSFERS)
        assert counts["checked"] == expected_checks(TRANSFERS) and counts["mismatched"] == 0, counts
        assert counts["changed"] == 0 and counts["unchanged"] > 0, counts
        out, err = child.communicate(timeout=60)
        assert child.returncode == 0, err[-4000:]
        result = json.loads(out.strip().splitlines()[-1])
        assert result == {"staged": TRANSFERS, "released": TRANSFERS, "aborted": 0, "triton_copies": False,
                          "backends": ["ipc"]}, result
        assert d.statistics()["loaded"] == TRANSFERS and d.statistics()["failed"] == 0

        def leases_back() -> bool:  # a receive lease goes back once the scatter that read it ran
            step()
            return d.pool is not None and d.pool.statistics().leases == 0

        wait_until(leases_back, 20, "D's receive leases back in its pool")
        wait_until(lambda: completed(broker) == TRANSFERS, 20, "every transfer's Done")
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        if d is not None:
            d.close()
