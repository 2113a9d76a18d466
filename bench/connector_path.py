"""The vLLM connector's own path, timed end to end against its transport's raw ceiling.

This times what a request costs on the connector's path: the worker halves as vLLM drives
them (bind, save_kv_layer, wait_for_save on P; bind, start_load_kv, get_finished on D),
P and D in processes of their own, Llama-3-8B-shaped KV (32 layers, 8 KV heads, head
128, bf16, block 16), through a real `kvbroker serve` (Offer, Prepare, Ready, Go, Done,
Release, and for nccl the communicators' rendezvous). No vLLM and no model: P's forward
pass is only its 32 per-layer gathers, unless `--prefill-ms` gives it GPU time of its own.

`--transport nccl`: P's KV on cuda:0, D's on cuda:1, flash-attn shaped, over the
communicator backend `--backend` names (the connector's `nccl_backend`; default: the
connector's own choice). On a host of one GPU both caches live on cuda:0 and the backend
is ipc (the copies then stay in that GPU's memory, so only the host's part of the path
compares with two GPUs).
`--transport tcp`: both on the CPU, vLLM CPU backend shaped (``[blocks, H, bs, 2D]``).

* raw          the transfer's bytes moved once with nothing else: one NCCL send/recv over
               the communicators the connector built (D's receive posted first), or one
               `sendall` over a loopback TCP socket into a buffer D reads into.
* connector    D's request is bound (start_load_kv) and P names D as its decode peer;
               the clock runs from P's bind to D's get_finished reporting the request,
               with D's scatter done. With `--inflight N`, N requests at once: P saves
               all N in one step, D loads all N, and the clock runs until D has reported
               the last; raw then moves all N requests' bytes as one transfer. D's engine steps all along
               from its claim, as vLLM's does (the step that claims a request runs its
               start_load_kv and get_finished), and P's request starts at a random point
               of D's cycle (`_Engine.phase`; `--d-cycle wakes`: at D's claim, as when
               an engine that had nothing to run wakes on the request, vLLM's engine
               core waiting on its input queue, just as P starts): each step is
               get_finished, then `--step-ms` spent waiting (a GPU decode step it waits
               for, or on the CPU the wait of an engine with nothing else to run), so D's
               main thread leaves the GIL to the connector's threads, and the end is
               seen within one step (with the step a sleep, D runs no model, so the
               step's get_finished may wait up to 4 ms for a landing, as the connector
               does in vLLM: `connector.consumer.IDLE_WAIT_S`). Where P and D share one GPU, D's step is a sleep
               (`--step-on host`): two processes time-slice one GPU, so a decode kernel of
               D's would hold up P's forward pass and copies by up to a time slice each
               time, which a D on a GPU of its own never does. Once the clock stops, D
               takes the reported requests' first step, as vLLM's scheduler runs it next:
               its get_finished sends the Dones an idle step held, which free P's staging
               for the next request.
* after prefill  (with `--prefill-ms X`) P's forward pass takes X ms of GPU time (on
               tcp, X ms of sleep that leaves the GIL free, as torch's CPU kernels do)
               before its gathers, spread over the 32 layers (each layer's share, then
               its save_kv_layer), as a real prefill does; the row's `after_prefill_ms`
               is the connector's time less the forward pass alone (no saves; GPU time
               on a GPU), timed right before each request (the median): what the
               transfer adds to the request once the prefill is done (the gathers
               included), against raw. (A baseline measured once at the start moved by
               up to 1.4 ms between two runs of the same code on one H200, with the
               GPU's clock, while the connector's times agreed within 0.2 ms.) The Offer, Prepare, Ready and Go, and the
               communicators' lookups, overlap the forward pass there, as in vLLM.
               On a GPU the forward pass is a sleep kernel, which leaves the SMs to
               whatever runs beside it; `--forward gemm` makes it bf16 matrix multiplies
               on every SM, as a real prefill's are, so what the copy kernels cost the
               forward pass shows. On the CPU it makes them float32 matrix multiplies on
               P's intra-op threads; `--p-cpus 0` binds those, and P's engine thread, to
               CPU 0 as vLLM's CPU backend binds a worker, so where the connector's own
               threads run (`--thread-cpus`, its `thread_cpus`) shows in the stretch.
               The row also splits that time where P's host sees its forward pass end
               (it waits for it, as vLLM's sampler does): `forward_stretch_ms`, how much
               longer the pass took than alone (the gathers that materialize the KV on
               its stream, and on one GPU the sends' copies sharing its memory), and
               `after_forward_end_ms`, from then until D reported the last request
               (the last layers' copies, D's step, its get_finished and scatter).
               And by where D's idle cycle put the report: `seen_waiting` of the
               requests were reported by the get_finished that was waiting as the last
               load landed (`after_prefill_seen_waiting_ms`, their median added), the
               others by a later step, their landing in the engine's sleep
               (`after_prefill_next_step_ms`).
* claim after  (with `--claim-after-ms MS`) D gets the requests only once P's forward pass
               has ended (MS later), as a proxy that sends the prompt to P first and
               then to D with P's answer does (vLLM's examples do): P has staged and
               offered the KV by then, D's engine takes the requests at the start of a
               step, and the clock runs from that claim to D's report, the prefill
               long done. P's link looks for D's receive when it offers, then each
               time D rings its bell, and sends on it when it sees it before the Go.
               With `--prefill-ms` P goes on meanwhile, as a P under load does:
               `NEXT_PASS_S` after the request's start it runs its next forward pass
               beside the waiting transfers (`forward_beside_ms`, against
               `forward_alone_ms`; a claim after at least that pass and 20 ms keeps it
               clear of the claim): with `--forward launches`, a pass bound by its
               host thread, what watching for D's receive takes from it shows.

Once per prompt length, D's blocks are compared with P's. Prints a table, and how many of
P's sends started on D's receive rather than on their Go; `--json PATH` writes the rows.

Usage: python bench/connector_path.py [--transport nccl|tcp] [--backend ipc] [--tokens 512,2048,8192]
       [--iters 20] [--inflight 1] [--step-ms 1] [--step-on gpu|host] [--prefill-ms 0] [--forward sleep|gemm|launches] [--d-cycle running|wakes] [--claim-after-ms MS] [--p-cpus LIST] [--thread-cpus auto|inherit|LIST]
       [--log-format json|console] [--thread-cpu] [--profile DIR] [--json PATH]

`--thread-cpu` (Linux) adds, per prompt length, the CPU time each of P's and D's threads
used while a request was timed, and how long each sat runnable without a CPU: what each
host spends on a request besides waiting for its GPU. D's window is the clock's; P's runs
from its bind until D has reported the requests and taken its next step (whose Dones
release P's staging), so P's Offer, send, Go and Release are in it, and with
`--claim-after-ms` and a forward pass, P's next pass too. P's threads share one GIL: their
CPU time together bounds how soon a request can end when nothing else overlaps it.

`--profile DIR` writes, per prompt length, P's GPU timeline of its last warm-up request
(torch's profiler, chrome format, `p-TOKENSxN.json`: which kernel ran on which stream
when, the sends' copies against the forward pass and its gathers), and a cProfile of each
worker over the timed requests (`p-loop-*.txt`, `d-loop-*.txt`; started on the broker
client's loop, it covers every thread of the process on Python 3.12). The timed requests
run unprofiled by torch's profiler, but cProfile slows every thread's Python: read those
runs' times as the profile's, not the benchmark's.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import multiprocessing as mp
import os
import random
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from connector.config import EngineInfo, parse_config  # noqa: E402
from connector.consumer import IDLE_WAIT_S  # noqa: E402
from connector.scheduler import KvBrokerMetadata, LoadSpec, SaveSpec  # noqa: E402
from connector.worker import ConnectorWorker  # noqa: E402
from workers.cpus import parse_cpu_list  # noqa: E402
from protocols.logs import configure_logging  # noqa: E402
import structlog  # noqa: E402

LAYERS, HEADS, DIM, BLOCK = 32, 8, 128, 16
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
WARM_S = 0.3  # busy time before the forward pass is timed at start-up
BLOCK_BYTES = LAYERS * 2 * BLOCK * HEADS * DIM * 2  # one block of every layer, K and V
DEADLINE_S = 30.0
GEMM = 4096  # `--forward gemm`: one layer's share is some of these square bf16 matrix multiplies
CPU_GEMM = 256  # the same on the CPU, float32 (a fraction of a millisecond each on one core)
# With `--claim-after-ms` and a forward pass: when P's next forward pass starts, from the
# start of the request whose transfers wait for D's claim beside it.
NEXT_PASS_S = 0.022


@dataclass(frozen=True)
class Spec:
    block_size: int = BLOCK
    num_kv_heads: int = HEADS
    head_size: int = DIM
    use_mla: bool = False


def gpu_ms(work: Callable[[], object], runs: int = 3) -> float:
    """Milliseconds of GPU time `work` enqueues (the median of `runs`)."""
    took = []
    for _ in range(runs):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        work()
        end.record()
        end.synchronize()
        took.append(begin.elapsed_time(end))
    return statistics.median(took)


def _median_ms(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def _seen(n: int, of: int, ms: float | None) -> str:
    """`n` of the `of` requests, and their median added ms."""
    return f"{n}/{of} {ms:.2f}" if ms is not None else f"0/{of} -"


class _Engine:
    """One side's device work: where its caches live, its syncs and its engine step."""

    def __init__(self, transport: str, role: str, step_ms: float, prefill_ms: float = 0.0,
                 step_on: str = "gpu", forward: str = "sleep", threads: int = 1) -> None:
        self.gpu = transport == "nccl"
        if not self.gpu:
            # P and D share this host's cores, so each gets its own intra-op threads, as the
            # README asks of instances sharing a host (their own cores each): one, unless P
            # is bound to cores of its own (`--p-cpus`). With torch's default of one per
            # core, P's copies in save_kv_layer spun OpenMP threads on the cores the sending
            # and receiving threads needed: on a 2-core VM one request of 2,048 tokens took
            # 96-98 ms against 81-84 with one thread, and P's 22 ms forward pass stretched
            # by 47-52 ms against 21-22 (docs/PERFORMANCE.md).
            torch.set_num_threads(threads)
        one = self.gpu and torch.cuda.device_count() == 1  # the ipc backend on one GPU: both caches there
        self.device = ("cuda:0" if role == "p" or one else "cuda:1") if self.gpu else "cpu"
        self.step_s = step_ms / 1e3
        self.step_on_gpu = self.gpu and step_on == "gpu"
        self.cycles = self.layer_cycles = 0
        self.layer_ops: list[int] = []  # `--forward gemm` or `launches`: each layer's ops
        self._op: Callable[[], None] = self._gemm  # `--forward gemm` or `launches`: one step of a layer
        self.prefill_ms = 0.0  # the forward pass's time (`layer` x the layers), as first measured here
        self.layer_s = 0.0  # on the CPU: one layer's share of the forward pass
        if self.gpu:
            torch.cuda.set_device(self.device)
            # The sleep kernel counts SM cycles: time it at the clock the requests will see,
            # once the GPU has been busy long enough to leave its idle clock.
            busy_until = time.perf_counter() + WARM_S
            while time.perf_counter() < busy_until:
                gpu_ms(lambda: torch.cuda._sleep(1_000_000), runs=1)
            per_ms = 1_000_000 / gpu_ms(lambda: torch.cuda._sleep(1_000_000), runs=5)
            self.cycles = int(per_ms * step_ms)
            if prefill_ms > 0:
                self.layer_cycles = int(per_ms * prefill_ms / LAYERS)
        if prefill_ms > 0 and forward in ("gemm", "launches"):
            # gemm: on a GPU bf16 matrix multiplies on every SM, as a prefill's are: what the
            # copy kernels' programs beside them cost shows up, which a sleep kernel hides.
            # On the CPU matrix multiplies on P's intra-op threads, the GIL released while
            # they run: a send's threads on those cores take time from the forward pass,
            # which a sleep hides. launches: tiny ops, each after some Python, as a GPU
            # prefill's host thread launches its kernels: a forward pass bound by that
            # thread (on a GPU, whose kernels wait for each launch), so what takes the GIL
            # from it (the broker client's loop, the link's looks) stretches it
            if forward == "gemm":
                self.mats = ([torch.randn(GEMM, GEMM, device=self.device, dtype=torch.bfloat16) for _ in range(3)]
                             if self.gpu else [torch.randn(CPU_GEMM, CPU_GEMM) for _ in range(3)])
            else:
                self.mats, self._op = [torch.zeros(16, device=self.device) for _ in range(3)], self._launch
            for _ in range(20):  # warm: the first ones take longer (a GPU's clock is up already, above)
                self._op()
            runs = 10 if self.gpu and forward == "gemm" else 50  # a GPU's multiply takes about a ms
            if self.gpu:
                op_ms = gpu_ms(lambda: [self._op() for _ in range(runs)]) / runs
            else:
                t0 = time.perf_counter()
                for _ in range(runs):
                    self._op()
                op_ms = (time.perf_counter() - t0) * 1e3 / runs
            # The pass's ops spread over its layers (some take one more), rather than a count
            # a layer rounded: a multiply of about a quarter of a layer's share would round
            # to 2 or 3 a layer, a pass of 16 or 24 ms, with the clock at start-up.
            ops = max(LAYERS, round(prefill_ms / op_ms))
            self.layer_ops = [ops // LAYERS + (i < ops % LAYERS) for i in range(LAYERS)]
        elif prefill_ms > 0 and not self.gpu:  # a CPU forward pass runs in torch's threads, the GIL released
            self.layer_s = prefill_ms / 1e3 / LAYERS
        self.prefill_ms = self.forward_pass()

    def forward_pass(self) -> float:
        """The forward pass alone (every layer's share, no saves), ms: GPU time on a GPU.
        Measured again before each timed request, so a clock that drifts during the run
        moves the baseline and the request alike."""
        if self.gpu and (self.layer_cycles or self.layer_ops):
            return gpu_ms(lambda: [self.layer(i) for i in range(LAYERS)], runs=1)
        if not self.layer_s and not self.layer_ops:
            return 0.0
        t0 = time.perf_counter()
        for i in range(LAYERS):
            self.layer(i)
        return (time.perf_counter() - t0) * 1e3

    def _gemm(self) -> None:
        a, b, out = self.mats
        torch.mm(a, b, out=out)

    def _launch(self) -> None:
        """About what a kernel launch costs a GPU prefill's host thread: Python, then a
        call that releases the GIL and takes it back at once (on a GPU, a launch)."""
        x = 0
        for i in range(200):
            x += i
        a, _, out = self.mats
        torch.add(a, 1, out=out)

    def layer(self, i: int) -> None:
        """Layer `i`'s share of the forward pass (nothing without `--prefill-ms`)."""
        if self.layer_ops:
            for _ in range(self.layer_ops[i]):
                self._op()
        elif self.layer_cycles:
            torch.cuda._sleep(self.layer_cycles)
        elif self.layer_s:
            time.sleep(self.layer_s)

    def phase(self, rng: random.Random) -> float:
        """A random point of one engine cycle (a step, and an idle step's wait for a
        landing, `IDLE_WAIT_S`), s: where D's engine is when P's request starts, since the
        two engines do not step together. D steps from its claim, as vLLM's does: the step
        whose scheduler claims a request runs that request's start_load_kv and then its
        get_finished, and an engine with nothing else to run steps on (an idle step's
        wait, vLLM's 1 ms sleep) until the KV is in. With P started at D's claim after
        a prefill, the last landing fell at the same point of D's cycle in every request
        (in its sleep, or in its wait), and the median measured that one point."""
        return rng.uniform(0.0, self.step_s + (0.0 if self.step_on_gpu else IDLE_WAIT_S))

    def sync(self) -> None:
        if self.gpu:
            torch.cuda.current_stream(self.device).synchronize()

    def step(self) -> None:
        """The rest of an engine step after get_finished, spent waiting."""
        if self.step_on_gpu:
            torch.cuda._sleep(self.cycles)
            self.sync()
        else:
            time.sleep(self.step_s)

    def caches(self, num_blocks: int, seed: int) -> dict[str, torch.Tensor]:
        g = torch.Generator(device=self.device).manual_seed(seed)
        shape = (2, num_blocks, BLOCK, HEADS, DIM) if self.gpu else (num_blocks, HEADS, BLOCK, 2 * DIM)
        return {n: torch.randn(shape, device=self.device, generator=g, dtype=torch.bfloat16) for n in NAMES}

    def blocks(self, cache: torch.Tensor, ids: list[int]) -> torch.Tensor:
        return (cache[:, ids] if self.gpu else cache[ids]).cpu()


class _ThreadCpu:
    """The CPU time each of this process's threads used over the timed windows, and the
    time each waited for a CPU, from /proc (Linux; nothing elsewhere). Threads are
    grouped by name (Python's, else the kernel's), so the loop's worker threads add up."""

    def __init__(self) -> None:
        self.used: dict[str, list[float]] = defaultdict(list)  # name -> CPU ms in each window
        self.queued: dict[str, list[float]] = defaultdict(list)  # name -> ms runnable, not running
        self._at: dict[int, tuple[str, int, int]] = {}

    @staticmethod
    def _snap() -> dict[int, tuple[str, int, int]]:
        names = {t.native_id: t.name for t in threading.enumerate()}
        snap = {}
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/schedstat") as f:
                    run, wait, _ = f.read().split()
                with open(f"/proc/self/task/{tid}/comm") as f:
                    comm = f.read().strip()
            except OSError:  # the thread ended meanwhile
                continue
            name = re.sub(r"[-_ ]?(\d+|[0-9a-f]{8,})$", "", names.get(int(tid), comm))  # "worker-3" and "worker-4" together
            snap[int(tid)] = (name, int(run), int(wait))
        return snap

    def start(self) -> None:
        if os.path.isdir("/proc/self/task"):
            self._at = self._snap()

    def stop(self) -> None:
        if not self._at:
            return
        used: dict[str, float] = defaultdict(float)
        queued: dict[str, float] = defaultdict(float)
        for tid, (name, run, wait) in self._snap().items():
            _, run0, wait0 = self._at.get(tid, (name, 0, 0))
            used[name] += (run - run0) / 1e6
            queued[name] += (wait - wait0) / 1e6
        for name, ms in used.items():
            self.used[name].append(ms)
            self.queued[name].append(queued[name])
        self._at = {}

    def table(self) -> dict[str, dict[str, float]]:
        """Per thread name: the median over windows of its CPU ms and its ms waiting for a CPU."""
        return {name: {"cpu_ms": round(statistics.median(ms), 3),
                       "runnable_ms": round(statistics.median(self.queued[name]), 3)}
                for name, ms in sorted(self.used.items(), key=lambda kv: -statistics.median(kv[1]))}


def _worker(endpoint: str, role: str, engine: _Engine, cfg: dict) -> tuple[ConnectorWorker, dict[str, torch.Tensor]]:
    caches = engine.caches(cfg["num_blocks"], 1 if role == "p" else 2)
    config = parse_config(
        {"broker": endpoint, "instance_id": f"{role}0", "transport": cfg["transport"], "pool_bytes": cfg["pool"],
         "staging_bytes": cfg["pool"], "load_timeout_s": DEADLINE_S,
         **({"nccl_backend": cfg["backend"]} if cfg["backend"] and cfg["transport"] == "nccl" else {}),
         **({"thread_cpus": cfg["thread_cpus"]} if cfg["transport"] == "tcp" else {})},
        kv_role="kv_producer" if role == "p" else "kv_consumer", engine_id=None,
    )
    backend = "FLASH_ATTN/bench" if engine.gpu else "CPU_ATTN/bench"
    info = EngineInfo(model="llama-3-8b-shaped", spec=Spec(), block_size=BLOCK, backend=backend)
    worker = ConnectorWorker(config, info)
    worker.register_kv_caches(caches)
    # As vLLM's engine and worker do once started (`freeze_gc_heap`): what exists now is
    # never scanned again, so a full collection does not stall a timed request for the
    # whole heap (one took 196 ms with vLLM imported, on a 2-core VM).
    for generation in range(3):
        gc.collect(generation)
    gc.freeze()
    return worker, caches


def _peer_of(worker: ConnectorWorker) -> str:
    assert worker.client is not None and worker.client.registered is not None
    return worker.client.registered.peer_id


class _RawTcp:
    """The raw ceiling on the CPU: one `sendall` over a loopback socket, read into a buffer."""

    def __init__(self) -> None:
        self.listener: socket.socket | None = None
        self.sock: socket.socket | None = None

    def listen(self) -> int:
        self.listener = socket.create_server(("127.0.0.1", 0))
        return self.listener.getsockname()[1]

    def accept(self) -> None:
        assert self.listener is not None
        self.sock, _ = self.listener.accept()

    def connect(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port))

    def send(self, data: torch.Tensor) -> None:
        assert self.sock is not None
        self.sock.sendall(memoryview(data.numpy()))

    def recv(self, into: torch.Tensor) -> None:
        assert self.sock is not None
        view, got = memoryview(into.numpy()), 0
        while got < len(view):
            n = self.sock.recv_into(view[got:])
            if not n:
                raise ConnectionError("the raw sender closed early")
            got += n


