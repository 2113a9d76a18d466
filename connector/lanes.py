"""Heterogeneous TP in the worker half: a decode rank loading from several lanes, and a
prefill rank sending some of its heads.

With different TP sizes the broker plans lanes, one per (prefill rank, decode rank)
pair (`protocols.heads`), and each lane's Prepare and Go name the model's KV heads it
carries. A prefill rank cuts those heads out of its staged copy (`workers.heads`) and
sends the range the Go asks for. A decode rank takes each lane's Prepare for a load as
its own receive: a lease of the lane's size (the broker reserved exactly that), the tcp
receive under ``"<transfer_id>|<source>"`` (two lanes of one transfer arrive at once),
and a Ready and later a Done naming the lane's source. Once its heads are all in, the
load is received; `get_finished` joins the lanes' parts into one staging of this rank's
layout and scatters it as for equal TP. A lane that fails fails the load; each lane's
task frees its own lease once its receive has ended, so no lease goes back to the pool
while the transport may still write into it.

Over nccl a lane goes on the communicator of its (prefill rank, decode rank) pair, in
that pair's ticket order, as any transfer does (`connector.nccl_link`). The prefill
rank's cut (`cut_lane`) is enqueued on a stream of its own after the event recorded on
the compute stream after the step's gathers, so it reads the staged copy as the gathers
left it; the send waits on an event after the cut. The decode rank receives each lane in
chunks into its lease, never straight into its blocks (the ipc backend's one-op receive
writes whole blocks of the same layout on both sides, and a lane is some of a block's
heads): `post_recv` without `into`, so P sees a chunked receive and follows it.
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import anyio
import torch

from protocols.errors import TransferFailed
from protocols.messages import Prepare
from workers.heads import merge_heads, part_nbytes, split_heads
from workers.layout import scatter_layers_from_staging, staging_view, tail_range
from workers.pool import Lease, PoolError

if TYPE_CHECKING:
    from .consumer import ConsumerSide, _Load
    from .worker import ConnectorWorker

__all__ = [
    "Lane", "Part", "cut_lane", "cut_read", "lane_key", "lane_nbytes", "on_lane", "receive_lane", "receive_lane_nccl",
    "release_ended", "scatter_lanes", "split_for_go", "stop_lanes",
]


def lane_key(transfer_id: str, source: str) -> str:
    """The tcp transport's id of one lane of a transfer."""
    return f"{transfer_id}|{source}"


@dataclass
class Lane:
    """One lane of a load: heads ``[start, stop)`` of the model, from `source`."""

    source: str
    start: int
    stop: int
    block_nbytes: int  # the lane's share of one block of one layer
    nbytes: int = 0
    lease: Lease | None = None
    active: bool = True  # its task runs; its lease is its task's to free
    received: bool = False
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)


def split_for_go(w: ConnectorWorker, staging: torch.Tensor, head_start: int, head_stop: int) -> torch.Tensor:
    """A prefill rank's staged copy cut down to the model's heads ``[head_start, head_stop)``."""
    a, b = head_start - w.heads[0], head_stop - w.heads[0]
    layout = next(iter(w.layouts.values()))
    part = torch.empty(staging.shape[0] * staging.shape[1] * part_nbytes(layout, a, b), dtype=torch.uint8)
    return split_heads(staging, layout, a, b, part).view(-1)


@dataclass
class Part:
    """A lane's heads cut out of a prefill rank's staging, shaped as the lease the nccl
    link sends from: bytes ``[offset, offset + nbytes)`` of `base`, a lease of the staging
    pool (`lease`) where it had room, so no GPU memory is allocated while ops are in
    flight. `event`: on a GPU, recorded after the cut; the send waits on it, and the
    staging and the part go back to the pool only once it has completed (`cut_read`)."""

    base: torch.Tensor
    offset: int
    nbytes: int
    block_nbytes: int  # the lane's share of one block of every layer
    event: torch.cuda.Event | None = None
    lease: Lease | None = None


def lane_nbytes(w: ConnectorWorker, staging: torch.Tensor, head_start: int, head_stop: int) -> int:
    """Bytes of the model's heads ``[head_start, head_stop)`` of a staged copy."""
    layout = next(iter(w.layouts.values()))
    return staging.shape[0] * staging.shape[1] * part_nbytes(layout, head_start - w.heads[0], head_stop - w.heads[0])


