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
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import anyio
import torch

from protocols.errors import TransferFailed
from protocols.messages import Prepare
from workers.heads import merge_heads, part_nbytes, split_heads
from workers.layout import scatter_layers_from_staging, staging_view, tail_range
from workers.pool import Lease, PoolError
from workers.transports.tcp import TcpTransportError

if TYPE_CHECKING:
    from .consumer import ConsumerSide, _Load
    from .worker import ConnectorWorker

__all__ = ["Lane", "lane_key", "on_lane", "receive_lane", "release_ended", "scatter_lanes", "split_for_go"]


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


async def receive_lane(side: ConsumerSide, msg: Prepare, load: _Load, lane: Lane) -> str:
    """Lease, expect, Ready, wait for one lane; "" once its bytes are in, else why not."""
    w, tid = side.w, msg.transfer_id
    assert w.pool is not None and w.client is not None and side.receiver is not None
    spec, lay = load.spec, msg.layout
    n, k, layers = len(spec.block_ids), spec.num_cached_blocks, len(w.layers)
    mine = w.heads[1] - w.heads[0]
    if not (w.heads[0] <= lane.start < lane.stop <= w.heads[1]) or lay.num_layers != layers or lay.num_blocks != n \
            or lay.block_nbytes * mine != w.block_nbytes * (lane.stop - lane.start) or k >= n:
        return (f"the producer's lane of heads [{lane.start}, {lane.stop}) ({lay.num_blocks} blocks x {lay.num_layers} "
                f"layers x {lay.block_nbytes} B) does not fit this rank's heads {list(w.heads)} and {n} x {layers} x "
                f"{w.block_nbytes} B after a {k}-block hit")
    offset, nbytes = tail_range(n, k, layers, lay.block_nbytes)
    lane.nbytes = nbytes
    key = lane_key(tid, lane.source)
    expecting = False
    try:
        with anyio.fail_after(max(load.deadline - time.monotonic(), 0.0)):
            lane.lease = await w.pool.acquire(nbytes)
            completion = side.receiver.expect(key, msg.attempt, lane.lease.tensor, nbytes)
            expecting = True
            await w.client.client.ready(tid, nbytes, offset, source=lane.source)
            w.log.info("transfer.ready", transfer_id=tid, phase="ready", offset=offset, nbytes=nbytes, skip_blocks=k,
                       source=lane.source, heads=[lane.start, lane.stop])
            await completion.wait()
            expecting = False
    except TimeoutError:
        return f"no KV from {lane.source} within the load deadline of {w.config.load_timeout_s:g} s"
    except TransferFailed as exc:
        expecting = False
        return exc.reason
    except PoolError as exc:
        return str(exc)
    finally:
        if expecting:
            try:
                await side.receiver.cancel(key, "the load ended")
            except TcpTransportError as exc:
                side.w.log.error("transfer.lease_quarantined", transfer_id=tid, phase="receive", reason=str(exc))
                with w.lock:
                    if lane.lease is not None:
                        side._quarantined.append(lane.lease)
                        lane.lease = None
    return ""


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
        with lane.scope:
            reason = await receive_lane(side, msg, load, lane)
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
                    load.state, load.received_at = "received", time.monotonic()
                    load.nbytes = sum(x.nbytes for x in lanes)
            elif not reason and load.state != "received":
                reason = load.reason or "the load was given up"
        tell = bool(reason) and side._fail(load, reason, telling=ended)
        if reason:  # the load cannot complete: its other lanes stop receiving
            for other in list(load.lanes.values()):
                other.scope.cancel()
    if tell:
        await side._abort(tid, reason)


def scatter_lanes(w: ConnectorWorker, load: _Load, targets: list[int], count: int) -> None:
    """Join every lane's part into one staging of this rank's layout, and scatter it."""
    layout = next(iter(w.layouts.values()))
    layers = len(w.layers)
    staging = staging_view(torch.empty(count * layers * w.block_nbytes, dtype=torch.uint8), count, layers,
                           w.block_nbytes)
    for lane in load.lanes.values():
        assert lane.lease is not None
        part = staging_view(lane.lease.tensor[:lane.nbytes], count, layers, lane.block_nbytes)
        merge_heads(part, layout, lane.start - w.heads[0], lane.stop - w.heads[0], staging)
    scatter_layers_from_staging(staging, w.staged_layers, targets)


def release_ended(w: ConnectorWorker, load: _Load) -> list[Lease]:
    """Take the leases of a failed load's lanes whose task has ended (caller holds the lock)."""
    out = []
    for lane in load.lanes.values():
        if not lane.active and lane.lease is not None:
            out.append(lane.lease)
            lane.lease = None
    return out