def _profiler(cfg: dict, it: int) -> Any:
    """A started torch profiler (CPU and CUDA activity) for P's last warm-up request when
    `--profile` names a folder, else None: kernels by stream, to see where a request's
    copies ran against the forward pass and its gathers."""
    if not cfg["profile"] or it != cfg["warmup"] - 1:
        return None
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    prof.start()
    return prof


class _LoopProfile:
    """cProfile of a worker over the timed requests of one size (`--profile`): where its
    threads' time goes (the Offers, the Go or Prepare handlers, the posts). Started and
    stopped on the broker client's loop: before Python 3.12 a profiler follows only the
    thread that enables it, and that one is the loop."""

    def __init__(self, worker: ConnectorWorker, cfg: dict, name: str) -> None:
        self.client = worker.client if cfg["profile"] else None
        self.path = os.path.join(cfg["profile"], name) if cfg["profile"] else ""
        self.prof: Any = None

    def start(self) -> None:
        if self.client is not None and self.prof is None:
            import cProfile

            self.prof = cProfile.Profile()
            self.client.call(self.prof.enable)

    def stop(self) -> None:
        if self.client is None or self.prof is None:
            return
        import io
        import pstats

        self.client.call(self.prof.disable)
        out = io.StringIO()
        for key in ("tottime", "cumulative"):
            pstats.Stats(self.prof, stream=out).sort_stats(key).print_stats(40)
        with open(self.path, "w") as f:
            f.write(out.getvalue())
        self.prof = None


