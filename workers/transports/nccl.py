"""The GPU transport: 2-party NCCL communicators, cached, capped, aborted on timeout.

Theory of operation
-------------------
Each (local worker, remote worker) pair gets its own 2-rank NCCL communicator, outside
any global group: vLLM owns that. Two backends build it (`CommunicatorCache(backend=)`):

* "direct" (the default when the library loads): NCCL's C API through a small ctypes
  binding (`workers.transports.nccl_lib`) to the libnccl that torch's wheel ships.
  Why a custom binding: each op posted through torch's ProcessGroupNCCL costs the host
  0.1-0.25 ms (work objects, coalescing, watchdog bookkeeping; measured on an H200
  pair, torch 2.11), so a chunked transfer's first byte left about 0.25 ms after a
  bare send's and the wire idled between chunk posts. A direct post costs a few
  microseconds plus two CUDA event records. Rendezvous: the initiator makes an
  ncclUniqueId (128 bytes) and publishes ``{"v": 2, "backend": "direct", "id",
  "nonce"}`` through the `Rendezvous`; the acceptor answers on ``<key>/joined`` with
  the nonce; then both run ncclCommInitRank (initiator = rank 0) and one small
  exchange each way on a helper thread under `connect_timeout_s`, aborting the
  communicator past it. Each communicator has its own CUDA stream, which waits on
  the posting stream's tail at posting, as a process group's NCCL stream does; a
  post returns a work whose ``wait()`` makes the current stream wait on an event after
  the group, and holds the group's tensors until its completion is seen.
* "torch": a `ProcessGroupNCCL` built on a `TCPStore`, as below. An acceptor builds
  whichever kind the initiator's payload names.

The rest holds for both (the torch details are marked as such).

* Rendezvous (torch). The initiator (the sender, P) starts a `TCPStore` on a free port and
  publishes ``{"host", "port", "nonce"}`` through an injected `Rendezvous` (the
  broker's `Relay` in production, queues in tests). Both sides build the group on a
  `PrefixStore` named by the nonce (initiator = rank 0), connect it eagerly, and
  exchange one small message each way: NCCL sets up point-to-point channels inside the
  first group that uses them, blocking the posting thread until the peer posts too, so
  without it a receive posted ahead of its send would hang its caller. After it,
  posting never blocks.
* One communicator per pair. Every op is posted in a group (torch: a coalescing group,
  even a lone send, since torch keys a lone point-to-point op to a second, lazily
  built communicator).
* Cache. `CommunicatorCache` keeps at most `capacity` (one measured ~300 MiB of GPU
  memory on an H200, torch 2.11, NCCL 2.28) and evicts the least recently used *idle*
  one; busy ones are never evicted (`CommunicatorLimit` when all are). Evicted and
  failed communicators are aborted, which frees their memory.
* Ordering. A send of staged KV is posted on the transport's stream only after
  ``stream.wait_event(staged_event)``; the group's NCCL stream waits on that stream at
  posting, so the send cannot read staging before the gather that fills it. NCCL pairs
  a peer's sends and receives by posting order alone, so one transfer's chunks are
  posted under the communicator's lock, and a receiver posts its transfers in the order
  the sender sends them (the order of its Ready messages).
* Pipelining. A transfer goes in block chunks (`workers.gpu_staging.pipeline_bounds`):
  chunk k's send waits only for the gather that covers chunk k, and the receiver
  scatters chunk k on its own stream as soon as chunk k's receive completes, while
  chunk k+1 is still on the wire. Posting one NCCL op through torch costs the host
  0.1-0.25 ms (measured on an H200 pair, torch 2.11), so a receiver sends Ready *before* it posts
  its receives: the two sides then post at the same time, and a send posted first
  simply waits on its GPU for the matching receive. (Posting a receive before Ready
  would also deadlock on a communicator's first use, whose creation needs the sender,
  which starts only once it has Ready.)
* Deadlines. Ops return a `Completion` (a CUDA event after the NCCL work) whose
  `wait(deadline)` spins briefly, then polls in pauses of at most 100 us (coarser
  polling would add its pause to every transfer's latency); past the deadline it aborts the communicator (a stuck NCCL
  kernel then returns), drops it from the cache and raises `SendTimeout`/`RecvTimeout`.
  The next use rebuilds it. The group's watchdog timeout (torch) is set far above any
  transfer deadline, so the watchdog (whose default reaction kills the process) never
  fires first.
* Host cost (torch). Before its first group the transport switches off torch's NCCL flight
  recorder and monitor threads (`TORCH_NCCL_QUIET`; an operator's values win): debugging
  it does not use, on the posting thread or beside it.
* Rebuilds and eviction are one-sided, so an acceptor checks `Rendezvous.poll` on each
  use and replaces its communicator when the initiator published a newer nonce. If the
  initiator sends before the acceptor saw it, that transfer misses its deadline on both
  sides and both rebuild; no bytes land in the wrong buffer.
"""

from __future__ import annotations

import json
import os
import queue
import secrets
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal, Protocol

import structlog
import torch

