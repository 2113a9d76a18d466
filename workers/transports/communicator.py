"""What every communicator backend is: one pair's ordered sends and receives on a GPU.

`Communicator` is the interface the connector's link (`connector.nccl_link`) and the
cache (`workers.transports.nccl_comm.CommunicatorCache`) program against; the backends
are `TorchCommunicator` and `DirectCommunicator` (`nccl_comm`) and `IpcCommunicator`
(`cuda_ipc`). What a backend can do beyond byte ranges it says through capabilities,
never through its type:

* `writes_into_blocks`: a staged transfer can go as one op from P's staging straight
  into D's blocks (`takes_blocks`, `post_blocks`, `send_blocks`), with no receive pool
  bytes and no scatter on D.
* `send_ready()`: whether a send posted now only enqueues, or would first wait on the
  host for the peer (the ipc backend reads the receiver's descriptor before it copies).

A block send may be posted before the producer's layers are all gathered: it then
follows the producer's `LayerFeed`, which launches it a group of layers at a time as
their gathers are enqueued (`LayerSend.launch`), and its end (`PendingEnd`) is recorded
by whichever thread launches its last layers.

This module imports no backend; the backends import it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol

import structlog
import torch

from protocols.errors import KvBrokerError, RecvTimeout, SendTimeout

from .ipc_mailbox import UNTAGGED

if TYPE_CHECKING:  # pragma: no cover
    from workers.gpu_staging import PagedKv

__all__ = [
    "Communicator", "CommunicatorLimit", "Completion", "LayerFeed", "LayerSend", "Owner", "PendingEnd", "Rendezvous",
    "StreamWork", "check_range", "nbytes_of",
]

log = structlog.get_logger()

Op = Literal["send", "recv"]

# Completions nobody waits for hold what they keep until seen done: pruned past this many.
_PENDING_PRUNE_AT = 16


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


class Owner(Protocol):
    """What a communicator and a backend's builder need of the cache that holds it."""

    local_id: str
    device: torch.device
    rendezvous: Rendezvous
    connect_timeout_s: float
    fallback: str

    def key(self, initiator: str, acceptor: str) -> str: ...

    def forget(self, comm: Communicator) -> None: ...

    def tell_stale(self, comm: Communicator) -> None: ...

    def bell_token(self) -> int:
        """This side's bell (`workers.transports.bell`), made at the first call: its token."""
        ...


class PendingEnd:
    """The end of an op launched in parts, possibly by another thread than the one that
    posted it (a block send that follows a `LayerFeed`): an event recorded by the launch
    of its last part. Until then it reads as not done, unlike a CUDA event never
    recorded, which reads as done. An op given up before its last part (its
    communicator was aborted) reads as done: its waiter then finds the communicator
    closed."""

    __slots__ = ("event", "given_up", "_set", "_lock", "_hook")

    def __init__(self) -> None:
        self.event = torch.cuda.Event()
        self.given_up = False
        self._set = threading.Event()
        self._lock = threading.Lock()
        self._hook: Callable[[], None] | None = None

    def record(self, stream: torch.cuda.Stream) -> None:
        self.event.record(stream)
        self._mark()

    def give_up(self) -> None:
        self.given_up = True
        self._mark()

    def on_recorded(self, hook: Callable[[], None]) -> bool:
        """Have `hook` (it must not block) called once the last part is launched or the
        op given up, unless that happened already: then False, and no call. One hook (a
        later call replaces it): the one poller that watches the op."""
        with self._lock:
            if self._set.is_set():
                return False
            self._hook = hook
            return True

    def _mark(self) -> None:
        with self._lock:
            self._set.set()
            hook, self._hook = self._hook, None
        if hook is not None:
            hook()

    @property
    def recorded(self) -> bool:
        """The last part was launched (or the op given up): no launch is still to come."""
        return self._set.is_set()

    def wait_recorded(self, timeout_s: float) -> bool:
        return self._set.wait(max(timeout_s, 0.0))

    def query(self) -> bool:
        return self._set.is_set() and (self.given_up or self.event.query())

    def wait_on(self, stream: torch.cuda.Stream) -> None:
        """`stream` waits for the op's end (recorded already; given up: nothing to wait for)."""
        if not self.given_up:
            stream.wait_event(self.event)


