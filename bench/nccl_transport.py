"""End-to-end KV transfer over NCCL between two GPUs, against two baselines.

P runs on cuda:0 and D on cuda:1, in two processes. The KV is shaped like Llama-3-8B
(32 layers, 8 KV heads, head 128, bf16, 16-token blocks: 2 MiB per block, 128 KiB per
token). Each case is timed from P's clock start, taken right after both sides leave a
barrier, to D's clock end, taken when D sees its last GPU work done (both
`time.perf_counter`, i.e. CLOCK_MONOTONIC, one clock for all processes of a host).
Every case, the ceiling included, notices GPU completion the same way: by spinning on
a CUDA event (`Completion.wait` with an unbounded spin), so none is charged a
different polling delay.

* raw          one NCCL send/recv of the same bytes as one contiguous tensor, the
               receive posted before the clock starts: the ceiling.
* raw_sendrecv the same send/recv with both sides posting after the barrier, as two
               processes that call ncclSend and ncclRecv at the same moment do: the
               clock also holds D's post, as it does in every ours_* row.
* ours_full    END TO END, nothing done before the clock: P sends the Offer, then
               enqueues the first chunk's gather out of its paged cache (one kernel)
               while the Offer travels; D takes the Offer, leases pool room, sends
               Ready, then posts every chunk's receive and then the scatters into its
               paged blocks (chunk k's scatter waits for chunk k's receive); P waits
               for Ready, posts chunk 0's send (it waits for chunk 0's gather event),
               then for each further chunk enqueues its gather and posts its send.
               The clock stops when D's last scatter is done: gather + handshake round
               trip + send + receive + scatter, all on the clock.
* ours_expect  as ours_full, but D's Ready (credit granted, pool room leased) was
               given before the clock starts, as D's Expect does in vLLM while P still
               runs the prefill: the Offer is one way, P posts its sends without
               waiting (a send posted first waits on P's GPU for its receive), and D
               posts its receives when the Offer arrives. On the clock: gather +
               one-way Offer + send + receive + scatter.
* ours_staged  as ours_full with the gathers done before the clock (in vLLM
               `save_kv_layer` gathers each layer during the forward pass); the whole
               handshake round trip is still on the clock, after staging.
* ours_data    ours_staged without the handshake (D's receives posted before the
               clock): the data path alone.
* ours_full_1  ours_full in one chunk (no pipelining): what the pipelining buys.
* ours_overlap (with --broker) the connector's flow: P's Offer leaves through the real
               broker without waiting, then P's compute stream runs a forward pass
               (`--forward-ms` of GPU time), then the gathers and sends; D's Expect was
               sent before the clock. Its time is counted from the end of that forward
               pass (the clock's total less the forward's measured GPU time), against
               `raw_overlap`: raw's send posted after the same forward pass.
* ours_layerwise  vLLM's own flow (`--forward-ms` of real work): P offers at bind, then
               runs a forward pass of 32 layers of matmuls on its compute stream and, after
               each layer, gathers that layer's blocks on the stager's side stream
               (`Stager.gather_layer(side=True)`, overlapping the next layer's compute),
               fences its compute stream behind the gathers (`Stager.fence`), takes D's
               Ready (which came during the forward pass) and posts every chunk's send.
               Timed from the forward pass's start to D's last scatter, less the same
               forward pass timed alone: what the transfer adds to the request, including
               whatever the gathers take from the forward's compute. Against
               `raw_layerwise`: the same forward pass, then raw's send. `~inline` rows
               gather on the compute stream instead, in the forward pass's time.
* ours_landing ours_full, but D keeps a receive for the first chunk posted ahead of the
               transfer (a standing receive into its pool, posted before the clock): P
               sends the first chunk as soon as it is gathered and waits for Ready only
               before the second; D takes the Offer, sends Ready and posts the rest.
* ours_broker  (with --broker) ours_full with the pipe handshake replaced by the broker's
               own Offer -> Prepare -> Ready -> Go, through a real `kvbroker serve`
               process started for the run, each side a `SyncBrokerClient`; D's Expect
               is sent before the clock, Done and Release come after it.
* ipc@G        (with --ipc) not NCCL: a comparison for a transport this project does not
               have yet. D's KV cache is mapped into P's process once (CUDA IPC), and a
               transfer is one kernel on P (G programs) that copies P's blocks straight
               into D's blocks over NVLink: no staging, no scatter, no NCCL FIFO. On the
               clock: the Offer/Ready round trip (Ready would carry D's block ids), the
               kernel, and D seeing it done (an interprocess CUDA event). D zeroes its
               blocks before each transfer and compares a checksum after it.
* raw@N        (with --raw-splits N) raw's bytes as N equal ops (4 KiB-aligned) posted
               back to back, D's receives posted before the clock: what NCCL itself
               charges for each op a pipelined transfer adds.
* per_layer    vLLM's P2pNcclConnector pattern: for each layer, extract its blocks,
               a ZMQ PUT and its ack, one NCCL send and a stream synchronize; D
               allocates, receives and injects each layer.

Backends: every case runs over the transport's default communicator backend (the
"direct" NCCL binding where the library loads); rows suffixed `~torch` run the same case
over torch's ProcessGroupNCCL backend in the same run (`--backends`), and `raw~torch`
is the bare send posted through torch. `x raw` is always against `raw` on the default
backend, the faster ceiling.

P's gathers after the first chunk's, which overlap earlier chunks' sends, run on
grids sized to the rate each needs (`adaptive_gathers`, at most `--gather-programs`,
the transport's `GATHER_PROGRAMS`), and NCCL's stream has high priority. `~fixed` rows
run every such gather at the cap, `~capN` rows at N programs (`cap0`: full width);
`~lowprio` rows are the transport without any of it (NCCL at the default priority,
full-width gathers and scatters): what it buys. `~hot` rows (and their own `raw~hot`
ceiling) keep both processes spinning between and inside iterations instead of
sleeping on the barrier and the pipe: a busy engine rather than an idle one woken up. `~aheadN` rows enqueue N gathers
ahead of the sends (`NcclTransport.gather_and_send`'s lookahead); D's scatters (all but
the last two chunks') are capped too (`SCATTER_PROGRAMS`), `~scapN` rows at N instead; `~eager` rows post P's sends
without waiting for Ready (a send posted first waits on the GPU for its receive; the
broker would have to pin the route for that), `~asyncoffer` rows send P's Offer from a
helper thread, as a broker client's loop thread would, instead of on P's own; `~gfirst` rows
enqueue chunk 0's gather before the Offer leaves instead of after it; `~lateoffer` rows
(`ours_landing` and its sweeps) send P's Offer only after chunk 0's send is posted, so
no message is on the first chunk's path (D needs the Offer for chunk 1 on); `~ptrcheck` rows
(`ours_full` and `ours_data`) launch the copy kernels with tensors rather than their
pointers as ints, so the launcher asks the driver about each (`_Launcher.int_pointers`).
`~nostream` rows (`ours_full` and `ours_data`) copy without the kernel's streaming cache
hints (`PagedKv.streaming`).

`ours_full@F/L/G[/B]` rows use other chunkings (first chunk F MiB, last chunk L MiB,
growth G, back ramp growth B; `pipeline_bounds`; `--variants` apply to them too); `~gf` rows enqueue every chunk's gather before P waits for Ready
and then post all sends (the default interleaves gathers and sends, one chunk at a
time, after the first). The trace lines give, per case, the
median time after P's clock start at which each step happened: host steps as taken,
GPU steps from timing events mapped onto the host clock through an anchor event
synchronized before the barrier (good to about 10 us). Traced runs are separate from
the timed ones. For each prompt length the cases run in rounds, every case once per
round in an order shuffled anew each round, so the machine's drift over a run (seen at
+-5%) and what the case before leaves behind fall on all of them alike. The
`after N tokens:` lines split raw's and ours_full's iterations by the kind of case that
ran just before (a forward pass of matmuls, the per-layer pattern, torch's backend, a
plain transfer; `after` in each JSON row): where one kind moves ours more than raw.
The `quarters N tokens:` lines give ours_full against raw over each quarter of the
rounds (each JSON row keeps its iterations in round order, `ms_each`): whether the
ratio drifts within a run.

The handshake here is a pluggable `Handshake`; `PipeHandshake` is one round trip over
a multiprocessing pipe, each message a few bytes. `--profile` adds to the trace lines
the entry (`>N`) and exit (`<N`) of each call on the critical path, on both sides. The broker's Offer/Prepare/Ready/Go path adds about 0.1 ms
more; in vLLM it overlaps the forward pass unless the prompt is short.

Usage: python bench/nccl_transport.py [--tokens 512,2048,8192] [--iters 60] [--backends auto|direct,torch]
       [--gather-programs N] [--variants nostream,fixed,cap0,scap0,lowprio,hot] [--sweep F/L/G,...] [--diag]
       [--host-costs] [--profile] [--broker] [--ipc 132,...] [--raw-splits 2,4] [--cases raw,ours_full,...]
       [--repeat N]
       [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from workers.gpu_staging import PagedKv, StagedTransfer, Stager, pipeline_bounds, pipeline_defaults  # noqa: E402
from workers.pool import BufferPool  # noqa: E402
from workers.transports.nccl import GATHER_PROGRAMS, SCATTER_PROGRAMS  # noqa: E402

LAYERS, HEADS, DIM, BLOCK = 32, 8, 128, 16
DEADLINE_S = 30.0


class Handshake(Protocol):
    """P announces a transfer (`offer`, no wait) and later waits for D's go-ahead
    (`wait_ready`); D takes the offer (`accept`) and answers once its pool has room
    (`ready`). The broker's Offer -> Prepare -> Ready -> Go has this shape."""

    def offer(self, transfer_id: str, nbytes: int) -> None: ...

    def wait_ready(self, transfer_id: str) -> None: ...

    def accept(self) -> tuple[str, int]: ...

    def ready(self, transfer_id: str) -> None: ...


