"""The connector's threads in a real vLLM CPU worker bound by vLLM's own binding.

One prefill `vllm.entrypoints.openai.api_server` with `VLLM_CPU_OMP_THREADS_BIND=auto`
(vLLM's default) and one CPU kept out of the OpenMP threads
(`VLLM_CPU_NUM_OF_RESERVED_CPU=1`, as vLLM keeps one for a KV connector on a host of more
cores): the worker's engine thread computes on vLLM's cores, and the connector's threads
(its broker client's loop and zmq's) run on the rest.
"""

from __future__ import annotations

import os
from importlib.util import find_spec
from pathlib import Path

import pytest

from demo import summary
from demo.servers import ServerProcess, kv_transfer_config
from tests.support import BrokerProcess
from workers.cpus import parse_cpu_list

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(find_spec("vllm") is None, reason="vLLM is not installed"),
    pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                       reason="needs Linux thread affinities and two CPUs"),
]


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def thread_cpus_of(pid: int) -> dict[int, tuple[str, frozenset[int]]]:
    threads = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/comm") as f:
            name = f.read().strip()
        threads[int(tid)] = (name, frozenset(os.sched_getaffinity(int(tid))))
    return threads


def test_vllms_worker_computes_on_its_cores_and_the_connector_runs_on_the_kept_one(
        tmp_path: Path, tiny_model_dir: Path) -> None:
    broker = BrokerProcess(tmp_path)
    broker.start()
    server = ServerProcess(
        tiny_model_dir, tmp_path, "prefill-0", kv_transfer_config(broker.endpoint, "kv_producer", "p0"),
        env={"VLLM_CPU_OMP_THREADS_BIND": "auto", "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"},
    )
    server.start()
    try:
        server.wait_healthy()
        placed = summary.log_events(server.log_path.read_text(errors="replace").splitlines(), "connector.thread_cpus")
        assert len(placed) == 1 and placed[0]["cpus"], placed
        cpus = parse_cpu_list(placed[0]["cpus"])
        workers = [p for p in descendants(server.proc.pid) if Path(f"/proc/{p}/cmdline").read_text().startswith("VLLM::Worker")]
        assert len(workers) == 1, workers
        threads = thread_cpus_of(workers[0])
        engine = threads[workers[0]][1]  # the worker's main thread: the forward pass's
        assert engine and not engine & cpus, (engine, cpus)
        assert cpus | engine <= frozenset(os.sched_getaffinity(0))
        ours = [name for name, on in threads.values() if on == cpus]
        # the broker client's loop thread, and zmq's I/O and reaper threads of its socket
        assert len(ours) >= 3 and "ZMQbg/IO/0" in ours, threads
        assert all(on == engine for name, on in threads.values() if name.startswith("pt_gloo")), threads
    finally:
        server.stop()
        broker.kill()
