"""The producer (prefill) side of the worker half: stage each request's KV, send it on Go.

1. `bind`: for each request whose prompt completes in this step, lease a staging
   buffer of ``blocks x layers x block_nbytes``, block-major, so D can skip a head of
   blocks it already holds with a byte offset. If the pool is full, wait for the
   broker's Releases (load_timeout_s at most per step, whatever its number of saves):
   that is the backpressure on prefill. The Offer leaves from the client's loop thread
   (a step never waits on the broker) once the first layer's copy is queued, so the
   GPU has work while that thread holds the GIL: the broker's round trip to D and back
   (about a millisecond) overlaps the forward pass instead of following it.
2. `save_kv_layer`: copy that layer of the request's blocks into the lease before
   returning (on a GPU with Triton, with the transport's copy kernel, except for a
   hybrid model, whose layers torch copies out of their groups' blocks; a step's saves
   are leased back to back out of one lease cut up, so one kernel copies the layer
   for all of them). On the CPU the
   copy is complete on return, so vLLM may free and reuse
   the blocks right after the step and the staged copy still holds what the cache held
   when the layer was computed (the seed's corruption came from copying later, on
   another thread). On a GPU (transport "nccl") the same gather is enqueued on the
   compute stream before the hook returns, so stream order makes it read the blocks as
   they were, whatever the next step writes into them.
3. `wait_for_save`: marks the step's copies complete; a step that missed a layer is
   dropped rather than sent half-written, and its transfer aborted at the broker. On a
   GPU it records an event after the step's gathers; the NCCL send waits on it.
4. On Go: over nccl with the copy kernel, post the send at once, even during the
   forward pass: sent into D's blocks, it follows the step's layers (`StepLayers`) and
   is launched a group of layers at a time, each behind an event after that group's
   gathers, so the transfer runs beside the forward pass and only the last layer's
   bytes remain when it ends. Over tcp likewise:
   the send writes each layer to D's socket once `save_kv_layer` has copied it
   (`_Layers`), the request's KV layer-major on the wire. Any other send (over nccl
   without the copy kernel, a hybrid model's rows, a lane of another TP size) first
   waits for the copy (at most load_timeout_s). Then send the requested byte range straight to D's TCP endpoint
   (returns once D acknowledged all of it), or over NCCL on the communicator the Go
   names, when it is next there in D's order (returns once the send has ended on the
   GPU). Over ipc into D's blocks the send may start before its Go: D posts that receive
   before its Ready, naming the transfer, and the thread of P's link that sees it posts
   the send there and then (`_receive_seen`); the Go then sends nothing. On Release (D
   has it) or Abort: free the lease, after any send still reading it; an Abort also ends
   an NCCL send still under way. A staged copy the broker never settles is
   freed after `staging_ttl_s`. A send this side cannot make (its NCCL op failed, its
   copy was never complete, its tcp payload failed, D names no endpoint for the
   transport, or a malformed one) aborts the transfer at the broker, so D's load fails
   at once instead of at its deadline; a broken link (no connection, no ack, a reject)
   is D's to report, or the broker's to re-route with the copy this side keeps.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cached_property, partial
from typing import TYPE_CHECKING

import anyio
import torch

from protocols.errors import SendTimeout, TransferFailed
from protocols.messages import Abort, Go, Release
from workers.gpu_staging import StepLayers, current_stream, layers_in_order
from workers.groups import GroupRows, gather_layer_rows
from workers.layout import StepGather, gather_layer_into_staging, staging_view, wire_layout
from workers.pool import Lease, PoolError
from workers.transports.tcp import SendFailed, SourceInUse, TcpSender, byte_view

from .lanes import Part, cut_lane, cut_read, lane_key, lane_nbytes, split_for_go
from .scheduler import KvBrokerMetadata, SaveSpec

if TYPE_CHECKING:
    from .nccl_link import Posted, Waited
    from .worker import ConnectorWorker

__all__ = ["ProducerSide"]


@dataclass
class _Staged:
    """A staged copy of one request, alive until Release/Abort."""

    spec: SaveSpec
    lease: Lease
    shape: tuple[int, int, int]  # its staging's (blocks or a hybrid model's cells, layers, block bytes)
    created: float
    layers_done: set[int] = field(default_factory=set)
    rows: GroupRows | None = None  # a hybrid model: the rows of its staging (`workers.groups`)
    ids: torch.Tensor | None = None  # on a GPU with Triton: the block ids on the GPU, for `PagedKv`
    sends: int = 0
    dead: bool = False
    dropped: str = ""  # why it was aborted or expired, once it was (`_unstage`)
    complete: bool = False  # every layer copied (wait_for_save); a Go before that waits
    event: torch.cuda.Event | None = None  # nccl: recorded after the step's gathers; the send waits on it
    waiter: anyio.Event | None = None  # made by an early Go on the loop; set once complete or dead
    grouped: bool = False  # gathered with the rest of its step's group (`_Group`), one kernel a layer
    gather: StepGather | None = None  # not grouped, without the copy kernel: from the registered caches
    sending_to: str = ""  # nccl: the decode peer of the send under way, for `NcclLink.cancel`
    # nccl: the decode peer and communicator of a send started on D's receive, seen before
    # the Go came (`_receive_seen`): that Go, when it comes, sends nothing again
    started: tuple[str, str] | None = None
    # nccl with the copy kernel: its step's layers, which a send posted during the forward pass follows
    feed: StepLayers | None = None
    # tcp, one staging row per block: its step's layers copied so far, for a send that
    # streams them as they are copied (`_Layers`)
    layers: _Layers | None = None
    settled: threading.Event = field(default_factory=threading.Event)  # complete or dead: `_Streaming.wait`

    @property
    def untouched(self) -> bool:
        """Alive, and no send of it started or under way: a send on D's receive may still
        take it (read under the worker's lock)."""
        return not self.dead and self.started is None and not self.sends

    @cached_property
    def staging(self) -> torch.Tensor:
        """The lease as ``shape`` (`staging_view`), made on first use: the GPU's copies
        address the pool by offset, and a view costs bind host time before the forward
        pass's first kernel is launched."""
        return staging_view(self.lease.tensor, *self.shape)


@dataclass
class _Group:
    """A step's saves staged back to back in one cut-up lease: each layer is gathered
    for all of them by one copy (one kernel on a GPU with Triton, one torch call
    otherwise), not one per request."""

    block_ids: list[int]  # every member's block ids, in member order
    members: list[_Staged]
    ids: torch.Tensor | None = None  # with `PagedKv`: `block_ids` on the GPU
    words: torch.Tensor | None = None  # with `PagedKv`: the staging pool as words
    offset: int = 0  # with `PagedKv`: the first member's staged bytes, in words into `words`
    gather: StepGather | None = None  # else, from the registered caches (`CacheRows`)

    @cached_property
    def staging(self) -> torch.Tensor:
        """The members' staging as one, block-major (`staging_view`); made on first use
        (the CPU's copies, or a layer handed over as another tensor than the registered one)."""
        first, last = self.members[0], self.members[-1]
        whole = first.lease.base[first.lease.offset : last.lease.offset + last.lease.nbytes]
        return staging_view(whole, len(self.block_ids), first.shape[1], first.shape[2])


class ProducerSide:
    def __init__(self, worker: ConnectorWorker) -> None:
        self.w = worker
        self.sender: TcpSender | None = None
        self._staged: dict[str, _Staged] = {}
        self._step: list[tuple[str, _Staged]] = []
        self._pending: dict[str, SaveSpec] = {}  # bound this step, not staged yet (`_stage`)
        self._offers: list[tuple[str, _Staged]] = []  # staged this step, not offered yet
        self._layers: _Layers | None = None  # tcp: this step's layers copied so far
        self._group: _Group | None = None
        self._pool_words: torch.Tensor | None = None
        self._feed: StepLayers | None = None  # nccl with the copy kernel: this step's layers (`_stage`)
        self._cut_stream: torch.cuda.Stream | None = None  # nccl: where lanes' heads are cut (`connector.lanes`)

    def start_transport(self) -> dict[str, str]:
        """A producer only connects out: it advertises no endpoint."""
        if self.w.config.transport == "tcp":
            self.sender = TcpSender(log_context={"role": self.w.role, "instance": self.w.config.instance_id})
        return {}

    def close(self) -> None:
        if self.sender is not None:
            self.sender.close()

    @property
    def staged_now(self) -> int:
        with self.w.lock:
            return len(self._staged)

    # -- main thread -----------------------------------------------------------------------

    def bind(self, meta: KvBrokerMetadata) -> None:
        # Only noted: the step's staging is leased, and its block ids go to the GPU, at its
        # first save_kv_layer (`_stage`). Bind runs before the forward pass launches its
        # first kernel, and on an H200 that work (0.25 ms for one save, 0.8 ms for eight)
        # left the GPU idle; after the first layer's kernels are queued it overlaps them.
        self._pending.update(meta.saves)
        for tid, reason in meta.cancels.items():
            self.w.spawn(self._cancel, tid, reason)

    def _stage(self) -> None:
        """Lease staging for the saves bound this step (at its first save_kv_layer, or
        at wait_for_save in a step that saved no layer)."""
        w = self.w
        saves, self._pending = self._pending, {}
        # One wait for staging room per step, shared by its saves: a step with many saves
        # and a full pool stalls vLLM for load_timeout_s at most, not that once per save.
        deadline = time.monotonic() + self.w.config.load_timeout_s
        feed = self._feed = StepLayers(len(w.layers)) if w.nccl is not None and w.paged is not None else None
        # tcp streams a save's layers as they are copied; a hybrid model's rows do not
        # follow the layers, so it is sent whole
        layers = self._layers = _Layers() if w.nccl is None and w.groups is None else None
        offers: list[tuple[str, _Staged]] = []
        together = self._lease_together(saves) if saves else {}
        for tid, spec in saves.items():
            staged = together.get(tid) or self._lease(tid, spec, deadline)
            if staged is not None:
                staged.feed, staged.layers = feed, layers
                with self.w.lock:
                    self._staged[tid] = staged  # before the Offer: a Go must find it
                self._step.append((tid, staged))
                offers.append((tid, staged))
        # Offered once the first layer's work is queued (`_send_offers`), not after the
        # forward pass: D's Prepare and Ready and the Go come back while the layers are
        # being copied. Not before: the loop thread's Offer work takes the GIL, and the
        # GPU would wait for the first layer's copy to be launched.
        self._offers += offers

    def _lease_together(self, saves: dict[str, SaveSpec]) -> dict[str, _Staged]:
        """Stage a step's saves back to back in one lease cut into one per save, so
        `save_kv_layer` gathers each layer for all of them with one copy: a step of N
        requests then costs 32 copies instead of 32 x N (each 10-20 us of host time, a
        kernel launch on a GPU, torch's indexing on a CPU). A step of one save too: on a
        GPU its copy then addresses the pool by offset, with no view made for each layer.
        Only with room now and every block id inside the cache; {} otherwise, and each
        save is leased on its own (waiting for room if need be)."""
        w = self.w
        if w.pool is None or not w.layouts or w.groups is not None:  # a hybrid model's rows: one by one
            return {}
        with w.lock:
            if any(tid in self._staged for tid in saves):
                return {}  # a duplicate: `_lease` decides what to do with it
        num_layers = len(w.layers)
        sizes = [len(spec.block_ids) * num_layers * w.block_nbytes for spec in saves.values()]
        block_ids = [b for spec in saves.values() for b in spec.block_ids]
        num_blocks = min(layout.num_blocks for layout in w.layouts.values())
        if any(n % w.pool.alignment for n in sizes[:-1]) or not all(0 <= b < num_blocks for b in block_ids):
            return {}  # ids outside the cache: the copy of the save that holds them names them
        paged = w.paged
        if paged is not None and w.pool.capacity % paged.word.itemsize:
            paged = None
        try:
            ids = paged.block_ids(block_ids) if paged is not None else None
            lease = w.pool.acquire_nowait(sum(sizes))
        except (ValueError, PoolError):  # no room now: one by one
            return {}
        parts = w.pool.split(lease, sizes)
        out: dict[str, _Staged] = {}
        at = 0
        for (tid, spec), part in zip(saves.items(), parts):
            n = len(spec.block_ids)
            out[tid] = _Staged(spec=spec, lease=part, shape=(n, num_layers, w.block_nbytes), created=time.monotonic(),
                               ids=None if ids is None else ids[at : at + n], grouped=True)
            at += n
        group = _Group(block_ids=block_ids, members=list(out.values()))
        if paged is not None:
            assert ids is not None
            if self._pool_words is None:
                self._pool_words = w.pool.tensor.view(paged.word)
            group.ids, group.words, group.offset = ids, self._pool_words, parts[0].offset // paged.word.itemsize
        else:
            group.gather = w.rows.step(group.staging, block_ids)
        self._group = group
        return out

    def _lease(self, tid: str, spec: SaveSpec, deadline: float) -> _Staged | None:
        w = self.w
        assert w.pool is not None and w.client is not None
        num_layers = len(w.layers)
        nbytes = len(spec.block_ids) * num_layers * w.block_nbytes
        rows = None
        if w.groups is not None:  # only the blocks each group's window still holds
            rows = w.groups.rows(len(spec.block_ids), spec.num_tokens)
            nbytes = rows.cells * w.block_nbytes
            if len(spec.groups) != len(w.groups.windows):
                reason = f"it came with the block ids of {len(spec.groups)} KV cache groups, not {len(w.groups.windows)}"
                w.log.error("transfer.stage_failed", transfer_id=tid, phase="stage", reason=reason)
                w.spawn(self._offer_aborted, tid, spec, nbytes, f"the prefill instance could not stage it: {reason}")
                return None
        with w.lock:
            old = self._staged.get(tid)
        if old is not None:
            self._duplicate(tid, old, spec)
            return None
        try:
            lease = w.pool.acquire_nowait(nbytes)
        except PoolError:
            try:  # wait for Releases (backpressure), on the client's loop, under the step's deadline
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("this step's wait for staging room is used up") from None
                # Only earlier steps' transfers can give room back: this step's own are
                # offered after its saves are staged, so waiting on them would only stall
                # the forward pass until the deadline.
                mine = sum(staged.lease.reserved for _, staged in self._step)
                if w.pool.size_for(nbytes) > w.pool.capacity - mine:
                    raise PoolError(f"this step's saves together need more than it holds: {mine} B are staged for the "
                                    "saves before this one")
                lease = w.client.call(self._acquire, nbytes, left)
            except Exception as exc:  # never raise into vLLM's step
                if isinstance(exc, (PoolError, TimeoutError)):
                    reason = f"no staging room ({exc or 'timed out'}); raise staging_bytes (now {w.pool.capacity} B)"
                else:  # the client's loop is gone or failed
                    reason = f"waiting for staging room failed: {exc!r}"
                w.log.error("transfer.stage_failed", transfer_id=tid, phase="stage", nbytes=nbytes, reason=reason)
                w.spawn(self._offer_aborted, tid, spec, nbytes, f"the prefill instance could not stage it: {reason}")
                return None
        blocks = (rows.cells, 1) if rows is not None else (len(spec.block_ids), num_layers)
        shape = (*blocks, w.block_nbytes)
        try:
            ids = w.paged.block_ids(spec.block_ids) if w.paged is not None else None
        except ValueError:  # ids outside the cache: the torch copy names them in save_kv_layer
            ids = None
        staged = _Staged(spec=spec, lease=lease, shape=shape, created=time.monotonic(), ids=ids, rows=rows)
        if w.paged is None and rows is None:
            staged.gather = w.rows.step(staged.staging, spec.block_ids)
        return staged

    def _duplicate(self, tid: str, old: _Staged, spec: SaveSpec) -> None:
        """A transfer_id that is still staged arrives again (a proxy retry, or a proxy bug).

        The same prompt has the same KV: keep the staged copy. A different prompt must
        not be answered with the old prompt's KV, so the transfer is aborted: the decode
        side fails its load and vLLM's failure policy applies.
        """
        w = self.w
        if old.spec.tokens == spec.tokens:
            w.log.warning(
                "transfer.duplicate", transfer_id=tid, phase="stage", reason="already staged for the same prompt"
            )
            return
        reason = "the transfer_id was reused for a different prompt while its KV was still staged"
        w.log.error("transfer.duplicate", transfer_id=tid, phase="stage", reason=reason)
        self._drop(tid, "aborted", reason)

    async def _acquire(self, nbytes: int, timeout_s: float) -> Lease:
        assert self.w.pool is not None
        with anyio.fail_after(timeout_s):
            return await self.w.pool.acquire(nbytes)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor) -> None:
        idx = self.w.layers.get(layer_name)
        if idx is None:
            return
        if self._pending:
            self._stage()
        if not self._step:
            return
        layout = self.w.layouts[layer_name]
        # The registered cache on a GPU: the transport's kernel, about ten times the rate
        # of an index_select into the strided staging rows (`ConnectorWorker._triton_copies`).
        registered = kv_layer is self.w.caches.get(layer_name)
        paged = self.w.paged if registered else None
        group = self._group
        failed: list[tuple[str, Exception]] = []  # never raised into vLLM's forward pass
        for tid, staged in self._step:
            if group is not None and staged.grouped:
                continue  # below, with the rest of its group
            try:
                if paged is not None and staged.ids is not None:
                    words = paged.staging_view(staged.lease.tensor, len(staged.spec.block_ids))
                    paged.gather_layer(idx, staged.ids, words)
                elif staged.rows is not None and self.w.groups is not None:  # this layer's group's blocks
                    ids = staged.spec.groups[self.w.groups.layer_group[idx]]
                    gather_layer_rows(staged.staging, staged.rows, idx, kv_layer, layout, ids)
                elif registered and staged.gather is not None:
                    staged.gather.layer(idx)
                else:
                    gather_layer_into_staging(staged.staging, idx, kv_layer, layout, staged.spec.block_ids)
            except Exception as exc:
                failed.append((tid, exc))
                continue
            staged.layers_done.add(idx)
        if group is not None:
            try:
                if paged is not None and group.ids is not None and group.words is not None:
                    paged.gather_layer_at(idx, group.ids, group.words, group.offset)
                elif registered and group.gather is not None:  # the CPU
                    group.gather.layer(idx)
                else:  # this layer handed over as another tensor than the one registered
                    gather_layer_into_staging(group.staging, idx, kv_layer, layout, group.block_ids)
            except Exception as exc:
                failed += [(tid, exc) for tid, staged in self._step if staged.grouped]  # the group's members
                self._group = None
            else:
                for staged in group.members:
                    staged.layers_done.add(idx)
        if self._feed is not None:  # after this layer's gathers, in stream order (the seed's invariant)
            self._feed.gathered(idx, current_stream(self.w.paged.device))
        self._send_offers()
        if failed:
            self._copy_failed(layer_name, failed)
        if self._layers is not None:  # after the copies, and after a failed save was dropped:
            self._layers.copied(idx)  # its send never takes this layer

    def _send_offers(self) -> None:
        """Hand the step's Offers to the client's loop (not awaited: a step never waits on it)."""
        if self._offers:
            offers, self._offers = self._offers, []
            self.w.spawn(self._offer_all, offers)

    def _copy_failed(self, layer_name: str, failed: list[tuple[str, Exception]]) -> None:
        """Saves whose layer could not be copied (a block id outside the cache, a layer
        tensor of another shape) leave the step and are aborted, so their decode loads fail
        now; the step's other saves, and the forward pass, go on."""
        gone = {tid for tid, _ in failed}
        self._step = [(tid, staged) for tid, staged in self._step if tid not in gone]
        for tid, exc in failed:
            reason = f"its KV of layer {layer_name} could not be copied: {exc}"
            self.w.log.error("transfer.stage_failed", transfer_id=tid, phase="stage", reason=reason)
            self._drop(tid, "aborted", reason)

    def wait_for_save(self) -> None:
        w = self.w
        if self._pending:  # a step that saved no registered layer: its saves fail below
            self._stage()
        self._send_offers()
        step, self._step = self._step, []
        layers, self._layers = self._layers, None
        feed, self._feed = self._feed, None
        self._group = None
        event = None
        if step and w.pool is not None and w.pool.tensor.is_cuda:  # after every gather of the step
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(w.pool.tensor.device))
        for tid, staged in step:
            if len(staged.layers_done) != len(w.layers):
                reason = f"only {len(staged.layers_done)} of {len(w.layers)} layers were saved in the step"
                w.log.error("transfer.stage_failed", transfer_id=tid, phase="stage", reason=reason)
                # offered already (or just above): D's load fails now, not at its deadline
                self._drop(tid, "aborted", reason)
                continue
            w.count("staged")
            with w.lock:
                staged.event = event
                staged.complete = True
                waiter = staged.waiter
            staged.settled.set()
            if waiter is not None:  # a Go already waits for this copy
                w.spawn(self._wake, waiter)
        if layers is not None:  # after the step's incomplete saves were dropped: their sends stop
            layers.end()
        if feed is not None:
            feed.end()
        self._expire()

    async def _offer_all(self, ready: list[tuple[str, _Staged]]) -> None:
        """Offer every transfer of the step at once; at most SEND_TIMEOUT_S while reconnecting.

        `BrokerClient.offer` records an offer before sending it, so one that cannot go
        out now is re-sent when the client registers again.
        """
        async with anyio.create_task_group() as tg:
            for tid, staged in ready:
                tg.start_soon(self._offer, tid, staged)

    async def _offer(self, tid: str, staged: _Staged) -> None:
        w = self.w
        if w.client is None:  # the worker closed before this task ran
            return
        nbytes, spec = staged.lease.nbytes, staged.spec
        with w.lock:
            dropped = staged.dropped if self._staged.get(tid) is not staged else ""
        if dropped:  # its own Abort may have left first, for a transfer the broker did not know yet
            await self._offer_aborted(tid, spec, nbytes, dropped)
            return
        client = w.client.client
        layout = wire_layout(next(iter(w.layouts.values())), len(w.layers), len(spec.block_ids))
        if not await self.w.send_bounded("offer", tid, client.offer, tid, nbytes, layout, spec.decode, spec.tokens):
            return  # still staged: freed by Release/Abort, or after staging_ttl_s
        w.count("offered")
        if w.nccl is not None and staged.feed is not None and w.groups is None:  # it may go into D's blocks
            w.nccl.watch_receive(tid, self._receive_seen)
        w.log.info(
            "transfer.offered",
            transfer_id=tid,
            phase="offer",
            req_id=staged.spec.req_id,
            nbytes=nbytes,
            blocks=len(staged.spec.block_ids),
            decode=staged.spec.decode or None,
        )

    async def _offer_aborted(self, tid: str, spec: SaveSpec, nbytes: int, reason: str) -> None:
        """A save that will never be sent (not staged, or dropped before its Offer left):
        offered and aborted right behind it. The broker ignores an Abort for a transfer it
        does not know, so without the Offer D's load would wait load_timeout_s; this way
        it fails now and vLLM recomputes. No byte is sent: a Go finds nothing staged."""
        w = self.w
        if w.client is None:  # the worker closed before this task ran
            return
        client = w.client.client
        layout = wire_layout(next(iter(w.layouts.values())), len(w.layers), len(spec.block_ids))
        if await w.send_bounded("offer", tid, client.offer, tid, nbytes, layout, spec.decode, spec.tokens):
            await w.send_bounded("abort", tid, client.abort, tid, reason)

    async def _cancel(self, tid: str, reason: str) -> None:
        """A transfer this instance will never stage (`KvBrokerMetadata.cancels`): ended at the
        broker, whose Abort fails a decode instance's claim at once."""
        if self.w.client is not None:  # else the worker closed before this task ran
            await self.w.send_bounded("cancel", tid, self.w.client.client.cancel, tid, reason)

    def _expire(self) -> None:
        """Free staged copies that outlived staging_ttl_s (only when the broker is gone)."""
        now = time.monotonic()
        ttl = self.w.config.staging_ttl_s
        with self.w.lock:
            old = [tid for tid, s in self._staged.items() if now - s.created > ttl]
        for tid in old:
            self._drop(tid, "expired", f"no Release or Abort within {ttl:g} s")

    def _drop(self, tid: str, phase: str, reason: str) -> None:
        """Forget a staged copy the broker still holds, and Abort it there (from the main
        thread): D's credit comes back, and the client forgets its re-send record."""
        self._unstage(tid, phase, reason)
        assert self.w.client is not None
        self.w.spawn(self.w.send_bounded, "abort", tid, self.w.client.client.abort, tid, reason)

    def _unstage(self, tid: str, phase: str, reason: str = "", *, on_loop: bool = False) -> None:
        """Forget a staged copy; free its lease now, or when its last send ends. `on_loop`:
        called on the client's loop thread (else the main thread)."""
        w = self.w
        if w.nccl is not None:
            w.nccl.unwatch_receive(tid)
        with w.lock:
            staged = self._staged.pop(tid, None)
            if staged is None:
                return
            staged.dead = True
            if phase != "released":
                staged.dropped = reason or phase
            free_now = staged.sends == 0
            waiter = staged.waiter
        staged.settled.set()
        if staged.layers is not None:  # a send streaming its layers stops
            staged.layers.wake()
        if waiter is not None:  # a Go waiting for the copy gives up
            if on_loop:
                waiter.set()
            else:
                w.spawn(self._wake, waiter)
        if free_now:
            staged.lease.release()
        w.count("released" if phase == "released" else "aborted")
        level = "info" if phase == "released" else "warning"
        getattr(w.log, level)(f"transfer.{phase}", transfer_id=tid, phase=phase, reason=reason or None)

    # -- the client's loop thread ------------------------------------------------------------

    @staticmethod
    async def _wake(waiter: anyio.Event) -> None:
        waiter.set()

    def _receive_seen(self, tid: str, decode: str, nonce: str, seq: int, nbytes: int) -> bool:
        """D's receive of `tid` straight into its blocks is posted (the link's poller
        thread saw it, or the loop as it posted the send before): post the send into it
        here and now, when it is next in this side's order and nothing needs a wait
        (`NcclLink.send_on_receive`); the loop then only waits for its end
        (`_sent_on_receive`). Else on to the loop, which may start the send as a Go would
        (`_go_on_receive`). Whether the send was posted here. Never raises (the
        poller's thread)."""
        w = self.w
        try:
            sent = self._send_on_receive(tid, decode, nonce, seq, nbytes)
        except Exception as exc:  # before its claim (`NcclLink.send_on_receive` raises only after)
            w.log.warning("transfer.send_on_receive_failed", transfer_id=tid, phase="send", error=repr(exc))
            sent = None
        if sent is None:
            w.spawn(self._go_on_receive, tid, decode, nonce, seq, nbytes)
        return bool(sent)

    def _send_on_receive(self, tid: str, decode: str, nonce: str, seq: int, nbytes: int) -> bool | None:
        """Whether the send was posted (False: claimed, but its post failed, which the loop
        reports); None: not claimed."""
        w = self.w
        assert w.nccl is not None
        with w.lock:
            staged = self._staged.get(tid)
        if staged is None or staged.feed is None or w.paged is None:
            return None
        offset = self._tail_at(staged, nbytes)
        if offset is None:
            return None

        def claim() -> bool:  # in the link's turn: the send is this one's, not its Go's
            with w.lock:
                if not staged.untouched:
                    return False
                staged.started, staged.sending_to = (decode, nonce), decode
                staged.sends += 1
                return True

        t0 = time.monotonic()
        deadline = t0 + w.config.load_timeout_s
        try:
            posted = w.nccl.send_on_receive(decode, tid, nonce, seq, staged.lease, offset, nbytes,
                                            block_nbytes=w.chunk_nbytes, paged=w.paged, claim=claim,
                                            streaming=_Streaming(self, tid, staged, deadline))
        except TransferFailed as exc:  # claimed, not posted
            w.spawn(self._sent_on_receive, tid, decode, staged, offset, nbytes, t0, exc)
            return False
        if posted is None:
            return None
        w.spawn(self._sent_on_receive, tid, decode, staged, offset, nbytes, t0, posted)
        return True

    async def _sent_on_receive(self, tid: str, decode: str, staged: _Staged, offset: int, nbytes: int, t0: float,
                               posted: Posted | TransferFailed) -> None:
        """On the loop: the end of a send posted where D's receive was seen (`_receive_seen`)."""
        w, waited = self.w, None
        assert w.nccl is not None
        try:
            if isinstance(posted, TransferFailed):  # claimed, but not posted
                raise posted
            waited = await w.nccl.wait(posted, t0 + w.config.load_timeout_s)
        except TransferFailed as exc:
            w.log.warning("transfer.send_failed", transfer_id=tid, phase="send", decode=decode, reason=exc.reason)
            if not staged.dead:
                await self._end(tid, exc.reason)
        else:
            self._sent(tid, decode, offset, nbytes, t0, waited, on_receive=True)
        finally:
            self._send_ended(staged)

    async def _go_on_receive(self, tid: str, decode: str, nonce: str, seq: int, nbytes: int) -> None:
        """Send `tid` into the receive D posted for it (receive `seq` on communicator
        `nonce`, `nbytes` of the staged tail) as its Go would, a broker round trip
        earlier: when that send is next in this side's order with `decode`, the
        communicator's number for it is `seq`, and the bytes are a whole-block tail of
        the staging. Else nothing: the Go comes, and decides."""
        w = self.w
        assert w.nccl is not None
        with w.lock:
            staged = self._staged.get(tid)
            if staged is None or not staged.untouched:
                return
        offset = self._tail_at(staged, nbytes)
        ticket = w.nccl.ticket_at(decode, nonce, seq)
        if ticket is None or offset is None:
            return
        await self.on_go(Go(transfer_id=tid, decode=decode, endpoints={}, offset=offset, nbytes=nbytes,
                            comm=nonce, seq=ticket[1]), on_receive=True)

    def _tail_at(self, staged: _Staged, nbytes: int) -> int | None:
        """Where the last `nbytes` of `staged` start, when they are whole staged blocks (what
        a receive D posted into its blocks takes, after its prefix hit); None otherwise."""
        total = staged.shape[0] * staged.shape[1] * staged.shape[2]
        row = len(self.w.layers) * self.w.block_nbytes
        return total - nbytes if 0 < nbytes <= total and (total - nbytes) % row == 0 else None

    async def on_go(self, msg: Go, *, on_receive: bool = False) -> None:
        """Send what `msg` names. `on_receive`: not the broker's Go, but one made from D's
        receive, seen before the Go came (`_go_on_receive`)."""
        w, tid = self.w, msg.transfer_id
        waiter = None
        if w.nccl is not None and not on_receive:
            w.nccl.unwatch_receive(tid)
        with w.lock:
            staged = self._staged.get(tid)
            if staged is not None and not on_receive and staged.started == (msg.decode, msg.comm):
                # Its send started on D's receive already: this is its Go, come the long way.
                w.log.debug("transfer.go_after_receive", transfer_id=tid, phase="send", decode=msg.decode)
                return
            if staged is not None and on_receive:
                staged.started = (msg.decode, msg.comm)
            # Over nccl with the copy kernel the send is posted at once, during the forward
            # pass too, and a send into D's blocks is launched a group of layers at a time
            # as they are gathered (`_Streaming`); else a Go during the forward pass waits.
            # A lane for a decode rank of another TP size is cut from the whole staged copy.
            # Over tcp a save's layers stream the same way, each once `save_kv_layer` copied it.
            streaming = staged is not None and not msg.head_stop and (
                (w.nccl is not None and w.paged is not None and staged.feed is not None)
                or staged.layers is not None)
            if staged is not None:
                staged.sends += 1
                if not staged.complete and not streaming:
                    waiter = staged.waiter = staged.waiter or anyio.Event()
        if staged is None:
            w.log.warning("transfer.go_ignored", transfer_id=tid, phase="send", reason="nothing staged")
            if w.nccl is not None:
                w.nccl.abandon(msg.decode, (msg.comm, msg.seq))
            return
        endpoint = msg.endpoints.get("tcp")
        t0 = time.monotonic()
        let_go = True  # False: a cancelled send's thread may still read the staging
        posting = False  # nccl: the send took its place in the pair's order (or gave it up itself)
        waited: Waited | None = None  # nccl: when the send's end was seen
        part: Part | None = None  # nccl: a lane's heads, cut out of the staging
        try:
            if waiter is not None:
                with anyio.move_on_after(w.config.load_timeout_s):
                    await waiter.wait()
                if staged.dead:  # ended meanwhile: the broker knows
                    raise TransferFailed(tid, f"its copy was dropped: {staged.dropped}")
                if not staged.complete:  # the forward pass never saved it all: this side's failure
                    raise TransferFailed(tid, f"its copy was not complete within load_timeout_s "
                                              f"({w.config.load_timeout_s:g} s)")
            if w.nccl is not None:
                staged.sending_to = msg.decode
                source, after, paged = staged.lease, staged.event, w.paged
                block_nbytes = w.chunk_nbytes
                if msg.head_stop:  # a decode rank of another TP size receives a lane in chunks
                    paged = None
                    if (msg.head_start, msg.head_stop) != w.heads:  # some of this rank's heads: cut them
                        part = await self._cut(tid, staged, msg)
                        source, after, block_nbytes = part, part.event, part.block_nbytes
                if staged.dead:  # ended while the Go waited (its lane's cut): post nothing
                    raise TransferFailed(tid, f"it ended before its send was posted: {staged.dropped}")
                posting = True
                deadline = time.monotonic() + w.config.load_timeout_s
                waited = await w.nccl.send(
                    msg.decode, tid, source, msg.offset, msg.nbytes, None if streaming else after,  # type: ignore[arg-type]
                    deadline, block_nbytes=block_nbytes, ticket=(msg.comm, msg.seq),
                    paged=paged, streaming=_Streaming(self, tid, staged, deadline) if streaming else None)
            else:
                assert self.sender is not None
                if endpoint is None:
                    raise TransferFailed(tid, f"decode peer {msg.decode} advertises no tcp endpoint; run prefill "
                                              "and decode with the same transport")
                key, data = tid, staged.lease.tensor
                if msg.head_stop:  # a decode rank of another TP size takes some of this rank's heads
                    assert w.client is not None
                    key = lane_key(tid, w.client.registered.peer_id)
                    # a copy of the lane's heads (tens of ms for a long prompt): off the client's loop
                    data = await anyio.to_thread.run_sync(split_for_go, w, staged.staging, msg.head_start,
                                                          msg.head_stop)
                with anyio.fail_after(w.config.load_timeout_s):
                    if streaming:
                        stopped = threading.Event()
                        parts = self._layer_parts(tid, staged, msg.offset, msg.nbytes, stopped,
                                                  time.monotonic() + w.config.load_timeout_s)
                        await self.sender.send_parts(endpoint, key, msg.attempt, msg.nbytes, parts,
                                                     stop=partial(_stop, stopped, staged))
                    else:
                        await self.sender.send(endpoint, key, msg.attempt, data[msg.offset : msg.offset + msg.nbytes])
        except (TransferFailed, TimeoutError, OSError) as exc:
            reason = getattr(exc, "reason", None) or f"no ack within {w.config.load_timeout_s:g} s"
            w.log.warning("transfer.send_failed", transfer_id=tid, phase="send", decode=msg.decode, reason=reason)
            if w.nccl is not None and not posting:
                w.nccl.abandon(msg.decode, (msg.comm, msg.seq))
            # This side's failure (its copy, its NCCL op, after which D would hold its
            # receive and its turn for this producer until its deadline; its tcp payload, a
            # missing endpoint) ends the transfer at the broker at once, unless it ended
            # already (the broker knows). A broken tcp link (no connection, no ack, a
            # reject) does not: D fails its load, or the broker, losing D, re-routes the
            # transfer to another decode peer, which the staged copy is kept for.
            link = w.nccl is None and isinstance(exc, (SendFailed, SendTimeout))
            if isinstance(exc, TransferFailed) and not link and not staged.dead:
                await self._end(tid, reason)
        except SourceInUse as exc:
            let_go = False
            w.log.error("transfer.staging_quarantined", transfer_id=tid, phase="send", reason=str(exc))
        except Exception as exc:  # e.g. a malformed endpoint from the peer: fail this transfer only
            reason = f"cannot send to decode endpoint {endpoint!r}: {exc}"
            w.log.warning("transfer.send_failed", transfer_id=tid, phase="send", decode=msg.decode, reason=reason)
            await self._end(tid, reason)
        else:
            self._sent(tid, msg.decode, msg.offset, msg.nbytes, t0, waited, on_receive=on_receive)
        finally:
            await cut_read(part)  # the cut reads the staging: it must have run before the staging goes back
            self._send_ended(staged, let_go=let_go)

    def _sent(self, tid: str, decode: str, offset: int, nbytes: int, t0: float, waited: Waited | None, *,
              on_receive: bool) -> None:
        w = self.w
        w.count("sent")
        w.count("bytes", nbytes)
        if on_receive:
            w.count("sent_on_receive")
        now = time.monotonic()
        w.log.info(
            "transfer.sent",
            transfer_id=tid,
            phase="send",
            decode=decode,
            offset=offset,
            nbytes=nbytes,
            ms=round((now - t0) * 1e3, 3),
            on_receive=on_receive,
            **(waited.log_fields(now) if waited is not None else {}),
        )

    def _send_ended(self, staged: _Staged, *, let_go: bool = True) -> None:
        """A send of `staged` is over: free its lease if it was the last of a dead one.
        `let_go` False: a cancelled send's thread may still read the staging, which is
        then never released."""
        with self.w.lock:
            staged.sends -= 1
            free_now = staged.dead and staged.sends == 0 and let_go
            if not let_go:
                staged.sends += 1  # never reaches 0: the lease is never released
        if free_now:
            staged.lease.release()

    def _layer_parts(self, tid: str, staged: _Staged, offset: int, nbytes: int, stopped: threading.Event,
                     deadline: float) -> Iterator[list[memoryview]]:
        """The staged rows of blocks ``[offset, offset + nbytes)`` (block-major bytes), layer
        by layer, each layer once `save_kv_layer` has copied it (iterated on the sending
        thread, which waits here): the wire carries a save's KV layer-major, blocks in
        order within a layer, and D reads it so (`ConsumerSide._scatter`)."""
        w = self.w
        assert staged.layers is not None
        num_layers, block = len(w.layers), w.block_nbytes
        row = num_layers * block
        if offset % row or nbytes % row:
            raise TransferFailed(tid, f"the byte range {offset}+{nbytes} is not whole blocks of {row} B")
        first, count = offset // row, nbytes // row
        view = byte_view(staged.lease.tensor, writable=False)
        for layer in range(num_layers):
            if not staged.layers.wait(layer, lambda: staged.dead or stopped.is_set(), deadline):
                raise TransferFailed(tid, f"its copy was dropped, or its layer {layer} was not copied within "
                                          "load_timeout_s")
            at = layer * block
            yield [view[b * row + at : b * row + at + block] for b in range(first, first + count)]

    async def _cut(self, tid: str, staged: _Staged, msg: Go) -> Part:
        """The heads `msg` names, cut out of the staged copy (`connector.lanes.cut_lane`);
        in a worker thread (a CPU copy takes tens of ms; a GPU one is enqueued)."""
        w = self.w
        assert w.pool is not None
        if w.pool.tensor.is_cuda and self._cut_stream is None:
            self._cut_stream = torch.cuda.Stream(w.pool.tensor.device)
        lease = None
        try:
            # Into the staging pool where it has room: no GPU allocation while ops are in
            # flight. Without room, new memory: waiting for room could wait for this send.
            lease = w.pool.acquire_nowait(lane_nbytes(w, staged.staging, msg.head_start, msg.head_stop))
        except PoolError:
            pass
        try:
            return await anyio.to_thread.run_sync(cut_lane, w, staged.staging, staged.event, msg.head_start,
                                                  msg.head_stop, self._cut_stream, lease)
        except Exception as exc:
            if lease is not None:
                lease.release()  # nothing was enqueued on the GPU that could still write it
            raise TransferFailed(tid, f"the heads [{msg.head_start}, {msg.head_stop}) could not be cut out of the "
                                 f"staged copy: {exc}") from exc

    async def _end(self, tid: str, reason: str) -> None:
        """Abort a transfer this side cannot send, and free its copy: the broker ends it
        on D at once, and no Release or Abort comes back here."""
        assert self.w.client is not None
        await self.w.send_bounded("abort", tid, self.w.client.client.abort, tid, reason)
        self._unstage(tid, "aborted", reason, on_loop=True)

    async def on_release(self, msg: Release) -> None:
        self._unstage(msg.transfer_id, "released", on_loop=True)

    async def on_abort(self, msg: Abort) -> None:
        w = self.w
        with w.lock:
            staged = self._staged.get(msg.transfer_id)
            sending_to = staged.sending_to if staged is not None and staged.sends else ""
        if sending_to and w.nccl is not None:
            # D gave it up: a send under way would end only at its deadline, or, still
            # building its communicator, wait that long for D (an abort blocks: off the loop).
            await anyio.to_thread.run_sync(w.nccl.cancel, sending_to, msg.transfer_id)
        self._unstage(msg.transfer_id, "aborted", msg.reason, on_loop=True)