class PipeHandshake:
    """One control round trip over a `multiprocessing` connection, each message a few
    bytes (as a msgspec-encoded one would be; no pickling). With `spin` set, a receive
    polls the pipe instead of blocking in the kernel (a busy process)."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.spin = False

    def recv(self) -> bytes:
        if self.spin:
            deadline = _deadline()
            while not self.conn.poll(0):
                if time.monotonic() > deadline:
                    raise TimeoutError("the peer sent nothing within the deadline")
        return self.conn.recv_bytes()

    def offer(self, transfer_id: str, nbytes: int) -> None:
        self.conn.send_bytes(b"O" + nbytes.to_bytes(8, "little") + transfer_id.encode())

    def wait_ready(self, transfer_id: str) -> None:
        msg = self.recv()
        assert msg[:1] == b"R" and msg[1:].decode() == transfer_id, msg

    def accept(self) -> tuple[str, int]:
        msg = self.recv()
        assert msg[:1] == b"O", msg
        return msg[9:].decode(), int.from_bytes(msg[1:9], "little")

    def ready(self, transfer_id: str) -> None:
        self.conn.send_bytes(b"R" + transfer_id.encode())

    def done(self) -> None:
        self.conn.send_bytes(b"D")


class _Inbox:
    """A broker client's handler: every message into a queue the worker's thread reads."""

    def __init__(self) -> None:
        self.msgs: queue.SimpleQueue = queue.SimpleQueue()

    async def on_prepare(self, msg: Any) -> None:
        self.msgs.put(msg)

    on_go = on_release = on_abort = on_relay = on_prepare

    def next(self, kind: type, transfer_id: str | None = None) -> Any:
        msg = self.msgs.get(timeout=DEADLINE_S)
        assert isinstance(msg, kind) and transfer_id in (None, msg.transfer_id), f"wanted {kind.__name__}, got {msg}"
        return msg


class BrokerHandshake:
    """The broker's own path, through a real `kvbroker serve` process: P's Offer, the
    broker's Prepare to D, D's Ready, the broker's Go to P. Each side talks through a
    `SyncBrokerClient` (an event loop on a thread of its own), as the connector does.
    After the clock: D's Done, and the broker's Release to P."""

    def __init__(self, role: str, endpoint: str, pool_capacity: int) -> None:
        from protocols.messages import Register
        from workers.client import BrokerClient, ClientConfig, SyncBrokerClient

        self.inbox = _Inbox()
        decode = role == "D"
        reg = Register(role="decode" if decode else "prefill", instance_id="d" if decode else "p",
                       pool_capacity=pool_capacity if decode else 0, compat_hash="bench")
        self.sync = SyncBrokerClient(BrokerClient(ClientConfig(broker=endpoint), reg, self.inbox))
        self._sizes: dict[str, int] = {}

    def offer(self, transfer_id: str, nbytes: int) -> None:
        self.sync.offer(transfer_id, nbytes, decode="d")

    def offer_nowait(self, transfer_id: str, nbytes: int) -> None:
        """As the connector offers: handed to the client's loop, not waited for."""
        self.sync.portal.start_task_soon(self.sync.client.offer, transfer_id, nbytes, None, "d")

    def wait_ready(self, transfer_id: str) -> None:
        from protocols.messages import Go

        self.inbox.next(Go, transfer_id)

    def accept(self) -> tuple[str, int]:
        from protocols.messages import Prepare

        msg = self.inbox.next(Prepare)
        self._sizes[msg.transfer_id] = msg.nbytes
        return msg.transfer_id, msg.nbytes

    def ready(self, transfer_id: str) -> None:
        self.sync.call(self.sync.client.ready, transfer_id, self._sizes[transfer_id])

    def expect(self, transfer_id: str) -> None:
        self.sync.expect(transfer_id, prefill="p")

    def done(self, transfer_id: str) -> None:
        self.sync.call(self.sync.client.done, transfer_id, self._sizes.pop(transfer_id))

    def released(self, transfer_id: str) -> None:
        from protocols.messages import Release

        self.inbox.next(Release, transfer_id)


def _deadline() -> float:
    return time.monotonic() + DEADLINE_S


def _wait(done: Any) -> None:
    """Wait for a completion, spinning on its event: every case notices the end alike."""
    done.wait(_deadline(), spin_s=DEADLINE_S)


@dataclass(frozen=True)
class Case:
    """One timed configuration: `kind` says what is on the clock (see the module doc)."""

    kind: str
    label: str
    chunking: tuple[int, ...] | None = None  # (first MiB, last MiB, growth[, back growth]); None: one chunk
    order: str = "pc"  # P: "pc" gather and send chunk by chunk; "gf" all gathers, then all sends;
    # "pg" chunk 0's gather and send, then every other gather, then every other send
    backend: str | None = None  # None: the first of cfg["backends"]
    gather_programs: int | None = GATHER_PROGRAMS  # the grid cap of gathers that overlap the wire; None: full
    high_priority: bool = True  # NCCL's stream above the copies' (direct backend)
    lookahead: int = 0  # P: gathers enqueued ahead of the sends (`NcclTransport.gather_and_send`)
    scatter_programs: int | None = SCATTER_PROGRAMS  # D: grid cap of scatters that overlap receives
    adaptive: bool = True  # P: each later gather's grid sized to the rate it needs (`adaptive_gathers`)
    eager: bool = False  # P posts its sends without waiting for Ready (reads it afterwards)
    async_offer: bool = False  # P's Offer leaves from a helper thread, as a broker client's would
    gather_first: bool = False  # P enqueues chunk 0's gather before its Offer leaves (not after)
    late_offer: bool = False  # landing: P's Offer leaves after chunk 0's send is posted (D needs it for chunk 1 on)
    hot: bool = False  # both sides spin between and inside iterations instead of sleeping (`_Side.meet`)
    side_gathers: bool = True  # layerwise: each layer's gather on the stager's side stream (False: compute stream)
    programs: int = 132  # ipc: the copy kernel's grid
    splits: int = 1  # raw: the bytes as this many equal ops back to back (NCCL's own per-op cost)
    streaming: bool = True  # gathers and scatters with streaming cache hints (`PagedKv.streaming`)
    int_pointers: bool = True  # copy kernels launched with pointers as ints (`_Launcher.int_pointers`)
    recv_on_clock: bool = False  # raw: D posts its receive after the barrier, as P its send (not before)


class _Side:
    """One process's state: caches, pools, transport and the control links."""

    def __init__(self, role: str, dev: int, outbox: dict, inbox: dict, conn: Any, barrier: Any, cfg: dict) -> None:
        from workers.transports.nccl import CommunicatorCache, NcclTransport, QueueRendezvous

        torch.cuda.set_device(dev)
        self.role, self.conn, self.cfg = role, conn, cfg
        self.barrier, self.met = barrier[0], barrier[1]  # a sleeping barrier; two shared counters for `meet`
        self.generation = 0
        self.peer = "D" if role == "P" else "P"
        self.device = torch.device("cuda", dev)
        # One cache and transport per backend, each on its own rendezvous queues.
        # Payloads drained into memory by a thread, as the broker client's loop does in the
        # connector, so checking for a rebuild on each use is a dict lookup, not a pipe poll.
        self.caches = {b: CommunicatorCache(role, self.device, QueueRendezvous(outbox[b], inbox[b], drain_thread=True),
                                            capacity=2,
                                            backend=b) for b in cfg["backends"]}
        self.transports = {b: NcclTransport(c) for b, c in self.caches.items()}
        self.use(cfg["backends"][0])
        self.hs = PipeHandshake(conn)
        self.bhs: BrokerHandshake | None = None  # made in `connect` when cfg names a broker
        self._offers: queue.SimpleQueue | None = None  # async_offer: the sender thread's inbox
        nb = cfg["cache_blocks"]
        g = torch.Generator(device=self.device).manual_seed(dev)
        self.kv = [
            torch.randn(2, nb, BLOCK, HEADS, DIM, device=self.device, generator=g, dtype=torch.bfloat16)
            for _ in range(LAYERS)
        ]
        self.paged = PagedKv(self.kv)
        self.paged.precompile()  # else D's first scatter may compile while P waits for D at a barrier
        cap = max(cfg["max_blocks"] * self.paged.staged_block_nbytes, 1 << 20)
        self.pool = BufferPool(cap, device=self.device)
        self.stager = Stager(self.paged, self.pool)
        self.raw = torch.empty(cap, dtype=torch.uint8, device=self.device)
        self.comm_mem_mib: dict[str, float] = {}
        self.forward_cycles, self.forward_ms = 0, 0.0  # set by `_calibrate_forward`
        self.layer_reps, self.layers_ms = 1, 0.0  # set by `_calibrate_layers`

    def meet(self, hot: bool) -> None:
        """Wait until both sides get here: asleep on the barrier (an idle process woken
        up, as between requests), or hot: each side bumps its own counter and spins
        until the other's catches up (a busy process, as an engine in a batch is)."""
        if not hot:
            self.barrier.wait()
            return
        me = 0 if self.role == "P" else 1
        self.generation += 1
        self.met[me] = self.generation
        deadline = _deadline()
        while self.met[1 - me] < self.generation:
            if time.monotonic() > deadline:
                raise TimeoutError("the other side never reached the meeting point")

    def offer_async(self, tid: str, nbytes: int) -> None:
        """Hand the Offer to a sender thread (started on first use), as P's broker
        client would send it from its own loop thread."""
        if self._offers is None:
            self._offers = queue.SimpleQueue()
            threading.Thread(target=self._send_offers, args=(self._offers,), daemon=True).start()
        self._offers.put((tid, nbytes))

    def _send_offers(self, inbox: queue.SimpleQueue) -> None:
        while True:
            tid, nbytes = inbox.get()
            self.hs.offer(tid, nbytes)

    def use(self, backend: str | None) -> None:
        b = backend or self.cfg["backends"][0]
        self.cache, self.transport = self.caches[b], self.transports[b]

    def connect(self) -> None:
        if self.cfg.get("endpoint"):
            self.bhs = BrokerHandshake(self.role, self.cfg["endpoint"], self.pool.capacity)
        _calibrate_forward(self)
        _calibrate_layers(self)
        if self.cfg.get("ipc"):
            _ipc_setup(self)
        for b in self.cfg["backends"]:
            self.use(b)
            comm = self.cache.get(self.peer, initiator=self.role == "P")
            self.comm_mem_mib[b] = round(comm.mem_bytes / 2**20, 1)
            # One full-size exchange, posted by both sides at once, before anything is timed.
            if self.role == "P":
                _wait(self.transport.send_tensors("D", [self.raw]))
            else:
                _wait(self.transport.recv_tensors("P", [self.raw]))
        self.use(None)


