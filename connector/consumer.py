"""The consumer (decode) side of the worker half: receive each request's KV, scatter it, report.

A load goes ``waiting -> receiving -> received`` and ends ``done`` or ``failed``:

1. `start_load_kv` (main thread): for each new load in the step's metadata, send Expect,
   so the broker routes the producer's Offer here. If the Prepare came first (the
   producer was quicker than this engine's scheduler), it is waiting, parked, and is
   used instead. Over tcp into a CPU cache the Expect says the KV goes straight into
   the load's blocks (`CachePlaces`, worked out then): the broker reserves no room in
   the receive pool for it, whatever its size.
2. On Prepare (loop thread): lease room in the receive pool under the load's deadline
   (not for a load received into its blocks), register the lease with the
   `TcpReceiver` (or the load's blocks), and only then send Ready with the byte range after D's
   prefix-cache hit, so P's bytes land straight in the lease (or the blocks). Over
   nccl (`connector.nccl_link`): the Ready names the communicator and place of the
   receive (a ticket), and the producer's turn is held from the ticket until the
   receive is posted, so a producer's next transfer is under way while this one is on
   the wire, and both sides post in ticket order (NCCL pairs ops by posting order).
   A receive straight into D's blocks on a communicator already built is posted before
   the Ready: the producer sees it and starts sending without waiting for its Go.
3. `get_finished` (main thread, every step): scatter what arrived into D's blocks after
   its prefix hit (nothing for what landed in them: ipc, or tcp into a CPU cache; the
   cache tensors from `register_kv_caches`; attn_metadata may be None in this step),
   send Done (the bytes are now in D's cache), free the lease and report the request
   as received. A step that ran no model hands its Dones to the next step's
   get_finished instead (`_held`): the engine is about to schedule the request it
   reports, and the loop sending them would hold the GIL from that. On a GPU the scatter is enqueued on the compute
   stream, so the lease goes back to the pool only once an event after it has completed
   (a later receive into the same bytes is not ordered after the scatter).
   Over nccl with the transport's copy kernel the scatter starts earlier: chunk by
   chunk, as each chunk's receive ends (`_land`, in the link's poller thread), on a
   stream of its own that first waits for an event recorded in `start_load_kv` (so
   for whatever the compute stream did with those blocks before they were given to
   this request). `get_finished` then only makes the compute stream wait for the
   last chunk's scatter. A chunk is scattered only once its bytes have arrived whole,
   so a load that fails later has had only the producer's bytes written into its
   blocks; those blocks are reported as load errors, and the compute stream and the
   lease's next use wait for any scatter already enqueued.
4. A missed deadline (no Prepare, no room, no bytes), a broken stream, a mismatched
   layout or an Abort (the producer died, the broker's lease ended) fails the load:
   its not-yet-loaded block ids go to `get_block_ids_with_load_errors` in the same step
   the request is reported, so vLLM's ``kv_load_failure_policy`` applies ("recompute"
   or "fail"). A hybrid model's load is reported failed by request instead
   (`take_failed_requests`, vLLM's ``failed_recving``): vLLM takes no block ids from
   several KV cache groups. Only bytes that arrived whole from the producer are ever scattered (over
   nccl a load can fail after some of its chunks were; its blocks are all reported),
   and D's prefix-cached blocks are never written.
"""

from __future__ import annotations

import threading
from functools import partial
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
import anyio.to_thread
import torch

from protocols.errors import TransferFailed
from protocols.messages import Abort, Prepare
from workers.groups import NULL_BLOCK, scatter_rows
from workers.layout import (
    layer_major_view,
    scatter_layers_from_staging,
    staging_view,
    tail,
    tail_range,
)
from workers.pool import Lease, PoolError
from workers.transports.tcp import TcpReceiver, TcpTransportError

from .config import loopback_receiver
from .lanes import Lane, lane_key, on_lane, release_ended, scatter_lanes, stop_lanes
from .scheduler import KvBrokerMetadata, LoadSpec

# Programs (CTAs) of a scatter that overlaps later chunks' receives: at full width (about
# 3.8 TB/s of HBM traffic) it slows the receive of the next chunk it overlaps.
SCATTER_PROGRAMS = 64

if TYPE_CHECKING:
    from .nccl_link import Waited
    from .worker import ConnectorWorker

__all__ = ["ConsumerSide"]

MAX_TOMBSTONES = 4096  # transfers the broker aborted before a local request claimed them; as many ended loads
_V = TypeVar("_V")
LOADED_ALREADY = (
    "this decode instance already has its KV: the broker sent this Prepare after losing track of the "
    "transfer (this peer or the broker reconnected or restarted)"
)
GAVE_UP = "this decode instance already gave the transfer up"
LOST_TRACK = (
    "a second Prepare came while the first was being received: the broker lost track of it "
    "(this peer or the broker reconnected or restarted), so the load ends now"
)
BROKER_ABORT = "aborted by the broker: "
# A load still "receiving" this long after its deadline lost its receiving task (the
# client's loop stopped or was torn down): `get_finished` fails it and frees its lease.
RECEIVE_GRACE_S = 1.0


# A step that runs no model (its requests all wait for KV) is followed by vLLM's 1 ms
# sleep (`EngineCore._process_engine_step`), and a load landing in that sleep is seen
# only at the next step's get_finished. Such a step's get_finished waits up to this long
# for a load being received to land, and reports it at once. Four times the sleep: a
# landing falls in the wait about four times in five rather than one in two (on one H200,
# 19-20 of 20 requests after a prefill against 2-12 with 1 ms, 0.15-0.3 ms less added at
# 512 and 2,048 tokens: docs/PERFORMANCE.md). Such an engine has nothing else to run; a
# request arriving meanwhile is scheduled at most this much later.
IDLE_WAIT_S = 4e-3
# Once one load of an idle step has landed, the step waits for the others while they keep
# landing, each within this long of the last: a step's eight loads landed within 0.1 ms
# of one another on an H200, and reporting the first alone left the rest for the next step.
LANDING_GAP_S = 2e-4
# How long an idle step's held Dones (`ConsumerSide._held`) wait for the next
# get_finished before the client's loop sends them: a reported request whose client went
# away meanwhile is freed without a step, and an engine with nothing else to run then
# takes none. Its room and P's staging would otherwise stay held until the broker's lease
# ended the transfer.
HELD_DONES_S = 0.05


def _us(seconds: float) -> int:
    return round(seconds * 1e6)


