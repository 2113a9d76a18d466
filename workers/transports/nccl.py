"""The GPU transport: 2-party NCCL communicators, cached, capped, aborted on timeout.

Theory of operation
-------------------
Each (local worker, remote worker) pair gets its own 2-rank NCCL communicator, outside
any global group: vLLM owns that. Three backends build it (`CommunicatorCache(backend=)`):

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
  which waits at posting on the events the op depends on; a post returns a work
  whose ``wait()`` makes the current stream wait on an event after the group, and
  holds the group's tensors until its completion is seen.
* "torch": a `ProcessGroupNCCL` built on a `TCPStore`, as below.
* "ipc" (`workers.transports.cuda_ipc`): both GPUs on one host; no NCCL at all: a send
  is one copy kernel straight into the receiver's buffer, mapped with CUDA IPC, paired
  with its receive through a page of shared memory. No communicator memory. A staged
  transfer goes whole as one kernel straight into D's blocks, each chunk copied as soon
  as P's compute stream says its gather is done (`_gather_and_send_blocks`): no
  per-chunk ops, no pool bytes or scatter on D (docs/RESULTS.md).

An acceptor builds whichever kind the initiator's payload names.

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
* Ordering. A send of staged KV is posted to run after its chunk's staging event
  (the NCCL stream waits on it; torch: the transport's stream does, and the group's
  NCCL stream waits on that stream), so the send cannot read staging before the
  gather that fills it. NCCL pairs a peer's sends and receives by posting order alone,
  so one transfer's chunks are posted under the communicator's lock, and a receiver
  posts its transfers in the order the sender sends them (the order of its Ready
  messages).
* Pipelining. A transfer goes in block chunks (`workers.gpu_staging.pipeline_bounds`):
  chunk k's send waits only for the gather that covers chunk k (P interleaves them,
  `gather_and_send`), and the receiver scatters chunk k on its own stream as soon as
  chunk k's receive completes, while chunk k+1 is still on the wire. Posting an op
  costs the host 0.06-0.25 ms (measured on an H200 pair), so a receiver sends Ready
  *before* it posts its receives: the two sides then post at the same time, and a
  send posted first simply waits on its GPU for the matching receive. (Posting a
  receive before Ready would also deadlock on a communicator's first use, whose
  creation needs the sender, which starts only once it has Ready.)
* Contention. The copies that run while bytes are on the wire (P's gathers after the
  first chunk's, D's scatters before the last two chunks') would, at full width, take
  the SMs and nearly all of HBM's bandwidth and slow the NCCL kernel they overlap by
  about 10%; they run on capped grids (`GATHER_PROGRAMS`, `SCATTER_PROGRAMS`) that still
  copy three to four times faster than the wire, and NCCL's stream has high priority,
  so its blocks are placed first. Measured in docs/RESULTS.md.
* Deadlines. Ops return a `Completion` (a CUDA event after the NCCL work) whose
  `wait(deadline)` spins briefly, then polls in pauses of at most 100 us (coarser
  polling would add its pause to every transfer's latency); past the deadline it
  aborts the communicator (a stuck NCCL kernel then returns), drops it from the cache
  and raises `SendTimeout`/`RecvTimeout`.
  The next use rebuilds it. The group's watchdog timeout (torch) is set far above any
  transfer deadline, so the watchdog (whose default reaction kills the process) never
  fires first.
* Host cost (torch). Before its first group the transport switches off torch's NCCL flight
  recorder and monitor threads (`TORCH_NCCL_QUIET`; an operator's values win): debugging
  it does not use, on the posting thread or beside it.
* Rebuilds and eviction are one-sided, so an acceptor checks `Rendezvous.poll` on each
  use and replaces its communicator when the initiator published a newer nonce. If the
  initiator sends before the acceptor saw it, that transfer misses its deadline on both
  sides and both rebuild; no bytes land in the wrong buffer. The other way round, an
  acceptor that aborts its side (a deadline, `discard`) publishes the dead nonce under
  ``<key>/stale``, and the initiator's next use, seeing it, builds a new communicator
  instead of posting into one whose other side is gone.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Literal

import structlog
import torch

from protocols.errors import RendezvousError
from workers.gpu_staging import PagedKv, StagedTransfer, Stager, current_stream
from workers.pool import Lease

from .cuda_ipc import IpcCommunicator
from .nccl_comm import (
    CacheStats,
    CommunicatorCache,
    CommunicatorLimit,
    Completion,
    DirectCommunicator,
    NcclCommunicator,
    QueueRendezvous,
    Rendezvous,
    check_byte_buffer,
)
from .nccl_setup import BACKENDS, resolve_backend

__all__ = [
    "BACKENDS", "CacheStats", "CommunicatorCache", "CommunicatorLimit", "Completion", "DirectCommunicator",
    "NcclCommunicator", "NcclTransport", "QueueRendezvous", "Rendezvous", "RendezvousError", "resolve_backend",
]

log = structlog.get_logger()

# Programs (CTAs) of a gather that overlaps the wire: enough to copy well ahead of
# NVLink's ~0.35 TB/s, few enough to leave most SMs and HBM to NCCL.
GATHER_PROGRAMS = 64
# And of a scatter on the receiver that overlaps later chunks' receives: at full width
# (about 3.8 TB/s of HBM traffic) it slows NCCL's receive of the next chunk.
SCATTER_PROGRAMS = 64
# With `adaptive_gathers`, a later chunk's gather gets programs for the rate it needs to
# be done when the chunk before it has left: (its size / the previous chunk's size) times
# NVLink's rate, at about 25 GB/s a program, with half again to spare; at least 16.
_PROGRAMS_PER_RATIO, _MIN_PROGRAMS = 22, 16


def gather_programs_for(ratio: float, cap: int | None) -> int:
    """Programs for a gather of a chunk `ratio` times the size of the chunk before it,
    at most `cap` (None: no cap)."""
    want = max(_MIN_PROGRAMS, math.ceil(ratio * _PROGRAMS_PER_RATIO))
    return want if cap is None else min(cap, want)


class NcclTransport:
    """Moves bytes and staged KV between GPUs over cached NCCL communicators.

    Args:
        cache: the communicators of this worker.
        unsafe_skip_event_wait: TEST ONLY. Post sends without waiting for the staging
            event, to show that the race this transport prevents is real.

    `gather_programs` caps the grid of every gather after a transfer's first chunk's:
    those run while earlier chunks are on the wire, and a full-width gather takes the
    SMs and memory bandwidth NCCL's send needs (`PagedKv.gather`). None: full width.
    With `adaptive_gathers` (the default) each of those gathers gets only the programs
    its chunk needs (`gather_programs_for`, at most `gather_programs`): a gather that
    merely keeps ahead of the wire leaves NCCL more of HBM than one at the cap.
    `scatter_programs` caps the receiver's scatters the same way, except the last two
    chunks' (small, and little is left to receive behind them). None: full width.

    Set `trace` to a list to collect ``(label, timing event)`` pairs at each chunk's
    end (``send_done@B``, ``recv_done@B``, ``scatter_done@B``, B the chunk's end
    block within the call; ``@all`` for raw tensors): what a benchmark or
    `kvbroker trace` reads a transfer's GPU timeline from. Recording them costs a few
    microseconds a chunk, so leave it None otherwise.
    """

    def __init__(
        self, cache: CommunicatorCache, *, gather_programs: int | None = GATHER_PROGRAMS, lookahead: int = 0,
        scatter_programs: int | None = SCATTER_PROGRAMS, adaptive_gathers: bool = True,
        unsafe_skip_event_wait: bool = False,
    ) -> None:
        self.cache = cache
        self.device = cache.device
        self.stream = torch.cuda.Stream(self.device)
        self.scatter_stream = torch.cuda.Stream(self.device)
        self.gather_programs = gather_programs
        self.adaptive_gathers = adaptive_gathers
        self.lookahead = lookahead
        self.scatter_programs = scatter_programs
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

    def gather_and_send(
        self, peer: str, stager: Stager, staged: StagedTransfer, *, bounds: Sequence[int] | None = None,
        before_send: Callable[[], None] | None = None, transfer_id: str = "",
        on_step: Callable[[str, int], None] | None = None, lookahead: int | None = None, ready_at: int = 0,
    ) -> Completion:
        """P's pipeline for a transfer from `Stager.begin`: gather chunk 0 on the current
        stream, call `before_send` (wait for D's Ready: its round trip overlaps that
        gather), post chunk 0's send; then, chunk by chunk, gather the next chunk (grid
        capped: it runs while the previous one is on the wire) and post its send.
        `lookahead` (default `self.lookahead`) gathers are enqueued ahead of the sends:
        with 1, chunk k+1's gather starts before chunk k's send is posted, so it is done
        by the time chunk k has left. `ready_at` is the chunk before whose send
        `before_send` is called: 1 sends the first chunk at once, into a receive D
        posted ahead of the transfer (`recv_staged`'s `posted`); with fewer chunks than
        that, `before_send` is not called at all.

        Each send waits on its own chunk's gather event, so P's blocks may be reused as
        soon as this returns. The communicator's lock is held throughout, so no other
        transfer's ops come between the chunks. `on_step(step, end_block)` is called
        after each gather is enqueued ("gather") and each send posted ("send"), for
        tracing. The completion is the last send's: NCCL runs one communicator's ops in
        order.
        """
        ends = list(bounds) if bounds else [staged.num_blocks]
        ahead = self.lookahead if lookahead is None else lookahead
        # Chunk 0's gather first: the wire waits for it, and finding the communicator (its
        # rendezvous check) can run while it copies. No op is posted before the lock below.
        stager.gather_chunk(staged, ends[0])
        if on_step is not None:
            on_step("gather", ends[0])
        comm = self.cache.get(peer, initiator=True)
        if ready_at == 0 and isinstance(comm, IpcCommunicator) and comm.takes_blocks(staged.paged, staged.num_blocks):
            return self._gather_and_send_blocks(comm, stager, staged, ends, before_send, transfer_id, on_step)
        # Staged on the GPU, each chunk's send is one lean post on a byte range of the
        # staging buffer; spilled, `send_staged` brings each chunk back through a bounce.
        data = staged.lease.base if staged.on_gpu else None  # the pool; the transfer starts at the lease's offset
        at = staged.lease.offset
        step = staged.paged.staged_block_nbytes
        done, start, gathered, works, earlier = None, 0, 1, [], []
        with comm.lock:
            for k, end in enumerate(ends):
                while gathered < min(len(ends), k + 1 + ahead):
                    programs = None if gathered == 0 else self._later_gather_programs(ends, gathered)
                    stager.gather_chunk(staged, ends[gathered], programs=programs)
                    if on_step is not None:
                        on_step("gather", ends[gathered])
                    gathered += 1
                if k == ready_at and before_send is not None:
                    before_send()
                if data is None:
                    if done is not None:
                        earlier.append(done)
                    done = self.send_staged(peer, staged, first_block=start, last_block=end, transfer_id=transfer_id)
                else:
                    event = None if self.unsafe_skip_event_wait else staged.event_for(end)
                    works.append(comm.post_range("send", data, at + start * step, (end - start) * step, self.stream,
                                                 event))
                if on_step is not None:
                    on_step("send", end)
                start = end
        if data is not None:
            return self._finish(comm, works, self.stream, "send", transfer_id, ends=ends)
        assert done is not None
        done.absorb(earlier)  # every chunk's bounce goes once the last send is seen done
        return done

    def _later_gather_programs(self, ends: Sequence[int], k: int) -> int | None:
        """The grid of chunk k's gather (k >= 1), which runs while earlier chunks move:
        `gather_programs`, or with `adaptive_gathers` what its size over the previous
        chunk's needs, at most that."""
        if not self.adaptive_gathers:
            return self.gather_programs
        prev = ends[k - 1] - (ends[k - 2] if k > 1 else 0)
        return gather_programs_for((ends[k] - ends[k - 1]) / prev, self.gather_programs)

    def _gather_and_send_blocks(
        self, comm: IpcCommunicator, stager: Stager, staged: StagedTransfer, ends: list[int],
        before_send: Callable[[], None] | None, transfer_id: str, on_step: Callable[[str, int], None] | None,
    ) -> Completion:
        """`gather_and_send` over a backend that sends a staged transfer whole (ipc): one
        copy kernel for every chunk, launched once chunk 0's gather is enqueued; after
        each chunk's gather the compute stream tells the kernel how many rows it may copy
        (`mark_staged`), in place of the event a chunk's send would wait on. Chunk 0's
        gather is already enqueued."""
        if not staged.on_gpu:  # spilled: every gather, then the whole transfer from a GPU copy
            for end in ends[1:]:
                stager.gather_chunk(staged, end)
            if before_send is not None:
                before_send()
            return self._send_blocks_whole(comm, staged, transfer_id)
        per_block = staged.paged.num_layers * staged.paged.pre
        compute = current_stream(self.device)
        with comm.lock:
            seq = comm.next_send
            if not self.unsafe_skip_event_wait:
                comm.mark_staged(compute, seq, ends[0] * per_block)
            if before_send is not None:
                before_send()
            # TEST ONLY (`unsafe_skip_event_wait`): every row released at once, gathered or not.
            work = comm.send_blocks(seq, staged.paged, staged.tensor.data_ptr(), staged.num_blocks,
                                    staged=self.unsafe_skip_event_wait, keep=[staged.tensor])
            if on_step is not None:
                on_step("send", ends[0])
            for k in range(1, len(ends)):
                stager.gather_chunk(staged, ends[k], programs=self._later_gather_programs(ends, k))
                if not self.unsafe_skip_event_wait:
                    comm.mark_staged(compute, seq, ends[k] * per_block)
                if on_step is not None:
                    on_step("gather", ends[k])
        return self._finish(comm, [work], self.stream, "send", transfer_id)

    def _send_blocks_whole(self, comm: IpcCommunicator, staged: StagedTransfer, transfer_id: str) -> Completion:
        """A staged transfer whose gathers are all enqueued, as one block op (ipc). Spilled
        staging is first copied back to the GPU, on the current stream after the gathers:
        the copy kernel reads GPU memory only."""
        src, keep = staged.tensor, [staged.tensor]
        if staged.on_gpu:
            event = None if self.unsafe_skip_event_wait else staged.event_for(staged.num_blocks)
        else:
            with torch.cuda.device(self.device):
                bounce = torch.empty(staged.nbytes, dtype=torch.uint8, device=self.device)
                bounce.copy_(staged.tensor, non_blocking=True)
            src, keep, event = bounce, [bounce, staged.tensor], _now(self.device)[0]
        with comm.lock:
            work = comm.send_blocks(comm.next_send, staged.paged, src.data_ptr(), staged.num_blocks, after=[event],
                                    staged=True, keep=keep)
        return self._finish(comm, [work], self.stream, "send", transfer_id)

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
        last = staged.num_blocks if last_block is None else last_block
        if (first_block == 0 and last == staged.num_blocks and isinstance(comm, IpcCommunicator)
                and comm.takes_blocks(staged.paged, staged.num_blocks)):
            return self._send_blocks_whole(comm, staged, transfer_id)
        step = staged.paged.staged_block_nbytes
        data, keep, works = staged.tensor, [], []
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
                if staged.on_gpu:
                    works.append(comm.post_range("send", staged.lease.base, staged.lease.offset + b0 * step,
                                                 (b1 - b0) * step, self.stream, event))
                    continue
                with torch.cuda.device(self.device), torch.cuda.stream(self.stream):  # spilled: through a bounce
                    if event is not None:
                        self.stream.wait_event(event)
                    bounce = torch.empty((b1 - b0) * step, dtype=torch.uint8, device=self.device)
                    bounce.copy_(data[b0 * step : b1 * step], non_blocking=True)
                    event = _now(self.device)[0]  # the send waits for the copy
                keep.append(bounce)
                works.append(comm.post([("send", bounce)], self.stream, [event]))
        return self._finish(comm, works, self.stream, "send", transfer_id, keep, [b1 + first_block for _, b1 in chunks])

    def recv_staged(
        self, peer: str, buf: torch.Tensor | Lease, paged: PagedKv, block_ids: torch.Tensor, *,
        bounds: Sequence[int] | None = None, transfer_id: str = "", posted: Sequence[Any] = (),
    ) -> Completion:
        """Receive staged blocks into `buf` (a pool lease, or its uint8 tensor) and
        scatter them into `block_ids`. `posted`: receives of the first chunks already
        posted into `buf` (a receive posted ahead, before the sender's Offer arrived).

        Every chunk's receive is posted first, at once: `buf` must have no GPU work
        left on it (a lease from a pool whose earlier transfers completed). Then the
        scatter stream waits for the current stream's work (which may still use the
        blocks) and for each receive in turn, and scatters that chunk, so scattering
        chunk k overlaps receiving chunk k+1. The completion covers the last scatter.
        Send Ready before calling this (see the module doc): the sender's posting then
        overlaps ours.
        """
        comm = self.cache.get(peer, initiator=False)
        n = block_ids.numel()
        if not posted and isinstance(comm, IpcCommunicator) and comm.takes_blocks(paged, n):
            # The sender writes straight into the blocks (ipc): `buf` stays untouched (the
            # caller still holds it: it is the credit the broker granted), no scatter.
            work = comm.post_blocks(paged, block_ids, after=_now(self.device))
            return self._finish(comm, [work], self.stream, "recv", transfer_id)
        step = paged.staged_block_nbytes
        chunks = _ranges(n, bounds)
        if isinstance(buf, Lease):  # a pool's tensor is uint8 and contiguous by construction
            base, at = buf.base, buf.offset
            if not base.is_cuda:
                raise ValueError("NCCL receives into a GPU pool; this lease is from a pool in host memory.")
        else:
            check_byte_buffer(buf)
            base, at = buf, 0
        works = list(posted)
        with comm.lock:  # the receives first: the sender may be waiting on the first one
            for b0, b1 in chunks[len(works):]:
                works.append(comm.post_range("recv", base, at + b0 * step, (b1 - b0) * step, self.stream))
        current = _now(self.device)
        words = paged.staging_view(buf.tensor if isinstance(buf, Lease) else buf, n)
        with torch.cuda.device(self.device), torch.cuda.stream(self.scatter_stream):
            # Whatever the caller enqueued on these blocks so far must finish before we write them.
            self.scatter_stream.wait_event(current[0])
            for k, (work, (b0, b1)) in enumerate(zip(works, chunks)):
                if work is not None:
                    work.wait()
                self._mark(self.scatter_stream, f"recv_done@{b1}")
                if paged.use_triton:  # no slicing: a chunk is a row range of the whole transfer
                    # The last two chunks' scatters run at full width: little is left to receive.
                    cap = self.scatter_programs if k < len(chunks) - 2 else None
                    paged.copy_range(block_ids, words, b0, b1, to_staging=False, programs=cap)
                else:
                    paged.scatter(block_ids[b0:b1], words[b0:b1])
                self._mark(self.scatter_stream, f"scatter_done@{b1}")
        return comm.completion([], self.scatter_stream, "recv", transfer_id, works)


def _now(device: torch.device) -> list[torch.cuda.Event]:
    """An event at the current tail of the current stream."""
    event = torch.cuda.Event()
    event.record(current_stream(device))
    return [event]


def _ranges(num_blocks: int, bounds: Sequence[int] | None) -> list[tuple[int, int]]:
    ends = list(bounds) if bounds else [num_blocks]
    if not ends or ends[-1] != num_blocks or any(b <= a for a, b in zip([0] + ends, ends)):
        raise ValueError(f"chunk bounds {ends} must rise strictly and end at {num_blocks}.")
    return list(zip([0] + ends[:-1], ends))