_PROFILE: dict[str, Any] = {"stamps": None, "seen": {}}  # --profile: where the wrapped calls put their stamps


def _profiled(fn: Callable, label: str) -> Callable:
    """`fn`, stamping its entry (`label>N`) and exit (`label<N`) into the traced clock;
    N counts the calls of one iteration."""
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        stamps = _PROFILE["stamps"]
        if stamps is None:
            return fn(*args, **kwargs)
        n = _PROFILE["seen"][label] = _PROFILE["seen"].get(label, -1) + 1
        stamps[f"{label}>{n}"] = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            stamps[f"{label}<{n}"] = time.perf_counter()
    return wrapper


def _install_profile(side: _Side) -> None:
    """Wrap the calls on a transfer's critical path (both sides) for `_Clock`'s traces."""
    import workers.gpu_staging as gs
    import workers.transports.nccl as nt
    import workers.transports.nccl_comm as nc

    for cls, names in ((gs.Stager, ("begin", "gather_chunk")), (gs.PagedKv, ("copy_range",)),
                       (gs._Launcher, ("__call__",)), (nc.CommunicatorCache, ("get",)),
                       (nt.NcclTransport, ("send_staged", "recv_staged")),
                       (nc.DirectCommunicator, ("post", "post_range", "completion")), (PipeHandshake, ("offer", "wait_ready",
                                                                                         "accept", "ready"))):
        for name in names:
            setattr(cls, name, _profiled(getattr(cls, name), f"{cls.__name__}.{name}"))
    gs._record = _profiled(gs._record, "record")
    nt._now = _profiled(nt._now, "now")
    side.pool.acquire_nowait = _profiled(side.pool.acquire_nowait, "acquire")  # type: ignore[method-assign]
    for comm in side.cache._comms.values() if hasattr(side.cache, "_comms") else ():
        lib = getattr(comm, "lib", None)
        if lib is not None and not getattr(lib, "_profiled", False):
            for name in ("group_start", "send", "recv", "group_end"):
                setattr(lib, name, _profiled(getattr(lib, name), f"nccl.{name}"))
            lib._profiled = True


class _Clock:
    """Host stamps of one iteration and, when tracing, the GPU events mapped onto them."""

    def __init__(self, side: _Side, tracing: bool) -> None:
        self.side, self.tracing = side, tracing
        self.stamps: dict[str, float] = {}
        if tracing and side.cfg.get("profile"):
            _PROFILE["stamps"], _PROFILE["seen"] = self.stamps, {}
        self.anchor: tuple[torch.cuda.Event, float] | None = None
        side.transport.trace = [] if tracing else None
        if tracing:  # a GPU event whose host time is known to a few microseconds
            torch.cuda.synchronize(side.device)
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            while not ev.query():
                pass
            self.anchor = (ev, time.perf_counter())

    def mark(self, label: str) -> None:
        if self.tracing:
            self.stamps[label] = time.perf_counter()

    def gpu(self, label: str) -> None:
        """A timing event at the current stream's tail (P's gathers run there)."""
        if self.tracing:
            self.side.transport._mark(torch.cuda.current_stream(), label)

    def collect(self) -> dict[str, float]:
        _PROFILE["stamps"] = None
        tr = self.side.transport
        if self.anchor is not None and tr.trace is not None:
            ev0, t0 = self.anchor
            for label, ev in tr.trace:
                ev.synchronize()
                self.stamps[label] = t0 + ev0.elapsed_time(ev) / 1e3
        tr.trace = None
        return self.stamps


def _forward(side: _Side) -> None:
    """P's forward pass: `--forward-ms` of GPU time on the compute stream (a spin kernel)."""
    torch.cuda._sleep(side.forward_cycles)


def _calibrate_forward(side: _Side) -> None:
    """Cycles of `torch.cuda._sleep` for the configured forward pass, and the GPU time
    it then takes (the median of 5, by events)."""
    want = side.cfg.get("forward_ms", 3.0)
    side.forward_cycles, side.forward_ms = int(want * 1e6), want  # ~1 GHz first guess
    times = []
    for _ in range(6):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        _forward(side)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
        side.forward_cycles = int(side.forward_cycles * want / max(times[-1], 1e-3))
    side.forward_ms = statistics.median(times[1:])


def _layer(side: _Side) -> None:
    """One layer of P's layerwise forward pass: bf16 matmuls on the compute stream."""
    for _ in range(side.layer_reps):
        torch.mm(side.mm[0], side.mm[1], out=side.mm[2])


def _layers_forward(side: _Side) -> None:
    for _ in range(LAYERS):
        _layer(side)


def _calibrate_layers(side: _Side) -> None:
    """Matmuls per layer for a `--forward-ms` forward pass of `LAYERS` layers, and the GPU
    time that pass then takes alone (the median of 5, by events): what the layerwise
    rows subtract."""
    g = torch.Generator(device=side.device).manual_seed(7)
    a = torch.randn(2048, 4096, device=side.device, dtype=torch.bfloat16, generator=g)
    w = torch.randn(4096, 4096, device=side.device, dtype=torch.bfloat16, generator=g)
    side.mm = (a, w, torch.empty(2048, 4096, device=side.device, dtype=torch.bfloat16))

    def timed(fn: Callable[[], None]) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    side.layer_reps = 1
    one = statistics.median(timed(lambda: _layer(side)) for _ in range(12))
    side.layer_reps = max(1, round(side.cfg.get("forward_ms", 3.0) / LAYERS / one))
    side.layers_ms = statistics.median(timed(lambda: _layers_forward(side)) for _ in range(6))


def _nccl_priority(side: _Side, high: bool) -> None:
    """Run the direct communicator's ops on a high- or a default-priority stream (the
    `~lowprio` variant shows what the transport's high priority buys)."""
    comm = side.cache.get(side.peer, initiator=side.role == "P")
    if not hasattr(comm, "nccl_stream"):
        return
    streams = side.__dict__.setdefault("_nccl_streams", {})
    if not streams:
        streams[True] = comm.nccl_stream
        streams[False] = torch.cuda.Stream(side.device, priority=0)
    comm.nccl_stream = streams[high]
    comm._stream_ptr = comm.nccl_stream.cuda_stream