@dataclass
class _Load:
    transfer_id: str
    spec: LoadSpec
    deadline: float
    state: str = "waiting"
    reason: str = ""
    lease: Lease | None = None
    nbytes: int = 0
    source: str = ""  # the producer's peer id, from the Prepare
    scope: anyio.CancelScope | None = None
    # True once the broker knows the transfer ended (it aborted it, or we told it).
    settled: bool = False
    # nccl with the copy kernel (`_land`): the compute stream's point at start_load_kv,
    # the target block ids on the GPU, and the event after the last chunk scattered.
    allocated: torch.cuda.Event | None = None
    targets: torch.Tensor | None = None
    scattered: torch.cuda.Event | None = None
    landed_blocks: int = 0
    # When the bytes were known to be in (time.monotonic()): the `transfer.loaded` line says
    # how long the load then waited for the engine's get_finished (`since_received_ms`).
    received_at: float = 0.0
    # nccl: when the last receive's end was seen, and by when it had landed (the line says).
    waited: Waited | None = None
    # nccl: how long posting the receive took, from the Ready's send (us; the line says).
    post_us: int | None = None
    # When its Prepare's handler started (time.monotonic()): the Ready's line says how long
    # D took from there (`prepare_us`), and of that the pool, the producer's turn and the send.
    prepared_at: float = 0.0
    # Held while a chunk's scatter is launched from the lease (`_land`), and by whoever
    # ends the receiving state or takes the lease meanwhile (taken before the worker's
    # lock, never after it). A landing then waits neither for another load's landing nor
    # for get_finished, and the lease cannot go back while a scatter from it is launched.
    landing: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)
    # Heterogeneous TP: the lanes (by source) that bring this rank's heads (`connector.lanes`).
    lanes: dict[str, Lane] = field(default_factory=dict)
    # Received straight into its blocks (tcp: `CachePlaces`; nccl: an ipc receive into the
    # blocks): nothing to scatter, and the receiving task sends the Done as they land.
    into_blocks: bool = False
    # The receiving task told the broker (the Done): the get_finished that reports it does not.
    told: bool = False
    # tcp: where its bytes go in the blocks, worked out at the Expect (which then tells the
    # broker that it takes no room in the pool); None: into a lease
    places: list[memoryview] | None = None


