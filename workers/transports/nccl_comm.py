"""The GPU transport's communicators: the NCCL backends, the capped cache, rendezvous.

Theory of operation
-------------------
Each (local worker, remote worker) pair gets its own 2-rank communicator, outside any
global group: vLLM owns that. Three backends build it (`CommunicatorCache(backend=)`),
each a `workers.transports.communicator.Communicator`:

* "direct" (the default when the library loads): NCCL's C API through a small ctypes
  binding (`workers.transports.nccl_lib`) to the libnccl that torch's wheel ships.
  Why a custom binding: each op posted through torch's ProcessGroupNCCL costs the host
  0.1-0.25 ms (work objects, coalescing, watchdog bookkeeping; measured on an H200
  pair, torch 2.11), so a chunked transfer's first byte left about 0.25 ms after a
  bare send's and the wire idled between chunk posts. A direct post is NCCL's own
  group call (about 70 us of host time on that machine) plus one event wait and one
  record, with no torch context managers. Rendezvous: the initiator makes an
  ncclUniqueId (128 bytes) and publishes ``{"v": 2, "backend": "direct", "id",
  "nonce"}`` through the `Rendezvous`; the acceptor answers on ``<key>/joined`` with
  the nonce; then both run ncclCommInitRank (initiator = rank 0) and one small
  exchange each way on a helper thread under `connect_timeout_s`, aborting the
  communicator past it. Each communicator has its own high-priority CUDA stream,
  which waits at posting on the events the op depends on. A connected pair's posts
  keep the GIL (`nccl_lib`'s `held`): an enqueue does not block, and letting go of the
  GIL for it handed the engine's thread a switch per op.
* "torch": a `ProcessGroupNCCL` built on a `TCPStore` (the initiator starts the store
  on a free port and publishes ``{"host", "port", "nonce"}``; both build the group on a
  `PrefixStore` named by the nonce). Every op is posted in a coalescing group, even a
  lone send, since torch keys a lone point-to-point op to a second, lazily built
  communicator. Before its first group the transport switches off torch's NCCL flight
  recorder and monitor threads (`TORCH_NCCL_QUIET`; an operator's values win).
* "ipc" (`workers.transports.cuda_ipc`): both GPUs on one host; no NCCL at all: a send
  is one copy kernel straight into the receiver's buffer, mapped with CUDA IPC, paired
  with its receive through a page of shared memory. No communicator memory. It can
  write a staged transfer straight into D's blocks (`Communicator.writes_into_blocks`).

An acceptor builds whichever kind the initiator's payload names.

* Connecting. NCCL sets up point-to-point channels inside the first group that uses
  them, blocking the posting thread until the peer posts too, so without a warm-up a
  receive posted ahead of its send would hang its caller. Each backend runs one small
  exchange each way while both sides are building; after it, posting never blocks.
* Cache. `CommunicatorCache` keeps at most `capacity` (an NCCL one takes 0.3-1 GB of GPU
  memory on an H200, by NCCL version; an ipc one none) and evicts the least recently
  used *idle* one; busy ones are never evicted (`CommunicatorLimit` when all are).
  Evicted and failed communicators are aborted, which frees their memory.
* Ordering. A send is posted to run after the event of what wrote its bytes (P's
  gathers, recorded in `wait_for_save`), on the communicator's stream, so it cannot read
  staging before the gather that fills it. Ops pair by posting order alone, so one
  transfer's ops are posted under the communicator's lock, and a receiver posts its
  transfers in the order the sender sends them (`connector.nccl_link`).
* Deadlines. Ops return a `Completion` (a CUDA event after the op) whose
  `wait(deadline)` spins briefly, then polls in pauses of at most 100 us; past the
  deadline it aborts the communicator (a stuck NCCL kernel then returns), drops it from
  the cache and raises `SendTimeout`/`RecvTimeout`. The next use rebuilds it. The torch
  group's watchdog timeout is set far above any transfer deadline, so the watchdog
  (whose default reaction kills the process) never fires first.
* Rebuilds and eviction are one-sided, so an acceptor checks `Rendezvous.poll` on each
  use and replaces its communicator when the initiator published a newer nonce. If the
  initiator sends before the acceptor saw it, that transfer misses its deadline on both
  sides and both rebuild; no bytes land in the wrong buffer. The other way round, an
  acceptor that aborts its side (a deadline, `discard`) publishes the dead nonce under
  ``<key>/stale``, and the initiator's next use, seeing it, builds a new communicator
  instead of posting into one whose other side is gone.
"""