def _ids(side: _Side, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(side.cfg["cache_blocks"], generator=g)[:n]


def _bounds(side: _Side, case: Case, n: int) -> list[int] | None:
    if case.chunking is None:
        return None
    first, last, growth, *back = case.chunking
    return pipeline_bounds(n, side.paged.staged_block_nbytes, first_nbytes=first << 20, last_nbytes=last << 20,
                           growth=growth, back_growth=back[0] if back else None)


def _rounds(side: _Side, cases: list[Case], tokens: int, iters: int, tracing: bool) -> dict[str, list[dict]]:
    """Run `cases` for one prompt length in rounds (each round runs every case once, in
    an order shuffled anew each round, the same on both sides), so drift of the machine
    over the run, and what the case before leaves behind, fall on all cases alike;
    returns each case's per-iteration stamps on this side."""
    n = tokens // BLOCK
    p_ids = side.paged.block_ids(_ids(side, n, 1))
    d_ids = side.paged.block_ids(_ids(side, n, 2))
    nbytes = n * side.paged.staged_block_nbytes
    bounds = {case.label: _bounds(side, case, n) for case in cases}
    out: dict[str, list[dict]] = {case.label: [] for case in cases}
    warmup = 0 if tracing else side.cfg["warmup"]
    repeat = max(1, side.cfg.get("repeat", 1))  # --repeat: each case this many times in a row, the last kept
    prev: str | None = None  # the case run just before (its label): `_by_predecessor`
    for it in range(warmup + iters):
        # A new order each round, seeded alike on both sides: a rotation would keep every
        # case right after the same one, and `ours_full` always ran right after `raw`.
        order = list(cases)
        random.Random(tokens * 100_003 + it).shuffle(order)
        for case in order:
            side.use(case.backend)
            side.transport.gather_programs = case.gather_programs
            side.transport.lookahead = case.lookahead
            side.transport.scatter_programs = case.scatter_programs
            side.transport.adaptive_gathers = case.adaptive
            side.paged.streaming = case.streaming
            if side.paged._launch is not None:
                side.paged._launch.int_pointers = case.int_pointers
            _nccl_priority(side, case.high_priority)
            side.hs.spin = case.hot
            for rep in range(repeat):  # the last run is the one kept
                clock = _Clock(side, tracing)
                tid = f"{case.label}-{it}-{rep}"
                if side.role == "P":
                    _p_iter(side, case, p_ids, nbytes, bounds[case.label], tid, clock)
                else:
                    _d_iter(side, case, d_ids, nbytes, bounds[case.label], tid, clock)
            stamps = clock.collect()
            if it >= warmup:
                if not tracing:  # timed stamps are read for t0 and t1 only
                    stamps["prev"] = prev if repeat == 1 else case.label  # type: ignore[assignment]
                out[case.label].append(stamps)
            prev = case.label
    side.use(None)
    return out


def _gather_and_send(
    side: _Side, staged: StagedTransfer, bounds: list[int] | None, tid: str, order: str,
    wait: Callable[[], None] | None, clock: _Clock, ready_at: int = 0,
    first_gathered: Callable[[], None] | None = None, first_sent: Callable[[], None] | None = None,
) -> Any:
    """P's pipeline: gathers on the compute stream, each send after its gather's event.

    "pc": gather chunk 0, wait for Ready, post send 0, then gather and post chunk by
    chunk (each host step overlaps the previous chunk's send). "gf": every gather,
    then Ready, then every send. "pg": gather chunk 0, Ready, send 0, then the other
    gathers, then the other sends (each still waits for its own gather's event).
    """
    ends = bounds or [staged.num_blocks]
    tr = side.transport
    if order == "pg":
        side.stager.gather_chunk(staged, ends[0])
        if first_gathered is not None:
            first_gathered()
        clock.gpu(f"gather@{ends[0]}")
        clock.mark("gather0_enqueued")
        if wait is not None:
            wait()
            clock.mark("ready_seen")
        done = tr.send_staged("D", staged, last_block=ends[0], transfer_id=tid)
        clock.mark("send0_posted")
        if len(ends) == 1:
            return done
        for end in ends[1:]:
            side.stager.gather_chunk(staged, end, programs=tr.gather_programs)
            clock.gpu(f"gather@{end}")
        clock.mark("gathers_enqueued")
        return tr.send_staged("D", staged, first_block=ends[0], bounds=[e - ends[0] for e in ends[1:]],
                              transfer_id=tid)
    if order == "gf":
        for k, end in enumerate(ends):
            side.stager.gather_chunk(staged, end, programs=None if k == 0 else tr.gather_programs)
            if k == 0 and first_gathered is not None:
                first_gathered()
            clock.gpu(f"gather@{end}")
        clock.mark("gathers_enqueued")
        if wait is not None:
            wait()
            clock.mark("ready_seen")
        return tr.send_staged("D", staged, bounds=ends, transfer_id=tid)

    def step(what: str, end: int) -> None:
        if what == "gather" and end == ends[0] and first_gathered is not None:
            first_gathered()
        if what == "gather":
            clock.gpu(f"gather@{end}")
        if end == ends[0]:
            clock.mark("gather0_enqueued" if what == "gather" else "send0_posted")
        if what == "send" and end == ends[0] and first_sent is not None:
            first_sent()

    def ready() -> None:
        if wait is not None:
            wait()
            clock.mark("ready_seen")

    return tr.gather_and_send("D", side.stager, staged, bounds=bounds, before_send=ready, transfer_id=tid,
                              on_step=step, ready_at=ready_at)


def _p_iter(side: _Side, case: Case, ids: torch.Tensor, nbytes: int, bounds: Any, tid: str, clock: _Clock) -> None:
    tr, kind = side.transport, case.kind
    staged = None
    if kind in ("staged", "data"):
        staged = side.stager.stage(ids, bounds=bounds)
        torch.cuda.synchronize()
    if kind == "expect":
        side.hs.wait_ready(tid)  # D's grant, given while P would still be running the prefill
    side.meet(case.hot)
    clock.stamps["t0"] = time.perf_counter()
    done = None
    if kind == "raw" and case.splits > 1:
        done = _raw_split(side, "send", nbytes, case.splits, tid)
    elif kind == "raw":
        done = tr.send_tensors("D", [side.raw[:nbytes]])
    elif kind == "raw_overlap":
        _forward(side)
        done = tr.send_tensors("D", [side.raw[:nbytes]])  # after the forward pass, in stream order
    elif kind == "overlap":
        assert side.bhs is not None
        side.bhs.offer_nowait(tid, nbytes)
        _forward(side)
        staged = side.stager.begin(ids)
        done = _gather_and_send(side, staged, bounds, tid, case.order, lambda: side.bhs.wait_ready(tid), clock)
    elif kind == "raw_layerwise":
        _layers_forward(side)
        done = tr.send_tensors("D", [side.raw[:nbytes]])  # after the forward pass, in stream order
    elif kind == "layerwise":
        side.hs.offer(tid, nbytes)  # at bind, before the forward pass
        clock.mark("offer_sent")
        staged = side.stager.begin(ids)
        for layer in range(LAYERS):
            _layer(side)
            side.stager.gather_layer(staged, layer, side=case.side_gathers)
        side.stager.fence(staged)  # the next step may write these blocks only after the gathers
        clock.gpu("forward_done")
        clock.mark("forward_enqueued")
        side.hs.wait_ready(tid)
        clock.mark("ready_seen")
        done = tr.send_staged("D", staged, bounds=bounds, transfer_id=tid)
    elif kind == "ipc":
        side.hs.offer(tid, nbytes)
        side.hs.wait_ready(tid)  # in a real protocol Ready would carry D's block ids
        clock.mark("ready_seen")
        _ipc_copy(side, ids, case.programs)
        side.ipc_event.record()
        side.conn.send_bytes(b"K" + side.ipc_checksum(ids))
        clock.mark("kernel_launched")
    elif kind == "per_layer":
        _per_layer_p(side, ids)
    elif kind in ("full", "expect", "broker", "landing"):
        hs = side.bhs if kind == "broker" else side.hs
        assert hs is not None

        def offer() -> None:
            if case.async_offer:
                side.offer_async(tid, nbytes)
            else:
                hs.offer(tid, nbytes)
            clock.mark("offer_sent")

        if not case.gather_first and not case.late_offer:
            offer()  # leaves first: the round trip overlaps the first gather's launch and run
        staged = side.stager.begin(ids)
        wait = (lambda: hs.wait_ready(tid)) if kind in ("full", "broker", "landing") and not case.eager else None
        done = _gather_and_send(side, staged, bounds, tid, case.order, wait, clock, ready_at=int(kind == "landing"),
                                first_gathered=offer if case.gather_first else None,
                                first_sent=offer if case.late_offer else None)
        if kind == "landing" and len(bounds or [0]) == 1:
            hs.wait_ready(tid)  # one chunk: it went without Ready, which is read now
        if kind == "full" and case.eager:
            side.hs.wait_ready(tid)  # the sends already wait on the GPU for D's receives
            clock.mark("ready_seen")
    elif kind == "staged":
        assert staged is not None
        side.hs.offer(tid, nbytes)
        side.hs.wait_ready(tid)
        clock.mark("ready_seen")
        done = tr.send_staged("D", staged, bounds=bounds, transfer_id=tid)
    else:  # data
        assert staged is not None
        done = tr.send_staged("D", staged, bounds=bounds, transfer_id=tid)
    clock.mark("sends_posted")
    if done is not None:
        _wait(done)
        clock.mark("sends_done")
    if kind in ("broker", "overlap"):
        side.bhs.released(tid)  # after D's Done: outside the clock, like the release itself
    if staged is not None:
        staged.release()
    assert side.hs.recv() == b"D"  # D finished; keeps iterations apart


def _raw_split(side: _Side, op: str, nbytes: int, splits: int, tid: str) -> Any:
    """Raw's bytes as `splits` equal ops posted back to back on one communicator, the
    first after the current stream's tail: what NCCL alone charges per extra op."""
    tr = side.transport
    comm = tr.cache.get(side.peer, initiator=op == "send")
    size = nbytes // splits // 4096 * 4096  # aligned: NCCL copies a misaligned buffer much slower
    ends = [size * (k + 1) if k < splits - 1 else nbytes for k in range(splits)]
    after = torch.cuda.Event()
    after.record()
    works = [comm.post_range(op, side.raw, start, end - start, tr.stream, after if k == 0 else None)
             for k, (start, end) in enumerate(zip([0] + ends[:-1], ends))]
    return tr._finish(comm, works, tr.stream, op, tid, ends=ends)


def _d_iter(side: _Side, case: Case, ids: torch.Tensor, nbytes: int, bounds: Any, tid: str, clock: _Clock) -> None:
    tr, kind = side.transport, case.kind
    done = lease = None
    posted: list[Any] = []
    if kind == "raw" and case.splits > 1:
        done = _raw_split(side, "recv", nbytes, case.splits, tid)
    elif kind in ("raw", "raw_overlap", "raw_layerwise") and not case.recv_on_clock:
        done = tr.recv_tensors("P", [side.raw[:nbytes]])
    elif kind == "data":
        lease = side.pool.acquire_nowait(nbytes)
        done = tr.recv_staged("P", lease, side.paged, ids, bounds=bounds)
    elif kind == "expect":  # the Expect: credit and pool room granted before P finishes
        lease = side.pool.acquire_nowait(nbytes)
        side.hs.ready(tid)
    elif kind in ("broker", "overlap"):  # D holds the request before P finishes, as in vLLM
        side.bhs.expect(tid)
    elif kind == "landing":  # the standing receive for the next transfer's first chunk
        lease = side.pool.acquire_nowait(nbytes)
        first = (bounds or [ids.numel()])[0] * side.paged.staged_block_nbytes
        comm = side.cache.get("P", initiator=False)
        posted = [comm.post_range("recv", lease.base, lease.offset, first, tr.stream)]
    elif kind == "ipc":  # so a copy that did not happen cannot pass the checksum
        for layer in side.kv:
            layer[:, ids] = 0
        torch.cuda.synchronize()
    side.meet(case.hot)
    clock.mark("barrier_left")
    if kind == "raw" and case.recv_on_clock:
        done = tr.recv_tensors("P", [side.raw[:nbytes]])
        clock.mark("all_posted")
    if kind == "per_layer":
        _per_layer_d(side, ids)
    elif kind == "ipc":
        got, _ = side.hs.accept()
        side.hs.ready(got)
        msg = side.hs.recv()
        assert msg[:1] == b"K", msg
        deadline = _deadline()
        while not side.ipc_event.query():
            if time.monotonic() > deadline:
                raise TimeoutError("P's copy kernel never finished")
        clock.stamps["t1"] = time.perf_counter()
        side.ipc_bad += msg[1:] != side.ipc_checksum(ids, fresh=True)
    elif done is None:
        hs = side.bhs if kind in ("broker", "overlap") else side.hs
        got, size = hs.accept()
        clock.mark("offer_seen")
        if lease is None or kind == "landing":
            lease = lease or side.pool.acquire_nowait(size)
            hs.ready(got)  # before posting: P's posting then overlaps ours
            clock.mark("ready_sent")
        done = tr.recv_staged("P", lease, side.paged, ids, bounds=bounds, transfer_id=got, posted=posted)
        clock.mark("all_posted")
    if done is not None:
        _wait(done)
    clock.stamps.setdefault("t1", time.perf_counter())
    if lease is not None:
        lease.release()
    if kind in ("broker", "overlap"):
        side.bhs.done(tid)
    side.hs.done()


# -- a direct CUDA IPC write, for comparison ---------------------------------------------

_IPC_KERNEL: list[Any] = []


def _ipc_kernel() -> Any:
    """The block-to-block copy kernel (made on first use: Triton only on the GPU host)."""
    if not _IPC_KERNEL:
        import triton
        import triton.language as tl

        @triton.jit
        def copy_blocks(src_ptrs, src_ids, dst_ptrs, dst_ids, n_src, n_dst, rows, ROW: tl.constexpr,
                        NUM_LAYERS: tl.constexpr, PRE: tl.constexpr, BLOCK: tl.constexpr):
            # Row r is (request block i, layer, pre p), as in the staging kernel; each
            # program copies rows r, r + G, ... from P's cache into D's, over NVLink.
            for r in tl.range(tl.program_id(0), rows, tl.num_programs(0)):
                row = r.to(tl.int64)
                i = row // (NUM_LAYERS * PRE)
                layer = (row // PRE) % NUM_LAYERS
                p = row % PRE
                src = tl.load(src_ptrs + layer).to(tl.pointer_type(tl.int64))
                dst = tl.load(dst_ptrs + layer).to(tl.pointer_type(tl.int64))
                src += (p * n_src + tl.load(src_ids + i).to(tl.int64)) * ROW
                dst += (p * n_dst + tl.load(dst_ids + i).to(tl.int64)) * ROW
                for start in tl.range(0, ROW, BLOCK):
                    offs = start + tl.arange(0, BLOCK)
                    mask = offs < ROW
                    tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)

        _IPC_KERNEL.append(copy_blocks)
    return _IPC_KERNEL[0]


def _cudart() -> Any:
    """The CUDA runtime library torch loaded (for cudaIpcOpenMemHandle on a chosen device)."""
    import ctypes

    with open("/proc/self/maps") as f:
        paths = sorted({line.split()[-1] for line in f if "libcudart" in line and line.split()[-1].startswith("/")})
    if not paths:
        raise RuntimeError("torch has not loaded libcudart")
    return ctypes.CDLL(paths[0])


def _ipc_setup(side: _Side) -> None:
    """D maps its cache layers into P's process (CUDA IPC handles over the pipe, opened on
    P's own device so P's kernels reach them over NVLink); P shares an interprocess event
    that D polls for the end."""
    import ctypes

    side.ipc_bad = 0
    if side.role == "D":
        shared = []
        for t in side.kv:
            info = t.untyped_storage()._share_cuda_()  # (device, handle, size, offset, ...)
            handle = bytes(info[1])
            if len(handle) == 66 and handle[1:2] == b"c":  # torch's version byte, then 'c' for a cudaMalloc block
                handle = handle[2:]
            if len(handle) != 64:
                raise RuntimeError(f"not a cudaMalloc IPC handle ({len(handle)} bytes, {handle[:1]!r})")
            shared.append((handle, int(info[3]) + t.storage_offset() * t.element_size()))
        side.conn.send(shared)
        side.ipc_event = torch.cuda.Event.from_ipc_handle(torch.device("cuda", 0), side.conn.recv())
        peer_ids = None
    else:
        class Handle(ctypes.Structure):
            _fields_ = [("reserved", ctypes.c_char * 64)]

        rt = _cudart()
        rt.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(ctypes.c_void_p), Handle, ctypes.c_uint]
        ptrs, opened = [], {}
        torch.cuda.set_device(side.device)
        for handle, offset in side.conn.recv():
            if handle not in opened:  # layers may share one allocation: open each once
                h = Handle()
                ctypes.memmove(ctypes.addressof(h), handle, 64)
                ptr = ctypes.c_void_p()
                err = rt.cudaIpcOpenMemHandle(ctypes.byref(ptr), h, 1)  # cudaIpcMemLazyEnablePeerAccess
                if err:
                    raise RuntimeError(f"cudaIpcOpenMemHandle failed with CUDA error {err}")
                opened[handle] = int(ptr.value)
            ptrs.append(opened[handle] + offset)
        side.ipc_dst = torch.tensor(ptrs, dtype=torch.int64, device=side.device)
        side.ipc_event = torch.cuda.Event(interprocess=True)
        side.conn.send(side.ipc_event.ipc_handle())
        peer_ids = side.paged.block_ids(_ids(side, side.cfg["max_blocks"], 2))  # D's blocks, as `_rounds` picks them
    side.ipc_peer_ids = peer_ids

    sums: dict[tuple[int, int], bytes] = {}

    def checksum(ids: torch.Tensor, *, fresh: bool = False) -> bytes:
        # P's blocks never change, so P sums them once per request (in a warm-up round);
        # D sums what landed, after its clock stopped.
        key = (ids.data_ptr(), ids.numel())
        if fresh or key not in sums:
            sums[key] = repr(sum(float(layer[:, ids].double().sum()) for layer in side.kv)).encode()
        return sums[key]

    side.ipc_checksum = checksum