class LayerSend(Protocol):
    """A posted block send, launched in parts as the producer's layers are gathered."""

    def launch(self, layers: int, after: torch.cuda.Event | None) -> None:
        """Copy the layers up to `layers` (those not launched yet) once `after`, an
        event recorded after their gathers, completed; the launch of the last layer
        also tells the receiver. Never waits on the host."""


class LayerFeed(Protocol):
    """Where a producer counts its step's layers gathered (on the compute stream).

    A block send posted before every layer is gathered follows it: `follow` launches
    the layers gathered so far at once and the rest as their gathers are enqueued, each
    behind an event recorded after them. So every wait on the GPU is for work already
    enqueued: a wait for a count that a later host call would write can stall, on a
    hardware queue shared with other streams, the very work that writes it."""

    def follow(self, send: LayerSend) -> None: ...


class Completion:
    """A CUDA event after one or more ops. A missed deadline aborts the communicator
    and raises `SendTimeout`/`RecvTimeout`: the bytes are then lost."""

    def __init__(self, comm: Communicator, event: torch.cuda.Event, op: Op, transfer_id: str,
                 keep: Sequence[Any] = ()) -> None:
        self.comm, self.event, self.op, self.transfer_id = comm, event, op, transfer_id
        self._keep = list(keep)  # the posted works (and what they hold) must outlive the op

    def done(self) -> bool:
        """True once the op finished on the GPU; never blocks."""
        return self.event.query()

    def until_launched(self, hook: Callable[[], None]) -> bool:
        """Whether the op's last part is still to be launched (a block send that follows
        a forward pass): it cannot end before that, and `hook` (which must not block) is
        called once it is launched."""
        end = self.event
        return isinstance(end, PendingEnd) and end.on_recorded(hook)

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


class StreamWork:
    """A posted group of a backend with a stream of its own (direct, ipc): an event after
    it on that stream (a `PendingEnd` where the op is launched in parts).

    Holds the group's tensors, so the caching allocator cannot hand their memory to
    anyone else while the ops may still use it."""

    __slots__ = ("event", "tensors")

    def __init__(self, event: torch.cuda.Event | PendingEnd, tensors: list[torch.Tensor]) -> None:
        self.event, self.tensors = event, tensors

    def wait(self) -> None:
        """Make the current stream wait for the group (no host block).

        Raises:
            RuntimeError: the group is launched in parts and its last part is not yet:
                there is no event to wait on (its `Completion` waits on the host)."""
        stream = torch.cuda.current_stream()
        if isinstance(self.event, PendingEnd):
            if not self.event.recorded:
                raise RuntimeError("this op's last part is not launched yet; wait for its Completion on the host.")
            self.event.wait_on(stream)
        else:
            stream.wait_event(self.event)