from protocols.errors import KvBrokerError, RecvTimeout, RendezvousError, SendTimeout
from workers.gpu_staging import PagedKv, StagedTransfer

__all__ = [
    "BACKENDS", "CacheStats", "CommunicatorCache", "CommunicatorLimit", "Completion", "DirectCommunicator",
    "NcclCommunicator", "NcclTransport", "QueueRendezvous", "Rendezvous", "RendezvousError", "resolve_backend",
]

log = structlog.get_logger()


class CommunicatorLimit(KvBrokerError):
    """Every cached communicator is busy and the cache is full."""


class Rendezvous(Protocol):
    """Carries a small payload from the initiator to one acceptor (the broker's `Relay`).

    `receive` blocks until a payload for `key` arrives and raises `RendezvousError`
    past its own deadline; `poll` returns the newest unread payload or None at once.
    """

    def publish(self, peer: str, key: str, payload: bytes) -> None: ...

    def receive(self, peer: str, key: str) -> bytes: ...

    def poll(self, peer: str, key: str) -> bytes | None: ...


class QueueRendezvous:
    """A `Rendezvous` over `multiprocessing` queues, for tests and benchmarks on one host.

    Args:
        outbox: where this side's published payloads go, as ``(key, payload)``.
        inbox: where the other side's arrive.
        timeout_s: how long `receive` waits.
    """

    def __init__(self, outbox: Any, inbox: Any, *, timeout_s: float = 60.0) -> None:
        self._out, self._in, self._timeout_s = outbox, inbox, timeout_s
        self._unread: dict[str, bytes] = {}

    def publish(self, peer: str, key: str, payload: bytes) -> None:
        self._out.put((key, payload))

    def _drain(self, block_until: float | None) -> None:
        while True:
            try:
                if block_until is None:
                    key, payload = self._in.get_nowait()
                else:
                    key, payload = self._in.get(timeout=max(0.0, block_until - time.monotonic()))
            except queue.Empty:
                return
            self._unread[key] = payload
            block_until = None

    def receive(self, peer: str, key: str) -> bytes:
        deadline = time.monotonic() + self._timeout_s
        while key not in self._unread:
            if time.monotonic() >= deadline:
                raise RendezvousError(f"no rendezvous data under {key!r} from {peer} in {self._timeout_s} s.")
            self._drain(deadline)
        self._drain(None)  # take the newest, if several generations queued up
        return self._unread.pop(key)

    def poll(self, peer: str, key: str) -> bytes | None:
        self._drain(None)
        return self._unread.pop(key, None)


class Completion:
    """A CUDA event after one or more NCCL ops. A missed deadline aborts the
    communicator and raises `SendTimeout`/`RecvTimeout`: the bytes are then lost."""

    def __init__(
        self, comm: NcclCommunicator, event: torch.cuda.Event, op: Literal["send", "recv"], transfer_id: str,
        keep: Sequence[Any] = (),
    ) -> None:
        self.comm, self.event, self.op, self.transfer_id = comm, event, op, transfer_id
        self._keep = list(keep)  # bounce buffers and posted works must outlive the op

    def done(self) -> bool:
        """True once the op finished on the GPU; never blocks."""
        return self.event.query()

    def wait(self, deadline: float, *, spin_s: float = 0.001, max_pause_s: float = 1e-4) -> None:
        """Block until done or `deadline` (a `time.monotonic()` value) passes.

        Spins for `spin_s` (transfers often end within it), then sleeps in steps that
        double up to `max_pause_s`: the pause bounds how late the end is noticed.

        Raises:
            SendTimeout, RecvTimeout: the deadline passed; the communicator is aborted.
        """
        start = time.monotonic()
        pause = 0.0
        while not self.event.query():
            now = time.monotonic()
            if now >= deadline:
                self.comm.fail(f"{self.op} missed its deadline")
                exc = SendTimeout if self.op == "send" else RecvTimeout
                raise exc(self.transfer_id or "-", f"NCCL {self.op} with {self.comm.peer} timed out")
            if now - start > spin_s:
                pause = min(max(pause * 2, 1e-5), max_pause_s)
            time.sleep(pause)
        self._keep.clear()


@dataclass(frozen=True)
class CacheStats:
    size: int
    capacity: int
    created: int
    evicted: int
    aborted: int