def _prefill(endpoint: str, conn: Any, cfg: dict) -> None:
    """P: for each request, tell D, wait until D holds it, then run the step."""
    engine = _Engine(cfg["transport"], "p", cfg["step_ms"], cfg["prefill_ms"], forward=cfg["forward"],
                     threads=len(parse_cpu_list(cfg["p_cpus"])) if cfg["p_cpus"] else 1)
    configure_logging(cfg["log_format"], cfg["log_level"])
    p, caches = _worker(endpoint, "p", engine, cfg)
    log = structlog.get_logger().bind(role="bench")
    raw_tcp = _RawTcp()
    try:
        conn.send((_peer_of(p), engine.prefill_ms))
        d_peer, port = conn.recv()
        if not engine.gpu:
            raw_tcp.connect(port)
        g = torch.Generator().manual_seed(0)
        k = cfg["inflight"]
        sends: dict[int, tuple[int, int]] = {}  # tokens -> P's timed sends, those started on D's receive
        # --claim-after-ms with a forward pass: P's next one, run while the transfers wait for D
        beside: dict[int, tuple[list[float], list[float]]] = {tok: ([], []) for tok in cfg["tokens"]}  # and alone
        goes_on = cfg["claim_after_ms"] is not None and engine.prefill_ms > 0
        cpu = {t: _ThreadCpu() for t in cfg["tokens"]}  # with --thread-cpu: who in P used the CPU meanwhile
        for tok in cfg["tokens"]:
            n = tok // BLOCK
            loop = _LoopProfile(p, cfg, f"p-loop-{tok}x{k}.txt")
            counted = p.statistics()
            for it in range(cfg["warmup"] + cfg["iters"]):
                if it == cfg["warmup"]:
                    loop.start()
                    counted = p.statistics()
                tids = [f"t{tok}-{it}" if k == 1 else f"t{tok}-{it}.{j}" for j in range(k)]
                srcs = [torch.randperm(cfg["num_blocks"], generator=g)[:n].tolist() for _ in tids]
                check = it == cfg["warmup"]
                conn.send((tids, it, n, check, {name: engine.blocks(caches[name], srcs[0]) for name in NAMES[::8]}
                           if check else None))
                bound, into_cycle = conn.recv()
                assert bound == "bound"
                alone = engine.forward_pass()  # the baseline, just before the request's own
                engine.sync()
                time.sleep(into_cycle)  # where in D's cycle (D stepping from its claim) the request starts
                # The last warm-up request's GPU timeline (`--profile`): the timed ones run unprofiled.
                profile = _profiler(cfg, it)
                log.info("bench.step_start", transfer_id=tids[-1])
                if cfg["thread_cpu"] and it >= cfg["warmup"]:
                    cpu[tok].start()
                t0 = time.perf_counter()
                p.bind(KvBrokerMetadata(saves={
                    tid: SaveSpec(req_id=f"req-{tid}", block_ids=src, num_tokens=n * BLOCK - 1, decode="d0")
                    for tid, src in zip(tids, srcs)}))
                saves = []  # P's host time in each save_kv_layer
                for i, name in enumerate(NAMES):
                    engine.layer(i)
                    s0 = time.perf_counter()
                    p.save_kv_layer(name, caches[name])
                    saves.append(time.perf_counter() - s0)
                s0 = time.perf_counter()
                p.wait_for_save()
                p.clear()
                launched = time.perf_counter()
                # P's host waits for its forward pass to end, as vLLM's sampler does: then the
                # request's time splits into the pass (stretched by the step's gathers) and after.
                engine.sync()
                ended = time.perf_counter()
                if profile is not None:
                    profile.stop()
                    profile.export_chrome_trace(os.path.join(cfg["profile"], f"p-{tok}x{k}.json"))
                log.info("bench.forward_end", transfer_id=tids[-1], first_save_us=round(saves[0] * 1e6),
                         saves_us=round(sum(saves) * 1e6), wait_for_save_us=round((launched - s0) * 1e6),
                         host_us=round((launched - t0) * 1e6), gpu_after_us=round((ended - launched) * 1e6))
                conn.send((t0, alone, ended))
                if goes_on:
                    # P goes on with its next step while these transfers wait for D's claim.
                    time.sleep(max(0.0, t0 + NEXT_PASS_S - time.perf_counter()))
                    took_beside = engine.forward_pass()
                    if it >= cfg["warmup"]:
                        beside[tok][0].append(took_beside)
                        beside[tok][1].append(alone)
                assert conn.recv() == "done"
                cpu[tok].stop()  # D reported the requests, and its next step released P's staging
                # raw: the same bytes once, D's receive ready first
                assert p.pool is not None
                total = k * n * BLOCK_BYTES
                data = p.pool.tensor[:total]
                comm = p.nccl.cache.get(d_peer, initiator=True) if p.nccl is not None else None
                assert conn.recv() == "posted"
                engine.sync()
                conn.send(time.perf_counter())
                if comm is not None and p.nccl is not None:
                    work = comm.post_range("send", p.pool.tensor, 0, total, p.nccl.stream)
                    comm.completion([work], p.nccl.stream, "send").wait(time.monotonic() + DEADLINE_S,
                                                                         spin_s=DEADLINE_S)
                else:
                    raw_tcp.send(data)
                assert conn.recv() == "done"
            loop.stop()
            now = p.statistics()
            sends[tok] = (now["sent"] - counted["sent"], now["sent_on_receive"] - counted["sent_on_receive"])
        conn.send(None)
        conn.send((sends, beside, {t: c.table() for t, c in cpu.items()} if cfg["thread_cpu"] else {}))
    finally:
        p.close()


