"""Which CPUs the connector's own threads run on, on a worker whose KV cache is on the CPU.

vLLM's CPU backend binds a worker's OpenMP threads to cores (`VLLM_CPU_OMP_THREADS_BIND`,
"auto" by default), and in a P/D setup it keeps a core of each rank out of them for the
KV connector (`VLLM_CPU_NUM_OF_RESERVED_CPU`). Every thread the worker starts after that
inherits its creator's cores, so the connector's threads (the broker client's loop, the
tcp transport's sending and receiving threads) would run on the cores the forward pass
computes on, and leave the kept one idle. A forward pass's OpenMP threads meet at a
barrier after each parallel region, so one core shared with a send slows every layer.

`thread_cpus` decides where they go: plain values in, a decision out (`Placement`), so
it is tested without a host of that shape. `read_host` reads this host's part of those
values from Linux, and `threads_started_on` starts threads there.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass

AUTO, INHERIT = "auto", "inherit"
_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")
MAX_CPU = 1 << 16


def parse_cpu_list(text: str) -> frozenset[int]:
    """A Linux CPU list ("0-3,7"): the CPUs it names.

    Raises:
        ValueError: not such a list, or it names no CPU.
    """
    cpus: set[int] = set()
    for part in text.replace(" ", "").split(","):
        m = _RANGE.match(part)
        if m is None:
            raise ValueError(f"{part!r} is not a CPU number or range")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) is not None else lo
        if hi < lo or hi >= MAX_CPU:
            raise ValueError(f"{part!r} is not a CPU range from low to high")
        cpus.update(range(lo, hi + 1))
    if not cpus:
        raise ValueError("it names no CPU")
    return frozenset(cpus)


def format_cpu_list(cpus: frozenset[int] | set[int]) -> str:
    """`cpus` as a Linux CPU list, ranges joined: {0, 1, 2, 7} -> "0-2,7"."""
    runs: list[list[int]] = []
    for c in sorted(cpus):
        if runs and runs[-1][1] == c - 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in runs)


@dataclass(frozen=True)
class Host:
    """What a worker process may run on, as its connector starts.

    allowed: the CPUs the instance may use (its engine process's, before vLLM bound the
        worker's threads).
    bound: the CPUs the worker's threads are bound to now, all of them together.
    nodes: the host's NUMA nodes, each its CPUs (one node where Linux names none).
    omp_bind: `VLLM_CPU_OMP_THREADS_BIND` ("auto" where unset).
    omp_placed: the OpenMP runtime was told where its threads go (`OMP_PLACES`,
        `GOMP_CPU_AFFINITY` or `KMP_AFFINITY` in the environment, as vLLM's binding sets
        them); else whatever bound the worker (`taskset` on it alone) was not vLLM.
    """

    allowed: frozenset[int]
    bound: frozenset[int]
    nodes: tuple[frozenset[int], ...]
    omp_bind: str = AUTO
    omp_placed: bool = False


@dataclass(frozen=True)
class Placement:
    """Where the connector's threads start: `cpus`, or where they would anyway (None); why."""

    cpus: frozenset[int] | None
    reason: str


class PlacementError(ValueError):
    """`thread_cpus` names CPUs this worker may not run on."""


def thread_cpus(setting: str | frozenset[int], host: Host) -> Placement:
    """Where the connector's threads should run, for the `thread_cpus` setting.

    "inherit": where the worker's thread that starts them runs. A CPU list: there. "auto":
    where vLLM's own CPU binding ("auto", placing the OpenMP threads through the
    environment) left CPUs of the worker's NUMA nodes out of its threads, there (the core
    it keeps for a KV connector, and any others it left, such as a bound core's second
    hyperthread); else inherit. With cores named by hand (`VLLM_CPU_OMP_THREADS_BIND=0-7`),
    other instances may compute on every core not named, so only a list given here moves
    the threads.

    Raises:
        PlacementError: a list that names CPUs outside `host.allowed`.
    """
    if setting == INHERIT:
        return Placement(None, "thread_cpus is inherit")
    if not isinstance(setting, str):
        outside = setting - host.allowed
        if outside:
            raise PlacementError(
                f"kv_connector_extra_config.thread_cpus names CPU {format_cpu_list(outside)}, which this worker may "
                f"not run on; name CPUs of {format_cpu_list(host.allowed)}."
            )
        return Placement(setting, "thread_cpus names them")
    if host.omp_bind == "nobind":
        return Placement(None, "vLLM does not bind this worker's threads (VLLM_CPU_OMP_THREADS_BIND=nobind)")
    if host.omp_bind != AUTO:
        return Placement(None, "VLLM_CPU_OMP_THREADS_BIND names this worker's cores: set thread_cpus to a core "
                               "left out of every instance's list")
    if not host.omp_placed:  # bound by someone else (taskset on this process): their choice stands
        return Placement(None, "this worker's OpenMP threads were not placed (no OMP_PLACES, GOMP_CPU_AFFINITY "
                               "or KMP_AFFINITY)")
    local = frozenset().union(*(node for node in host.nodes if node & host.bound)) or host.allowed
    free = (host.allowed & local) - host.bound
    if not free:
        return Placement(None, "no CPU of this worker's NUMA nodes is left outside its threads")
    return Placement(free, "vLLM's CPU binding left them out of this worker's threads")


def _affinity(tid: int) -> frozenset[int]:
    return frozenset(os.sched_getaffinity(tid))


@functools.cache
def read_host() -> Host:
    """This process's `Host`, from Linux, read once: after the first connector of a
    process has placed its threads, they would count as the worker's. On a system
    without thread affinities (not Linux), every thread may run anywhere: nothing is
    bound."""
    if not hasattr(os, "sched_getaffinity"):
        everything = frozenset(range(os.cpu_count() or 1))
        return Host(everything, everything, (everything,))
    bound: set[int] = set(_affinity(0))  # this thread's, where /proc cannot be read
    with contextlib.suppress(OSError):
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError):  # the thread ended meanwhile
                bound |= _affinity(int(tid))
    try:  # the engine process that started this worker, which vLLM does not bind
        allowed = _affinity(os.getppid())
    except OSError:
        allowed = frozenset(bound)
    nodes: list[frozenset[int]] = []
    with contextlib.suppress(OSError):
        root = "/sys/devices/system/node"
        for name in sorted(os.listdir(root)):
            if re.fullmatch(r"node\d+", name):
                with open(os.path.join(root, name, "cpulist")) as f, contextlib.suppress(ValueError):
                    nodes.append(parse_cpu_list(f.read().strip()))
    omp_bind = os.environ.get("VLLM_CPU_OMP_THREADS_BIND", AUTO).strip() or AUTO
    omp_placed = any(os.environ.get(k) for k in ("OMP_PLACES", "GOMP_CPU_AFFINITY", "KMP_AFFINITY"))
    return Host(allowed=allowed, bound=frozenset(bound), nodes=tuple(nodes) or (allowed,), omp_bind=omp_bind,
                omp_placed=omp_placed)


@contextlib.contextmanager
def threads_started_on(cpus: frozenset[int] | None) -> Iterator[None]:
    """Threads started by this thread inside the block run on `cpus` (Linux threads
    inherit their creator's), and so do the threads those start later; this thread's
    own CPUs are back as they were after it. None: nothing changes."""
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