class ConsumerSide:
    def __init__(self, worker: ConnectorWorker) -> None:
        self.w = worker
        self.receiver: TcpReceiver | None = None
        self._loads: dict[str, _Load] = {}
        self._rejected: list[_Load] = []
        self._parked: dict[str, anyio.Event] = {}  # loop thread only
        self._tombstones: OrderedDict[str, str] = OrderedDict()
        # Loads ended lately, and whether they got their KV: a Prepare the broker sends for
        # one after losing track of this peer (it re-routed the transfer as the bytes
        # landed) is refused at once, not parked until our deadline holding its credit.
        self._ended: OrderedDict[str, bool] = OrderedDict()
        self._errors: set[int] = set()
        # A hybrid model's failed loads, by request: vLLM takes no block ids from several
        # KV cache groups (their ids are not unique across groups), only the requests.
        self._failed_requests: set[str] = set()
        self._quarantined: list[Lease] = []  # a transport thread may still write these: never released
        self._draining: list[tuple[torch.cuda.Event, Lease]] = []  # scattered on a GPU: released once the event is
        self._landing_stream: torch.cuda.Stream | None = None  # `_land`'s copies, made on first use
        # Notified, under the worker's lock, as a load is received (`_received`): an idle
        # step's get_finished waits on it.
        self.landed = threading.Condition(worker.lock)
        self.idle_wait_s, self.landing_gap_s = IDLE_WAIT_S, LANDING_GAP_S
        # An idle step's get_finished is waiting for a landing (`_await_landing`, under
        # the worker's lock): it reports what lands and sends the Done itself.
        self._awaiting = False
        self._endings = 0  # loads ended (received or failed) so far
        # The Dones, and their `transfer.loaded` lines, of the loads a step that ran no
        # model reported: sent by the next step's get_finished (or `send_held` at close). The
        # engine goes from that report straight to scheduling the request, and a Done
        # sent then woke the client's loop, which held the GIL from it: D's sync after
        # get_finished took 0.17-0.39 ms at 512-2,048 tokens, 0.12-0.24 with the Dones held
        # (docs/PERFORMANCE.md).
        # By the next get_finished the request's first step is launched; if none comes
        # within HELD_DONES_S, the client's loop sends them (`_send_held_later`). Under the
        # worker's lock.
        self._held: tuple[list[tuple[str, int, str]], list[dict[str, Any]]] = ([], [])

    def start_transport(self) -> dict[str, str]:
        """Listen for producers; the endpoint goes into this peer's registration (nccl:
        none, the producer reaches this peer by its id)."""
        if self.w.config.transport == "nccl":
            return {}
        ctx = {"role": self.w.role, "instance": self.w.config.instance_id}
        self.receiver = TcpReceiver(self.w.config.tcp_host, 0, log_context=ctx)
        unreachable = loopback_receiver(self.w.config)
        if unreachable is not None:
            self.w.log.warning("connector.tcp_host_loopback", phase="register", detail=unreachable)
        return {"tcp": self.receiver.start()}

    def close(self) -> None:
        if self.receiver is not None:
            self.receiver.close()

    def send_held(self) -> None:
        """Send the Dones an idle step held, waiting until they are sent (shutting down:
        the engine takes no next step to send them)."""
        dones, lines = self._take_held()
        if dones and self.w.client is not None:
            try:
                self.w.client.call(self._finish, dones, [], lines)
            except Exception as exc:  # noqa: BLE001 (the loop stopped: the broker's lease ends them)
                self.w.log.warning("connector.dones_not_sent", phase="close", transfers=len(dones), error=repr(exc))

    def _take_held(self) -> tuple[list[tuple[str, int, str]], list[dict[str, Any]]]:
        with self.w.lock:
            held, self._held = self._held, ([], [])
        return held

    async def _send_held_later(self, held: tuple[list[tuple[str, int, str]], list[dict[str, Any]]]) -> None:
        """Send an idle step's held Dones unless a get_finished took them first."""
        await anyio.sleep(HELD_DONES_S)
        with self.w.lock:
            if self._held is not held:
                return
            self._held = ([], [])
        await self._finish(held[0], [], held[1])

    @property
    def loading_now(self) -> int:
        with self.w.lock:
            return len(self._loads)

    # -- main thread -----------------------------------------------------------------------

    def start_load_kv(self, meta: KvBrokerMetadata) -> None:
        w = self.w
        now = time.monotonic()
        new: list[_Load] = []
        allocated = None
        if meta.loads and w.nccl is not None and w.paged is not None:
            # Everything the compute stream did so far, including with the blocks these
            # requests were just given: `_land`'s scatters wait for it.
            allocated = torch.cuda.Event()
            allocated.record(torch.cuda.current_stream(w.paged.device))
        with w.lock:
            for tid, spec in meta.loads.items():
                load = _Load(tid, spec, now + w.config.load_timeout_s, allocated=allocated)
                if spec.refused:  # the scheduler half refused it: fail it now, the broker never hears of it
                    load.transfer_id = ""
                    load.state, load.settled, load.reason = "failed", True, spec.refused
                    self._rejected.append(load)
                    continue
                if tid in self._loads:
                    load.state, load.settled = "failed", True
                    load.reason = "another request on this instance is already loading this transfer_id"
                    self._rejected.append(load)
                    continue
                reason = self._tombstones.pop(tid, None)
                if reason is not None:
                    load.state, load.settled = "failed", True
                    load.reason = f"the broker aborted it before this request arrived: {reason}"
                self._loads[tid] = load
                new.append(load)
        if new:
            self.w.spawn(self._announce, new)

    def get_finished(self, finished_req_ids: set[str], *, idle: bool = False) -> set[str] | None:
        """Scatter what arrived, fail what is late; both count as received for vLLM. In a
        step that ran no model (`idle`), first wait up to `idle_wait_s` (`IDLE_WAIT_S`) for the
        loads being received to land (`_await_landing`)."""
        w = self.w
        held, held_lines = self._take_held()
        if held:  # the last idle step's (`_held`)
            w.spawn(self._finish, held, [], held_lines)
        if idle:
            self._await_landing(self.idle_wait_s)
        self._drain()
        done = self._collect(finished_req_ids)
        if not done:
            return None
        finished: set[str] = set()
        dones: list[tuple[str, int, str]] = []
        aborts: list[tuple[str, str]] = []
        lines: list[dict[str, Any]] = []
        loaded = loaded_bytes = 0
        for load in done:
            scattered = False
            if load.state == "received":
                error = self._scatter(load)
                if error is None:
                    loaded, loaded_bytes = loaded + 1, loaded_bytes + load.nbytes
                    if not load.told:  # else its receiving task sent the Done as the bytes landed
                        dones += [(load.transfer_id, lane.nbytes, lane.source) for lane in load.lanes.values()] or [
                            (load.transfer_id, load.nbytes, "")]
                        lines.append(self._loaded_line(load))
                    scattered = True
                else:
                    load.state, load.reason = "failed", error
            if load.scattered is not None and not scattered:
                # Failed after some chunks were scattered: whatever uses these blocks next
                # on the compute stream runs after those copies.
                torch.cuda.current_stream(load.scattered.device).wait_event(load.scattered)
            if load.lease is not None:
                # scattered (or some chunks were): the room goes back once that ran; else at once
                self._give_back(load.lease, scattered, load.scattered)
                load.lease = None
            with w.lock:  # a lane still receiving frees its own lease when it ends
                lane_leases = [lane.lease for lane in load.lanes.values() if not lane.active and lane.lease is not None]
                for lane in load.lanes.values():
                    lane.lease = lane.lease if lane.active else None
            for lease in lane_leases:
                self._give_back(lease, scattered, None)
            finished.add(load.spec.req_id)
            if load.state != "failed":
                continue
            if not load.settled:
                load.settled = True
                aborts.append((load.transfer_id, load.reason))
            blocks = _tail_blocks(load.spec)
            if w.groups is None:
                self._errors.update(blocks)
            else:
                self._failed_requests.add(load.spec.req_id)
            w.count("failed")
            w.log.warning(
                "transfer.load_failed",
                transfer_id=load.transfer_id,
                phase="failed",
                req_id=load.spec.req_id,
                blocks=len(blocks),
                reason=load.reason,
            )
        if loaded:
            with w.lock:  # once a step, not twice a load
                w.counters["loaded"] += loaded
                w.counters["bytes"] += loaded_bytes
        if idle and dones:  # see `_held`
            held = (dones, lines)
            with w.lock:
                self._held = held
            self.w.spawn(self._send_held_later, held)
            dones, lines = [], []
        if dones or aborts:
            self.w.spawn(self._finish, dones, aborts, lines)
        return finished

    def _await_landing(self, timeout_s: float) -> None:
        """Wait, at most `timeout_s`, while a load is being received: until one ends
        (received or failed), then while the others keep landing, each within
        `landing_gap_s` of the last, so a step's loads, which land together, are reported
        together. At once when none is being received (nothing can land), or when one
        ended before (it waited through the engine's sleep already)."""
        deadline = time.monotonic() + timeout_s
        left, woken = timeout_s, False
        with self.landed:
            try:
                while left > 0:
                    states = {load.state for load in self._loads.values()}
                    if "receiving" not in states or (not woken and states & {"received", "failed"}):
                        return
                    seen = self._endings
                    self._awaiting = True
                    if not self.landed.wait_for(lambda: self._endings != seen, left):
                        return
                    if not woken:
                        self.w.counters["seen_waiting"] += 1  # the worker's lock is held: `landed`'s
                    left, woken = min(deadline - time.monotonic(), self.landing_gap_s), True
            finally:
                self._awaiting = False

    def _received(self, load: _Load) -> None:
        """Mark `load` received (the worker's lock held) and wake an idle step waiting for it."""
        load.state, load.received_at = "received", time.monotonic()
        self._ended_now()

    def _ended_now(self) -> None:
        """A load ended (the worker's lock held): wake an idle step waiting for it."""
        self._endings += 1
        self.landed.notify_all()

    def _give_back(self, lease: Lease, scattered: bool, landed: torch.cuda.Event | None) -> None:
        """Return `lease` to the pool; on a GPU after the scatter that reads it has run:
        `landed` where `_land` scattered it chunk by chunk (its own stream's last event),
        else an event after the scatter just enqueued on the compute stream."""
        if landed is not None:
            with self.w.lock:
                self._draining.append((landed, lease))
        elif scattered and lease.base.is_cuda:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(lease.base.device))
            with self.w.lock:
                self._draining.append((event, lease))
        else:
            lease.release()

    def _drain(self) -> None:
        """Release the leases whose scatter has run (main thread, every step)."""
        with self.w.lock:  # `_fail` adds to it from the loop thread
            draining, self._draining = self._draining, []
        left = []
        for event, lease in draining:
            if event.query():
                lease.release()
            else:
                left.append((event, lease))
        if left:
            with self.w.lock:
                self._draining = left + self._draining

    def _collect(self, finished_req_ids: set[str]) -> list[_Load]:
        """Take the loads that ended (expiring late ones first). A restarted broker gets
        our Expects again from the client, which tracks them until the load's Done or Abort."""
        w = self.w
        now = time.monotonic()
        with w.lock:
            stuck = [
                load
                for load in self._loads.values()
                if load.state == "receiving" and now > load.deadline + RECEIVE_GRACE_S
            ]
        for load in stuck:
            self._give_up_stuck(load)
        with w.lock:
            for load in self._loads.values():
                # A load some of whose lanes came, waiting for another lane's Prepare, waits as one.
                between_lanes = load.state == "receiving" and load.lanes and not any(
                    lane.active for lane in load.lanes.values())
                if (load.state == "waiting" or between_lanes) and (
                        now > load.deadline or load.spec.req_id in finished_req_ids):
                    load.state = "failed"
                    load.reason = (
                        f"no Prepare within the load deadline of {w.config.load_timeout_s:g} s"
                        if now > load.deadline
                        else "the request finished before its KV arrived"
                    )
            done = [load for load in self._loads.values() if load.state in ("received", "failed")]
            for load in done:
                del self._loads[load.transfer_id]
                _keep(self._ended, load.transfer_id, load.state == "received")
            done += self._rejected
            self._rejected = []
        return done

    def _give_up_stuck(self, load: _Load) -> None:
        """Fail a load whose receiving task is gone: stop the receiver writing, then free the lease."""
        reason = f"no KV within the load deadline of {self.w.config.load_timeout_s:g} s (the receive never ended)"
        if self.w.nccl is not None:  # its thread may still post or wait: abort the op, never reuse the lease
            self.w.nccl.cancel(load.source, load.transfer_id)
            for lane in list(load.lanes.values()):  # heterogeneous TP: each lane's op, and its lease
                if lane.active:
                    self.w.nccl.cancel(lane.source, load.transfer_id)
                    with self.w.lock:
                        lane.active = False
                        if lane.lease is not None:
                            self._quarantined.append(lane.lease)
                            lane.lease = None
            self._quarantine(load, "an NCCL receive into it may not have ended")
            self._fail(load, reason, telling=False)
            return
        assert self.receiver is not None
        for lane in list(load.lanes.values()):  # heterogeneous TP: each lane's receive, then its lease
            if lane.active:
                try:
                    self.receiver.cancel_blocking(lane_key(load.transfer_id, lane.source), reason)
                    lane.active = False
                except TcpTransportError as exc:
                    self.w.log.error("transfer.lease_quarantined", transfer_id=load.transfer_id, reason=str(exc))
                    with self.w.lock:
                        if lane.lease is not None:
                            self._quarantined.append(lane.lease)
                            lane.lease = None
        if load.lanes:
            self._fail(load, reason, telling=False)
            return
        try:
            self.receiver.cancel_blocking(load.transfer_id, reason)
        except TcpTransportError as exc:
            self._quarantine(load, str(exc))
        self._fail(load, reason, telling=False)

    def _fail(self, load: _Load, reason: str, *, telling: bool) -> bool:
        """Mark `load` failed and free its lease (its lanes' whose receive ended); True if
        the caller must tell the broker now. Waits for a chunk's landing under way, whose
        scatter reads the lease."""
        with load.landing, self.w.lock:
            lane_leases = release_ended(self.w, load)
            lease, load.lease = load.lease, None
            load.state, load.reason = "failed", load.reason or reason
            self._ended_now()  # an idle step's get_finished reports it now
            tell = telling and not load.settled
            if tell:
                load.settled = True
            if lease is not None and load.scattered is not None:  # a chunk's scatter may still read it
                self._draining.append((load.scattered, lease))
                lease = None
        if lease is not None:
            lease.release()
        for lane_lease in lane_leases:
            lane_lease.release()
        return tell

    def _quarantine(self, load: _Load, why: str, holder: _Load | Lane | None = None) -> None:
        """The receiver may still write into the lease of `holder` (default: the load):
        keep it out of the pool for good."""
        holder = load if holder is None else holder
        with load.landing, self.w.lock:
            lease, holder.lease = holder.lease, None
            if lease is not None:
                self._quarantined.append(lease)
        self.w.log.error(
            "transfer.lease_quarantined",
            transfer_id=load.transfer_id,
            phase="receive",
            nbytes=lease.nbytes if lease is not None else 0,
            into_blocks=load.into_blocks,  # then the receiver may write the load's blocks, which fail it
            reason=why,
        )

    def _scatter(self, load: _Load) -> str | None:
        """Write the received blocks into D's cache after its prefix hit; None, or why it failed."""
        w, spec = self.w, load.spec
        if load.into_blocks:
            # Written as the bytes came (tcp), or by a receive (ipc) whose end this process
            # saw before it marked the load received (`_landed_in_place`): the compute
            # stream has nothing to wait for, and asking the driver again took get_finished
            # 25-30 us a load on an H200 host, traced.
            return None
        assert load.lease is not None or load.lanes or load.scattered is not None
        count = len(spec.block_ids) - spec.num_cached_blocks
        try:
            targets = tail(spec.block_ids, spec.num_cached_blocks)
            if w.groups is not None:  # a hybrid model: each layer into its group's blocks
                assert load.lease is not None
                rows = w.groups.rows(len(spec.block_ids), spec.num_tokens).tail(spec.num_cached_blocks)
                scatter_rows(load.lease.tensor, rows, w.staged_layers, spec.groups, w.groups.layer_group)
            elif load.lanes:  # heterogeneous TP: join the lanes' heads, then scatter as below
                scatter_lanes(w, load, list(targets), count)
            elif load.scattered is not None:  # scattered chunk by chunk as it arrived (`_land`)
                assert load.landed_blocks == count, (load.landed_blocks, count)
                # The compute stream waits only for what has not run yet: a wait for an
                # event that had ended still had the GPU schedule this process's context
                # before the next step's work (measured: docs/PERFORMANCE.md).
                if not load.scattered.query():
                    torch.cuda.current_stream(load.scattered.device).wait_event(load.scattered)
            elif w.paged is not None:  # one kernel for every layer (`ConnectorWorker._triton_copies`)
                assert load.lease is not None
                w.paged.scatter(w.paged.block_ids(list(targets)), w.paged.staging_view(load.lease.tensor, count))
            else:
                assert load.lease is not None
                # tcp streams a save layer by layer (`ProducerSide._layer_parts`); nccl
                # sends the staging as P holds it, block by block
                view = staging_view if w.nccl is not None else layer_major_view
                staging = view(load.lease.tensor, count, len(w.layers), w.block_nbytes)
                scatter_layers_from_staging(staging, w.staged_layers, targets)
        except Exception as exc:
            w.log.exception("transfer.scatter_failed", transfer_id=load.transfer_id, phase="scatter")
            return f"scatter failed: {exc}"
        return None

    @staticmethod
    def _loaded_line(load: _Load) -> dict[str, Any]:
        """The fields of a load's `transfer.loaded` line, taken as its Done is sent: as it
        lands for a load straight into its blocks (`done_at` "landing"), else as the
        engine's get_finished reports it ("report"). The line itself is written on the
        client's loop, after the Done (`_finish`): on the engine's thread each line cost its
        get_finished 20 us (0.15 ms of a step that reports eight loads, on an H200 host)."""
        spec = load.spec
        return {
            "transfer_id": load.transfer_id, "phase": "loaded", "req_id": spec.req_id, "nbytes": load.nbytes,
            "done_at": "landing" if load.told else "report",
            "blocks": len(spec.block_ids) - spec.num_cached_blocks, "skipped_blocks": spec.num_cached_blocks,
            "since_received_ms": round((time.monotonic() - load.received_at) * 1e3, 3) if load.received_at else None,
            # over nccl: the post's time from the Ready, and D's host's after the last byte
            **(load.waited.log_fields() if load.waited is not None else {}),
            **({"post_us": load.post_us} if load.post_us is not None else {}),
        }

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    def take_failed_requests(self) -> set[str]:
        """A hybrid model's requests whose load failed since the last call (vLLM's failed_recving)."""
        failed, self._failed_requests = self._failed_requests, set()
        return failed

    # -- the client's loop thread ------------------------------------------------------------

    async def _announce(self, loads: list[_Load]) -> None:
        w = self.w
        assert w.client is not None
        client = w.client.client
        for load in loads:
            tid = load.transfer_id
            if load.state != "waiting":
                continue
            parked = self._parked.get(tid)
            nbytes = self._staged_nbytes(load.spec)
            if self.receiver is not None:  # tcp: straight into a CPU cache's blocks, taking no pool room
                load.places = self._places(load, self._tail_nbytes(load.spec))
                into_blocks = load.places is not None
            else:  # nccl: into the blocks over a communicator built with the producer already
                into_blocks = self._receives_into_blocks(load)
            if parked is not None:
                # Its Prepare came first: no Expect now, but one on registering again.
                await client.expect(tid, load.spec.prefill, nbytes=nbytes, into_blocks=into_blocks, announce=False)
                parked.set()
                continue
            # Tracked by the client, so a broker restart gets it again (with the route it
            # carries) until the load's Done or Abort. One that crosses our own Prepare is
            # accepted by the broker; one for a transfer granted to another decode peer
            # is refused, and that refusal fails this load at once instead of at its
            # deadline.
            await self.w.send_bounded("expect", tid, partial(client.expect, nbytes=nbytes, into_blocks=into_blocks), tid,
                                      load.spec.prefill)
            w.log.info("transfer.expect", transfer_id=tid, phase="expect", req_id=load.spec.req_id, nbytes=nbytes,
                       into_blocks=into_blocks)

    def _receives_into_blocks(self, load: _Load) -> bool:
        """Over nccl: whether `load`'s receive would go straight into its blocks, posted now:
        the request names its prefill instance, and a communicator built with the rank
        that feeds this one writes into blocks (ipc, one host). Its Prepare decides again."""
        w, spec = self.w, load.spec
        if w.nccl is None or w.paged is None or w.groups is not None or not spec.prefill:
            return False
        count = len(spec.block_ids) - spec.num_cached_blocks
        return count > 0 and w.nccl.receives_into_blocks(f"{spec.prefill}:{w.info.rank}", w.paged, count)

    def _tail_nbytes(self, spec: LoadSpec) -> int:
        """The bytes this rank receives for `spec` after its prefix hit (equal TP, no hybrid)."""
        n, k = len(spec.block_ids), spec.num_cached_blocks
        return 0 if not self.w.layers or k >= n else tail_range(n, k, len(self.w.layers), self.w.block_nbytes)[1]

    def _staged_nbytes(self, spec: LoadSpec) -> int:
        """What the producer stages and offers for `spec` into this rank, every lane
        together: the staged size of all its blocks, which `_receive` checks a Prepare
        against, and the room the broker reserves at the Expect. 0 where this side cannot
        tell (no cache registered, a hybrid request whose groups do not match: its Prepare
        is refused anyway)."""
        w = self.w
        n = len(spec.block_ids)
        if not w.layers or n == 0:
            return 0
        if w.groups is not None:
            if len(spec.groups) != len(w.groups.windows):
                return 0
            return w.groups.rows(n, spec.num_tokens).cells * w.block_nbytes
        return n * len(w.layers) * w.block_nbytes

    async def _finish(self, dones: list[tuple[str, int, str]], aborts: list[tuple[str, str]],
                      lines: list[dict[str, Any]]) -> None:
        """Tell the broker what a get_finished reported (the Dones first: they give P's
        staging and D's room back), then write its loads' `transfer.loaded` lines."""
        assert self.w.client is not None
        client = self.w.client.client
        for tid, nbytes, source in dones:
            if source:  # one lane of several: the Done names it
                await self.w.send_bounded("done", tid, partial(client.done, source=source), tid, nbytes)
            else:
                await self.w.send_bounded("done", tid, client.done, tid, nbytes)
        for tid, reason in aborts:
            await self._abort(tid, reason)
        for fields in lines:
            self.w.log.info("transfer.loaded", **fields)

    async def _abort(self, tid: str, reason: str) -> None:
        assert self.w.client is not None
        client = self.w.client.client
        await self.w.send_bounded("abort", tid, client.abort, tid, reason)

    async def on_prepare(self, msg: Prepare) -> None:
        w, tid = self.w, msg.transfer_id
        arrived = time.monotonic()
        with w.lock:
            load = self._loads.get(tid)
            ended = self._ended.get(tid) if load is None else None
        if ended is not None:  # nothing to wait for
            await self._abort(tid, LOADED_ALREADY if ended else GAVE_UP)
            return
        if load is None:
            load = await self._wait_for_request(tid)
            if load is None:
                return
        if msg.head_stop:  # one of the lanes of a producer of another TP size
            await on_lane(self, msg, load, arrived)
            return
        with w.lock:
            start = load.state == "waiting"
            if start:
                load.state, load.prepared_at = "receiving", arrived
                load.scope = anyio.CancelScope()
            scope = self._stop_locked(load, LOST_TRACK) if load.state == "receiving" and not start else None
            received = load.state == "received"
        if not start:
            await self._abort(tid, LOST_TRACK if scope is not None else LOADED_ALREADY if received else GAVE_UP)
            if scope is not None:
                await self._cancel_receive(load, scope)
            return
        assert load.scope is not None
        # Kept if the task is cancelled from outside (the client's task group ends):
        # the load still fails, and `get_finished` tells the broker.
        reason = "the broker client stopped while the KV was being received"
        ended = False
        try:
            with load.scope:
                reason = await self._receive(msg, load)
            if load.scope.cancelled_caught:
                reason = load.reason or "cancelled"
            ended = True
        except Exception as exc:  # one transfer must never take the client down
            reason = f"decode worker error: {exc!r}"
            w.log.exception("transfer.crashed", transfer_id=tid, phase="receive")
            ended = True
        finally:
            tell = bool(reason) and self._fail(load, reason, telling=ended)
        if tell:
            await self._abort(tid, reason)

    async def _wait_for_request(self, tid: str) -> _Load | None:
        """A Prepare before the request reached this engine: wait for it, under the deadline."""
        w = self.w
        event = self._parked.setdefault(tid, anyio.Event())
        with anyio.move_on_after(w.config.load_timeout_s):
            await event.wait()
        self._parked.pop(tid, None)
        reason = f"no request on decode instance {w.config.instance_id} claimed it within {w.config.load_timeout_s:g} s"
        with w.lock:  # checked and buried at once: a request arriving between them would wait for nothing
            load = self._loads.get(tid)
            give_up = load is None and tid not in self._tombstones
            if give_up:
                _keep(self._tombstones, tid, reason)
        if give_up:
            await self._abort(tid, reason)
        return load

    async def _receive(self, msg: Prepare, load: _Load) -> str:
        """Lease, expect, Ready, wait; "" once the bytes are in the lease, else why not."""
        w = self.w
        assert w.pool is not None and w.client is not None
        spec, lay = load.spec, msg.layout
        if msg.prompt and spec.tokens and msg.prompt != spec.tokens:
            # The same transfer_id was given to P and D with different prompts (a proxy
            # bug): that KV would decode into a wrong answer without any error.
            return (
                f"the producer's KV is for another prompt (digest {msg.prompt} against this request's "
                f"{spec.tokens}); the proxy must send P and D the same prompt under one transfer_id"
            )
        n, k, layers = len(spec.block_ids), spec.num_cached_blocks, len(w.layers)
        if lay.num_layers != layers or lay.block_nbytes != w.block_nbytes or lay.num_blocks != n:
            return (
                f"the producer staged {lay.num_blocks} blocks x {lay.num_layers} layers x {lay.block_nbytes} B "
                f"but this request needs {n} x {layers} x {w.block_nbytes} B"
            )
        if w.groups is not None:  # a hybrid model: rows hold the layers whose window keeps them
            if len(spec.groups) != len(w.groups.windows) or k >= n:
                return f"the request holds blocks of {len(spec.groups)} KV cache groups after a {k}-block hit"
            if msg.nbytes != (staged := self._staged_nbytes(spec)):
                return (f"{msg.nbytes} B offered do not match the {staged} B the KV cache "
                        f"groups' windows hold for {spec.num_tokens} tokens")
            first, cells = w.groups.rows(n, spec.num_tokens).tail_cells(k)
            offset, nbytes = first * w.block_nbytes, cells * w.block_nbytes
        elif msg.nbytes != self._staged_nbytes(spec) or k >= n:
            return (
                f"{msg.nbytes} B offered do not match {n} blocks of {layers * w.block_nbytes} B after a {k}-block hit"
            )
        else:
            offset, nbytes = tail_range(n, k, layers, w.block_nbytes)
        load.nbytes = nbytes
        receive = self._receive_nccl if w.nccl is not None else self._receive_tcp
        reason = await receive(msg, load, offset, nbytes)
        if reason:
            return reason
        with load.landing, w.lock:
            if load.state == "receiving":
                self._received(load)
            elif load.state != "received":  # given up by `get_finished` meanwhile (else `_land` marked it)
                return load.reason or "the load was given up"
            # In its blocks, the load is as the engine will read it: the Done goes now, from
            # this task. Sent after the get_finished that reports it, it woke this loop just
            # as the engine went on, and held the GIL from it (docs/PERFORMANCE.md). Not when
            # that get_finished took the load already, nor while an idle step waits for
            # landings: it reports this one at once, and this loop's Dones would hold the
            # GIL from it (and from the step's other landings).
            tell = (load.into_blocks and not load.settled and not self._awaiting
                    and self._loads.get(load.transfer_id) is load)
            if tell:
                load.told = load.settled = True
        if tell:
            w.count("done_at_landing")
            await self._finish([(load.transfer_id, load.nbytes, "")], [], [self._loaded_line(load)])
        # Else the bytes are in (and, chunk by chunk, being scattered); the engine sees it at
        # its next get_finished, whose `transfer.loaded` line says how the receive went. No
        # line here: with many loads landing at once, this thread's lines took the GIL from
        # the engine's get_finished that reports them.
        return ""

    async def _receive_nccl(self, msg: Prepare, load: _Load, offset: int, nbytes: int) -> str:
        """Lease; then ticket, Ready, post, in the producer's turn; then wait for the bytes."""
        w = self.w
        assert w.nccl is not None
        load.source = msg.source
        try:
            with anyio.fail_after(max(load.deadline - time.monotonic(), 0.0)):
                # Over the ipc backend the bytes may go straight into the blocks (`Into`).
                into = ((w.paged, list(tail(load.spec.block_ids, load.spec.num_cached_blocks)), load.allocated)
                        if w.paged is not None else None)
                posted = await self.post_receive(msg, load, load, offset, nbytes, w.chunk_nbytes, into)
                if posted.into_blocks:  # nothing to land: the receive's end is the load's
                    load.into_blocks = True
                    load.waited = await w.nccl.wait(
                        posted, load.deadline, landed=lambda b0, b1, left: self._landed_in_place(load, posted, b1))
                else:
                    load.waited = await w.nccl.wait(
                        posted, load.deadline,
                        landed=(lambda b0, b1, left: self._land(load, b0, b1, left)) if w.paged else None,
                        before=(lambda: self._before_landing(load)) if w.paged else None)
        except TimeoutError:
            return f"no KV within the load deadline of {w.config.load_timeout_s:g} s"
        except TransferFailed as exc:
            return exc.reason
        except PoolError as exc:
            return str(exc)
        return ""

    async def post_receive(self, msg: Prepare, load: _Load, holder: _Load | Lane, offset: int, nbytes: int,
                           block_nbytes: int, into: Any = None, **fields: Any) -> Any:
        """Over nccl: lease `nbytes` into `holder.lease` (the load, or one of its lanes; no
        lease for a receive straight into the load's blocks on a communicator built
        already), then take a ticket, send the Ready and post the receive, in the producer's
        turn; the posted receive. Where `NcclLink.posts_first` says, the receive is posted
        first, in the turn, and the Ready sent once the turn is passed on.
        `fields` (a lane's source and heads) go into the Ready and its log line. A ticket
        whose receive was not posted is given up: its Ready may be out, and the
        producer's send must not pair with another receive."""
        w, tid, source = self.w, msg.transfer_id, msg.source
        assert w.pool is not None and w.client is not None and w.nccl is not None
        # Room first: a transfer waiting for room does not hold up the producer's
        # transfers that have theirs. None for a receive straight into the blocks on a
        # communicator built already (its Expect told the broker it takes no room).
        asked = time.monotonic()
        in_place = into is not None and holder is load and w.nccl.receives_into_blocks(source, into[0], len(into[1]))
        if not in_place:
            holder.lease = await w.pool.acquire(nbytes)
        leased = time.monotonic()
        # The producer's turn is held from the ticket until the receive is posted, not
        # until it ends: the next transfer's Ready goes while this one is on the wire, and
        # its receive is posted after this one's (`connector.nccl_link`).
        posted, posted_at = None, 0.0
        async with w.nccl.receiving(source):
            turn = time.monotonic()
            ticket = w.nccl.ticket(source)
            # Into blocks on a communicator built already, the receive goes first: the
            # producer sees it in their mailbox and starts sending without waiting for
            # the Go (`NcclLink.watch_receive`). Else the Ready goes first.
            first = into is not None and w.nccl.posts_first(source, ticket)
            try:
                if holder.lease is None and not (first and w.nccl.receives_into_blocks(source, into[0], len(into[1]))):
                    # the communicator changed since: the bytes go through the pool after all
                    holder.lease = await w.pool.acquire(nbytes)
                if first:
                    posted = await w.nccl.post_recv(source, tid, holder.lease, nbytes, load.deadline, ticket,
                                                    block_nbytes=block_nbytes, into=into)
                    posted_at = time.monotonic()
                else:
                    ready = await self._ready(load, ticket, offset, nbytes, fields, lease_s=leased - asked,
                                              turn_s=turn - leased, since=turn, first=False)
                    posted = await w.nccl.post_recv(source, tid, holder.lease, nbytes, load.deadline, ticket,
                                                    block_nbytes=block_nbytes, into=into)
                    if holder is load:
                        load.post_us = _us(time.monotonic() - ready)
            finally:
                if posted is None:
                    with anyio.CancelScope(shield=True):
                        await w.nccl.give_up(source)
        if first:
            # Posted: the turn is the next transfer's now, whose receive then goes while
            # this Ready is sent (with eight of a step, each Ready held the next post back).
            if holder is load:
                load.post_us = _us(posted_at - turn)
            try:
                await self._ready(load, ticket, offset, nbytes, fields, lease_s=leased - asked, turn_s=turn - leased,
                                  since=posted_at, first=True)
            except BaseException:  # posted, but the broker may never hear of it: end it
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(w.nccl.cancel, source, tid)
                raise
        return posted

    async def _ready(self, load: _Load, ticket: tuple[str, int], offset: int, nbytes: int, fields: dict[str, Any], *,
                     lease_s: float, turn_s: float, since: float, first: bool) -> float:
        """Send `load`'s Ready naming `ticket`, and log where D's time before it went: room
        in the pool (`lease_s`), the producer's turn (`turn_s`: the transfers ahead of it
        posting), then from `since` the post (when `first`, it went before the Ready) and
        the send. When it was sent."""
        w, tid = self.w, load.transfer_id
        assert w.client is not None
        await w.client.client.ready(tid, nbytes, offset, comm=ticket[0], seq=ticket[1], source=fields.get("source", ""))
        ready = time.monotonic()
        w.log.info("transfer.ready", transfer_id=tid, phase="ready", offset=offset, nbytes=nbytes,
                   skip_blocks=load.spec.num_cached_blocks, transport="nccl", comm=ticket[0] or None,
                   seq=ticket[1], prepare_us=_us(ready - load.prepared_at), lease_us=_us(lease_s),
                   turn_us=_us(turn_s), send_us=_us(ready - since), posted_first=first, **fields)
        return ready

    def _before_landing(self, load: _Load) -> None:
        """As the receive is waited for, before the first chunk can land: put the scatter
        stream after the compute stream's point at `start_load_kv` and the target block
        ids on the GPU, while the bytes are still on the wire. Done at the first landing
        instead, this cost the last byte 0.3-0.4 ms on an H200 pair (a one-chunk transfer)."""
        w = self.w
        assert w.paged is not None
        try:
            with load.landing:
                if load.state == "receiving" and load.targets is None:
                    stream = self._landing_stream_made()
                    with torch.cuda.device(w.paged.device), torch.cuda.stream(stream):
                        self._targets(load, stream)
        except Exception:  # the wait must still happen: `_land` tries again, and fails the load if it cannot
            w.log.exception("transfer.landing_setup_failed", transfer_id=load.transfer_id, phase="receive")

    def _landing_stream_made(self) -> torch.cuda.Stream:
        """The one stream every load's landings are scattered on."""
        assert self.w.paged is not None
        if self._landing_stream is None:
            with self.w.lock:  # two loads' first landings may race to make it
                if self._landing_stream is None:
                    self._landing_stream = torch.cuda.Stream(self.w.paged.device)
        return self._landing_stream

    def _targets(self, load: _Load, stream: torch.cuda.Stream) -> torch.Tensor:
        """The load's target block ids on the GPU, made once (holding `load.landing`), on
        `stream` after `allocated`."""
        assert self.w.paged is not None and load.allocated is not None
        if load.targets is None:
            stream.wait_event(load.allocated)
            load.targets = self.w.paged.block_ids(list(tail(load.spec.block_ids, load.spec.num_cached_blocks)))
        return load.targets

    def _land(self, load: _Load, b0: int, b1: int, left: int = 0) -> None:
        """Blocks ``[b0, b1)`` of the load's transfer have arrived whole in its lease:
        scatter them into D's cache now (the link's poller thread), on the landing stream,
        after the compute stream's point at `start_load_kv`. Not once the load was given up.
        With more than one chunk still to come the copy runs on a capped grid
        (`SCATTER_PROGRAMS`): at full width it would slow the receive it overlaps. After the last chunk the load is received at once, so the
        engine's next `get_finished` sees it without waiting for the loop thread.

        Holds only this load's `landing` lock while it launches: with many loads in
        flight, landings under the worker's lock queued behind one another and kept
        get_finished waiting (1-2 ms a landing with eight in flight on an H200 pair)."""
        w = self.w
        assert w.paged is not None and load.allocated is not None
        asked = time.monotonic()
        with load.landing:  # against `_fail` and `get_finished` deciding the load's fate meanwhile
            locked, cpu = time.monotonic(), time.thread_time()
            if load.state != "receiving" or load.lease is None:
                return
            stream = self._landing_stream_made()
            with torch.cuda.device(w.paged.device), torch.cuda.stream(stream):
                count = len(load.spec.block_ids) - load.spec.num_cached_blocks
                targets = self._targets(load, stream)
                words = w.paged.staging_view(load.lease.tensor, count)
                w.paged.copy_range(targets, words, b0, b1, to_staging=False,
                                   programs=SCATTER_PROGRAMS if left > 1 else None)
                event = torch.cuda.Event()
                event.record(stream)
            with w.lock:  # what get_finished reads
                load.scattered, load.landed_blocks = event, b1
                if left == 0 and b1 == count:
                    self._received(load)
        # What a landing costs D's host: waiting for the load's lock, then the launch under
        # it, and of that the CPU time this thread used (the rest it waited: for the GIL,
        # the driver or the worker's lock).
        w.log.debug("transfer.landed", transfer_id=load.transfer_id, phase="landed", blocks=[b0, b1], left=left,
                    lock_wait_us=_us(locked - asked), launch_us=_us(time.monotonic() - locked),
                    launch_cpu_us=_us(time.thread_time() - cpu))

    def _landed_in_place(self, load: _Load, posted: Any, count: int) -> None:
        """The load's one receive straight into its blocks has ended (the ipc backend):
        the blocks hold the bytes, and the compute stream only has to be after it. Its
        lease, never written, goes back now rather than in the engine's get_finished."""
        with load.landing:  # against `_fail` and `get_finished` deciding the load's fate meanwhile
            if load.state != "receiving":
                return
            with self.w.lock:  # what get_finished reads
                load.scattered, load.landed_blocks = posted.completions[-1].event, count
                lease, load.lease = load.lease, None
                self._received(load)
        if lease is not None:
            lease.release()
        self.w.log.debug("transfer.landed", transfer_id=load.transfer_id, phase="landed", blocks=[0, count], left=0,
                         in_place=True)

    async def _receive_tcp(self, msg: Prepare, load: _Load, offset: int, nbytes: int) -> str:
        return await self.receive_tcp(msg, load, load, msg.transfer_id, offset, nbytes)

    async def receive_tcp(self, msg: Prepare, load: _Load, holder: _Load | Lane, key: str, offset: int, nbytes: int,
                          **fields: Any) -> str:
        """Lease `nbytes` into `holder.lease` (the load, or one of its lanes), expect them at
        the receiver under `key`, then Ready, then wait for them; "" once they are in, else
        why not. `fields` (a lane's source and heads) go into the Ready and its log line.
        A receive that cannot be called off leaves its lease quarantined."""
        w, tid = self.w, msg.transfer_id
        assert w.pool is not None and w.client is not None and self.receiver is not None
        source = fields.get("source", "")
        expecting = False
        try:
            with anyio.fail_after(max(load.deadline - time.monotonic(), 0.0)):
                asked = time.monotonic()
                into = self._places(load, nbytes) if holder is load else None
                if into is None:  # into a lease, and scattered from it
                    holder.lease = await w.pool.acquire(nbytes)
                leased = time.monotonic()
                if into is not None:  # straight into the blocks: no pool room, and get_finished scatters nothing
                    completion = self.receiver.expect(key, msg.attempt, into=into)
                    load.into_blocks = True
                else:
                    assert holder.lease is not None
                    completion = self.receiver.expect(key, msg.attempt, holder.lease.tensor, nbytes)
                expecting = True
                await w.client.client.ready(tid, nbytes, offset, source=source)
                ready = time.monotonic()
                w.log.info(
                    "transfer.ready", transfer_id=tid, phase="ready", offset=offset, nbytes=nbytes,
                    skip_blocks=load.spec.num_cached_blocks, prepare_us=_us(ready - load.prepared_at),
                    lease_us=_us(leased - asked), send_us=_us(ready - leased), into_blocks=into is not None,
                    **fields,
                )
                await completion.wait()
                expecting = False
        except TimeoutError:
            return f"no KV{f' from {source}' if source else ''} within the load deadline of {w.config.load_timeout_s:g} s"
        except TransferFailed as exc:
            expecting = False
            return exc.reason
        except PoolError as exc:
            return str(exc)
        finally:
            if expecting:
                try:
                    await self.receiver.cancel(key, "the load ended")
                except TcpTransportError as exc:
                    self._quarantine(load, str(exc), holder)
        return ""

    def _places(self, load: _Load, nbytes: int) -> list[memoryview] | None:
        """Where the tcp wire's `nbytes` go in this instance's cache for `load`, written by
        the receiving thread as they arrive, so the engine's get_finished has no scatter
        to run (on a 2-core VM the scatter held the engine's thread 5-18 ms for a request
        of 512-2,048 tokens, 24-26 ms for eight of 512: docs/PERFORMANCE.md). None:
        receive into the lease and scatter (a hybrid model's rows, a GPU cache, anything
        `CachePlaces` declines)."""
        w = self.w
        if w.groups is not None:
            return None
        places = load.places  # worked out at the Expect
        if places is None:
            places = w.places.of(tail(load.spec.block_ids, load.spec.num_cached_blocks))
        return places if places is not None and sum(len(p) for p in places) == nbytes else None

    async def on_abort(self, msg: Abort) -> None:
        w, tid = self.w, msg.transfer_id
        with w.lock:
            load = self._loads.get(tid)
            if load is None:
                # Under the same lock as the lookup: a request claiming it right after
                # must find the tombstone, or it would wait its whole deadline.
                _keep(self._tombstones, tid, msg.reason)
            scope = self._stop_locked(load, BROKER_ABORT + msg.reason) if load is not None else None
        if load is None:
            parked = self._parked.pop(tid, None)
            if parked is not None:
                parked.set()
        elif scope is not None:
            await self._cancel_receive(load, scope)

    def _stop_locked(self, load: _Load, reason: str) -> anyio.CancelScope | None:
        """End a load the broker no longer carries (caller holds the lock): a waiting one
        fails now; a receiving one's scope is returned, for `_cancel_receive`."""
        if load.state not in ("waiting", "receiving"):
            return None
        load.reason, load.settled = reason, True
        if load.state == "waiting":
            load.state = "failed"
            return None
        return load.scope

    async def _cancel_receive(self, load: _Load, scope: anyio.CancelScope) -> None:
        if self.w.nccl is not None and load.source:  # the receive runs in a thread: end it, then the task
            await anyio.to_thread.run_sync(self.w.nccl.cancel, load.source, load.transfer_id)  # blocks: off the loop
        scope.cancel()
        await stop_lanes(self, load)
        if load.lanes and not any(lane.active for lane in load.lanes.values()):
            self._fail(load, load.reason, telling=False)  # no lane's task is left to end it

def _tail_blocks(spec: LoadSpec) -> list[int]:
    """The blocks a failed load leaves unwritten: every group's past the prefix hit, never the null block."""
    groups = spec.groups or [spec.block_ids]
    return [b for ids in groups for b in tail(ids, spec.num_cached_blocks) if b != NULL_BLOCK]


def _keep(memory: OrderedDict[str, _V], tid: str, value: _V) -> None:
    """Remember `value` for `tid`, forgetting the oldest past MAX_TOMBSTONES (caller holds the lock)."""
    memory[tid] = value
    while len(memory) > MAX_TOMBSTONES:
        memory.popitem(last=False)