def _decode(endpoint: str, conn: Any, cfg: dict, results: Any) -> None:
    """D: hold each request, then step until get_finished reports it."""
    engine = _Engine(cfg["transport"], "d", cfg["step_ms"], step_on=cfg["step_on"])
    configure_logging(cfg["log_format"], cfg["log_level"])
    d, caches = _worker(endpoint, "d", engine, cfg)
    raw_tcp = _RawTcp()
    rows: list[dict[str, Any]] = []
    claim_after: float | None = cfg["claim_after_ms"]
    try:
        p_peer, _ = conn.recv()
        port = 0 if engine.gpu else raw_tcp.listen()
        conn.send((_peer_of(d), port))
        if not engine.gpu:
            raw_tcp.accept()
        g = torch.Generator().manual_seed(1)
        times: dict[int, tuple[list[float], list[float]]] = {t: ([], []) for t in cfg["tokens"]}
        alone: dict[int, list[float]] = {t: [] for t in cfg["tokens"]}  # P's forward pass by itself, ms
        tails: dict[int, tuple[list[float], list[float]]] = {t: ([], []) for t in cfg["tokens"]}
        # of "then sync": D's host up to the sync (wall, and its main thread's CPU time in it)
        before_sync: dict[int, tuple[list[float], list[float]]] = {t: ([], []) for t in cfg["tokens"]}
        # the forward pass's stretch over its time alone, and the time after P's host saw it end
        split: dict[int, tuple[list[float], list[float]]] = {t: ([], []) for t in cfg["tokens"]}
        # each request's time less P's forward pass before it, ms: [reported by a later step, by the waiting one]
        by_step: dict[int, tuple[list[float], list[float]]] = {t: ([], []) for t in cfg["tokens"]}
        cpu = {t: _ThreadCpu() for t in cfg["tokens"]}  # with --thread-cpu: who in D used the CPU meanwhile
        phase = random.Random(7)  # where in its cycle D's engine is when P's request starts (`phase`)
        while (msg := conn.recv()) is not None:
            tids, it, n, check, want = msg
            tok, k = n * BLOCK, len(tids)
            if it == cfg["warmup"]:
                loop = _LoopProfile(d, cfg, f"d-loop-{tok}x{k}.txt")
                loop.start()
            free = torch.randperm(cfg["num_blocks"], generator=g)[: k * n].tolist()  # no two loads share a block
            dsts = [free[j * n : (j + 1) * n] for j in range(k)]
            loads = KvBrokerMetadata(loads={
                tid: LoadSpec(req_id=f"req-{tid}", block_ids=dst, num_cached_blocks=0, num_tokens=n * BLOCK - 1)
                for tid, dst in zip(tids, dsts)})
            started: tuple[float, float, float] | None = None  # P's (t0, forward pass alone, its host saw it end)
            claimed = 0.0  # with --claim-after-ms: when D's engine took the requests
            if claim_after is not None:
                # The requests reach D only once P is done with them, as vLLM's proxies send
                # them (P's answer carries what D needs); an engine with nothing else to run
                # takes them at the start of its next step.
                conn.send(("bound", 0.0))
                started = conn.recv()
                if claim_after > 0:
                    time.sleep(claim_after / 1e3)
                claimed = time.perf_counter()
            d.bind(loads)
            d.start_load_kv()
            d.clear()
            if claim_after is None:  # P's request starts that long into D's cycle
                conn.send(("bound", engine.phase(phase) if cfg["d_cycle"] == "running" else 0.0))
            if cfg["thread_cpu"] and it >= cfg["warmup"]:
                cpu[tok].start()
            seen_waiting = d.statistics()["seen_waiting"]
            deadline = time.monotonic() + DEADLINE_S
            waiting = {f"req-{tid}" for tid in tids}
            while True:  # the engine steps all along, before P's step too (as a busy engine does)
                # A step of D's engine: with the step a sleep, D runs no model (an idle
                # engine, whose get_finished may wait for a landing); a GPU step is a decode.
                d.bind(KvBrokerMetadata(idle=not engine.step_on_gpu))
                g0 = time.perf_counter()
                _, recving = d.get_finished(set())
                g1, c1 = time.perf_counter(), time.thread_time()
                d.clear()
                waiting -= recving or set()
                if not waiting:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"D never finished {sorted(waiting)}: {d.statistics()}")
                if started is None and conn.poll():
                    started = conn.recv()
                engine.step()
            if d.get_block_ids_with_load_errors():
                raise RuntimeError(f"{', '.join(tids)} failed to load: {d.statistics()}")
            s0, c0 = time.perf_counter(), time.thread_time()
            engine.sync()  # the scatter get_finished enqueued
            t1 = time.perf_counter()
            cpu[tok].stop()
            t0, forward_ms, ended = started if started is not None else conn.recv()
            if claim_after is not None:  # the clock runs from the claim, the prefill long done
                t0, forward_ms, ended = claimed, 0.0, claimed
            took = t1 - t0
            if check:
                for name, got in want.items():
                    assert torch.equal(engine.blocks(caches[name], dsts[0]), got), f"{tids[0]}: {name} differs"
            # The reported requests' first decode step, which vLLM's scheduler runs next: its
            # get_finished sends the Dones an idle step held, and they free P's staging.
            d.bind(KvBrokerMetadata())
            d.start_load_kv()
            engine.step()
            d.get_finished(set())
            d.clear()
            conn.send("done")
            # raw
            assert d.pool is not None
            into = d.pool.tensor[: k * n * BLOCK_BYTES]
            if d.nccl is not None:
                comm = d.nccl.cache.get(p_peer, initiator=False)
                work = comm.post_range("recv", d.pool.tensor, 0, k * n * BLOCK_BYTES, d.nccl.stream)
                done = comm.completion([work], d.nccl.stream, "recv")
                conn.send("posted")
                r0 = conn.recv()
                done.wait(time.monotonic() + DEADLINE_S, spin_s=DEADLINE_S)
            else:
                conn.send("posted")
                r0 = conn.recv()
                raw_tcp.recv(into)
            raw = time.perf_counter() - r0
            conn.send("done")
            if it == cfg["warmup"] + cfg["iters"] - 1:
                loop.stop()
            if it >= cfg["warmup"]:
                times[tok][0].append(took)
                times[tok][1].append(raw)
                alone[tok].append(forward_ms)
                tails[tok][0].append(g1 - g0)  # the get_finished that reported the last request
                tails[tok][1].append(t1 - g1)  # then D's compute stream catching up with the scatter
                before_sync[tok][0].append(s0 - g1)
                before_sync[tok][1].append(c0 - c1)
                split[tok][0].append((ended - t0) * 1e3 - forward_ms)
                split[tok][1].append((t1 - ended) * 1e3)
                # reported by the idle step that was waiting as the last load landed, or by a
                # later step (the landing fell in the engine's sleep between steps)
                waited = d.statistics()["seen_waiting"] > seen_waiting
                by_step[tok][waited].append(took * 1e3 - forward_ms)
        p_sends, beside, p_threads = conn.recv()
        for tok, (conn_s, raw_s) in times.items():
            r, c = statistics.median(raw_s) * 1e3, statistics.median(conn_s) * 1e3
            prefill_ms = statistics.median(alone[tok])
            after = c - prefill_ms  # what the transfer adds once P's forward pass is done
            rows.append({"tokens": tok, "inflight": cfg["inflight"], "claim_after_ms": claim_after,
                         "d_cycle": cfg["d_cycle"],
                         "prefill_ms": round(prefill_ms, 3),
                         "after_prefill_ms": round(after, 3),
                         "after_prefill_vs_raw": round(r / after, 3) if after > 0 else None,
                         "MiB": cfg["inflight"] * tok // BLOCK * BLOCK_BYTES / 2**20, "raw_ms": round(r, 3),
                         "connector_ms": round(c, 3), "connector_min_ms": round(min(conn_s) * 1e3, 3),
                         "connector_max_ms": round(max(conn_s) * 1e3, 3),
                         # the spread D's idle cycle gives (where in it the last landing falls)
                         "connector_mean_ms": round(statistics.fmean(conn_s) * 1e3, 3),
                         "connector_p90_ms": round(statistics.quantiles(conn_s, n=10)[-1] * 1e3, 3)
                         if len(conn_s) > 1 else round(c, 3),
                         "vs_raw": round(r / c, 3),
                         "iters": len(conn_s), "stats": d.statistics(),
                         # P's sends of the timed requests, and of them those started on D's
                         # receive (seen before their Go: `ProducerSide._go_on_receive`)
                         "p_sent": p_sends[tok][0], "p_sent_on_receive": p_sends[tok][1],
                         # --claim-after-ms with a forward pass: P's next one, beside the
                         # transfers waiting for D's claim, and P's forward pass alone
                         "forward_beside_ms": _median_ms(beside[tok][0]),
                         "forward_alone_ms": _median_ms(beside[tok][1]),
                         "get_finished_ms": round(statistics.median(tails[tok][0]) * 1e3, 3),
                         "then_sync_ms": round(statistics.median(tails[tok][1]) * 1e3, 3),
                         # of it, D's host before the sync: wall, and the main thread's CPU
                         # time (wall beyond it is waiting, for the GIL among others)
                         "before_sync_ms": round(statistics.median(before_sync[tok][0]) * 1e3, 3),
                         "before_sync_cpu_ms": round(statistics.median(before_sync[tok][1]) * 1e3, 3),
                         "forward_stretch_ms": round(statistics.median(split[tok][0]), 3),
                         "after_forward_end_ms": round(statistics.median(split[tok][1]), 3),
                         # where D's idle cycle put the report (an idle engine only): the requests
                         # whose last landing the waiting get_finished saw, and the others
                         "seen_waiting": len(by_step[tok][1]),
                         "after_prefill_seen_waiting_ms": _median_ms(by_step[tok][1]),
                         "after_prefill_next_step_ms": _median_ms(by_step[tok][0]),
                         **({"p_threads": p_threads[tok], "d_threads": cpu[tok].table()} if cfg["thread_cpu"] else {})})
        results.put(rows)
    except BaseException as exc:
        results.put(repr(exc))
        raise
    finally:
        d.close()