class _Layers:
    """A CPU step's layers copied so far, in order (tcp): a send posted at the Go streams
    each layer once `save_kv_layer` has copied it (`ProducerSide._layer_parts`), so the
    transfer runs beside the forward pass and the bytes sent are still the copy taken
    before the hook returned (the seed's invariant)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._done: set[int] = set()
        self._prefix = 0  # layers [0, prefix) are copied
        self._ended = False  # the step's wait_for_save ran: no layer is copied any more

    def copied(self, layer: int) -> None:
        with self._cond:
            self._done.add(layer)
            self._prefix = layers_in_order(self._done, self._prefix)
            self._cond.notify_all()

    def end(self) -> None:
        with self._cond:
            self._ended = True
            self._cond.notify_all()

    def wake(self) -> None:
        """Let waiters look at their `stop` again."""
        with self._cond:
            self._cond.notify_all()

    def wait(self, layer: int, stop: Callable[[], bool], deadline: float) -> bool:
        """Wait until `layer` is copied: True; False once `stop()` holds, the step ended
        without it, or `deadline` (time.monotonic()) passed."""
        with self._cond:
            self._cond.wait_for(lambda: self._prefix > layer or self._ended or stop(),
                                max(deadline - time.monotonic(), 0.0))
            return self._prefix > layer and not stop()


def _stop(stopped: threading.Event, staged: _Staged) -> None:
    """A cancelled streaming send: end its wait for the next layer."""
    stopped.set()
    if staged.layers is not None:
        staged.layers.wake()


class _Streaming:
    """A send posted at the Go, whatever the forward pass has gathered yet
    (`connector.nccl_link.Streaming`): it follows its step's layers (`StepLayers`)."""

    def __init__(self, side: ProducerSide, tid: str, staged: _Staged, deadline: float) -> None:
        assert staged.feed is not None
        self.side, self.tid, self.staged, self.deadline = side, tid, staged, deadline
        self.feed = staged.feed

    def wait(self) -> torch.cuda.Event | None:
        staged = self.staged
        if not staged.settled.wait(max(self.deadline - time.monotonic(), 0.0)) or staged.dead \
                or not staged.complete:
            raise TransferFailed(self.tid, "its copy was dropped or not complete within load_timeout_s")
        return staged.event