class Communicator:
    """One 2-rank communicator with one peer, built by the cache (`Owner`).

    A backend implements `post`, `post_range` and `_abort`, and the capabilities it has
    (module docstring). Posting order pairs ops: a receiver posts its transfers in the
    order the sender sends them, and one transfer's ops are posted under `lock`.
    """

    backend = ""
    writes_into_blocks = False

    def __init__(self, *, peer: str, rank: int, device: torch.device, nonce: str, cache: Owner | None,
                 mem_bytes: int) -> None:
        self.peer, self.rank, self.peer_rank, self.device = peer, rank, 1 - rank, device
        self.nonce, self.mem_bytes = nonce, mem_bytes
        self._cache = cache
        self._pending: list[Completion] = []
        self.broken = self.closed = False
        # Held while one transfer posts its ops: they pair by posting order, so two
        # transfers' ops must never interleave on one communicator.
        self.lock = threading.RLock()

    # -- what a backend provides -------------------------------------------------------

    def post(self, ops: Sequence[tuple[Op, torch.Tensor]], stream: torch.cuda.Stream,
             after: Sequence[torch.cuda.Event | None] = ()) -> Any:
        """Post `ops` as one group, to run after the events `after`; returns the work.

        `after` must cover everything the group depends on (what wrote a send's
        tensor, what still reads a receive's). Later work on `stream` cannot delay the
        group. ``work.wait()`` makes the current stream wait for the group.

        Raises:
            RuntimeError: closed, or the ops were refused (then it is aborted).
        """
        raise NotImplementedError

    def post_range(self, op: Op, base: torch.Tensor, start: int, nbytes: int, stream: torch.cuda.Stream,
                   after: torch.cuda.Event | None = None) -> Any:
        """Post one op on bytes ``[start, start + nbytes)`` of `base` (a contiguous uint8
        CUDA tensor: a pool's), after the event `after`: one chunk of a transfer."""
        raise NotImplementedError

    def _abort(self) -> None:
        raise NotImplementedError

    def send_ready(self) -> bool:
        """Whether a send posted now only enqueues (no host wait for the peer)."""
        return True

    # With `writes_into_blocks` (see `cuda_ipc.IpcCommunicator` for what each does):

    @staticmethod
    def takes_blocks(paged: PagedKv, num_blocks: int) -> bool:
        """Whether a staged transfer of `num_blocks` blocks of `paged`'s shape goes as one op."""
        return False

    def post_blocks(self, paged: PagedKv, block_ids: torch.Tensor | Sequence[int],
                    after: Sequence[torch.cuda.Event | None] = (), *, tag: bytes = UNTAGGED) -> Any:
        raise NotImplementedError(f"the {self.backend} backend does not write into blocks")

    @property
    def next_send(self) -> int:
        raise NotImplementedError(f"the {self.backend} backend does not number its sends")

    def next_receive_takes_blocks(self) -> bool:
        """P: whether the peer's receive for the next send goes straight into its blocks."""
        return False

    def next_block_receive(self) -> tuple[int, bytes, int] | None:
        """P: the peer's receive for the next send, if it is posted and goes straight into
        its blocks: its number, the tag of its transfer, its bytes. Never waits: raises
        BlockingIOError while a post holds the communicator (look again soon)."""
        return None

    def send_blocks(self, seq: int, paged: PagedKv, src: int, num_blocks: int, *,
                    after: Sequence[torch.cuda.Event | None] = (), keep: Sequence[torch.Tensor] = (),
                    programs: int | None = None, feed: LayerFeed | None = None, tag: bytes = UNTAGGED) -> Any:
        raise NotImplementedError(f"the {self.backend} backend does not write into blocks")

    # -- shared --------------------------------------------------------------------------

    def idle(self) -> bool:
        """No op of this communicator is still running."""
        self._pending = [c for c in self._pending if not c.done()]
        return not self._pending

    def completion(self, works: Sequence[Any], stream: torch.cuda.Stream, op: Op, transfer_id: str = "",
                   keep: Sequence[Any] = ()) -> Completion:
        """An event after `works` (no host block). When they are all `StreamWork`s, the
        last one's event: they run in order on the communicator's stream; else `stream`
        waits for them and the event is recorded there."""
        mine = [w for w in works if w is not None]
        if mine and all(isinstance(w, StreamWork) for w in mine):
            done = Completion(self, mine[-1].event, op, transfer_id, [*keep, *mine])
        else:
            with torch.cuda.device(self.device), torch.cuda.stream(stream):
                for work in mine:
                    work.wait()
                event = torch.cuda.Event()
                event.record(stream)
            done = Completion(self, event, op, transfer_id, [*keep, *mine])
        self._pending.append(done)
        if len(self._pending) > _PENDING_PRUNE_AT:
            self._pending = [c for c in self._pending if not c.done()]
        return done

    def fail(self, reason: str) -> None:
        """Abort after an error or a timeout and drop out of the cache."""
        if self.closed:
            return
        self.broken = True
        log.warning("nccl.abort", peer=self.peer, nonce=self.nonce, backend=self.backend, reason=reason)
        if self._cache is not None:
            self._cache.forget(self)
        self.abort()
        if self._cache is not None:
            self._cache.tell_stale(self)

    def abort(self) -> None:
        """End the communicator, freeing what it holds; idempotent."""
        if self.closed:
            return
        self.closed = True
        try:
            self._abort()
        except Exception as exc:  # abort is best effort; the object is dropped anyway
            log.warning("nccl.abort_failed", peer=self.peer, backend=self.backend, error=repr(exc))
        self._pending.clear()


def check_range(base: torch.Tensor, start: int, nbytes: int) -> None:
    """Only the bounds, on the critical path; `base` is a pool's own tensor, contiguous
    uint8 on the GPU by construction."""
    if not (0 <= start and 0 < nbytes and start + nbytes <= base.numel()):
        raise ValueError(f"bytes [{start}, {start + nbytes}) lie outside a {base.numel()}-byte buffer.")


def nbytes_of(tensor: torch.Tensor) -> int:
    if not tensor.is_cuda or not tensor.is_contiguous():
        raise ValueError(f"NCCL ops need contiguous CUDA tensors; got one on {tensor.device}.")
    return tensor.numel() * tensor.element_size()