from __future__ import annotations

import json
import queue
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

import structlog
import torch

from protocols.errors import RendezvousError

from . import nccl_lib
from .communicator import (
    Communicator,
    CommunicatorLimit,
    Rendezvous,
    StreamWork,
    check_range,
    nbytes_of,
)
from .bell import Bell
from .cuda_ipc import connect_ipc
from .nccl_setup import (
    HIGH_PRIORITY,
    SHM_DIR,
    IpcDeclined,
    await_join,
    init_direct,
    join,
    master_store,
    new_torch_group,
    parse_payload,
    resolve_backend,
)

log = structlog.get_logger()


class QueueRendezvous:
    """A `Rendezvous` over `multiprocessing` queues, for tests and benchmarks on one host.

    Args:
        outbox: where this side's published payloads go, as ``(key, payload)``.
        inbox: where the other side's arrive.
        timeout_s: how long `receive` waits.
        drain_thread: move arriving payloads into memory on a thread of its own, as the
            broker client's loop does for `workers.rendezvous.BrokerRendezvous`, so that
            `poll` (on every use of a communicator) is a dict lookup, not a pipe poll.
            `close()` ends the thread.
    """

    def __init__(self, outbox: Any, inbox: Any, *, timeout_s: float = 60.0, drain_thread: bool = False) -> None:
        self._out, self._in, self._timeout_s = outbox, inbox, timeout_s
        self._unread: dict[str, bytes] = {}
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        if drain_thread:
            self._thread = threading.Thread(target=self._drain_forever, name="rendezvous-drain", daemon=True)
            self._thread.start()

    def publish(self, peer: str, key: str, payload: bytes) -> None:
        self._out.put((key, payload))

    def _drain_forever(self) -> None:
        while (item := self._in.get()) is not None:
            with self._cond:
                self._unread[item[0]] = item[1]
                self._cond.notify_all()

    def close(self) -> None:
        """End the drain thread, if any (the sentinel goes through our own inbox)."""
        if self._thread is not None:
            self._in.put(None)
            self._thread.join(timeout=5.0)
            self._thread = None

    def _drain(self, block_until: float | None) -> None:
        while True:
            try:
                if block_until is None:
                    item = self._in.get_nowait()
                else:
                    item = self._in.get(timeout=max(0.0, block_until - time.monotonic()))
            except queue.Empty:
                return
            with self._cond:
                self._unread[item[0]] = item[1]
            block_until = None

    def receive(self, peer: str, key: str, cancelled: threading.Event | None = None) -> bytes:
        deadline = time.monotonic() + self._timeout_s
        while True:
            with self._cond:
                if key in self._unread:
                    break
            if cancelled is not None and cancelled.is_set():
                raise RendezvousError(f"the wait for rendezvous data under {key!r} from {peer} was cancelled.")
            if time.monotonic() >= deadline:
                raise RendezvousError(f"no rendezvous data under {key!r} from {peer} in {self._timeout_s} s.")
            # A queue cannot be woken: look at `cancelled` every 50 ms (`wake` ends a wait
            # on the drain thread's condition at once).
            wait_until = deadline if cancelled is None else min(deadline, time.monotonic() + 0.05)
            if self._thread is not None:
                with self._cond:
                    self._cond.wait_for(lambda: key in self._unread, max(0.0, wait_until - time.monotonic()))
            else:
                self._drain(wait_until)
        if self._thread is None:
            self._drain(None)  # take the newest, if several generations queued up
        with self._cond:
            return self._unread.pop(key)

    def wake(self) -> None:
        # A wait on the drain thread's condition looks at its cancel flag now; a wait on
        # the queue itself does within 50 ms.
        with self._cond:
            self._cond.notify_all()

    def poll(self, peer: str, key: str) -> bytes | None:
        if self._thread is None and not self._in.empty():  # one pipe poll, not the queue's lock
            self._drain(None)
        with self._cond:
            return self._unread.pop(key, None)