class NcclCommunicator:
    """One 2-rank NCCL communicator with one peer (torch's ProcessGroupNCCL); built by
    `CommunicatorCache`. `DirectCommunicator` is the same over the bare NCCL library."""

    backend = "torch"

    def __init__(
        self, *, peer: str, rank: int, device: torch.device, pg: Any, store: Any, nonce: str,
        cache: CommunicatorCache | None, mem_bytes: int,
    ) -> None:
        self.peer, self.rank, self.peer_rank, self.device = peer, rank, 1 - rank, device
        self.pg, self.nonce, self.mem_bytes = pg, nonce, mem_bytes
        self._store = store  # the store's server must live as long as the group
        self._cache = cache
        self._pending: list[Completion] = []
        self.broken = self.closed = False
        # Held while one transfer posts its chunks: NCCL matches ops by posting order,
        # so two transfers' chunks must never interleave on one communicator.
        self.lock = threading.RLock()

    def idle(self) -> bool:
        """No op of this communicator is still running."""
        self._pending = [c for c in self._pending if not c.done()]
        return not self._pending

    def post(
        self, ops: Sequence[tuple[Literal["send", "recv"], torch.Tensor]], stream: torch.cuda.Stream,
        after: Sequence[torch.cuda.Event | None] = (),
    ) -> Any:
        """Post `ops` as one NCCL group once `stream` has waited for `after`; returns the work.

        The group's NCCL stream waits on `stream` now: later work on `stream` cannot
        delay it, earlier work cannot be overtaken. ``work.wait()`` makes the current
        stream wait for the group.

        Raises:
            RuntimeError: closed, or the ops were refused (then it is aborted).
        """
        if self.closed:
            raise RuntimeError(f"the communicator with {self.peer} is closed; get a new one from the cache.")
        with self.lock, torch.cuda.device(self.device), torch.cuda.stream(stream):
            for event in after:
                if event is not None:
                    stream.wait_event(event)
            try:
                return self._post(ops, stream)
            except BaseException:
                self.fail("posting an op failed")
                raise

    def _post(self, ops: Sequence[tuple[Literal["send", "recv"], torch.Tensor]], stream: torch.cuda.Stream) -> Any:
        self.pg._start_coalescing()
        try:
            for op, tensor in ops:
                fn = self.pg.send if op == "send" else self.pg.recv
                fn([tensor], self.peer_rank, 0)
        finally:
            work = self.pg._end_coalescing()
        return work

    def completion(
        self, works: Sequence[Any], stream: torch.cuda.Stream, op: Literal["send", "recv"], transfer_id: str = "",
        keep: Sequence[Any] = (),
    ) -> Completion:
        """Make `stream` wait for `works` (no host block) and return an event after them."""
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            for work in works:
                if work is not None:
                    work.wait()
            event = torch.cuda.Event()
            event.record(stream)
        # The works (and the tensors a direct one holds) live until the completion is seen.
        done = Completion(self, event, op, transfer_id, [*keep, *(w for w in works if w is not None)])
        self._pending.append(done)
        return done

    def fail(self, reason: str) -> None:
        """Abort after an error or a timeout and drop out of the cache."""
        if self.closed:
            return
        self.broken = True
        log.warning("nccl.abort", peer=self.peer, nonce=self.nonce, backend=self.backend, reason=reason)
        if self._cache is not None:
            self._cache._forget(self)
        self.abort()

    def abort(self) -> None:
        """Abort the NCCL communicator, freeing its memory; idempotent."""
        if self.closed:
            return
        self.closed = True
        try:
            self._abort()
        except Exception as exc:  # abort is best effort; the object is dropped anyway
            log.warning("nccl.abort_failed", peer=self.peer, backend=self.backend, error=repr(exc))
        self._pending.clear()

    def _abort(self) -> None:
        try:
            try:
                self.pg.abort()
            except TypeError:  # torch versions whose abort() takes a reason
                self.pg.abort(None)
        finally:
            self.pg = None
            self._store = None


class _DirectWork:
    """A posted group of a `DirectCommunicator`: an event after it on the NCCL stream.

    Holds the group's tensors, so the caching allocator cannot hand their memory to
    anyone else while the ops may still use it."""

    __slots__ = ("event", "tensors")

    def __init__(self, event: torch.cuda.Event, tensors: list[torch.Tensor]) -> None:
        self.event, self.tensors = event, tensors

    def wait(self) -> None:
        """Make the current stream wait for the group (no host block)."""
        torch.cuda.current_stream().wait_event(self.event)


class DirectCommunicator(NcclCommunicator):
    """A 2-rank communicator driven through `workers.transports.nccl_lib`: a few
    microseconds of host time an op instead of torch's 0.1-0.25 ms.

    Like a process group it runs its ops on a stream of its own, which waits on the
    posting stream's tail at posting; so two communicators of one transport never queue
    behind each other, and the ordering rules of `NcclCommunicator.post` hold as they are.
    """

    backend = "direct"

    def __init__(
        self, *, peer: str, rank: int, device: torch.device, lib: Any, handle: int, nonce: str,
        cache: CommunicatorCache | None, mem_bytes: int,
    ) -> None:
        super().__init__(peer=peer, rank=rank, device=device, pg=None, store=None, nonce=nonce, cache=cache,
                         mem_bytes=mem_bytes)
        self.lib, self.handle = lib, handle
        self.nccl_stream = torch.cuda.Stream(device)
        self._stream_ptr = self.nccl_stream.cuda_stream

    def _post(self, ops: Sequence[tuple[Literal["send", "recv"], torch.Tensor]], stream: torch.cuda.Stream) -> Any:
        lib, handle, peer, sp = self.lib, self.handle, self.peer_rank, self._stream_ptr
        tensors = []
        for _, tensor in ops:
            if not tensor.is_cuda or not tensor.is_contiguous():
                raise ValueError(f"NCCL ops need contiguous CUDA tensors; got one on {tensor.device}.")
            tensors.append(tensor)
        ready = torch.cuda.Event()
        ready.record(stream)
        self.nccl_stream.wait_event(ready)
        lib.group_start()
        try:
            for op, tensor in ops:
                fn = lib.send if op == "send" else lib.recv
                fn(tensor.data_ptr(), tensor.numel() * tensor.element_size(), peer, handle, sp)
        finally:
            lib.group_end()
        done = torch.cuda.Event()
        done.record(self.nccl_stream)
        return _DirectWork(done, tensors)

    def async_error(self) -> int:
        """NCCL's asynchronous error code for this communicator (0: none)."""
        return self.lib.async_error(self.handle) if not self.closed else 0

    def _abort(self) -> None:
        handle, self.handle = self.handle, 0
        if handle:
            self.lib.abort(handle)


