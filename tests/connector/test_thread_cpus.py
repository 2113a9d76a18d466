"""The connector's threads on a worker that vLLM's CPU backend has bound: a real child
process whose OpenMP runtime binds its main thread to one core, as vLLM's auto binding
binds a worker's, and a real transfer through a real broker."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support import ROOT, BrokerProcess, env
from workers.cpus import format_cpu_list, parse_cpu_list

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                       reason="needs Linux thread affinities and two CPUs"),
]


def run_bound_worker(broker: BrokerProcess, setting: str, *, by: str = "openmp",
                     ) -> tuple[frozenset[int], frozenset[int], dict]:
    """(the core the child's engine thread is bound to, the child's main thread's CPUs, its
    threads). `by`: "openmp", as vLLM binds a worker; "taskset", the child alone bound from
    outside (its OpenMP runtime told nothing)."""
    omp = min(os.sched_getaffinity(0))
    child_env = env()
    for key in ("VLLM_CPU_OMP_THREADS_BIND", "OMP_PLACES", "GOMP_CPU_AFFINITY", "KMP_AFFINITY"):
        child_env.pop(key, None)  # vLLM's default: it binds the worker itself
    if by == "openmp":
        child_env.update({"OMP_PLACES": f"{{{omp}}}", "OMP_PROC_BIND": "true", "OMP_NUM_THREADS": "1"})
    out = subprocess.run([sys.executable, "tests/connector/thread_cpus_child.py", broker.endpoint, setting],
                         cwd=ROOT, env=child_env, capture_output=True, text=True, timeout=120,
                         preexec_fn=(lambda: os.sched_setaffinity(0, {omp})) if by == "taskset" else None)
    assert out.returncode == 0, out.stderr[-4000:]
    report = json.loads(next(line for line in out.stdout.splitlines() if line.startswith("THREADS "))[8:])
    return frozenset({omp}), parse_cpu_list(report["main"]), report["threads"]


def started_by_the_connector(threads: dict) -> dict[str, frozenset[int]]:
    return {f'{t["name"]} {tid}': parse_cpu_list(t["cpus"]) for tid, t in threads.items() if not t["started_before"]}


def test_the_connectors_threads_run_on_the_cores_vllms_binding_left_free(broker: BrokerProcess) -> None:
    """Its broker client's loop, zmq's I/O thread, the tcp receiver's threads and the
    send's worker thread run off the core the forward pass computes on; the engine's own
    thread stays there."""
    omp, main, threads = run_bound_worker(broker, "auto")
    free = frozenset(os.sched_getaffinity(0)) - omp
    assert main == omp
    ours = started_by_the_connector(threads)
    names = " ".join(ours)
    for kind in ("asyncio-portal", "ZMQbg/IO", "kvbroker-tcp-accept", "kvbroker-tcp-rx", "AnyIO worker thread"):
        assert kind in names, f"no {kind} thread among {sorted(ours)}"
    misplaced = {name: format_cpu_list(cpus) for name, cpus in ours.items() if cpus != free}
    assert not misplaced, f"threads not on CPUs {format_cpu_list(free)}: {misplaced}"


def test_inherit_leaves_them_on_the_forward_passs_core(broker: BrokerProcess) -> None:
    """The twin: what every connector thread did before, and still does when told to."""
    omp, main, threads = run_bound_worker(broker, "inherit")
    assert main == omp
    ours = started_by_the_connector(threads)
    assert ours and all(cpus == omp for cpus in ours.values()), ours


def test_auto_leaves_a_worker_bound_from_outside_where_it_was_bound(broker: BrokerProcess) -> None:
    """A worker run under `taskset` alone: its parent may use more CPUs, but nothing left
    them for the connector, so its threads stay inside the binding."""
    omp, main, threads = run_bound_worker(broker, "auto", by="taskset")
    assert main == omp
    ours = started_by_the_connector(threads)
    assert ours and all(cpus == omp for cpus in ours.values()), ours


def test_a_list_puts_them_where_it_says(broker: BrokerProcess) -> None:
    target = max(os.sched_getaffinity(0))
    _, _, threads = run_bound_worker(broker, str(target))
    ours = started_by_the_connector(threads)
    assert ours and all(cpus == {target} for cpus in ours.values()), ours


def test_cpus_linux_refuses_leave_the_threads_where_they_are(broker: BrokerProcess,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU outside the process's cgroup: Linux refuses it, and the worker still starts."""
    import structlog

    from tests.connector.test_worker import make_caches, make_worker
    from workers import cpus

    def refuse(pid: int, mask: object) -> None:
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(cpus.os, "sched_setaffinity", refuse)
    with structlog.testing.capture_logs() as logs:
        worker = make_worker(broker.endpoint, "d", "d0", make_caches(), thread_cpus=str(max(os.sched_getaffinity(0))))
    try:
        assert worker.client is not None and worker.client.registered is not None
        placed = [e for e in logs if e["event"] == "connector.thread_cpus"]
        assert [(e["log_level"], e["cpus"]) for e in placed] == [("warning", None)], placed
        assert "Linux refused CPUs" in placed[0]["reason"]
    finally:
        worker.close()
