"""The nccl transport as the connector's worker half uses it: one byte range a transfer
(in a few chunks), posted from a worker thread of the broker client's loop, waited for
without blocking that loop.

Why one transfer at a time per (P, D) pair: NCCL pairs a sender's ops with the
receiver's by posting order alone. P posts in the order its Go messages arrive, D in the
order it sends Ready, and the broker turns each Ready into a Go in order; but two
handler tasks on either side may reach NCCL in either order (trio schedules tasks in no
fixed order), and the bytes of one transfer would land in another's buffer. So D holds
a per-producer lock from its Ready until its receive has ended (`receiving`): a producer
has at most one Go from a given decode peer outstanding, and both sides post it alone.
Transfers between different pairs still run at once, each over its own communicator,
and one transfer already uses the whole link.

A transfer goes as a few ops, one per chunk (`chunks`: the transport's pipeline plan,
the same on both sides since both know the size and the staged block size), so D can
scatter chunk k into its cache while chunk k+1 is still on the wire: `recv` calls
`landed` for each chunk once its receive has ended and the communicator is still
whole, which is when the chunk's bytes are known to be the producer's.

A communicator is built for one transfer: P names it in its rendezvous data, and D joins
only a build for the transfer it is receiving (`CommunicatorCache.get`'s `purpose`). D
may give a transfer up after its Ready and before its receive is posted (its load was
cancelled); P's send for it may already be building a communicator. Joining that build
for D's next receive would pair P's send with it, and D would load another request's KV.

A send or receive that misses its deadline aborts its communicator (see
`workers.transports.nccl_comm.Completion`): an op left posted would otherwise pair with
the next transfer's. Both sides then build a new one on their next transfer, through
the broker's `Relay` (`workers.rendezvous.BrokerRendezvous`).

Ordering against the model: P's send waits on an event recorded after the step's
gathers (`wait_for_save`), on the GPU and without a host wait. D's receive lands in a
receive-pool lease that has no GPU work pending (a lease goes back to the pool only
after the scatter that read it has run, see `connector.consumer`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import anyio
import anyio.to_thread
import torch

from protocols.errors import KvBrokerError, TransferFailed
from workers.client import SyncBrokerClient
from workers.gpu_staging import pipeline_bounds, pipeline_defaults
from workers.pool import Lease
from workers.rendezvous import BrokerRendezvous
from workers.transports.nccl import CommunicatorCache

__all__ = ["NcclLink", "chunks", "plan"]

# Communicators kept per worker: each costs 0.6-1 GB of GPU memory (measured on H200).
COMMUNICATORS = 8


# How long a wait for a posted op spins before it sleeps in short steps. A spin holds the
# GIL (an event query does not release it), so the client's loop thread, which carries
# the next Ready or Go, waits as long as the spin lasts.
WAIT_SPIN_S = 0.001

# Bump when `chunks` (or `pipeline_bounds`) cuts a transfer differently for the same
# parameters: peers of two versions must then be refused at registration (`plan`).
PLAN_VERSION = 1


def plan() -> str:
    """What `chunks` depends on besides the transfer, as text: P and D must agree on it
    (an NCCL receive and the send it pairs with must have the same size), so it goes
    into the compatibility fields a peer registers with (`connector.worker`)."""
    d = pipeline_defaults()
    mib = {k: d[k] >> 20 for k in ("first_nbytes", "last_nbytes", "cap_nbytes")}
    return (f"chunks v{PLAN_VERSION} of {mib['first_nbytes']}..{mib['cap_nbytes']} MiB, last {mib['last_nbytes']} MiB, "
            f"growth {d['growth']}/{d['back_growth']}")


def chunks(nbytes: int, block_nbytes: int) -> list[tuple[int, int]]:
    """A transfer's chunks as block ranges ``[b0, b1)``, one NCCL op each: the
    transport's pipeline plan (`pipeline_bounds`) for whole staged blocks of
    `block_nbytes`, one chunk for anything else. Both sides must call it alike."""
    if block_nbytes <= 0 or nbytes <= 0 or nbytes % block_nbytes:
        return [(0, 1)]
    ends = pipeline_bounds(nbytes // block_nbytes, block_nbytes)
    return list(zip([0, *ends[:-1]], ends))


class NcclLink:
    """One worker's NCCL communicators and the posts of its transfers.

    Args:
        client: the worker's broker client (its peer id names this side; it relays the
            rendezvous data).
        device: the GPU of this worker's KV cache and pools.
        connect_timeout_s: longest a communicator may take to build.
    """

    def __init__(self, client: SyncBrokerClient, device: torch.device, *, connect_timeout_s: float) -> None:
        self.device = device
        self.rendezvous = BrokerRendezvous(client, timeout_s=connect_timeout_s)
        self.cache = CommunicatorCache(
            client.registered.peer_id, device, self.rendezvous, capacity=COMMUNICATORS,
            connect_timeout_s=connect_timeout_s,
        )
        self.stream = torch.cuda.Stream(device)  # the stream the posts hang off (each communicator has its own)
        self._receiving: dict[str, anyio.Lock] = {}
        self._inflight: dict[str, tuple[str, threading.Event]] = {}  # per peer: the op's transfer id, cancel flag
        self._lock = threading.Lock()

    def receiving(self, producer: str) -> anyio.Lock:
        """D: hold this from Ready until the receive has ended: one transfer in flight per producer."""
        with self._lock:
            return self._receiving.setdefault(producer, anyio.Lock())

    async def send(self, decode: str, transfer_id: str, lease: Lease, offset: int, nbytes: int,
                   after: torch.cuda.Event | None, deadline: float, *, block_nbytes: int = 0) -> None:
        """P: send bytes ``[offset, offset + nbytes)`` of the staged `lease` to `decode`,
        once `after` (the step's gathers) has completed on the GPU; in `chunks` of
        staged blocks of `block_nbytes` (0: one op).

        Raises:
            TransferFailed: not sent by `deadline` (a `time.monotonic()` value; the
                communicator is then aborted), no communicator, or it was aborted.
        """
        await self._post(decode, "send", transfer_id, lease, lease.offset + offset, nbytes, after, deadline,
                         block_nbytes, None)

    async def recv(self, producer: str, transfer_id: str, lease: Lease, nbytes: int, deadline: float, *,
                   block_nbytes: int = 0, landed: Callable[[int, int, int], None] | None = None) -> None:
        """D: receive `nbytes` from `producer` into the start of `lease`, in the same
        chunks as the sender. Send Ready first: the producer builds a new communicator
        only once it has the Go. `landed(b0, b1, left)` is called (in a worker thread)
        as each chunk's blocks have arrived whole, in order; `left`: chunks still to come.

        Raises:
            TransferFailed: as `send`; also when `cancel` ended it.
        """
        await self._post(producer, "recv", transfer_id, lease, lease.offset, nbytes, None, deadline, block_nbytes,
                         landed)

    def cancel(self, peer: str, transfer_id: str) -> None:
        """End `transfer_id`'s op with `peer` before its deadline, if it is the one in
        flight: its communicator is aborted (an op left posted would pair with the next
        transfer's), or, not yet posted, it is not posted. Its `send`/`recv` then raises.
        A communicator still being built for it stops waiting for the peer's rendezvous
        data. A transfer still waiting for its turn is left to its caller's cancel scope."""
        with self._lock:
            inflight = self._inflight.get(peer)
            if inflight is None or inflight[0] != transfer_id:
                return
            inflight[1].set()
        self.rendezvous.wake()  # a communicator still being built for it stops waiting for the peer
        self.cache.discard(peer)

    async def _post(self, peer: str, op: Any, transfer_id: str, lease: Lease, start: int, nbytes: int,
                    after: torch.cuda.Event | None, deadline: float, block_nbytes: int,
                    landed: Callable[[int, int, int], None] | None) -> None:
        # In a worker thread: building a communicator blocks (its rendezvous goes through
        # this loop) and the wait spins. Not abandoned on cancellation: the op must have
        # ended before the caller frees the lease or lets the next transfer post; `cancel`
        # ends it early.
        flag = threading.Event()
        with self._lock:
            self._inflight[peer] = (transfer_id, flag)
        try:
            await anyio.to_thread.run_sync(self._post_and_wait, peer, op, transfer_id, lease, start, nbytes, after,
                                           deadline, flag, block_nbytes, landed)
        except TransferFailed:
            raise
        except (KvBrokerError, RuntimeError) as exc:  # no communicator (rendezvous, NCCL init), or a refused post
            raise TransferFailed(transfer_id, f"NCCL {op} with {peer} failed: {exc}") from exc
        finally:
            with self._lock:
                if self._inflight.get(peer, (None, None))[1] is flag:
                    del self._inflight[peer]

    def _post_and_wait(self, peer: str, op: Any, transfer_id: str, lease: Lease, start: int, nbytes: int,
                       after: torch.cuda.Event | None, deadline: float, cancelled: threading.Event,
                       block_nbytes: int, landed: Callable[[int, int, int], None] | None) -> None:
        torch.cuda.set_device(self.device)
        # A communicator built now is for this transfer only: D never joins a build P made
        # for a transfer D gave up after its Ready, whose send would pair with D's next receive.
        comm = None if cancelled.is_set() else self.cache.get(peer, initiator=op == "send", cancelled=cancelled,
                                                              purpose=transfer_id)
        if comm is None or cancelled.is_set():
            raise TransferFailed(transfer_id, f"the NCCL {op} with {peer} was cancelled before it was posted")
        whole = block_nbytes > 0 and nbytes % block_nbytes == 0
        if landed is not None and not whole:
            raise ValueError(f"a receive reported chunk by chunk must be whole blocks of {block_nbytes} B, "
                             f"not {nbytes} B")
        parts = chunks(nbytes, block_nbytes) if whole else [(0, 1)]
        step = block_nbytes if whole else nbytes
        with comm.lock:  # the chunks back to back: nothing of another transfer may come between
            works = [comm.post_range(op, lease.base, start + b0 * step, (b1 - b0) * step, self.stream,
                                     after if k == 0 else None)  # one NCCL stream: later ops follow the first
                     for k, (b0, b1) in enumerate(parts)]
        for k, (work, (b0, b1)) in enumerate(zip(works, parts)):
            comm.completion([work], self.stream, op, transfer_id).wait(deadline, spin_s=WAIT_SPIN_S)
            if comm.closed or comm.broken:  # aborted meanwhile (`cancel`, a timeout): the kernel ended early
                raise TransferFailed(transfer_id,
                                     f"the NCCL {op} with {peer} was cut short: its communicator was aborted")
            if landed is not None:
                try:
                    landed(b0, b1, len(parts) - 1 - k)
                except BaseException:
                    if k < len(parts) - 1:  # later chunks' ops are posted: they would pair with the next transfer's
                        self.cache.discard(peer)
                    raise

    def close(self) -> None:
        self.cache.close()