class CommunicatorCache:
    """At most `capacity` live communicators of one local worker, LRU-evicted when idle.

    Args:
        local_id: this worker's id, as peers and the rendezvous know it.
        device: this worker's GPU.
        rendezvous: carries the store address to the acceptor.
        capacity: communicators kept at once.
        advertise_host: the address acceptors reach this host's stores at.
        connect_timeout_s: how long building a communicator may take (rendezvous
            waits and NCCL's init).
        watchdog_timeout_s: the process group's own timeout (torch backend); keep it
            well above every transfer deadline (see the module docstring).
        backend: "direct" (the NCCL library through `nccl_lib`), "torch" (a
            ProcessGroupNCCL), or None: `KVBROKER_NCCL_BACKEND` if set, else "direct"
            when the library loads, else "torch". It applies to communicators this side
            initiates; an acceptor builds whichever kind the initiator's payload names.

    Raises:
        ValueError: an unknown backend, or "direct" without a loadable NCCL library.
    """

    def __init__(
        self, local_id: str, device: torch.device | str, rendezvous: Rendezvous, *, capacity: int = 8,
        advertise_host: str = "127.0.0.1", connect_timeout_s: float = 60.0, watchdog_timeout_s: float = 600.0,
        backend: str | None = None,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, not {capacity}.")
        self.backend = resolve_backend(backend)
        self.local_id, self.device, self.rendezvous = local_id, torch.device(device), rendezvous
        self.capacity, self.advertise_host = capacity, advertise_host
        self.connect_timeout_s, self.watchdog_timeout_s = connect_timeout_s, watchdog_timeout_s
        self._comms: OrderedDict[str, NcclCommunicator] = OrderedDict()
        self._lock = threading.Lock()
        self._created = self._evicted = self._aborted = 0

    @staticmethod
    def key(initiator: str, acceptor: str) -> str:
        return f"nccl/{initiator}>{acceptor}"

    def get(self, peer: str, *, initiator: bool) -> NcclCommunicator:
        """The communicator with `peer`, built through the rendezvous if needed.

        Args:
            initiator: True on the side that creates the store (the sender).

        Raises:
            RendezvousError: the peer's address did not arrive in time or was invalid.
            CommunicatorLimit: the cache is full of busy communicators.
            RuntimeError: torch could not build the process group (peer gone, ...).
        """
        payload = None
        with self._lock:
            comm = self._comms.get(peer)
            if comm is not None and not initiator:
                payload = self.rendezvous.poll(peer, self.key(peer, self.local_id))
                if payload is not None and _parse(payload)["nonce"] == comm.nonce:
                    payload = None
                if payload is not None:  # the initiator rebuilt: ours is stale
                    self._comms.pop(peer)
                    self._aborted += 1
                    comm.abort()
                    comm = None
            if comm is not None:
                self._comms.move_to_end(peer)
                return comm
            if len(self._comms) >= self.capacity and not any(c.idle() for c in self._comms.values()):
                raise CommunicatorLimit(
                    f"all {len(self._comms)} NCCL communicators are busy (capacity {self.capacity}); "
                    "raise the communicator capacity or wait for transfers to finish."
                )
        comm = self._connect(peer, initiator, payload)
        with self._lock:
            old = self._comms.pop(peer, None)
            self._comms[peer] = comm
            self._created += 1
            victims = self._evict_locked()
        for victim in ([old] if old is not None else []) + victims:
            victim.abort()
        return comm

    def discard(self, peer: str) -> None:
        """Abort and forget the communicator with `peer`, if any (e.g. the peer restarted)."""
        with self._lock:
            comm = self._comms.pop(peer, None)
            if comm is not None:
                self._aborted += 1
        if comm is not None:
            comm.abort()

    def statistics(self) -> CacheStats:
        with self._lock:
            return CacheStats(len(self._comms), self.capacity, self._created, self._evicted, self._aborted)

    def close(self) -> None:
        """Abort every communicator; the cache stays usable."""
        with self._lock:
            comms = list(self._comms.values())
            self._comms.clear()
        for comm in comms:
            comm.abort()

    # -- internals -------------------------------------------------------------------

    def _forget(self, comm: NcclCommunicator) -> None:
        with self._lock:
            if self._comms.get(comm.peer) is comm:
                del self._comms[comm.peer]
                self._aborted += 1

    def _evict_locked(self) -> list[NcclCommunicator]:
        victims: list[NcclCommunicator] = []
        while len(self._comms) > self.capacity:
            idle = next((p for p, c in self._comms.items() if c.idle()), None)
            if idle is None:  # all became busy while we connected: over capacity until one idles
                log.warning("nccl.over_capacity", size=len(self._comms), capacity=self.capacity)
                break
            victims.append(self._comms.pop(idle))
            self._evicted += 1
        return victims

    def _connect(self, peer: str, initiator: bool, payload: bytes | None) -> NcclCommunicator:
        info = None
        if not initiator:
            info = _parse(payload if payload is not None else self.rendezvous.receive(peer, self.key(peer, self.local_id)))
        if (info["backend"] if info is not None else self.backend) == "direct":
            return self._connect_direct(peer, info)
        return self._connect_torch(peer, info)

    def _connect_direct(self, peer: str, info: dict[str, Any] | None) -> NcclCommunicator:
        """Initiator: a unique id through the rendezvous, then the acceptor's ack; acceptor:
        the ack. Then both run ncclCommInitRank and a warm-up exchange under a deadline."""
        from workers.transports import nccl_lib

        lib = nccl_lib.load()
        if lib is None:
            raise RendezvousError(f"{peer} asked for a direct NCCL communicator: {nccl_lib.load_error()}")
        key = self.key(self.local_id, peer) if info is None else self.key(peer, self.local_id)
        deadline = time.monotonic() + self.connect_timeout_s
        if info is None:
            uid, nonce = lib.unique_id(), secrets.token_hex(8)
            self.rendezvous.publish(peer, key, json.dumps(
                {"v": 2, "backend": "direct", "id": uid.hex(), "nonce": nonce}).encode())
            # ncclCommInitRank blocks until the peer joins: start it once the peer is there.
            while True:
                ack = self.rendezvous.receive(peer, f"{key}/joined")
                if ack.decode(errors="replace") == nonce:
                    break
                if time.monotonic() >= deadline:  # only stale acks of older generations
                    raise RendezvousError(f"{peer} did not join NCCL rendezvous {nonce} in time.")
            rank = 0
        else:
            uid, nonce, rank = info["id"], info["nonce"], 1
            self.rendezvous.publish(peer, f"{key}/joined", nonce.encode())
        free_before = torch.cuda.mem_get_info(self.device)[0]
        handle = _init_direct(lib, uid, rank, self.device, deadline, peer, nonce)
        mem = max(0, free_before - torch.cuda.mem_get_info(self.device)[0])
        log.info("nccl.connected", peer=peer, rank=rank, nonce=nonce, backend="direct", mem_mib=round(mem / 2**20, 1))
        return DirectCommunicator(peer=peer, rank=rank, device=self.device, lib=lib, handle=handle, nonce=nonce,
                                  cache=self, mem_bytes=mem)

    def _connect_torch(self, peer: str, info: dict[str, Any] | None) -> NcclCommunicator:
        from torch.distributed import PrefixStore, TCPStore

        initiator = info is None
        timeout = timedelta(seconds=self.connect_timeout_s)
        if initiator:
            store = _master_store(self.advertise_host, timeout)
            nonce = secrets.token_hex(8)
            self.rendezvous.publish(
                peer, self.key(self.local_id, peer),
                json.dumps({"v": 1, "host": self.advertise_host, "port": store.port, "nonce": nonce}).encode(),
            )
            # ncclCommInitRank has no deadline, so only start it once the peer is there.
            try:
                store.wait([f"kvbroker/{nonce}/joined"], timeout)
            except Exception as exc:  # DistStoreError / RuntimeError, by torch version
                raise RendezvousError(f"{peer} did not join NCCL rendezvous {nonce} in time: {exc}") from exc
        else:
            if info["backend"] != "torch":  # pragma: no cover - _connect dispatches
                raise RendezvousError(f"not a torch rendezvous payload: {info}")
            try:
                store = TCPStore(info["host"], info["port"], is_master=False, timeout=timeout)
            except Exception as exc:
                raise RendezvousError(f"cannot reach {peer}'s store at {info['host']}:{info['port']}: {exc}") from exc
            nonce = info["nonce"]
            store.set(f"kvbroker/{nonce}/joined", b"1")
        rank = 0 if initiator else 1
        free_before = torch.cuda.mem_get_info(self.device)[0]
        pg = _new_group(PrefixStore(f"kvbroker/{nonce}/pg", store), rank, self.device, self.watchdog_timeout_s)
        mem = max(0, free_before - torch.cuda.mem_get_info(self.device)[0])
        log.info("nccl.connected", peer=peer, rank=rank, nonce=nonce, backend="torch", mem_mib=round(mem / 2**20, 1))
        return NcclCommunicator(
            peer=peer, rank=rank, device=self.device, pg=pg, store=store, nonce=nonce, cache=self, mem_bytes=mem
        )


BACKENDS = ("direct", "torch")


def resolve_backend(backend: str | None = None) -> str:
    """The communicator backend to use: `backend`, else `KVBROKER_NCCL_BACKEND`, else
    "direct" when the NCCL library loads, else "torch".

    Raises:
        ValueError: an unknown name, or "direct" asked for without a loadable library.
    """
    from workers.transports import nccl_lib

    name = backend or os.environ.get("KVBROKER_NCCL_BACKEND", "") or None
    if name is None:
        return "direct" if nccl_lib.load() is not None else "torch"
    if name not in BACKENDS:
        raise ValueError(f"unknown NCCL backend {name!r}; use one of {BACKENDS}.")
    if name == "direct" and nccl_lib.load() is None:
        raise ValueError(f"the direct NCCL backend needs the NCCL library: {nccl_lib.load_error()}")
    return name


def _init_direct(lib: Any, uid: bytes, rank: int, device: torch.device, deadline: float, peer: str,
                 nonce: str) -> int:
    """ncclCommInitRank plus one small exchange each way, on a helper thread, by `deadline`.

    NCCL connects point-to-point channels inside the first group that uses them, and
    that blocks the posting thread until the peer posts too (see `_new_group`); the
    exchange does it now, while both sides are here. Past the deadline the communicator,
    if init got that far, is aborted (which also ends a stuck exchange); a thread still
    inside ncclCommInitRank, which has no deadline of its own, aborts what it gets once
    that returns.

    Raises:
        RendezvousError: the deadline passed or NCCL failed.
    """
    box: dict[str, Any] = {}
    lock = threading.Lock()

    def run() -> None:
        try:
            torch.cuda.set_device(device)
            handle = lib.init_rank(2, uid, rank)
            with lock:
                box["handle"] = handle
                if box.get("abandoned"):
                    box.pop("handle")
                    lib.abort(handle)
                    return
            stream = torch.cuda.Stream(device)
            buf = torch.zeros(2, 1 << 20, dtype=torch.uint8, device=device)
            torch.cuda.current_stream(device).synchronize()
            lib.group_start()
            try:
                lib.send(buf[0].data_ptr(), buf[0].numel(), 1 - rank, handle, stream.cuda_stream)
                lib.recv(buf[1].data_ptr(), buf[1].numel(), 1 - rank, handle, stream.cuda_stream)
            finally:
                lib.group_end()
            stream.synchronize()
            err = lib.async_error(handle)
            if err not in (0, 7):
                raise RuntimeError(f"NCCL reported {lib.error_string(err)} after the warm-up exchange")
            box["ok"] = True
        except BaseException as exc:  # reported to the caller below
            box["error"] = exc

    thread = threading.Thread(target=run, name=f"nccl-init-{peer}", daemon=True)
    thread.start()
    thread.join(max(0.0, deadline - time.monotonic()))
    with lock:
        if box.get("ok"):
            return box["handle"]
        box["abandoned"] = True
        handle = box.pop("handle", None)
    if handle:
        try:
            lib.abort(handle)
        except Exception as exc:  # best effort: the handle is dropped anyway
            log.warning("nccl.abort_failed", peer=peer, backend="direct", error=repr(exc))
    if "error" in box:
        raise RendezvousError(f"NCCL init with {peer} (rendezvous {nonce}) failed: {box['error']}") from box["error"]
    raise RendezvousError(f"NCCL init with {peer} (rendezvous {nonce}) did not finish in time.")


def _master_store(host: str, timeout: timedelta) -> Any:
    """A TCPStore server on a free port (port 0 where torch supports it)."""
    from torch.distributed import TCPStore

    try:
        store = TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timeout)
        if store.port:
            return store
    except (RuntimeError, ValueError):
        pass
    with socket.socket() as s:  # older stores: pick a port, accepting a small race
        s.bind((host, 0))
        port = s.getsockname()[1]
    return TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=timeout)