def cut_lane(w: ConnectorWorker, staging: torch.Tensor, gathered: torch.cuda.Event | None, head_start: int,
             head_stop: int, stream: torch.cuda.Stream | None, lease: Lease | None) -> Part:
    """The model's heads ``[head_start, head_stop)`` of a prefill rank's staged copy, for
    the nccl link, into `lease` (None: new memory). On a GPU the copy is enqueued on
    `stream` after `gathered` (the event `wait_for_save` records on the compute stream
    after the step's gathers): stream order, not the host, makes it read what the
    gathers wrote. On the CPU it is done on return."""
    a, b = head_start - w.heads[0], head_stop - w.heads[0]
    layout = next(iter(w.layouts.values()))
    block = staging.shape[1] * part_nbytes(layout, a, b)
    nbytes = lane_nbytes(w, staging, head_start, head_stop)
    event = None
    with ExitStack() as on_stream:
        if staging.is_cuda:
            assert stream is not None
            on_stream.enter_context(torch.cuda.device(staging.device))
            on_stream.enter_context(torch.cuda.stream(stream))
            if gathered is not None:
                stream.wait_event(gathered)
        out = lease.tensor if lease is not None else torch.empty(nbytes, dtype=torch.uint8, device=staging.device)
        split_heads(staging, layout, a, b, out)
        if staging.is_cuda:
            event = torch.cuda.Event()
            event.record(stream)
    if lease is not None:
        return Part(lease.base, lease.offset, nbytes, block, event, lease)
    return Part(out, 0, nbytes, block, event)


async def cut_read(part: Part | None) -> None:
    """Until the GPU has run `part`'s cut (it reads the staging, which may then go back to
    its pool), then the part's lease back; at once where the send that waited on it ended."""
    if part is None:
        return
    if part.event is not None and not part.event.query():
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(part.event.synchronize)
    if part.lease is not None:
        part.lease.release()
        part.lease = None


def _misfit(w: ConnectorWorker, msg: Prepare, load: _Load, lane: Lane) -> str:
    """Why the lane's Prepare does not fit this rank's heads and the load, or ""."""
    spec, lay = load.spec, msg.layout
    n, k, layers = len(spec.block_ids), spec.num_cached_blocks, len(w.layers)
    mine = w.heads[1] - w.heads[0]
    if not (w.heads[0] <= lane.start < lane.stop <= w.heads[1]) or lay.num_layers != layers or lay.num_blocks != n \
            or lay.block_nbytes * mine != w.block_nbytes * (lane.stop - lane.start) or k >= n:
        return (f"the producer's lane of heads [{lane.start}, {lane.stop}) ({lay.num_blocks} blocks x {lay.num_layers} "
                f"layers x {lay.block_nbytes} B) does not fit this rank's heads {list(w.heads)} and {n} x {layers} x "
                f"{w.block_nbytes} B after a {k}-block hit")
    return ""


async def receive_lane(side: ConsumerSide, msg: Prepare, load: _Load, lane: Lane) -> str:
    """Lease, expect, Ready, wait for one lane over tcp; "" once its bytes are in, else why not."""
    misfit = _misfit(side.w, msg, load, lane)
    if misfit:
        return misfit
    spec = load.spec
    offset, nbytes = tail_range(len(spec.block_ids), spec.num_cached_blocks, len(side.w.layers), msg.layout.block_nbytes)
    lane.nbytes = nbytes
    return await side.receive_tcp(msg, load, lane, lane_key(msg.transfer_id, lane.source), offset, nbytes,
                                  source=lane.source, heads=[lane.start, lane.stop])


async def receive_lane_nccl(side: ConsumerSide, msg: Prepare, load: _Load, lane: Lane) -> str:
    """Lease; ticket, Ready, post in the producer's turn; wait for one lane over nccl;
    "" once its bytes are in the lease, else why not (`connector.consumer`'s nccl
    receive, for a lane: its Ready names the source, and it goes in chunks into the lease)."""
    w = side.w
    assert w.nccl is not None
    misfit = _misfit(w, msg, load, lane)
    if misfit:
        return misfit
    spec, layers = load.spec, len(w.layers)
    offset, nbytes = tail_range(len(spec.block_ids), spec.num_cached_blocks, layers, msg.layout.block_nbytes)
    lane.nbytes = nbytes
    try:
        with anyio.fail_after(max(load.deadline - time.monotonic(), 0.0)):
            posted = await side.post_receive(msg, load, lane, offset, nbytes, layers * msg.layout.block_nbytes,
                                             source=lane.source, heads=[lane.start, lane.stop])
            await w.nccl.wait(posted, load.deadline)
    except TimeoutError:
        return f"no KV from {lane.source} within the load deadline of {w.config.load_timeout_s:g} s"
    except TransferFailed as exc:
        return exc.reason
    except PoolError as exc:
        return str(exc)
    return ""