def _ipc_copy(side: _Side, ids: torch.Tensor, programs: int) -> None:
    paged, n = side.paged, ids.numel()
    dst_ids = side.ipc_peer_ids[:n]
    rows = n * paged.num_layers * paged.pre
    _ipc_kernel()[(min(rows, programs),)](
        paged._layer_ptrs, ids, side.ipc_dst, dst_ids, paged.num_blocks, paged.num_blocks, rows,
        ROW=paged.row_words, NUM_LAYERS=paged.num_layers, PRE=paged.pre, BLOCK=min(paged.row_words, 4096),
        num_warps=8)


# -- the P2pNcclConnector pattern --------------------------------------------------------


def _per_layer_p(side: _Side, ids: torch.Tensor) -> None:
    import msgpack

    sock = side.zmq_sock  # type: ignore[attr-defined]
    for layer in range(LAYERS):
        kv = side.kv[layer][:, ids]  # extract_kv_from_layer: a contiguous copy of the blocks
        ev = torch.cuda.Event()
        ev.record()
        sock.send(msgpack.packb({"cmd": "PUT", "tensor_id": f"req#{layer}", "shape": list(kv.shape),
                                 "dtype": "bfloat16"}))
        assert sock.recv() == b"0"
        _wait(side.transport.send_tensors("D", [kv], after=[ev]))  # send + synchronize


def _per_layer_d(side: _Side, ids: torch.Tensor) -> None:
    import msgpack

    sock = side.zmq_sock  # type: ignore[attr-defined]
    for layer in range(LAYERS):
        ident, frame = sock.recv_multipart()
        msg = msgpack.unpackb(frame)
        buf = torch.empty(msg["shape"], dtype=getattr(torch, msg["dtype"]), device=side.device)
        sock.send_multipart([ident, b"0"])
        _wait(side.transport.recv_tensors("P", [buf]))
        torch.cuda.current_stream().wait_stream(side.transport.stream)
        side.kv[layer][:, ids] = buf  # inject into D's paged cache
    torch.cuda.current_stream().synchronize()


def _zmq_setup(side: _Side) -> None:
    import zmq

    ctx = zmq.Context.instance()
    if side.role == "D":
        sock = ctx.socket(zmq.ROUTER)
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        side.conn.send(port)
    else:
        sock = ctx.socket(zmq.DEALER)
        sock.connect(f"tcp://127.0.0.1:{side.conn.recv()}")
    side.zmq_sock = sock  # type: ignore[attr-defined]


# -- micro measurements -----------------------------------------------------------------


def _rtt_us(side: _Side, rounds: int = 200) -> dict[str, float]:
    """Median control round trips: the pipe handshake and a ZMQ PUT/ack."""
    out: dict[str, float] = {}
    for kind in ("pipe", "zmq"):
        samples = []
        for _ in range(rounds):
            if side.role == "P":
                t = time.perf_counter()
                if kind == "pipe":
                    side.hs.offer("x", 1)
                    side.hs.wait_ready("x")
                else:
                    side.zmq_sock.send(b"ping")  # type: ignore[attr-defined]
                    side.zmq_sock.recv()  # type: ignore[attr-defined]
                samples.append((time.perf_counter() - t) * 1e6)
            elif kind == "pipe":
                tid, _ = side.hs.accept()
                side.hs.ready(tid)
            else:
                ident, _ = side.zmq_sock.recv_multipart()  # type: ignore[attr-defined]
                side.zmq_sock.send_multipart([ident, b"0"])  # type: ignore[attr-defined]
        if samples:
            out[f"{kind}_rtt_us"] = round(statistics.median(samples), 1)
    return out