def _parse(payload: bytes) -> dict[str, Any]:
    """A rendezvous payload: v1 a torch store address, v2 a direct NCCL unique id."""
    try:
        info = json.loads(payload)
        if not isinstance(info.get("nonce"), str):
            raise ValueError("bad fields")
        if info.get("v") == 2 and info.get("backend") == "direct":
            uid = bytes.fromhex(info["id"])
            if len(uid) != 128:
                raise ValueError(f"an NCCL unique id is 128 bytes, not {len(uid)}")
            return {"backend": "direct", "id": uid, "nonce": info["nonce"]}
        if info.get("v") != 1 or not isinstance(info["port"], int):
            raise ValueError("bad fields")
        return {"backend": "torch", "host": str(info["host"]), "port": info["port"], "nonce": info["nonce"]}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise RendezvousError(f"unusable NCCL rendezvous payload ({exc}): {payload[:120]!r}") from exc


# torch's ProcessGroupNCCL debugging and monitoring, which this transport does not use:
# its own deadlines and `Completion.wait` catch stuck ops, and it never reads the
# flight recorder. The flight recorder (TORCH_NCCL_TRACE_BUFFER_SIZE) records every op,
# with a captured stack, on the posting thread, i.e. on a transfer's critical path; the
# dumps on timeout need it; the heartbeat monitor is one more thread per group, whose
# reaction is to kill the process. Set with `os.environ.setdefault` before the first
# group of the process (torch reads some once per process), so an operator's value
# wins; KVBROKER_NCCL_TORCH_DEBUG=1 leaves torch's defaults alone. They are process-wide
# but only switch debugging off. Knobs that change how ops run (record streams, event
# caching) and NCCL_* variables, which would also change the host application's own
# communicators, are left alone. Measured on an H200 pair (torch 2.11, NCCL 2.28): the
# posting cost stayed within run-to-run noise (0.1-0.25 ms an op either way), so this
# is hygiene, not the fix for host time.
TORCH_NCCL_QUIET = {
    "TORCH_NCCL_TRACE_BUFFER_SIZE": "0",
    "TORCH_NCCL_ENABLE_MONITORING": "0",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
    "TORCH_NCCL_DESYNC_DEBUG": "0",
    "TORCH_NCCL_ENABLE_TIMING": "0",
    "TORCH_NCCL_TRACE_CPP_STACK": "0",
    "TORCH_NCCL_LOG_CPP_STACK_ON_UNCLEAN_SHUTDOWN": "0",
}