class TorchCommunicator(Communicator):
    """A 2-rank communicator over torch's ProcessGroupNCCL."""

    backend = "torch"

    def __init__(self, *, peer: str, rank: int, device: torch.device, pg: Any, store: Any, nonce: str,
                 cache: Any, mem_bytes: int) -> None:
        super().__init__(peer=peer, rank=rank, device=device, nonce=nonce, cache=cache, mem_bytes=mem_bytes)
        self.pg = pg
        self._store = store  # the store's server must live as long as the group

    def post(
        self, ops: Sequence[tuple[Literal["send", "recv"], torch.Tensor]], stream: torch.cuda.Stream,
        after: Sequence[torch.cuda.Event | None] = (),
    ) -> Any:
        # torch posts through `stream`, which waits for `after` and whose tail the group's
        # NCCL stream then waits on.
        if self.closed:
            raise RuntimeError(f"the communicator with {self.peer} is closed; get a new one from the cache.")
        with self.lock, torch.cuda.device(self.device), torch.cuda.stream(stream):
            for event in after:
                if event is not None:
                    stream.wait_event(event)
            try:
                self.pg._start_coalescing()
                try:
                    for op, tensor in ops:
                        fn = self.pg.send if op == "send" else self.pg.recv
                        fn([tensor], self.peer_rank, 0)
                finally:
                    work = self.pg._end_coalescing()
                return work
            except BaseException:
                self.fail("posting an op failed")
                raise

    def post_range(
        self, op: Literal["send", "recv"], base: torch.Tensor, start: int, nbytes: int, stream: torch.cuda.Stream,
        after: torch.cuda.Event | None = None,
    ) -> Any:
        check_range(base, start, nbytes)
        return self.post([(op, base[start : start + nbytes])], stream, [after])

    def _abort(self) -> None:
        try:
            try:
                self.pg.abort()
            except TypeError:  # torch versions whose abort() takes a reason
                self.pg.abort(None)
        finally:
            self.pg = None
            self._store = None


@dataclass(frozen=True)
class CacheStats:
    size: int
    capacity: int
    created: int
    evicted: int
    aborted: int