def _copy_rates(side: _Side, tokens: int) -> dict[str, float]:
    """Gather and scatter GB/s on one GPU, Triton (one kernel) and per-layer index_select."""
    n = tokens // BLOCK
    ids = side.paged.block_ids(_ids(side, n, 1))
    out = {}
    buf = side.paged.staging_view(side.raw, n)
    kinds = [("per_layer", PagedKv(side.kv, use_triton=False), None)]
    if side.paged.use_triton:
        kinds = [("triton", side.paged, None)] + [(f"triton{c}", side.paged, c) for c in (16, 32, 64, 128)] + kinds
    for label, paged, programs in kinds:
        for op in ("gather", "scatter"):
            fn = getattr(paged, op)
            kw = {"programs": programs} if programs else {}
            fn(ids, buf, **kw)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            times = []
            for _ in range(10):
                start.record()
                fn(ids, buf, **kw)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            ms = statistics.median(times)
            out[f"{op}_{label}_GBps"] = round(n * side.paged.staged_block_nbytes / ms / 1e6, 1)
            out[f"{op}_{label}_ms"] = round(ms, 3)
    return out


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _host_costs(side: _Side, rounds: int = 8) -> dict[str, Any]:
    """Median host microseconds of the steps before P's first byte leaves, split up.

    "hot": the posting thread spun for 2 ms first (a busy process, as P is while it
    runs the model); "cold": it slept 5 ms first (as the benchmark's P does between
    iterations, blocked on its barrier). D posts each matching receive; only P times.
    Posts: `send_tensors` whole, and its bare NCCL group (default backend); and torch's
    coalesced send when the torch backend runs. Launches: `Stager.begin`, then a chunk's
    gather through `gather_chunk`, `PagedKv.copy_range` (the kept compiled kernel) and
    Triton's own launch path; one event record. `fast_launch` says whether the kept
    kernel is in use (see `workers.gpu_staging._Launcher`).
    """
    out: dict[str, list[float]] = {}

    def rec(key: str, *stamps: float) -> None:
        out.setdefault(key, []).append((stamps[-1] - stamps[0]) * 1e6)

    def settle(mode: str) -> None:
        if mode == "hot":
            _spin(0.002)
        else:
            time.sleep(0.005)

    from workers.gpu_staging import _copy_rows_kernel

    x = side.raw[: 128 << 20]
    posts = [("post", side.transports[side.cfg["backends"][0]])]
    if "torch" in side.transports and side.cfg["backends"][0] != "torch":
        posts.append(("torchpost", side.transports["torch"]))
    for name, tr in posts:
        comm = tr.cache.get(side.peer, initiator=side.role == "P")
        for mode in ("hot", "cold"):
            for bare in (False, True):
                for _ in range(rounds):
                    side.barrier.wait()
                    settle(mode)
                    if side.role == "D":
                        _wait(tr.recv_tensors("P", [x]))
                        continue
                    t0 = time.perf_counter()
                    if not bare:
                        done = tr.send_tensors("D", [x])
                        rec(f"{mode}_{name}_send_tensors_us", t0, time.perf_counter())
                    elif hasattr(comm, "lib"):  # the bare NCCL group, no torch around it
                        comm.lib.group_start()
                        comm.lib.send(x.data_ptr(), x.numel(), comm.peer_rank, comm.handle, comm._stream_ptr)
                        comm.lib.group_end()
                        rec(f"{mode}_{name}_bare_group_us", t0, time.perf_counter())
                        done = comm.completion([], comm.nccl_stream, "send")
                    else:
                        with torch.cuda.stream(tr.stream):
                            comm.pg._start_coalescing()
                            comm.pg.send([x], 1, 0)
                            work = comm.pg._end_coalescing()
                        rec(f"{mode}_{name}_bare_group_us", t0, time.perf_counter())
                        done = comm.completion([work], tr.stream, "send")
                    _wait(done)
    if side.role == "P":
        ids = side.paged.block_ids(_ids(side, 64, 1))  # on the GPU already, as in the timed cases
        words = side.paged.staging_view(side.raw, 32)
        for mode in ("hot", "cold"):
            for _ in range(rounds):
                torch.cuda.synchronize()
                settle(mode)
                t0 = time.perf_counter()
                staged = side.stager.begin(ids)
                t1 = time.perf_counter()
                side.stager.gather_chunk(staged, 32)
                t2 = time.perf_counter()
                side.paged.copy_range(ids, words, 0, 32, to_staging=True)
                t3 = time.perf_counter()
                paged = side.paged
                _copy_rows_kernel[(32 * LAYERS * paged.pre,)](  # Triton's own launch path, for comparison
                    paged._layer_ptrs, ids, words, paged.num_blocks, 0, 32 * LAYERS * paged.pre, 0, 0,
                    ROW=paged.row_words, NUM_LAYERS=LAYERS, PRE=paged.pre, BLOCK=paged._block, TO_STAGING=True,
                    STREAM=paged.streaming, ONE_LAYER=False, num_warps=8)
                t4 = time.perf_counter()
                ev = torch.cuda.Event()
                ev.record(torch.cuda.current_stream(side.device))
                t5 = time.perf_counter()
                rec(f"{mode}_stager_begin_us", t0, t1)
                rec(f"{mode}_gather_chunk_us", t1, t2)
                rec(f"{mode}_copy_range_us", t2, t3)
                rec(f"{mode}_triton_launch_us", t3, t4)
                rec(f"{mode}_event_record_us", t4, t5)
                torch.cuda.synchronize()
                staged.release()
    res: dict[str, Any] = {k: round(statistics.median(v), 1) for k, v in out.items()}
    res["fast_launch"] = bool(side.paged._launch and side.paged._launch.fast)
    return res


# -- driver ------------------------------------------------------------------------------

TRACED = ["raw", "raw_sendrecv", "ours_full", "ours_expect", "ours_staged", "ours_data", "ours_broker", "ours_landing",
          "ours_overlap", "raw_overlap", "ours_layerwise", "raw_layerwise"]
TARGETS = {  # (case, tokens, against): at least this
    ("ours_full", 2048, "vs_raw"): 0.90,
    ("ours_full", 8192, "vs_raw"): 0.95,
    ("ours_full", 512, "vs_per_layer"): 3.0,
}


def _default_chunking() -> tuple[int, int, int, int]:
    d = pipeline_defaults()
    return d["first_nbytes"] >> 20, d["last_nbytes"] >> 20, d["growth"], d["back_growth"] or d["growth"]


def _cases(cfg: dict) -> dict[str, Case]:
    chunk = (cfg["first_mib"], cfg["last_mib"], cfg["growth"], cfg["back_growth"])
    cap = cfg["gather_programs"]
    cases = {
        "raw": Case("raw", "raw"),
        "raw_sendrecv": Case("raw", "raw_sendrecv", recv_on_clock=True),
        "ours_full": Case("full", "ours_full", chunk, cfg["order"], gather_programs=cap),
        "ours_expect": Case("expect", "ours_expect", chunk, cfg["order"], gather_programs=cap),
        "ours_staged": Case("staged", "ours_staged", chunk, gather_programs=cap),
        "ours_data": Case("data", "ours_data", chunk, gather_programs=cap),
        "ours_full_1": Case("full", "ours_full_1", None, cfg["order"], gather_programs=cap),
        **({"ours_broker": Case("broker", "ours_broker", chunk, cfg["order"], gather_programs=cap),
            "raw_overlap": Case("raw_overlap", "raw_overlap"),
            "ours_overlap": Case("overlap", "ours_overlap", chunk, cfg["order"], gather_programs=cap)}
           if cfg.get("endpoint") else {}),
        "ours_landing": Case("landing", "ours_landing", chunk, cfg["order"], gather_programs=cap),
        "raw_layerwise": Case("raw_layerwise", "raw_layerwise"),
        "ours_layerwise": Case("layerwise", "ours_layerwise", chunk),
        "ours_layerwise~inline": Case("layerwise", "ours_layerwise~inline", chunk, side_gathers=False),
        "per_layer": Case("per_layer", "per_layer"),
        **{f"ipc@{g}": Case("ipc", f"ipc@{g}", programs=g) for g in cfg.get("ipc", [])},
        **{f"raw@{n}": Case("raw", f"raw@{n}", splits=n) for n in cfg.get("raw_splits", [])},
    }
    for b in cfg["backends"][1:]:  # the same cases over the other backends
        for name in ("raw", "ours_full", "ours_expect", "ours_staged", "ours_data"):
            cases[f"{name}~{b}"] = replace(cases[name], label=f"{name}~{b}", backend=b)
    for alt in cfg["sweep"]:  # other chunk plans for ours_full (and for the cases named with --sweep-cases)
        if tuple(alt) != chunk[: len(alt)]:
            for name in ("ours_full", *cfg.get("sweep_cases", [])):
                label = f"{name}@" + "/".join(map(str, alt))
                cases[label] = replace(cases[name], label=label, chunking=tuple(alt))
    for variant in cfg["variants"]:  # capN: gathers overlapping the wire get N programs (0: all);
        # lowprio: NCCL's stream at the default priority and full-width gathers (no contention control)
        if variant == "lowprio":
            change: dict[str, Any] = {"high_priority": False, "gather_programs": None, "scatter_programs": None,
                                      "adaptive": False}
        elif variant.startswith("ahead"):
            change = {"lookahead": int(variant.removeprefix("ahead"))}
        elif variant.startswith("scap"):
            change = {"scatter_programs": int(variant.removeprefix("scap")) or None}
        elif variant == "fixed":
            change = {"adaptive": False}
        elif variant == "nostream":
            change = {"streaming": False}
        elif variant == "dup":  # the same cases under another name: the spread between equal rows
            for name in ("ours_full", "ours_data"):
                cases[f"{name}~dup"] = replace(cases[name], label=f"{name}~dup")
            continue
        elif variant == "hot":
            for name in ("raw", "ours_full", "ours_expect", "ours_data"):
                cases[f"{name}~hot"] = replace(cases[name], label=f"{name}~hot", hot=True)
            continue
        elif variant in ("eager", "asyncoffer", "eager+asyncoffer"):
            change = {"eager": "eager" in variant, "async_offer": "asyncoffer" in variant}
        elif variant == "lateoffer":  # every ours_landing row (and its sweeps): the Offer after send 0
            for name in [n for n in cases if n.startswith("ours_landing")]:
                cases[f"{name}~lateoffer"] = replace(cases[name], label=f"{name}~lateoffer", late_offer=True)
            continue
        elif variant == "gfirst":
            change = {"gather_first": True}
        elif variant == "ptrcheck":
            change = {"int_pointers": False}
        else:  # every later gather on the same grid
            change = {"gather_programs": int(variant.removeprefix("cap")) or None, "adaptive": False}
        if all(getattr(cases["ours_full"], k) == v for k, v in change.items()):
            continue  # the default already
        both = variant in ("lowprio", "nostream", "ptrcheck") or variant.startswith("scap")
        swept = [n for n in cases if n.startswith("ours_full@") and "~" not in n]  # --sweep's plans too
        for name in ("ours_full", "ours_data", *swept) if both else ("ours_full", *swept):
            cases[f"{name}~{variant}"] = replace(cases[name], label=f"{name}~{variant}", **change)
    if cfg["diag"]:
        for other in cfg["diag_orders"]:
            if other == cfg["order"]:
                continue
            cases[f"ours_full~{other}"] = replace(cases["ours_full"], label=f"ours_full~{other}", order=other)
    return cases