def _quiet_torch_nccl() -> dict[str, str]:
    """Apply `TORCH_NCCL_QUIET` (unless opted out); returns the values in effect."""
    if os.environ.get("KVBROKER_NCCL_TORCH_DEBUG", "") not in ("", "0"):
        return {}
    for key, value in TORCH_NCCL_QUIET.items():
        os.environ.setdefault(key, value)
    return {key: os.environ[key] for key in TORCH_NCCL_QUIET}


def _new_group(store: Any, rank: int, device: torch.device, watchdog_timeout_s: float) -> Any:
    """A 2-rank ProcessGroupNCCL on `store`, connected now rather than at the first op."""
    from torch.distributed import ProcessGroupNCCL

    _quiet_torch_nccl()
    opts = ProcessGroupNCCL.Options()
    opts._timeout = timedelta(seconds=watchdog_timeout_s)
    pg = ProcessGroupNCCL(store, rank, 2, opts)
    try:
        pg.bound_device_id = device
    except (AttributeError, RuntimeError):  # older torch: eager connect alone suffices
        pass
    with torch.cuda.device(device):
        pg.eager_connect_single_device(device)
        # NCCL connects point-to-point channels lazily, inside the first group that uses
        # them, and that blocks until the peer posts its side. A receive posted long
        # before its send (normal for D) would then block its thread, deadline or not.
        # One small exchange each way, while both sides are here, connects them now.
        buf = torch.zeros(2, 1 << 20, dtype=torch.uint8, device=device)
        pg._start_coalescing()
        pg.send([buf[0]], 1 - rank, 0)
        pg.recv([buf[1]], 1 - rank, 0)
        pg._end_coalescing().wait()
        torch.cuda.current_stream(device).synchronize()
    return pg