class DirectCommunicator(Communicator):
    """A 2-rank communicator driven through `workers.transports.nccl_lib`: a few
    microseconds of host time an op instead of torch's 0.1-0.25 ms.

    Like a process group it runs its ops on a stream of its own, which waits on the
    posting stream's tail at posting; so two communicators of one transport never queue
    behind each other, and the ordering rules of `Communicator.post` hold as they are.
    """

    backend = "direct"

    def __init__(
        self, *, peer: str, rank: int, device: torch.device, lib: Any, handle: int, nonce: str,
        cache: CommunicatorCache | None, mem_bytes: int,
    ) -> None:
        super().__init__(peer=peer, rank=rank, device=device, nonce=nonce, cache=cache, mem_bytes=mem_bytes)
        self.lib, self.handle = lib, handle
        # High priority: when a copy kernel on this GPU has CTAs waiting (a gather or
        # scatter of another chunk), the block scheduler places NCCL's first, so a copy
        # cannot hold a send or receive back from the wire.
        self.nccl_stream = torch.cuda.Stream(device, priority=HIGH_PRIORITY)
        self._stream_ptr = self.nccl_stream.cuda_stream
        # Whether an op was posted already: NCCL connects a pair at its first op, which
        # blocks until the peer posts too; later posts only enqueue, and keep the GIL.
        self._connected = False

    def post(
        self, ops: Sequence[tuple[Literal["send", "recv"], torch.Tensor]], stream: torch.cuda.Stream,
        after: Sequence[torch.cuda.Event | None] = (),
    ) -> Any:
        # The lean path, on every transfer's critical path: no device or stream context
        # managers and no hop through `stream`; each costs the host microseconds, and a
        # transfer posts one group per chunk (measured: 0.27 ms a post before, of which
        # NCCL's own group call was 0.07 ms).
        if self.closed:
            raise RuntimeError(f"the communicator with {self.peer} is closed; get a new one from the cache.")
        lib, handle, peer, sp, ns = self.lib, self.handle, self.peer_rank, self._stream_ptr, self.nccl_stream
        sizes = [nbytes_of(tensor) for _, tensor in ops]
        with self.lock:
            for event in after:
                if event is not None:
                    ns.wait_event(event)
            held = self._connected
            try:
                lib.group_start(held)
                try:
                    for (op, tensor), size in zip(ops, sizes):
                        (lib.send if op == "send" else lib.recv)(tensor.data_ptr(), size, peer, handle, sp, held)
                finally:
                    lib.group_end(held)
            except BaseException:
                self.fail("posting an op failed")
                raise
            self._connected = True
            done = torch.cuda.Event()
            done.record(ns)
        return StreamWork(done, [tensor for _, tensor in ops])

    def post_range(
        self, op: Literal["send", "recv"], base: torch.Tensor, start: int, nbytes: int, stream: torch.cuda.Stream,
        after: torch.cuda.Event | None = None,
    ) -> Any:
        # The leanest post, for the first chunk of a transfer (on its critical path): no
        # slice of `base`, no group around the single op (NCCL groups one op by itself).
        if self.closed:
            raise RuntimeError(f"the communicator with {self.peer} is closed; get a new one from the cache.")
        check_range(base, start, nbytes)
        lib = self.lib
        with self.lock:
            if after is not None:
                self.nccl_stream.wait_event(after)
            try:
                (lib.send if op == "send" else lib.recv)(base.data_ptr() + start, nbytes, self.peer_rank, self.handle,
                                                         self._stream_ptr, self._connected)
            except BaseException:
                self.fail("posting an op failed")
                raise
            self._connected = True
            done = torch.cuda.Event()
            done.record(self.nccl_stream)
        return StreamWork(done, [base])

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
            ProcessGroupNCCL), "ipc" (copy kernels over CUDA IPC, one host only:
            `cuda_ipc`), or None: `KVBROKER_NCCL_BACKEND` if set, else "direct" when the
            library loads, else "torch". It applies to communicators this side
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
        # What this side builds as initiator, and what instead when the peer declines it
        # ("ipc,direct": ipc within a host, direct between hosts).
        self.backend, _, self.fallback = resolve_backend(backend).partition(",")
        self.local_id, self.device, self.rendezvous = local_id, torch.device(device), rendezvous
        self.capacity, self.advertise_host = capacity, advertise_host
        self.connect_timeout_s, self.watchdog_timeout_s = connect_timeout_s, watchdog_timeout_s
        self._comms: OrderedDict[str, Communicator] = OrderedDict()
        self._dropped: dict[str, bytes] = {}  # peer -> a stale notice `usable` read, for `get` to act on
        self._lock = threading.Lock()
        self._created = self._evicted = self._aborted = 0
        # Rung by ipc peers once they posted a receive straight into this side's sends'
        # blocks (`bell_token`); the link's poller waits on it.
        self.bell: Bell | None = None

    @staticmethod
    def key(initiator: str, acceptor: str) -> str:
        return f"nccl/{initiator}>{acceptor}"

    def get(self, peer: str, *, initiator: bool, cancelled: threading.Event | None = None,
            purpose: str = "") -> Communicator:
        """The communicator with `peer`, built through the rendezvous if needed.

        Args:
            initiator: True on the side that creates the store (the sender).
            cancelled: set it (then `Rendezvous.wake`) to end a wait for the peer's
                rendezvous data early, with `RendezvousError`.
            purpose: the transfer a communicator built now is for. The initiator names it
                in its rendezvous data; the acceptor joins only a build for the same
                transfer (or one that names none). So a send built for a transfer the
                acceptor gave up can never pair with the acceptor's next receive.

        Raises:
            RendezvousError: the peer's address did not arrive in time or was invalid.
            CommunicatorLimit: the cache is full of busy communicators.
            RuntimeError: torch could not build the process group (peer gone, ...).
        """
        payload = None
        with self._lock:
            comm = self._comms.get(peer)
            if comm is not None and initiator:
                stale = self._dropped.pop(peer, None) or self.rendezvous.poll(peer, self._stale_key(peer))
                if stale is not None and stale.decode(errors="replace") == comm.nonce:  # the acceptor dropped it
                    self._comms.pop(peer)
                    self._aborted += 1
                    comm.abort()
                    comm = None
            if comm is not None and not initiator:
                payload = self.rendezvous.poll(peer, self.key(peer, self.local_id))
                info = None if payload is None else parse_payload(payload)
                if info is not None and (info["nonce"] == comm.nonce or not _built_for(info, purpose)):
                    payload = None  # ours, or a build for another transfer: keep ours
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
        comm = self._connect(peer, initiator, payload, cancelled, purpose)
        with self._lock:
            old = self._comms.pop(peer, None)
            self._comms[peer] = comm
            self._created += 1
            victims = self._evict_locked()
        for victim in ([old] if old is not None else []) + victims:
            victim.abort()
        return comm

    def usable(self, peer: str, nonce: str, *, initiator: bool) -> Communicator | None:
        """The cached communicator with `peer` if it is the one named `nonce` and an op
        may be posted on it now: whole, and (initiator) not dropped by the acceptor. Builds
        nothing, aborts nothing, never blocks; None: `get` decides (it may do both).
        An acceptor's use skips the check for a rebuild by the initiator: an op on a
        communicator named by the transfer's own ticket pairs there or times out."""
        with self._lock:
            comm = self._comms.get(peer)
            if comm is None or comm.closed or comm.broken or comm.nonce != nonce:
                return None
            if initiator:
                stale = self.rendezvous.poll(peer, self._stale_key(peer))
                if stale is not None:  # `get` acts on it: aborting blocks
                    self._dropped[peer] = stale
                    return None
            self._comms.move_to_end(peer)
            return comm

    def _stale_key(self, peer: str) -> str:
        """Where an acceptor tells this initiator it dropped their communicator."""
        return f"{self.key(self.local_id, peer)}/stale"

    def current(self, peer: str) -> Communicator | None:
        """The communicator with `peer` now, if one is cached and whole; builds nothing
        and asks the rendezvous nothing."""
        with self._lock:
            comm = self._comms.get(peer)
        return None if comm is None or comm.closed or comm.broken else comm

    def built(self) -> list[Communicator]:
        """The communicators cached now that are whole; builds nothing, asks nothing."""
        with self._lock:
            comms = list(self._comms.values())
        return [c for c in comms if not (c.closed or c.broken)]

    def discard(self, peer: str) -> None:
        """Abort and forget the communicator with `peer`, if any (e.g. the peer restarted,
        or an op on it had to be cut short). An acceptor also tells the initiator, whose
        side would otherwise stay up and take the next transfer's first op, so that its
        next use builds a new one."""
        with self._lock:
            comm = self._comms.pop(peer, None)
            if comm is not None:
                self._aborted += 1
        if comm is not None:
            comm.abort()
            self.tell_stale(comm)

    def statistics(self) -> CacheStats:
        with self._lock:
            return CacheStats(len(self._comms), self.capacity, self._created, self._evicted, self._aborted)

    def close(self) -> None:
        """Abort every communicator and remove the bell; the cache stays usable."""
        with self._lock:
            comms = list(self._comms.values())
            self._comms.clear()
            bell, self.bell = self.bell, None
        for comm in comms:
            comm.abort()
        if bell is not None:
            bell.close()

    def bell_token(self) -> int:
        with self._lock:
            if self.bell is None:
                self.bell = Bell(SHM_DIR)
            return self.bell.token

    # -- internals -------------------------------------------------------------------

    def forget(self, comm: Communicator) -> None:
        with self._lock:
            if self._comms.get(comm.peer) is comm:
                del self._comms[comm.peer]
                self._aborted += 1

    def tell_stale(self, comm: Communicator) -> None:
        """An acceptor dropped `comm`: tell the initiator (see `discard`)."""
        if comm.rank != 1:
            return
        try:
            self.rendezvous.publish(comm.peer, f"{self.key(comm.peer, self.local_id)}/stale", comm.nonce.encode())
        except Exception as exc:  # the initiator then finds out by its next op's deadline
            log.warning("nccl.stale_not_sent", peer=comm.peer, nonce=comm.nonce, error=repr(exc))

    def _evict_locked(self) -> list[Communicator]:
        victims: list[Communicator] = []
        while len(self._comms) > self.capacity:
            idle = next((p for p, c in self._comms.items() if c.idle()), None)
            if idle is None:  # all became busy while we connected: over capacity until one idles
                log.warning("nccl.over_capacity", size=len(self._comms), capacity=self.capacity)
                break
            victims.append(self._comms.pop(idle))
            self._evicted += 1
        return victims

    def _connect(
        self, peer: str, initiator: bool, payload: bytes | None, cancelled: threading.Event | None, purpose: str = "",
    ) -> Communicator:
        info = None if initiator else self._build_for(peer, payload, cancelled, purpose)
        try:
            return self._connect_over(info["backend"] if info is not None else self.backend, peer, info, cancelled,
                                      purpose)
        except IpcDeclined as exc:
            if not exc.fallback:
                raise
            log.info("nccl.ipc_declined", peer=peer, reason=str(exc), fallback=exc.fallback, initiator=initiator)
            if initiator:
                return self._connect_over(exc.fallback, peer, None, cancelled, purpose)
            info = self._build_for(peer, None, cancelled, purpose)  # the initiator's fallback build
            return self._connect_over(info["backend"], peer, info, cancelled, purpose)

    def _build_for(self, peer: str, payload: bytes | None, cancelled: threading.Event | None,
                   purpose: str) -> dict[str, Any]:
        """Acceptor: the initiator's rendezvous data for a build this side may join
        (`payload`, if given and usable); builds for other transfers are left."""
        key = self.key(peer, self.local_id)
        info = None if payload is None else parse_payload(payload)
        while info is None or not _built_for(info, purpose):
            info = parse_payload(self.rendezvous.receive(peer, key, cancelled))
        return info

    def _connect_over(self, backend: str, peer: str, info: dict[str, Any] | None,
                      cancelled: threading.Event | None, purpose: str) -> Communicator:
        if backend == "direct":
            return self._connect_direct(peer, info, cancelled, purpose)
        if backend == "ipc":
            return connect_ipc(self, peer, info, cancelled, purpose)
        return self._connect_torch(peer, info, purpose)

    def _connect_direct(
        self, peer: str, info: dict[str, Any] | None, cancelled: threading.Event | None = None, purpose: str = "",
    ) -> Communicator:
        """Initiator: a unique id through the rendezvous, then the acceptor's ack; acceptor:
        the ack. Then both run ncclCommInitRank and a warm-up exchange under a deadline."""
        lib = nccl_lib.load()
        if lib is None:
            raise RendezvousError(f"{peer} asked for a direct NCCL communicator: {nccl_lib.load_error()}")
        key = self.key(self.local_id, peer) if info is None else self.key(peer, self.local_id)
        deadline = time.monotonic() + self.connect_timeout_s
        if info is None:
            uid, nonce = lib.unique_id(), secrets.token_hex(8)
            self.rendezvous.publish(peer, key, json.dumps(
                {"v": 2, "backend": "direct", "id": uid.hex(), "nonce": nonce, "for": purpose}).encode())
            # ncclCommInitRank blocks until the peer joins: start it once the peer is there.
            declined = await_join(self.rendezvous, peer, key, nonce, cancelled, deadline, "NCCL")
            if declined is not None:
                raise RendezvousError(f"{peer} declined NCCL rendezvous {nonce}: {declined}")
            rank = 0
        else:
            uid, nonce, rank = info["id"], info["nonce"], 1
            join(self.rendezvous, peer, key, nonce)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        handle = init_direct(lib, uid, rank, self.device, deadline, peer, nonce)
        mem = max(0, free_before - torch.cuda.mem_get_info(self.device)[0])
        log.info("nccl.connected", peer=peer, rank=rank, nonce=nonce, backend="direct", mem_mib=round(mem / 2**20, 1))
        return DirectCommunicator(peer=peer, rank=rank, device=self.device, lib=lib, handle=handle, nonce=nonce,
                                  cache=self, mem_bytes=mem)

    def _connect_torch(self, peer: str, info: dict[str, Any] | None, purpose: str = "") -> Communicator:
        from torch.distributed import PrefixStore, TCPStore

        initiator = info is None
        timeout = timedelta(seconds=self.connect_timeout_s)
        if initiator:
            store = master_store(self.advertise_host, timeout)
            nonce = secrets.token_hex(8)
            self.rendezvous.publish(
                peer, self.key(self.local_id, peer),
                json.dumps({"v": 1, "host": self.advertise_host, "port": store.port, "nonce": nonce,
                            "for": purpose}).encode(),
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
        pg = new_torch_group(PrefixStore(f"kvbroker/{nonce}/pg", store), rank, self.device, self.watchdog_timeout_s)
        mem = max(0, free_before - torch.cuda.mem_get_info(self.device)[0])
        log.info("nccl.connected", peer=peer, rank=rank, nonce=nonce, backend="torch", mem_mib=round(mem / 2**20, 1))
        return TorchCommunicator(
            peer=peer, rank=rank, device=self.device, pg=pg, store=store, nonce=nonce, cache=self, mem_bytes=mem
        )


def _built_for(info: dict[str, Any], purpose: str) -> bool:
    """Whether an initiator's rendezvous data (`parse_payload`'s) may be joined for the
    transfer `purpose`: it was built for that transfer, or names none (older peers), or
    `purpose` is ""."""
    built = info["for"]
    return not purpose or not built or built == purpose
