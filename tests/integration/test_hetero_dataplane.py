"""Heterogeneous TP across processes: every rank of a prefill and a decode instance of
different TP sizes is a process with a real paged cache, a real broker between them and
the tcp transport; every decode rank must end up with exactly its heads of every block."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from broker.status import fetch_status
from protocols.heads import lanes
from tests.support import BrokerProcess, env, wait_until

pytestmark = pytest.mark.slow

RANK = Path(__file__).with_name("hetero_rank.py")
TRANSFERS, HEADS = 4, 4


@pytest.fixture
def broker(tmp_path: Path):
    b = BrokerProcess(tmp_path, "--heartbeat", "0.5", "--peer-lease", "10")
    b.start()
    yield b
    assert b.stop() == 0, b.log_path.read_text()


def spawn(endpoint: str, role: str, rank: int, tp: int, kind: str) -> subprocess.Popen[str]:
    instance, other = ("p", "d") if role == "prefill" else ("d", "p")
    cmd = [sys.executable, str(RANK), "--broker", endpoint, "--role", role, "--instance", instance, "--other", other,
           "--rank", str(rank), "--tp", str(tp), "--heads", str(HEADS), "--kind", kind,
           "--transfers", str(TRANSFERS)]
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env())


@pytest.mark.parametrize(("p_tp", "d_tp", "kind"), [(1, 2, "kv_first"), (2, 1, "cpu"), (2, 4, "kv_first_hnd")])
def test_hetero_ranks_in_processes_get_exactly_their_heads_over_tcp(
    broker: BrokerProcess, p_tp: int, d_tp: int, kind: str
) -> None:
    procs = {("decode", r): spawn(broker.endpoint, "decode", r, d_tp, kind) for r in range(d_tp)}
    procs |= {("prefill", r): spawn(broker.endpoint, "prefill", r, p_tp, kind) for r in range(p_tp)}
    try:
        for (role, r), proc in procs.items():
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert json.loads(line or "{}") == {"registered": True}, (role, r, proc.stderr.read() if proc.stderr else "")
        for proc in procs.values():  # every rank of both instances is registered: go
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        results, errs = {}, {}
        for key, proc in procs.items():
            out, errs[key] = proc.communicate(timeout=120)
            assert proc.returncode == 0, (key, errs[key])
            results[key] = json.loads(out.strip().splitlines()[-1])
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    plan = lanes(HEADS, p_tp, d_tp)
    for r in range(d_tp):
        got = results[("decode", r)]
        want_lanes = sum(lane.rank == r for lane in plan)
        # A rank's stderr has each Abort it saw, with the broker's reason, and the broker's log the rest.
        assert (got["checked"], got["mismatched"], got["cached_changed"], got["aborts_seen"]) == (TRANSFERS, 0, 0, 0), (
            r, errs[("decode", r)][-2000:], broker.log_path.read_text()[-4000:])
        assert got["lanes"] == TRANSFERS * want_lanes
    for p in range(p_tp):
        got = results[("prefill", p)]
        assert (got["released"], got["aborted"]) == (TRANSFERS, 0), (p, errs[("prefill", p)][-2000:])
        assert got["sent"] == TRANSFERS * sum(lane.source == p for lane in plan)

    async def status():
        return await fetch_status(broker.endpoint)

    counters = wait_until(lambda: anyio.run(status).counters, 10, "the broker's status")
    assert counters["completed"] == TRANSFERS * len(plan) and counters["aborted"] == 0