class NcclTransport:
    """Moves bytes and staged KV between GPUs over cached NCCL communicators.

    Args:
        cache: the communicators of this worker.
        unsafe_skip_event_wait: TEST ONLY. Post sends without waiting for the staging
            event, to show that the race this transport prevents is real.

    Set `trace` to a list to collect ``(label, timing event)`` pairs at each chunk's
    end (``send_done@B``, ``recv_done@B``, ``scatter_done@B``, B the chunk's end
    block within the call; ``@all`` for raw tensors): what a benchmark or
    `kvbroker trace` reads a transfer's GPU timeline from. Recording them costs a few
    microseconds a chunk, so leave it None otherwise.
    """

    def __init__(self, cache: CommunicatorCache, *, unsafe_skip_event_wait: bool = False) -> None:
        self.cache = cache
        self.device = cache.device
        self.stream = torch.cuda.Stream(self.device)
        self.scatter_stream = torch.cuda.Stream(self.device)
        self.unsafe_skip_event_wait = unsafe_skip_event_wait
        self.trace: list[tuple[str, torch.cuda.Event]] | None = None

    def _mark(self, stream: torch.cuda.Stream, label: str) -> None:
        if self.trace is not None:
            event = torch.cuda.Event(enable_timing=True)
            event.record(stream)
            self.trace.append((label, event))

    def _finish(
        self, comm: NcclCommunicator, works: Sequence[Any], stream: torch.cuda.Stream, op: Literal["send", "recv"],
        transfer_id: str, keep: Sequence[torch.Tensor] = (), ends: Sequence[Any] = ("all",),
    ) -> Completion:
        if self.trace is None:
            return comm.completion(works, stream, op, transfer_id, keep)
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            for work, end in zip(works, ends):
                work.wait()
                self._mark(stream, f"{op}_done@{end}")
        return comm.completion([], stream, op, transfer_id, [*keep, *works])

    # -- raw tensors -----------------------------------------------------------------

    def send_tensors(
        self, peer: str, tensors: Sequence[torch.Tensor], *,
        after: Sequence[torch.cuda.Event | None] | None = None, transfer_id: str = "",
    ) -> Completion:
        """Send `tensors` to `peer` as one NCCL group (one step's sends).

        The send waits for the events `after`, or by default for everything enqueued
        on the current stream so far (what produced the tensors).
        """
        comm = self.cache.get(peer, initiator=True)
        wait = () if self.unsafe_skip_event_wait else (_now(self.device) if after is None else after)
        work = comm.post([("send", t) for t in tensors], self.stream, wait)
        return self._finish(comm, [work], self.stream, "send", transfer_id)

    def recv_tensors(self, peer: str, tensors: Sequence[torch.Tensor], *, transfer_id: str = "") -> Completion:
        """Receive into `tensors` from `peer` as one NCCL group, after the current stream's work."""
        comm = self.cache.get(peer, initiator=False)
        work = comm.post([("recv", t) for t in tensors], self.stream, _now(self.device))
        return self._finish(comm, [work], self.stream, "recv", transfer_id)

    # -- staged KV -------------------------------------------------------------------

    def send_staged(
        self, peer: str, staged: StagedTransfer, *, first_block: int = 0, last_block: int | None = None,
        bounds: Sequence[int] | None = None, transfer_id: str = "",
    ) -> Completion:
        """Send blocks ``[first_block, last_block)`` of a staged transfer, one NCCL op per chunk.

        Chunk k is posted after the staging event that covers it, so chunk k can be on
        the wire while later chunks are still being gathered: enqueue the gathers
        (`Stager.gather_chunk`) first, then call this once, without waiting for the
        GPU. `bounds` (chunk ends in blocks, relative to `first_block`) must match
        the receiver's. Sending a transfer in several calls (a block range each) is
        allowed only if no other transfer to `peer` is posted in between.
        """
        comm = self.cache.get(peer, initiator=True)
        step = staged.paged.staged_block_nbytes
        data, keep, works = staged.tensor, [], []
        last = staged.num_blocks if last_block is None else last_block
        waited: torch.cuda.Event | None = None
        chunks = _ranges(last - first_block, bounds)
        with comm.lock:
            for b0, b1 in chunks:
                b0, b1 = b0 + first_block, b1 + first_block
                event = None if self.unsafe_skip_event_wait else staged.event_for(b1)
                if event is waited:  # the stream already waited for it (one gather, several sends)
                    event = None
                else:
                    waited = event
                chunk = data[b0 * step : b1 * step]
                if not chunk.is_cuda:  # spilled: bring it back through a bounce buffer
                    with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
                        if event is not None:
                            self.stream.wait_event(event)
                        bounce = torch.empty(chunk.numel(), dtype=torch.uint8, device=self.device)
                        bounce.copy_(chunk, non_blocking=True)
                    chunk, event = bounce, None
                    keep.append(bounce)
                works.append(comm.post([("send", chunk)], self.stream, [event]))
        return self._finish(comm, works, self.stream, "send", transfer_id, keep, [b1 + first_block for _, b1 in chunks])

    def recv_staged(
        self, peer: str, buf: torch.Tensor, paged: PagedKv, block_ids: torch.Tensor, *,
        bounds: Sequence[int] | None = None, transfer_id: str = "",
    ) -> Completion:
        """Receive staged blocks into `buf` (a pool lease) and scatter them into `block_ids`.

        Every chunk's receive is posted first (after the current stream's work, which
        may still use `buf` or the blocks); then the scatter stream waits for each
        receive in turn and scatters that chunk, so scattering chunk k overlaps
        receiving chunk k+1. The completion covers the last scatter. Send Ready before
        calling this (see the module doc): the sender's posting then overlaps ours.
        """
        comm = self.cache.get(peer, initiator=False)
        n = block_ids.numel()
        step = paged.staged_block_nbytes
        words = paged.staging_view(buf, n)
        chunks = _ranges(n, bounds)
        current = _now(self.device)
        works = []
        with comm.lock:
            for k, (b0, b1) in enumerate(chunks):
                works.append(comm.post([("recv", buf[b0 * step : b1 * step])], self.stream, current if k == 0 else ()))
        with torch.cuda.device(self.device), torch.cuda.stream(self.scatter_stream):
            # Whatever the caller enqueued on these blocks so far must finish before we write them.
            self.scatter_stream.wait_event(current[0])
            for work, (b0, b1) in zip(works, chunks):
                if work is not None:
                    work.wait()
                self._mark(self.scatter_stream, f"recv_done@{b1}")
                paged.scatter(block_ids[b0:b1], words[b0:b1])
                self._mark(self.scatter_stream, f"scatter_done@{b1}")
        return comm.completion([], self.scatter_stream, "recv", transfer_id, works)


def _now(device: torch.device) -> list[torch.cuda.Event]:
    """An event at the current tail of the current stream."""
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return [event]


def _ranges(num_blocks: int, bounds: Sequence[int] | None) -> list[tuple[int, int]]:
    ends = list(bounds) if bounds else [num_blocks]
    if not ends or ends[-1] != num_blocks or any(b <= a for a, b in zip([0] + ends, ends)):
        raise ValueError(f"chunk bounds {ends} must rise strictly and end at {num_blocks}.")
    return list(zip([0] + ends[:-1], ends))
