"""A worker process bound the way vLLM's CPU backend binds one: moves one request from a
P half to a D half (both here), then prints each thread's CPUs as one JSON line.

    OMP_PLACES={0} OMP_PROC_BIND=true python tests/connector/thread_cpus_child.py BROKER SETTING

SETTING is the connector's `thread_cpus`. The OpenMP runtime binds this process's main
thread as it loads with torch, as in a vLLM worker, before the connector starts any thread.
"""

from __future__ import annotations

import json
import os
import sys
import threading

import torch

from tests.connector.test_worker import load, make_caches, make_worker, run_steps, stage
from workers.cpus import format_cpu_list


def main() -> None:
    broker, setting = sys.argv[1], sys.argv[2]
    torch.ones(1 << 16).sum()  # a parallel region: the runtime's threads exist, bound
    before = {t.native_id for t in threading.enumerate()}
    pc, dc = make_caches(seed=1), make_caches(seed=2)
    p = make_worker(broker, "p", "p0", pc, thread_cpus=setting)
    d = make_worker(broker, "d", "d0", dc, thread_cpus=setting)
    try:
        load(d, "t0", [3, 4, 5], cached=0)
        stage(p, pc, "t0", [7, 8, 9], decode="d0")  # its send runs on a thread of the loop's
        run_steps(d, {"req-t0"}, 20)
        assert all(torch.equal(dc[n][[3, 4, 5]], pc[n][[7, 8, 9]]) for n in pc), "the KV did not arrive whole"
        threads = {}
        names = {t.native_id: t.name for t in threading.enumerate()}
        for tid in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = names.get(int(tid), f.read().strip())  # Python's name, else the kernel's
            threads[tid] = {"name": name, "cpus": format_cpu_list(os.sched_getaffinity(int(tid))),
                            "started_before": int(tid) in before}
        print("THREADS " + json.dumps({"main": format_cpu_list(os.sched_getaffinity(0)), "threads": threads}), flush=True)
    finally:
        p.close()
        d.close()


if __name__ == "__main__":
    main()