def _plan(cfg: dict) -> tuple[list[Case], list[Case]]:
    """The timed cases, and the traced ones."""
    cases = _cases(cfg)
    if cfg.get("only"):  # --cases: the named cases and their variants
        cases = {name: c for name, c in cases.items() if name.split("~")[0].split("@")[0] in cfg["only"]}
    traced = [c for name, c in cases.items()
              if name.split("~")[0].split("@")[0] in TRACED
              and (name in TRACED or name.startswith(("raw~", "raw@", "ours_full~", "ours_data~", "ours_landing~")))]
    return list(cases.values()), traced


def _merge_trace(case: Case, tokens: int, p: list[dict], d: list[dict], chunk_ends: list[int] | None) -> dict:
    """Median microseconds after P's t0 of every step on either side."""
    index = {str(end): k for k, end in enumerate(chunk_ends or [])}
    rel: dict[str, list[float]] = {}
    for ps, ds in zip(p, d):
        t0 = ps["t0"]
        for side, stamps in (("P", ps), ("D", ds)):
            for label, t in stamps.items():
                if label == "t0":
                    continue
                name, _, end = label.partition("@")
                if end:
                    name = f"{name}#{index.get(end, end) if end != 'all' else 'all'}"
                rel.setdefault(f"{side}.{name}", []).append((t - t0) * 1e6)
    steps = {k: round(statistics.median(v), 1) for k, v in rel.items()}
    return {"case": case.label, "tokens": tokens, "iters": len(p), "chunks": chunk_ends,
            "us": dict(sorted(steps.items(), key=lambda kv: kv[1]))}