def _start_broker(log_level: str = "warning") -> tuple[subprocess.Popen, str]:
    """`kvbroker serve` on a free loopback port, logging JSON lines at `log_level` to this
    process's standard error; (process, endpoint)."""
    folder = tempfile.mkdtemp(prefix="kvbroker-bench-")
    port_file = os.path.join(folder, "endpoint")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH", "")]))}
    proc = subprocess.Popen([sys.executable, "-m", "broker.cli", "serve", "--bind", "tcp://127.0.0.1:0",
                             "--port-file", port_file, "--log-level", log_level, "--log-format", "json"],
                            cwd=ROOT, env=env)
    deadline = time.monotonic() + 30
    while not os.path.exists(port_file):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("the broker did not start; run `python -m broker.cli serve` to see why")
        time.sleep(0.05)
    with open(port_file) as f:
        endpoint = f.read().strip()
    shutil.rmtree(folder, ignore_errors=True)
    return proc, endpoint


@contextlib.contextmanager
def _bound_as_vllm_binds(cpus: str) -> Iterator[None]:
    """A process started in the block binds its OpenMP threads, and with them its main
    thread, to `cpus` as it loads torch: the environment vLLM's CPU backend starts a
    worker with (`VLLM_CPU_OMP_THREADS_BIND=auto`, GNU OpenMP)."""
    if not cpus:
        yield
        return
    listed = sorted(parse_cpu_list(cpus))
    env = {"OMP_PLACES": "{" + ",".join(map(str, listed)) + "}", "OMP_PROC_BIND": "true",
           "OMP_NUM_THREADS": str(len(listed))}
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--transport", choices=("nccl", "tcp"), default="nccl")
    ap.add_argument("--tokens", default="", help="default: 512,2048,8192 (nccl), 512,2048 (tcp)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--backend", default="", choices=("", "direct", "torch", "ipc", "ipc,direct"),
                    help="nccl: the connector's nccl_backend (default: ipc on a host of one GPU, else the "
                         "connector's own choice)")
    ap.add_argument("--inflight", type=int, default=1, help="requests moved at once, all from P to D in one step")
    ap.add_argument("--step-ms", type=float, default=1.0, help="D's engine step: GPU time it waits for")
    ap.add_argument("--step-on", default="", choices=("", "gpu", "host"),
                    help="nccl: where D's step waits: a GPU kernel it waits for (gpu), or a sleep (host); default: "
                         "host when P and D share one GPU (processes time-slice one GPU, so D's step kernels would "
                         "stretch P's forward pass and copies, which a D of its own GPU never does), else gpu")
    ap.add_argument("--prefill-ms", type=float, default=0.0,
                    help="P's forward pass, ms spread over its layers before each save_kv_layer (GPU time on nccl; "
                         "on tcp a sleep, the GIL released as torch's CPU kernels release it)")
    ap.add_argument("--forward", default="sleep", choices=("sleep", "gemm", "launches"),
                    help="with --prefill-ms: P's forward pass as a sleep (a kernel on nccl: GPU time that leaves "
                         "the SMs free) or as matrix multiplies, as a real prefill's (bf16 on every SM; float32 "
                         "on P's intra-op threads on tcp); or launches, Python between calls that release the "
                         "GIL for a moment, as a GPU prefill's host thread runs (on nccl tiny kernels, launched "
                         "so: a forward pass bound by its host thread)")
    ap.add_argument("--d-cycle", default="running", choices=("running", "wakes"),
                    help="where in D's cycle P's request starts, D stepping from its claim (the claim's own step "
                         "runs get_finished): at a random point (running: the two engines do not step together), "
                         "or at the claim (wakes: D's engine woke on the request as P took it; after a prefill "
                         "the landing then falls at one point of D's cycle in every request, see _Engine.phase)")
    ap.add_argument("--claim-after-ms", type=float, default=None, metavar="MS",
                    help="D gets the requests only MS after P's forward pass ended (0: at once), as a proxy that "
                         "sends the prompt to P first and then to D does, and the clock runs from D's claim: what "
                         "the transfer adds there (default: D holds them from the start, its claim overlapping "
                         "P's forward pass)")
    ap.add_argument("--p-cpus", default="",
                    help="tcp: bind P's engine thread and OpenMP threads to these CPUs (\"0\", \"0-5\"), as "
                         "vLLM's CPU backend binds a worker, before P imports torch")
    ap.add_argument("--thread-cpus", default="auto",
                    help="tcp: the connector's thread_cpus on both sides (auto, inherit, or a CPU list)")
    ap.add_argument("--log-format", default="json", choices=("console", "json"),
                    help="the workers' logs: json as in production (microsecond timestamps, for `kvbroker trace`); "
                         "console costs each log line about three times the host time")
    ap.add_argument("--log-level", default="info", choices=("debug", "info", "warning"),
                    help="the workers' log level (debug: also each landing's wait for its load's lock)")
    ap.add_argument("--broker-log-level", default="warning", choices=("debug", "info", "warning"),
                    help="the broker's log level (debug: also when it sent each Prepare and relayed each Go, "
                         "for `kvbroker phases`)")
    ap.add_argument("--thread-cpu", action="store_true",
                    help="also print the CPU time each of P's and D's threads used while a request was timed (Linux)")
    ap.add_argument("--profile", default="",
                    help="a folder: P writes a torch profiler trace (chrome format) of its last warm-up request "
                         "of each size there, p-TOKENSxINFLIGHT.json (needs --warmup 1 or more), and each worker "
                         "a cProfile of the timed requests, p-loop-* and d-loop-*.txt")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    gpus = torch.cuda.device_count() if args.transport == "nccl" else 0
    backend = args.backend or (os.environ.get("KVBROKER_NCCL_BACKEND", "") if gpus else "")
    if gpus == 1 and not backend:
        backend = "ipc"  # the one backend that moves KV between two caches of one GPU
    if args.transport == "nccl" and (gpus == 0 or (gpus == 1 and not backend.startswith("ipc"))):
        print("--transport nccl needs 2 CUDA GPUs, or 1 with --backend ipc (--transport tcp runs on the CPU)",
              file=sys.stderr)
        return 2

    tokens = [int(t) for t in (args.tokens or ("512,2048,8192" if args.transport == "nccl" else "512,2048")).split(",")]
    cfg = {"transport": args.transport, "tokens": tokens, "iters": args.iters, "warmup": args.warmup,
           "step_ms": args.step_ms, "prefill_ms": args.prefill_ms, "forward": args.forward, "inflight": args.inflight,
           "thread_cpu": args.thread_cpu, "backend": backend, "profile": args.profile,
           "p_cpus": args.p_cpus, "thread_cpus": args.thread_cpus, "claim_after_ms": args.claim_after_ms,
           "d_cycle": args.d_cycle, "step_on": args.step_on or ("host" if gpus == 1 else "gpu"),
           "log_format": args.log_format, "log_level": args.log_level,
           "num_blocks": (args.inflight + 1) * max(tokens) // BLOCK,
           "pool": args.inflight * max(tokens) // BLOCK * BLOCK_BYTES + (64 << 20)}
    if args.profile:
        os.makedirs(args.profile, exist_ok=True)
    broker, endpoint = _start_broker(args.broker_log_level)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    conn_p, conn_d = ctx.Pipe()
    procs = [ctx.Process(target=_prefill, args=(endpoint, conn_p, cfg)),
             ctx.Process(target=_decode, args=(endpoint, conn_d, cfg, results))]
    try:
        for proc in procs:
            with _bound_as_vllm_binds(args.p_cpus if proc is procs[0] else ""):
                proc.start()
        rows = results.get(timeout=600)
        for proc in procs:
            proc.join(timeout=60)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        broker.terminate()
        broker.wait(timeout=10)
    if isinstance(rows, str):
        print(f"D failed: {rows}", file=sys.stderr)
        return 1
    print(f"{'tokens':>7}{'inflight':>9}{'MiB':>7}{'raw ms':>9}{'connector ms':>14}{'min':>8}{'max':>8}{'x raw':>8}"
          f"{'prefill ms':>12}{'after it ms':>13}{'x raw':>8}{'stretch ms':>12}{'after end ms':>14}"
          f"{'seen waiting':>16}{'next step':>16}")
    for r in rows:
        print(f"{r['tokens']:>7}{r['inflight']:>9}{r['MiB']:>7.0f}{r['raw_ms']:>9.3f}{r['connector_ms']:>14.3f}"
              f"{r['connector_min_ms']:>8.3f}{r['connector_max_ms']:>8.3f}{r['vs_raw']:>8.3f}"
              f"{r['prefill_ms']:>12.3f}{r['after_prefill_ms']:>13.3f}{r['after_prefill_vs_raw'] or 0:>8.3f}"
              f"{r['forward_stretch_ms']:>12.3f}{r['after_forward_end_ms']:>14.3f}"
              f"{_seen(r['seen_waiting'], r['iters'], r['after_prefill_seen_waiting_ms']):>16}"
              f"{_seen(r['iters'] - r['seen_waiting'], r['iters'], r['after_prefill_next_step_ms']):>16}")
    print("P's sends started on D's receive, before their Go: "
          + ", ".join(f"{r['p_sent_on_receive']} of {r['p_sent']} at {r['tokens']}" for r in rows))
    if any(r["forward_beside_ms"] is not None for r in rows):
        print("P's next forward pass, while the transfers waited for D's claim, against alone (ms): "
              + ", ".join(f"{r['forward_beside_ms']:.3f} / {r['forward_alone_ms']:.3f} at {r['tokens']}" for r in rows))
    for r in rows:
        for side, key in (("P", "p_threads"), ("D", "d_threads")):
            if key not in r:
                continue
            print(f"\n{side}'s threads while {r['tokens']} tokens x {r['inflight']} were timed (median ms a request):")
            print(f"{'thread':<40}{'CPU':>9}{'runnable':>10}")
            for name, t in r[key].items():
                if t["cpu_ms"] >= 0.01:
                    print(f"{name:<40}{t['cpu_ms']:>9.3f}{t['runnable_ms']:>10.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": cfg, "rows": rows, "torch": torch.__version__,
                       "device": torch.cuda.get_device_name(0) if args.transport == "nccl" else "cpu"}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