async def stop_lanes(side: ConsumerSide, load: _Load) -> None:
    """End every lane of a load that cannot complete: over nccl the op first (a wait for
    it is shielded, and would last until the deadline), then the lane's task."""
    if side.w.nccl is not None:
        for lane in list(load.lanes.values()):
            if lane.active:  # an abort blocks: off the loop
                await anyio.to_thread.run_sync(side.w.nccl.cancel, lane.source, load.transfer_id)
    for lane in list(load.lanes.values()):
        lane.scope.cancel()


async def on_lane(side: ConsumerSide, msg: Prepare, load: _Load, arrived: float) -> None:
    """One lane of a load that several producer ranks feed (`connector.lanes`): each
    lane receives on its own; the load is received once its heads are all in."""
    from .consumer import GAVE_UP, LOADED_ALREADY, LOST_TRACK  # the consumer imports this module

    w, tid = side.w, msg.transfer_id
    lane = Lane(msg.source, msg.head_start, msg.head_stop, msg.layout.block_nbytes)
    with w.lock:
        if load.state == "waiting":
            load.state, load.prepared_at, load.scope = "receiving", arrived, anyio.CancelScope()
        fresh = load.state == "receiving" and msg.source not in load.lanes
        if fresh:
            load.lanes[msg.source] = lane
        scope = None if fresh or load.state != "receiving" else side._stop_locked(load, LOST_TRACK)
        received = load.state == "received"
    if not fresh:
        await side._abort(tid, LOST_TRACK if scope is not None else LOADED_ALREADY if received else GAVE_UP)
        if scope is not None:
            await side._cancel_receive(load, scope)
        return
    reason = "the broker client stopped while the KV was being received"
    ended = False
    try:
        receive = receive_lane_nccl if w.nccl is not None else receive_lane
        with lane.scope:
            reason = await receive(side, msg, load, lane)
        if lane.scope.cancelled_caught:
            reason = load.reason or "cancelled"
        ended = True
    except Exception as exc:  # one transfer must never take the client down
        reason = f"decode worker error: {exc!r}"
        w.log.exception("transfer.crashed", transfer_id=tid, phase="receive", source=lane.source)
        ended = True
    finally:
        with w.lock:
            lane.active = False
            if not reason and load.state == "receiving":
                lane.received = True
                lanes = [x for x in load.lanes.values() if x.received]
                if sum(x.stop - x.start for x in lanes) == w.heads[1] - w.heads[0]:
                    load.nbytes = sum(x.nbytes for x in lanes)
                    side._received(load)
            elif not reason and load.state != "received":
                reason = load.reason or "the load was given up"
        tell = bool(reason) and side._fail(load, reason, telling=ended)
        if reason:  # the load cannot complete: its other lanes stop receiving
            for other in list(load.lanes.values()):
                other.scope.cancel()
    if reason and w.nccl is not None:  # and their ops, whose waits the scopes do not end
        with anyio.CancelScope(shield=True):
            await stop_lanes(side, load)
    if tell:
        await side._abort(tid, reason)


def scatter_lanes(w: ConnectorWorker, load: _Load, targets: list[int], count: int) -> None:
    """Join every lane's part into one staging of this rank's layout, and scatter it. On a
    GPU (main thread, compute stream) every copy is enqueued there, after the receives
    the host saw end; the staging is that stream's own allocation, so its bytes go to no
    other work before these copies ran."""
    layout = next(iter(w.layouts.values()))
    layers = len(w.layers)
    first = next(iter(load.lanes.values())).lease
    assert first is not None
    flat = torch.empty(count * layers * w.block_nbytes, dtype=torch.uint8, device=first.tensor.device)
    staging = staging_view(flat, count, layers, w.block_nbytes)
    for lane in load.lanes.values():
        assert lane.lease is not None
        part = staging_view(lane.lease.tensor[:lane.nbytes], count, layers, lane.block_nbytes)
        merge_heads(part, layout, lane.start - w.heads[0], lane.stop - w.heads[0], staging)
    if w.paged is not None and flat.is_cuda:  # one kernel for every layer (`ConnectorWorker._triton_copies`)
        w.paged.scatter(w.paged.block_ids(targets), w.paged.staging_view(flat, count))
    else:
        scatter_layers_from_staging(staging, w.staged_layers, targets)


def release_ended(w: ConnectorWorker, load: _Load) -> list[Lease]:
    """Take the leases of a failed load's lanes whose task has ended (caller holds the lock)."""
    out = []
    for lane in load.lanes.values():
        if not lane.active and lane.lease is not None:
            out.append(lane.lease)
            lane.lease = None
    return out
