"""NCCL communicators for the GPU transport: the backends, a capped cache, rendezvous.

See `workers/transports/nccl.py` for the theory of operation; this module holds the
communicator side of it (building, posting, completion, abort, LRU cache) so the
transport module keeps to moving staged transfers.
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
from typing import Any, Literal, Protocol

import structlog
import torch

from protocols.errors import KvBrokerError, RecvTimeout, RendezvousError, SendTimeout

from .nccl_setup import (
    HIGH_PRIORITY,
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


class CommunicatorLimit(KvBrokerError):
    """Every cached communicator is busy and the cache is full."""


class Rendezvous(Protocol):
    """Carries a small payload from the initiator to one acceptor (the broker's `Relay`).

    `receive` blocks until a payload for `key` arrives and raises `RendezvousError`
    past its own deadline, or soon after `cancelled` is set (`wake` hurries it);
    `poll` returns the newest unread payload or None at once.
    """

    def publish(self, peer: str, key: str, payload: bytes) -> None: ...

    def receive(self, peer: str, key: str, cancelled: threading.Event | None = None) -> bytes: ...

    def wake(self) -> None: ...

    def poll(self, peer: str, key: str) -> bytes | None: ...


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


_PENDING_PRUNE_AT = 16

# Whether a direct communicator keeps the GIL while it enqueues an op on a pair already
# connected (`NcclLib`'s `held`). False: every NCCL call lets go of it, as ctypes does
# by default (`bench/connector_path.py --hold-gil 0`).
HOLD_GIL_POSTS = True


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

    def absorb(self, earlier: Sequence[Completion]) -> None:
        """Take over what `earlier` completions on this communicator's stream keep alive
        (they end before this one), so waiting for this one releases all of it."""
        for other in earlier:
            self._keep.extend(other._keep)
            other._keep = []

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
            # No sleep(0) while spinning: it gives up the GIL and the CPU, and on a busy
            # host the end was then seen 20-50 us late (measured on an H200 pair).
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
        """Post `ops` as one NCCL group, to run after the events `after`; returns the work.

        `after` must cover everything the group depends on (what wrote a send's
        tensor, what still reads a receive's). torch posts through `stream`, which
        waits for `after` and whose tail the group's NCCL stream then waits on; the
        direct backend leaves `stream` alone and has its NCCL stream wait for `after`
        itself. Later work on `stream` cannot delay the group either way.
        ``work.wait()`` makes the current stream wait for the group.

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

    def post_range(
        self, op: Literal["send", "recv"], base: torch.Tensor, start: int, nbytes: int, stream: torch.cuda.Stream,
        after: torch.cuda.Event | None = None,
    ) -> Any:
        """Post one op on bytes ``[start, start + nbytes)`` of `base` (a contiguous uint8
        CUDA tensor, see `check_byte_buffer`), after the event `after`: `post` for a chunk
        of a transfer."""
        _check_range(base, start, nbytes)
        return self.post([(op, base[start : start + nbytes])], stream, [after])

    def completion(
        self, works: Sequence[Any], stream: torch.cuda.Stream, op: Literal["send", "recv"], transfer_id: str = "",
        keep: Sequence[Any] = (),
    ) -> Completion:
        """Make `stream` wait for `works` (no host block) and return an event after them.
        When `works` are all posted groups of a backend with its own stream (`_DirectWork`),
        the last one's event is the completion: they run in order on that stream."""
        mine = [w for w in works if w is not None]
        if mine and all(isinstance(w, _DirectWork) for w in mine):
            done = Completion(self, mine[-1].event, op, transfer_id, [*keep, *mine])
            self._track(done)
            return done
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            for work in works:
                if work is not None:
                    work.wait()
            event = torch.cuda.Event()
            event.record(stream)
        # The works (and the tensors a direct one holds) live until the completion is seen.
        done = Completion(self, event, op, transfer_id, [*keep, *(w for w in works if w is not None)])
        self._track(done)
        return done

    def _track(self, done: Completion) -> None:
        # Completions nobody waits for (all but the last of a spilled transfer's chunks)
        # hold their bounce buffers until seen done here; pruning past a few bounds that.
        self._pending.append(done)
        if len(self._pending) > _PENDING_PRUNE_AT:
            self._pending = [c for c in self._pending if not c.done()]

    def fail(self, reason: str) -> None:
        """Abort after an error or a timeout and drop out of the cache."""
        if self.closed:
            return
        self.broken = True
        log.warning("nccl.abort", peer=self.peer, nonce=self.nonce, backend=self.backend, reason=reason)
        if self._cache is not None:
            self._cache._forget(self)
        self.abort()
        if self._cache is not None:
            self._cache._tell_stale(self)

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
    """A posted group of a `DirectCommunicator` (or an `IpcCommunicator`): an event after
    it on the communicator's own stream.

    Holds the group's tensors, so the caching allocator cannot hand their memory to
    anyone else while the ops may still use it."""

    __slots__ = ("event", "tensors")

    def __init__(self, event: torch.cuda.Event, tensors: list[torch.Tensor]) -> None:
        self.event, self.tensors = event, tensors

    def wait(self) -> None:
        """Make the current stream wait for the group (no host block)."""
        torch.cuda.current_stream().wait_event(self.event)


def check_byte_buffer(buf: torch.Tensor) -> None:
    """Raise unless `buf` can be addressed by byte ranges (`post_range`): contiguous uint8 on a GPU."""
    if buf.dtype is not torch.uint8 or not buf.is_cuda or not buf.is_contiguous():
        raise ValueError(f"NCCL byte ranges need a contiguous uint8 CUDA buffer; got {buf.dtype} on {buf.device}.")


def _check_range(base: torch.Tensor, start: int, nbytes: int) -> None:
    # Only the bounds, on the critical path; what `base` is was checked where it came
    # from (a pool's own tensor, or `check_byte_buffer`).
    if not (0 <= start and 0 < nbytes and start + nbytes <= base.numel()):
        raise ValueError(f"bytes [{start}, {start + nbytes}) lie outside a {base.numel()}-byte buffer.")


def _nbytes(tensor: torch.Tensor) -> int:
    if not tensor.is_cuda or not tensor.is_contiguous():
        raise ValueError(f"NCCL ops need contiguous CUDA tensors; got one on {tensor.device}.")
    return tensor.numel() * tensor.element_size()


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
        # High priority: when a copy kernel on this GPU has CTAs waiting (a gather or
        # scatter of another chunk), the block scheduler places NCCL's first, so a copy
        # cannot hold a send or receive back from the wire.
        self.nccl_stream = torch.cuda.Stream(device, priority=HIGH_PRIORITY)
        self._stream_ptr = self.nccl_stream.cuda_stream
        # Whether an op was posted already: NCCL connects a pair at its first op, which
        # blocks until the peer posts too; later posts only enqueue, and keep the GIL
        # for it (`HOLD_GIL_POSTS`).
        self._connected = False

    @property
    def _held(self) -> bool:
        """Whether the next enqueue keeps the GIL: the pair is connected (`HOLD_GIL_POSTS`)."""
        return HOLD_GIL_POSTS and self._connected

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
        sizes = [_nbytes(tensor) for _, tensor in ops]
        with self.lock:
            for event in after:
                if event is not None:
                    ns.wait_event(event)
            held = self._held
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
        return _DirectWork(done, [tensor for _, tensor in ops])

    def post_range(
        self, op: Literal["send", "recv"], base: torch.Tensor, start: int, nbytes: int, stream: torch.cuda.Stream,
        after: torch.cuda.Event | None = None,
    ) -> Any:
        # The leanest post, for the first chunk of a transfer (on its critical path): no
        # slice of `base`, no group around the single op (NCCL groups one op by itself).
        if self.closed:
            raise RuntimeError(f"the communicator with {self.peer} is closed; get a new one from the cache.")
        _check_range(base, start, nbytes)
        lib = self.lib
        with self.lock:
            if after is not None:
                self.nccl_stream.wait_event(after)
            try:
                (lib.send if op == "send" else lib.recv)(base.data_ptr() + start, nbytes, self.peer_rank, self.handle,
                                                         self._stream_ptr, self._held)
            except BaseException:
                self.fail("posting an op failed")
                raise
            self._connected = True
            done = torch.cuda.Event()
            done.record(self.nccl_stream)
        return _DirectWork(done, [base])

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
        self._comms: OrderedDict[str, NcclCommunicator] = OrderedDict()
        self._dropped: dict[str, bytes] = {}  # peer -> a stale notice `usable` read, for `get` to act on
        self._lock = threading.Lock()
        self._created = self._evicted = self._aborted = 0

    @staticmethod
    def key(initiator: str, acceptor: str) -> str:
        return f"nccl/{initiator}>{acceptor}"

    def get(self, peer: str, *, initiator: bool, cancelled: threading.Event | None = None,
            purpose: str = "") -> NcclCommunicator:
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

    def usable(self, peer: str, nonce: str, *, initiator: bool) -> NcclCommunicator | None:
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

    def current(self, peer: str) -> NcclCommunicator | None:
        """The communicator with `peer` now, if one is cached and whole; builds nothing
        and asks the rendezvous nothing."""
        with self._lock:
            comm = self._comms.get(peer)
        return None if comm is None or comm.closed or comm.broken else comm

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
            self._tell_stale(comm)

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

    def _tell_stale(self, comm: NcclCommunicator) -> None:
        """An acceptor dropped `comm`: tell the initiator (see `discard`)."""
        if comm.rank != 1:
            return
        try:
            self.rendezvous.publish(comm.peer, f"{self.key(comm.peer, self.local_id)}/stale", comm.nonce.encode())
        except Exception as exc:  # the initiator then finds out by its next op's deadline
            log.warning("nccl.stale_not_sent", peer=comm.peer, nonce=comm.nonce, error=repr(exc))

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

    def _connect(
        self, peer: str, initiator: bool, payload: bytes | None, cancelled: threading.Event | None, purpose: str = "",
    ) -> NcclCommunicator:
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
                      cancelled: threading.Event | None, purpose: str) -> NcclCommunicator:
        if backend == "direct":
            return self._connect_direct(peer, info, cancelled, purpose)
        if backend == "ipc":
            from .cuda_ipc import connect_ipc  # imports this module

            return connect_ipc(self, peer, info, cancelled, purpose)
        return self._connect_torch(peer, info, purpose)

    def _connect_direct(
        self, peer: str, info: dict[str, Any] | None, cancelled: threading.Event | None = None, purpose: str = "",
    ) -> NcclCommunicator:
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

    def _connect_torch(self, peer: str, info: dict[str, Any] | None, purpose: str = "") -> NcclCommunicator:
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
        return NcclCommunicator(
            peer=peer, rank=rank, device=self.device, pg=pg, store=store, nonce=nonce, cache=self, mem_bytes=mem
        )


def _built_for(info: dict[str, Any], purpose: str) -> bool:
    """Whether an initiator's rendezvous data (`parse_payload`'s) may be joined for the
    transfer `purpose`: it was built for that transfer, or names none (older peers), or
    `purpose` is ""."""
    built = info["for"]
    return not purpose or not built or built == purpose