def _worker(role: str, dev: int, outbox: Any, inbox: Any, conn: Any, barrier: Any, results: Any, cfg: dict) -> None:
    if os.environ.get("KVB_BENCH_DUMP_S"):  # a run that hangs shows where each side waits
        import faulthandler

        faulthandler.dump_traceback_later(float(os.environ["KVB_BENCH_DUMP_S"]), exit=True)
    try:
        side = _Side(role, dev, outbox, inbox, conn, barrier, cfg)
        side.connect()
        _zmq_setup(side)
        extra: dict[str, Any] = {"backends": cfg["backends"], "comm_mem_mib": side.comm_mem_mib, **_rtt_us(side)}
        from workers.transports import nccl_lib
        lib = nccl_lib.load()
        extra["nccl_lib"] = {"path": lib.path, "version": ".".join(map(str, lib.version))} if lib else None
        extra["forward_ms_measured"] = round(side.forward_ms, 4)  # what the overlap rows subtract
        extra["layerwise_forward_ms"] = round(side.layers_ms, 4)  # what the layerwise rows subtract
        extra["layerwise_matmuls_per_layer"] = side.layer_reps
        if cfg["host_costs"]:
            extra["host_costs"] = _host_costs(side)
        if cfg["profile"]:
            _install_profile(side)
        from workers.transports.nccl_setup import TORCH_NCCL_QUIET
        extra["torch_nccl_env"] = {k: os.environ.get(k) for k in TORCH_NCCL_QUIET}
        if role == "P":
            extra[f"copy_{max(cfg['tokens'])}"] = _copy_rates(side, max(cfg["tokens"]))
        rows, traces = [], []
        timed, traced = _plan(cfg)
        for tracing in (False, True):
            for tokens in cfg["tokens"]:
                group = traced if tracing else timed
                runs = _rounds(side, group, tokens, cfg["trace_iters"] if tracing else cfg["iters"], tracing)
                if role == "D":
                    conn.send(runs)
                    continue
                theirs_all = conn.recv()
                for case in group:
                    stamps, theirs = runs[case.label], theirs_all[case.label]
                    bounds = _bounds(side, case, tokens // BLOCK)
                    if tracing:
                        traces.append(_merge_trace(case, tokens, stamps, theirs, bounds))
                        continue
                    ms = [(d["t1"] - p["t0"]) * 1e3 for p, d in zip(stamps, theirs)]
                    if case.kind in ("overlap", "raw_overlap"):  # from the end of the forward pass
                        ms = [m - side.forward_ms for m in ms]
                    if case.kind in ("layerwise", "raw_layerwise"):  # beyond the forward pass alone
                        ms = [m - side.layers_ms for m in ms]
                    after: dict[str, list[float]] = {}
                    for m, p in zip(ms, stamps):
                        after.setdefault(_prev_class(p.get("prev")), []).append(m)
                    rows.append({"case": case.label, "tokens": tokens,
                                 "MiB": tokens * 2 * LAYERS * HEADS * DIM * 2 / 2**20,
                                 "chunks": len(bounds) if bounds else 1,
                                 "ms": round(statistics.median(ms), 3), "ms_min": round(min(ms), 3),
                                 "ms_p90": round(sorted(ms)[int(0.9 * (len(ms) - 1))], 3),
                                 "after": {k: [len(v), round(statistics.median(v), 3)] for k, v in sorted(after.items())},
                                 "ms_each": [round(m, 4) for m in ms]})  # in round order: drift within the run
        for cache in side.caches.values():
            cache.close()
            cache.rendezvous.close()
        if side.bhs is not None:
            side.bhs.sync.close()
        if cfg.get("ipc"):
            extra["ipc_checksum_mismatches"] = side.ipc_bad
        results.put((role, {"rows": rows, "traces": traces, **extra}))
    except BaseException:
        # Printed at once too: the other side may now wait forever for this one.
        print(f"{role} failed:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        results.put((role, {"error": traceback.format_exc()}))


def _num(x: float | None, width: int, places: int) -> str:
    return f"{'-':>{width}}" if x is None else f"{x:>{width}.{places}f}"


def _table(rows: list[dict]) -> tuple[str, list[dict]]:
    by = {(r["case"], r["tokens"]): r for r in rows}
    summary, lines = [], []
    for r in rows:
        r["GBps"] = round(r["MiB"] * 2**20 / (r["ms"] * 1e-3) / 1e9, 1)
    head = (f"{'case':<22}{'tokens':>7}{'MiB':>7}{'chunks':>7}{'ms':>9}{'min':>8}{'p90':>8}{'GB/s':>8}"
            f"{'x raw':>8}{'x per-layer':>12}")
    lines.append(head)
    for r in rows:
        # A hot row against the hot ceiling; an overlap row against raw after the same forward pass.
        base = ("raw_overlap" if r["case"] == "ours_overlap" else "raw_layerwise" if r["case"].startswith("ours_layerwise")
                else "raw~hot" if r["case"].endswith("~hot") else "raw")
        raw, pl = by.get((base, r["tokens"])), by.get(("per_layer", r["tokens"]))
        r["vs_raw"] = round(raw["ms"] / r["ms"], 3) if raw else None
        r["vs_per_layer"] = round(pl["ms"] / r["ms"], 2) if pl else None
        lines.append(f"{r['case']:<22}{r['tokens']:>7}{r['MiB']:>7.0f}{r['chunks']:>7}{r['ms']:>9.3f}"
                     f"{r['ms_min']:>8.3f}{r['ms_p90']:>8.3f}{r['GBps']:>8.1f}"
                     f"{_num(r['vs_raw'], 8, 3)}{_num(r['vs_per_layer'], 12, 2)}")
    for tokens in sorted({r["tokens"] for r in rows}):
        s: dict[str, Any] = {"tokens": tokens}
        for case in ("ours_full", "ours_expect", "ours_staged", "ours_data", "ours_broker", "ours_landing",
                     "ours_overlap", "ours_layerwise", "ours_layerwise~inline", "ours_full~hot", "ours_data~hot"):
            if (case, tokens) in by:
                s[f"{case}_vs_raw"] = by[(case, tokens)]["vs_raw"]
                s[f"{case}_vs_per_layer"] = by[(case, tokens)]["vs_per_layer"]
        both = by.get(("raw_sendrecv", tokens))
        for case in ("raw", "ours_full") if both else ():  # against a send/recv both sides post on the clock
            if (case, tokens) in by:
                s[f"{case}_vs_raw_sendrecv"] = round(both["ms"] / by[(case, tokens)]["ms"], 3)
                lines.append(f"{case} {tokens} tokens against raw_sendrecv: {s[f'{case}_vs_raw_sendrecv']}")
        summary.append(s)
    for (case, tokens, key), want in TARGETS.items():
        for label in (case, f"{case}~hot") + (("ours_layerwise",) if case == "ours_full" else ()):
            got = by.get((label, tokens))
            if got is not None and got[key] is not None:
                verdict = "met" if got[key] >= want else "MISSED"
                lines.append(f"target {label} {tokens} tokens {key} >= {want}: {got[key]} ({verdict})")
    return "\n".join(lines), summary


def _prev_class(label: Any) -> str:
    """What kind of case ran just before: one that ran a forward pass of matmuls, the
    per-layer pattern, one over torch's backend, or a plain transfer."""
    if not isinstance(label, str):
        return "none"
    if "layerwise" in label or "overlap" in label:
        return "forward"
    if label == "per_layer":
        return "per_layer"
    return "torch" if label.endswith("~torch") else "transfer"


def _raw_and_ours(rows: list[dict]) -> Iterator[tuple[int, dict, dict]]:
    """(tokens, raw's row, ours_full's row) for each prompt length that has both."""
    by = {(r["case"], r["tokens"]): r for r in rows}
    for tokens in sorted({r["tokens"] for r in rows}):
        raw, ours = by.get(("raw", tokens)), by.get(("ours_full", tokens))
        if raw is not None and ours is not None:
            yield tokens, raw, ours


def _by_predecessor(rows: list[dict]) -> str:
    """raw and ours_full by the kind of case that ran just before each iteration: the
    median ms of each, and their ratio, where both have one of that kind."""
    out = []
    for tokens, raw, ours in _raw_and_ours(rows):
        if len(raw.get("after", {})) < 2:
            continue
        parts = []
        for kind in sorted(set(raw["after"]) & set(ours["after"])):
            (n_raw, ms_raw), (n_ours, ms_ours) = raw["after"][kind], ours["after"][kind]
            parts.append(f"{kind}: raw {ms_raw:.3f} ms (n={n_raw}), ours_full {ms_ours:.3f} ms (n={n_ours}), "
                         f"x raw {ms_raw / ms_ours:.3f}")
        out.append(f"after {tokens} tokens: " + "; ".join(parts))
    return "\n".join(out)


def _by_quarter(rows: list[dict]) -> str:
    """ours_full against raw over each quarter of the rounds (medians of each): whether
    the ratio drifts within the run, e.g. slower early on a machine just started."""
    out = []
    for tokens, raw, ours in _raw_and_ours(rows):
        if len(raw["ms_each"]) < 8:
            continue
        q = len(raw["ms_each"]) // 4
        ratios = [statistics.median(raw["ms_each"][k * q:(k + 1) * q]) / statistics.median(ours["ms_each"][k * q:(k + 1) * q])
                  for k in range(4)]
        out.append(f"quarters {tokens} tokens: ours_full x raw " + " ".join(f"{r:.3f}" for r in ratios))
    return "\n".join(out)


def _trace_lines(traces: list[dict]) -> str:
    out = []
    for t in traces:
        steps = "  ".join(f"{k}={v:.0f}" for k, v in t["us"].items())
        out.append(f"trace {t['case']} {t['tokens']} (us after P.t0, chunks {t['chunks']}): {steps}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    first, last, growth, back_growth = _default_chunking()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="512,2048,8192")
    ap.add_argument("--iters", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--trace-iters", type=int, default=10)
    ap.add_argument("--first-mib", type=int, default=first, help="first pipeline chunk (pipeline_bounds default)")
    ap.add_argument("--last-mib", type=int, default=last, help="last pipeline chunk (pipeline_bounds default)")
    ap.add_argument("--growth", type=int, default=growth, help="chunk growth inward (pipeline_bounds default)")
    ap.add_argument("--back-growth", type=int, default=back_growth, help="the back ramp's growth")
    ap.add_argument("--order", choices=("pc", "gf", "pg"), default="pc", help="P: chunk by chunk, or all gathers first")
    ap.add_argument("--sweep", default="", help="other first/last/growth[/back growth] for ours_full, e.g. 128/32/4,64/16/2/4")
    ap.add_argument("--sweep-cases", default="", help="also sweep these cases' plans, e.g. ours_expect,ours_landing")
    ap.add_argument("--backends", default="auto",
                    help="communicator backends, the first timed unsuffixed; auto: the default, then torch")
    ap.add_argument("--diag", action="store_true", help="also time and trace the other P orders")
    ap.add_argument("--diag-orders", default="pg,gf", help="the P orders --diag adds")
    ap.add_argument("--host-costs", action="store_true", help="also time NCCL posts and gather launches")
    ap.add_argument("--profile", action="store_true",
                    help="traces also stamp entry and exit of each call on the critical path (adds ~1 us a call)")
    ap.add_argument("--gather-programs", type=int, default=GATHER_PROGRAMS if GATHER_PROGRAMS else 0,
                    help="grid cap of copies that overlap the wire (0: full width)")
    ap.add_argument("--variants", default="nostream,fixed,cap0,scap0,lowprio,hot",
                    help="ours_full/ours_data variants: fixed (later gathers all at the cap), capN (all on N programs, "
                         "0: full), scapN, aheadN (N gathers enqueued ahead of the sends), lowprio, nostream (copies "
                         "without streaming cache hints), eager, asyncoffer, gfirst (chunk 0's gather enqueued before the "
                         "Offer leaves), lateoffer (ours_landing: the Offer after chunk 0's send), ptrcheck (copy kernels launched with tensors, whose pointers the launcher checks), "
                         "dup (the same rows again: the spread), "
                         "hot (both sides spin; with raw~hot)")
    ap.add_argument("--broker", action="store_true",
                    help="also time ours_broker and ours_overlap: the handshake through a real `kvbroker serve` process")
    ap.add_argument("--forward-ms", type=float, default=3.0, help="ours_overlap and ours_layerwise: P's forward pass, ms of GPU time")
    ap.add_argument("--ipc", default="", help="also time the CUDA IPC comparison with these grids, e.g. 132,528")
    ap.add_argument("--raw-splits", default="", help="also time raw as N equal ops back to back, e.g. 2,4,6")
    ap.add_argument("--cases", default="", help="time only these cases (and their ~variants), e.g. raw,ours_full")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run each case N times in a row within a round and keep the last: its code and buffers "
                         "just used, as in an engine that moves a transfer every step (default 1: each case once)")
    ap.add_argument("--json", default="")
    args = ap.parse_args(argv)
    if torch.cuda.device_count() < 2:
        print("needs 2 CUDA GPUs", file=sys.stderr)
        return 2
    from workers.transports.nccl import resolve_backend

    tokens = [int(t) for t in args.tokens.split(",")]
    if args.backends == "auto":
        first_backend = resolve_backend()
        backends = [first_backend] + (["torch"] if first_backend != "torch" else [])
    else:
        backends = [resolve_backend(b) for b in args.backends.split(",") if b]
    sweep = [tuple(int(x) for x in s.split("/")) for s in args.sweep.split(",") if s]
    cfg = {"tokens": tokens, "iters": args.iters, "warmup": args.warmup, "trace_iters": args.trace_iters,
           "first_mib": args.first_mib, "last_mib": args.last_mib, "growth": args.growth,
           "back_growth": args.back_growth, "order": args.order,
           "sweep": sweep, "sweep_cases": [c for c in args.sweep_cases.split(",") if c], "backends": backends,
           "gather_programs": args.gather_programs or None,
           "variants": [v for v in args.variants.split(",") if v],
           "only": [c for c in args.cases.split(",") if c],
           "ipc": [int(g) for g in args.ipc.split(",") if g],
           "raw_splits": [int(n) for n in args.raw_splits.split(",") if n],
           "diag": args.diag, "diag_orders": [o for o in args.diag_orders.split(",") if o],
           "repeat": args.repeat, "host_costs": args.host_costs, "forward_ms": args.forward_ms, "profile": args.profile, "max_blocks": max(tokens) // BLOCK, "cache_blocks": max(2 * max(tokens) // BLOCK, 64)}
    broker = _start_broker() if args.broker else None
    try:
        if broker is not None:
            cfg["endpoint"] = broker[1]
        return _run(cfg, args)
    finally:
        if broker is not None:
            broker[0].terminate()
            broker[0].wait(timeout=10)


def _start_broker(log_level: str = "warning") -> tuple[subprocess.Popen, str]:
    """`kvbroker serve` on a free loopback port, logging JSON lines at `log_level` to this
    process's standard error; (process, endpoint)."""
    folder = tempfile.mkdtemp(prefix="kvbroker-bench-")
    port_file = os.path.join(folder, "endpoint")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH", "")]))}
    proc = subprocess.Popen([sys.executable, "-m", "broker.cli", "serve", "--bind", "tcp://127.0.0.1:0",
                             "--port-file", port_file, "--log-level", log_level, "--log-format", "json"],
                            cwd=root, env=env)
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


def _run(cfg: dict, args: argparse.Namespace) -> int:
    backends = cfg["backends"]
    ctx = mp.get_context("spawn")
    p_to_d, d_to_p = {b: ctx.Queue() for b in backends}, {b: ctx.Queue() for b in backends}
    results = ctx.Queue()
    conn_p, conn_d = ctx.Pipe()
    barrier = (ctx.Barrier(2), ctx.RawArray("q", 2))
    procs = [ctx.Process(target=_worker, args=("P", 0, p_to_d, d_to_p, conn_p, barrier, results, cfg)),
             ctx.Process(target=_worker, args=("D", 1, d_to_p, p_to_d, conn_d, barrier, results, cfg))]
    for p in procs:
        p.start()
    out: dict[str, Any] = {}
    try:
        while len(out) < 2:
            role, res = results.get(timeout=200)
            out[role] = res
            if "error" in res:
                print(f"{role} failed:\n{res['error']}", file=sys.stderr)
                return 1
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    table, summary = _table(out["P"]["rows"])
    print(table)
    print(_by_predecessor(out["P"]["rows"]))
    print(_by_quarter(out["P"]["rows"]))
    print(_trace_lines(out["P"]["traces"]))
    skip = ("rows", "traces")
    print(json.dumps({k: v for k, v in out["P"].items() if k not in skip}))
    print("D:", json.dumps({k: v for k, v in out["D"].items() if k not in skip}))
    report = {"config": cfg, "rows": out["P"]["rows"], "summary": summary, "traces": out["P"]["traces"],
              "P": {k: v for k, v in out["P"].items() if k not in skip},
              "D": {k: v for k, v in out["D"].items() if k not in skip},
              "torch": torch.__version__, "nccl": ".".join(map(str, torch.cuda.nccl.version())),
              "gpu": torch.cuda.get_device_name(0)}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
