"""The "ipc" communicator backend: sends and receives between two GPUs of one host as
one copy kernel over NVLink, paired like NCCL's, without NCCL.

Why: between GPUs of one host NCCL's point-to-point ops are themselves copies through
mapped peer memory, plus a FIFO, a proxy and a start-up cost of about 17-30 us an op
(measured on an H200 pair, NCCL 2.28); a pipelined transfer of four chunks pays it four
times. A 2-party NCCL communicator also holds 0.3-1 GB of GPU memory. Here the sender's
kernel writes the bytes straight into the receiver's buffer, mapped into the sender's
process with CUDA IPC.

Shared state: a page of host memory (`ipc_mailbox`: receive descriptors, read and
written by the hosts only) and each side's GPU counters in its own GPU memory
(`_Counters`), which the peer maps and writes: `ready` (the peer's receive k may be
written) and `arrived` (the peer's send k landed: one word per op in flight, so sends
copying at once on different streams each tell their own). Each GPU waits on and reads only its
own memory. (A first version kept the counters in the host page: the copy kernel's
read of `ready` from host memory cost about 8 us a program, serialized, so a 32-program
copy took 0.25 ms longer; docs/PERFORMANCE.md says where this was measured.)

How one op pairs:

* receive number k (receiver): the host writes descriptor k (the IPC handle of the
  allocation the buffer lies in, the offset, the length); the receiver's stream waits
  for the events the op depends on, then writes the peer's `ready = k` (its buffer may
  now be written), then waits until its own `arrived >= k`. A work's event after that
  wait is the receive's end.
* send number k (sender): the host reads descriptor k (waiting for it under a deadline:
  the receiver posts before its Ready, so it is normally there), maps the allocation
  once per handle; the sender's stream waits for the events the op depends on and for
  its own `ready >= k`, runs the copy kernel, then writes the peer's `arrived` word of
  op k (`k % _TALLIES`) behind a system-wide fence, so the receiver sees the bytes
  before it sees the count. Whole staged transfers (below) copy on `SEND_STREAMS`
  streams in turn, so the copies of several requests of one step wait for their
  layers side by side instead of queueing behind the first.
* In one group, receives are announced before sends are posted, and their waits come
  after (`ipc_mailbox.group_steps`): two sides exchanging in one group cannot wait on
  each other.
* A staged transfer whole (`send_blocks` with `post_blocks`, what the connector's link
  posts when D's cache allows it): one op, one kernel, straight from P's staging into
  D's blocks, so D needs no pool bytes and no scatter. D's host publishes its layer
  table once (where each layer of its cache lies) and a BLOCKS descriptor per transfer,
  which names the transfer (a digest of its id: P checks it, and the size, against its
  own send before it copies, so a fault in the order of posts fails the send instead of
  landing one request's KV in the blocks of another of the same size), and rings P's
  bell (`workers.transports.bell`, named in the page), which P's poller waits on to
  start a send before its Go;
  D's GPU copies the block ids into P's arena (in P's counters' allocation), then writes
  P's `ready`, without waiting for its earlier block receives to land (only for the
  one whose arena slot it reuses), and waits for `arrived` on a stream of its own.
  P's kernel copies the staged rows. A send posted while the forward pass still gathers
  its layers (the connector posts it at the Go) follows the producer's `LayerFeed`: it
  is launched a group of layers at a time (`workers.gpu_staging.StepLayers`), each
  launch behind an event recorded after that group's gathers, by whichever thread
  comes second: the one posting (the layers gathered by then, in one launch for
  those the GPU has already run) or the forward pass's (the rest). So no program holds
  an SM while layers are still being computed (one launch whose 32 programs waited on
  the GPU for each layer added 13 ms to a prefill of matrix multiplies on one H200),
  and no stream waits for a count that a later host call writes (such a wait can
  stall, on a hardware queue shared with other streams, the very work that would end
  it). The gathers stay on the compute stream, so P's blocks may be reused as soon as
  `save_kv_layer` returns.
* Abort: the side that gives up marks the page dead (the peer's host stops waiting for
  its descriptors) and pushes past `ABORT` its own counters, which ends its own GPU
  waits, and the peer's `ready`: a copy reads `ready` first and skips its bytes past it,
  so a sender's copy never lands in a buffer its receiver gave up (unless it had already
  started: a copy of a chunk lasts at most about a millisecond). The peer's `arrived` is
  never forced, so no receive looks done without its bytes; it ends by the peer's own
  deadline, as with NCCL. As with NCCL, an aborted communicator's ops end early: callers
  check `closed` after an op's end (the connector does).

Set up through the same rendezvous as the NCCL backends: the initiator creates the page
(a file in /dev/shm) and publishes ``{"v": IPC_VERSION, "backend": "ipc", "page", "boot", "fallback"}``;
the acceptor checks it runs on the same host (the boot id), maps the page, answers; or
it declines, saying why, and the initiator builds its fallback ("ipc,direct": direct
NCCL between hosts) or fails at once with that reason; each
side writes where its counters are into the page before it publishes or answers; then
both map the other's counters and run a small exchange each way, which also proves each
side can map the other's memory.
"""

from __future__ import annotations

import json
import os
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal

import structlog
import torch

from protocols.errors import RecvTimeout, RendezvousError, SendTimeout

from .ipc_mailbox import (
    BLOCKS,
    MAX_LAYERS,
    UNTAGGED,
    Counters,
    Descriptor,
    LayerTable,
    Mailbox,
    MailboxError,
    group_steps,
    pairing_error,
)
from .communicator import Communicator, LayerFeed, Owner, PendingEnd, StreamWork, check_range, nbytes_of
from .bell import Ringer
from .cuda_driver import CudaDriver, boot_id, driver, driver_error
from .nccl_setup import HIGH_PRIORITY, IPC_PAGE_PREFIX, IPC_VERSION, SHM_DIR, IpcDeclined, await_join, decline, join

if TYPE_CHECKING:  # pragma: no cover
    from workers.gpu_staging import PagedKv

log = structlog.get_logger()

__all__ = ["IpcCommunicator", "connect_ipc"]

# Programs of the copy kernel: NVLink's ~0.45 TB/s a direction needs a few dozen SMs of
# stores; the rest stay with the gathers and scatters beside it.
COPY_PROGRAMS = 32
# Words a program copies per step, and its warps. On few programs a copy's rate is bound
# by the loads each program keeps in flight: on 32 programs, with 16 KiB a step (2,048
# words, 8 warps) a send of 1 GiB into blocks moved 0.52 TB/s on one H200, with 32 KiB
# (4,096 words, 16 warps) 0.74 TB/s, and cost matrix multiplies beside it no more
# (docs/PERFORMANCE.md, "Figures the code quotes").
_COPY_BLOCK = 4096
_COPY_WARPS = 16
# A staged transfer of at most this many blocks goes as one op, straight into the
# receiver's blocks (`IpcCommunicator.send_blocks`); its ids take an arena slot.
MAX_BLOCKS = 8192
_ID_SLOTS = 8  # arena slots: a receive's ids are read by the sender's kernel before the next 8 receives

ABORT = 1 << 62  # a counter at or past it: the communicator was aborted
_PROCESS = secrets.randbits(63)  # names this process in the page (process ids repeat across containers)
# -- the copy kernel ----------------------------------------------------------------------

_KERNEL: list[Any] = []
_TALLIES = 64  # per-op program tallies and arrival words a communicator cycles through (ops in flight at most)
# Streams a communicator's whole staged sends take in turn (send k on stream k % this).
# On one stream the copies of a step's requests queued: each waits on the GPU for its
# layers' gathers, so only the first overlapped the forward pass (8 requests of 2,048
# tokens added 8.3 ms after a 20 ms prefill on one H200, 5.6-5.8 ms on eight streams;
# docs/PERFORMANCE.md, figures the code quotes). It divides
# `_TALLIES`, so send k + _TALLIES, which reuses send k's words, runs after it.
SEND_STREAMS = 8


def _kernel() -> Any:
    if not _KERNEL:
        import triton
        import triton.language as tl

        @triton.jit(do_not_specialize=["src", "dst", "count", "ready", "arrived", "tally", "seq"])
        def ipc_copy(src, dst, count, ready, arrived, tally, seq, ABORT_AT: tl.constexpr, WIDE: tl.constexpr,
                     BLOCK: tl.constexpr):
            # Send number `seq`: wait (on this GPU's own memory) until the receiver made its
            # buffer writable, copy, and have the last program to finish tell the receiver.
            # All in the kernel: stream memory ops around it cost about 50 us an op.
            ready_at = ready.to(tl.pointer_type(tl.int64))
            r = tl.load(ready_at, volatile=True)
            while r < seq:
                r = tl.load(ready_at, volatile=True)
            if r < ABORT_AT:  # past it: the receiver gave the buffer up; copy nothing into it
                if WIDE:
                    s = src.to(tl.pointer_type(tl.int64))
                    d = dst.to(tl.pointer_type(tl.int64))
                else:
                    s = src.to(tl.pointer_type(tl.uint8))
                    d = dst.to(tl.pointer_type(tl.uint8))
                n = count.to(tl.int64)
                for start in tl.range(tl.program_id(0).to(tl.int64) * BLOCK, n, tl.num_programs(0) * BLOCK):
                    offs = start + tl.arange(0, BLOCK)
                    mask = offs < n
                    tl.store(d + offs, tl.load(s + offs, mask=mask, eviction_policy="evict_first"), mask=mask,
                             cache_modifier=".cs")
                tl.debug_barrier()  # every thread's stores before this program's release below
                tally_at = tally.to(tl.pointer_type(tl.int32))
                if tl.atomic_add(tally_at, 1, sem="acq_rel", scope="sys") == tl.num_programs(0) - 1:
                    tl.store(tally_at, 0)  # the tally is used again _TALLIES ops later, in stream order
                    tl.atomic_xchg(arrived.to(tl.pointer_type(tl.int64)), seq, sem="release", scope="sys")

        @triton.jit(do_not_specialize=["src", "layers", "ids", "num_cache_blocks", "rows", "ready", "arrived",
                                       "tally", "seq", "row_words", "num_layers", "pre", "first_row", "end_row",
                                       "last"])
        def ipc_blocks(src, layers, ids, num_cache_blocks, rows, ready, arrived, tally, seq, row_words, num_layers,
                       pre, first_row, end_row, last, BLOCK: tl.constexpr, ABORT_AT: tl.constexpr):
            # The cache's shape is passed at run time, not compiled in: the kernel is then
            # compiled and loaded once, when the communicator is built. Loading a module
            # later, while a peer's stream in this process waits on a count, would wait for
            # that stream (a module load synchronizes the context) and never end.
            # Send number `seq` of a whole staged transfer, straight into the receiver's
            # blocks. Staging row (block i, layer, pre p) is (i * NUM_LAYERS + layer) * PRE
            # + p, as P's gathers write it; it goes to row p of block ids[i] of the
            # receiver's `layer`. Rows are numbered in layer order (t = (layer * blocks +
            # i) * PRE + p), and one launch copies rows [first_row, end_row), whole
            # layers: a send posted during the forward pass is launched a group of layers
            # at a time, each behind an event after that group's gathers
            # (`IpcCommunicator.send_blocks`), so no program waits here for the forward
            # pass. Only the `last` launch tells the receiver; the ones before it ran
            # earlier on the same stream. All waits read this GPU's own memory; the
            # receiver wrote `ready` and the ids over NVLink.
            seq64 = seq.to(tl.int64)
            ready_at = ready.to(tl.pointer_type(tl.int64))
            r = tl.load(ready_at, volatile=True)
            while r < seq64:
                r = tl.load(ready_at, volatile=True)
            r = tl.atomic_add(ready_at, 0, sem="acquire", scope="sys")  # the ids before them: ordered after
            live = r < ABORT_AT  # past it: the receiver gave its blocks up; copy nothing into them
            s = src.to(tl.pointer_type(tl.int64))
            lp = layers.to(tl.pointer_type(tl.int64))
            ip = ids.to(tl.pointer_type(tl.int64))
            n = rows.to(tl.int64)
            ncb = num_cache_blocks.to(tl.int64)
            ROW = row_words.to(tl.int64)
            NUM_LAYERS = num_layers.to(tl.int64)
            PRE = pre.to(tl.int64)
            NB = n // (NUM_LAYERS * PRE)  # the transfer's blocks
            for t in tl.range(first_row.to(tl.int64) + tl.program_id(0), end_row.to(tl.int64), tl.num_programs(0)):
                if live:
                    # Read while this row copies, looked at after it: a receiver that gave
                    # its blocks up (a failed load whose blocks vLLM may reuse) gets no row
                    # started after it said so.
                    gate = tl.load(ready_at, volatile=True)
                    layer = t // (NB * PRE)
                    i = (t // PRE) % NB
                    p = t % PRE
                    dst = tl.load(lp + layer).to(tl.pointer_type(tl.int64))
                    blk = tl.load(ip + i, cache_modifier=".cg")
                    d_row = dst + (p * ncb + blk) * ROW
                    s_row = s + ((i * NUM_LAYERS + layer) * PRE + p) * ROW
                    for start in tl.range(0, ROW, BLOCK):
                        offs = start + tl.arange(0, BLOCK)
                        mask = offs < ROW
                        # .cg: staging rows are rewritten between transfers; never an L1 copy
                        tl.store(d_row + offs, tl.load(s_row + offs, mask=mask, cache_modifier=".cg"), mask=mask,
                                 cache_modifier=".cs")
                    live = gate < ABORT_AT
            tl.debug_barrier()  # every thread's stores before this program's release below
            # A program that saw an abort does not count, so the receiver is never told.
            if live & (last != 0):
                tally_at = tally.to(tl.pointer_type(tl.int32))
                if tl.atomic_add(tally_at, 1, sem="acq_rel", scope="sys") == tl.num_programs(0) - 1:
                    tl.store(tally_at, 0)
                    tl.atomic_xchg(arrived.to(tl.pointer_type(tl.int64)), seq64, sem="release", scope="sys")

        _KERNEL.append(ipc_copy)
        _KERNEL.append(ipc_blocks)
    return _KERNEL[0]


def _blocks_kernel() -> Any:
    _kernel()
    return _KERNEL[1]


def copy_shape(src: int, dst: int, nbytes: int, programs: int) -> tuple[int, int, bool]:
    """`ipc_copy`'s grid, count and width for `nbytes` from `src` to `dst`: 8-byte words
    where the size and both addresses allow, else bytes; at most `programs` programs, and
    no more than there are steps of `_COPY_BLOCK` to copy."""
    wide = src % 8 == 0 and dst % 8 == 0 and nbytes % 8 == 0
    count = nbytes // 8 if wide else nbytes
    return max(1, min(programs, -(-count // _COPY_BLOCK))), count, wide


def block_grid(programs: int, args: tuple[int, ...]) -> int:
    """`ipc_blocks`' programs: at most `programs`, and none without a row of its range
    (args[12:14]) to copy."""
    return max(1, min(programs, args[13] - args[12]))


def block_args(seq: int, *, src: int, layers: int, ids: int, num_cache_blocks: int, ready: int, arrived: int,
               tally: int, shape: tuple[int, int, int, int], layer_range: tuple[int, int] | None = None,
               last: bool = True) -> tuple[int, ...]:
    """`ipc_blocks`' run-time arguments for send `seq`, in its order: addresses (staging,
    the receiver's layer addresses, its block ids, the counters) and `shape`, the
    transfer's (blocks, layers, rows a block, bytes a row); `layer_range`: the layers
    this launch copies (default: all); `last`: whether it is the send's last launch (it
    tells the receiver)."""
    num_blocks, num_layers, pre, row_nbytes = shape
    a, b = layer_range or (0, num_layers)
    per_layer = num_blocks * pre
    return (src, layers, ids, num_cache_blocks, num_blocks * num_layers * pre, ready, arrived, tally, seq,
            row_nbytes // 8, num_layers, pre, a * per_layer, b * per_layer, int(last))


class _Copier:
    """Launches the copy kernel on a given stream. The first launch of each variant goes
    through Triton (which compiles it); later ones call the compiled kernel directly,
    which skips Triton's per-call binding (tens of microseconds of host time, on every
    chunk's post), once a local copy through that path has been checked."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.compiled: dict[bool, Any] = {}
        self.fast = False

    def __call__(self, stream: torch.cuda.Stream, src: int, dst: int, nbytes: int, *, ready: int, arrived: int,
                 tally: int, seq: int) -> None:
        grid, count, wide = copy_shape(src, dst, nbytes, COPY_PROGRAMS)
        kernel = self.compiled.get(wide)
        if kernel is not None and self.fast:
            kernel.run(grid, 1, 1, stream.cuda_stream, kernel.function, kernel.packed_metadata, None, None, None,
                       src, dst, count, ready, arrived, tally, seq, ABORT, wide, _COPY_BLOCK)
            return
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            kernel = _kernel()[(grid,)](src, dst, count, ready, arrived, tally, seq, ABORT_AT=ABORT, WIDE=wide,
                                        BLOCK=_COPY_BLOCK, num_warps=_COPY_WARPS)
        self.compiled.setdefault(wide, kernel)

    def check(self, scratch: torch.Tensor, peer: str = "") -> None:
        """Compile both variants, check Triton's copy, and switch the direct launch on
        if it copies the same bytes (`scratch`: zeroed int64 words this may use as
        counters).

        Raises:
            RuntimeError: the kernel copied other bytes, or did not count (a broken
                Triton or GPU).
        """
        n, tail = 32768, 13
        stream = torch.cuda.Stream(self.device)
        ready, arrived, tally = (scratch.data_ptr() + 8 * k for k in range(3))
        with torch.cuda.device(self.device):
            src = torch.randint(0, 256, (n,), dtype=torch.uint8, device=self.device)
            want = torch.zeros_like(src)
            want[: n - 64] = src[: n - 64]
            want[n - 63 : n - 63 + tail] = src[n - 63 : n - 63 + tail]
            scratch.zero_()
            scratch[0] = 5  # `ready`: send 5 may copy
            outs = [torch.zeros_like(src), torch.zeros_like(src)]
            # Every buffer made on the current stream, done before the copies on `stream`:
            # a zeroing still queued there (behind an engine's step) would land after them.
            torch.cuda.current_stream(self.device).synchronize()
            for fast, out in zip((False, True), outs):
                self.fast = fast
                try:
                    self(stream, src.data_ptr(), out.data_ptr(), n - 64, ready=ready, arrived=arrived, tally=tally,
                         seq=5)  # whole words
                    self(stream, src.data_ptr() + n - 63, out.data_ptr() + n - 63, tail, ready=ready, arrived=arrived,
                         tally=tally, seq=5)  # odd bytes
                except Exception as exc:  # another Triton's launcher: keep Triton's path
                    if not fast:
                        raise
                    log.info("ipc.fast_launch_off", peer=peer, reason=repr(exc))
            stream.synchronize()
            # The last program told `arrived`, and set the tally back to zero for its next use.
            counted = int(scratch[1].item()) == 5 and int(scratch[2].item()) == 0
            scratch.zero_()
        if not torch.equal(outs[0], want) or not counted:
            raise RuntimeError("the IPC copy kernel copied other bytes than asked, or did not count its programs.")
        self.fast = torch.equal(outs[1], want)
        if not self.fast:  # where the bytes differ says which launch went wrong (words: before n - 64)
            wrong = (outs[1] != want).nonzero().flatten()
            log.warning("ipc.fast_launch_off", peer=peer, reason="the direct launch copied other bytes", wrong_bytes=wrong.numel(),
                        first_wrong=int(wrong[0]), last_wrong=int(wrong[-1]), words_end=n - 64)


class _BlockCopier:
    """Launches `ipc_blocks`, as `_Copier` does the byte copy: through Triton the first
    time (`load`, when the communicator is built), then through the compiled kernel when
    `fast` (the byte copy's check proved that launch path on this Triton)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.compiled: Any = None

    def __call__(self, stream: torch.cuda.Stream, args: tuple[int, ...], *, programs: int, fast: bool) -> None:
        grid = block_grid(programs, args)
        kernel = self.compiled
        if kernel is not None and fast:
            kernel.run(grid, 1, 1, stream.cuda_stream, kernel.function, kernel.packed_metadata, None, None, None,
                       *args, _COPY_BLOCK, ABORT)
            return
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            kernel = _blocks_kernel()[(grid,)](*args, BLOCK=_COPY_BLOCK, ABORT_AT=ABORT, num_warps=_COPY_WARPS)
        if self.compiled is None:
            self.compiled = kernel

    def load(self, scratch: torch.Tensor) -> None:
        """Compile and load the kernel now, with a send of no rows that counts into
        `scratch` (zeroed int64 words), not into a peer's counters."""
        word = scratch.data_ptr()
        stream = torch.cuda.Stream(self.device)
        with torch.cuda.device(self.device):
            scratch.zero_()
            scratch[0] = 1  # `ready` for send 1
            torch.cuda.current_stream(self.device).synchronize()
            self(stream, block_args(1, src=word, layers=word, ids=word, num_cache_blocks=1, ready=word,
                                    arrived=word + 16, tally=word + 24, shape=(0, 1, 1, 64)),
                 programs=1, fast=False)
            stream.synchronize()
            scratch.zero_()
            torch.cuda.current_stream(self.device).synchronize()


class _BlockSend:
    """A posted block send (`IpcCommunicator.send_blocks`), launched a group of layers at a
    time (`launch`, from the thread that posted it or the producer's forward pass) on its
    stream, in layer order; the launch of the last layer records its end. Every launch
    waits on the GPU only for an event already recorded, never for a count to come."""

    def __init__(self, comm: IpcCommunicator, stream: torch.cuda.Stream, args: tuple[int, ...], num_layers: int,
                 programs: int, end: PendingEnd) -> None:
        self.comm, self.stream, self.args, self.num_layers, self.programs = comm, stream, args, num_layers, programs
        self.end = end
        self.launched = 0  # layers [0, launched) are launched
        self._lock = threading.Lock()  # launches come from two threads; they go in layer order

    def launch(self, layers: int, after: torch.cuda.Event | None) -> None:
        with self._lock:
            if self.end.recorded or layers <= self.launched:  # given up, or launched already
                return
            comm = self.comm
            comm.drv.make_current(comm.ctx)
            if after is not None:
                self.stream.wait_event(after)
            per_layer = self.args[4] // self.num_layers
            last = layers >= self.num_layers
            args = (*self.args[:12], self.launched * per_layer, layers * per_layer, int(last))
            comm._blocks(self.stream, args, programs=self.programs, fast=comm._copy.fast)
            self.launched = layers
            if last:
                self.end.record(self.stream)

    def give_up(self) -> None:
        """No more launches (the communicator was aborted); its end reads as done."""
        with self._lock:
            if not self.end.recorded:
                self.end.give_up()


# -- the shared page ----------------------------------------------------------------------


class _Page:
    """The mailbox file mapped into this process (host memory only)."""

    def __init__(self, path: str, *, create: bool) -> None:
        import mmap

        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, Mailbox.SIZE)
            self._mm = mmap.mmap(fd, Mailbox.SIZE)
        finally:
            os.close(fd)
        self.path = path
        self._view = memoryview(self._mm)
        self.box = Mailbox(self._view)
        if create:
            self.box.init()
        else:
            self.box.check()

    def close(self) -> None:
        self.box.release()
        self._view.release()
        self._mm.close()


class _Counters:
    """This side's GPU counters, in its own GPU memory, which the peer maps and writes:
    `ready` (byte 0: the peer's receive number k may be written, so this side's send k
    may copy); the tallies of this side's copy programs (byte 128: one for each of `_TALLIES`
    sends in a row; bytes 512-1023 are unused), `arrived` (byte
    1024: one word for each of `_TALLIES` receives, the peer's send k landed in this
    side's receive k once word k % _TALLIES reaches k), scratch words for
    the copy kernel's check (from byte 1536), and from byte 2048 the arena where the
    peer's GPU puts the block ids of its BLOCKS receives (`_ID_SLOTS` slots of
    `MAX_BLOCKS` int64). Each GPU waits on and reads only its own memory; the peer
    writes over NVLink."""

    READY = 0
    TALLY = 128  # this side's sends' program tallies (int32 each)
    ARRIVED = 1024  # the peer's sends that landed here, a word per op in flight (int64 each)
    ARENA = 2048  # the peer's block ids, for this side's block sends
    LAYERS = ARENA + _ID_SLOTS * MAX_BLOCKS * 8  # where the peer's layers are mapped here (int64 each)

    @staticmethod
    def arena(at: int, seq: int) -> int:
        """Where block send/receive `seq`'s ids go in the arena that starts at `at`."""
        return at + (seq % _ID_SLOTS) * MAX_BLOCKS * 8

    def __init__(self, device: torch.device, drv: CudaDriver) -> None:
        self.tensor = torch.zeros(self.LAYERS // 8 + MAX_LAYERS, dtype=torch.int64, device=device)
        self.scratch = self.tensor[192:256]
        # Staging for the layer addresses, so mapping the peer's table allocates nothing
        # while a peer's stream in this process may wait (an allocation can wait for it).
        self.layers_host = torch.zeros(MAX_LAYERS, dtype=torch.int64).pin_memory()
        torch.cuda.current_stream(device).synchronize()
        self.addr = self.tensor.data_ptr()
        self.handle, self.offset, self.base = drv.export(self.addr)


# -- the communicator ---------------------------------------------------------------------


class IpcCommunicator(Communicator):
    """A pair's sends and receives as copy kernels over CUDA IPC (module docstring)."""

    backend = "ipc"
    writes_into_blocks = True

    def __init__(self, *, peer: str, rank: int, device: torch.device, page: _Page, drv: CudaDriver, ctx: int,
                 counters: _Counters, peer_counters: tuple[bytes, int, int, bool], nonce: str,
                 cache: Owner | None, ringer: Ringer, op_timeout_s: float = 60.0) -> None:
        super().__init__(peer=peer, rank=rank, device=device, nonce=nonce, cache=cache, mem_bytes=0)
        self.page, self.drv, self.ctx = page, drv, ctx
        self.ringer = ringer  # the peer's bell: rung once a receive into blocks is posted
        self.out, self.into = rank, 1 - rank  # the directions of this side's sends and receives
        self.sent = self.received = 0  # ops posted so far, each way
        self.op_timeout_s = op_timeout_s
        self.stream = torch.cuda.Stream(device, priority=HIGH_PRIORITY)
        # Whole staged sends take these in turn (`SEND_STREAMS`); the first is `stream`.
        self.sends = [self.stream, *(torch.cuda.Stream(device, priority=HIGH_PRIORITY)
                                     for _ in range(SEND_STREAMS - 1))]
        # Block receives end here (`post_blocks`): their waits for the sender's arrival
        # stay off `stream`, so the next receive's `ready` goes out before this one landed.
        self.arrivals = torch.cuda.Stream(device, priority=HIGH_PRIORITY)
        self._sp = self.stream.cuda_stream
        self._mapped: dict[bytes, int] = {}  # the peer's allocations opened here, by handle
        self._copy = _Copier(device)
        # The counters: this side's (its GPU waits on them), and the peer's, mapped here
        # (`peer_counters`: their allocation's handle, where it is mapped, their offset, and
        # whether the peer is this very process: then its addresses are used as they are).
        self.counters = counters
        handle, base, offset, self.same_process = peer_counters
        if not self.same_process:
            self._mapped[handle] = base  # a receive buffer of the peer's may share that allocation
        self.my_ready = counters.addr + _Counters.READY
        self.peer_ready = base + offset + _Counters.READY
        self._my_arrived, self._peer_arrived = counters.addr + _Counters.ARRIVED, base + offset + _Counters.ARRIVED
        self.peer_arena = base + offset + _Counters.ARENA
        self._blocks = _BlockCopier(device)
        self._following: list[_BlockSend] = []  # block sends that may still have layers to launch
        self._table: tuple[PagedKv, int] | None = None  # this side's published layer table: its cache, its version
        # The end of each of the last `_TALLIES` sends: send k reuses send k - _TALLIES's
        # tally and arrival word, so it waits for that one's end (they may be on two streams).
        self._send_ends: list[torch.cuda.Event | PendingEnd | None] = [None] * _TALLIES
        self._table_copied: torch.cuda.Event | None = None  # the peer's layer table, on `stream`
        self._peer_layers: tuple[int, torch.Tensor, LayerTable] | None = None  # the peer's, mapped: version, addresses, table

    def post(
        self, ops: Sequence[tuple[Literal["send", "recv"], torch.Tensor]], stream: torch.cuda.Stream,
        after: Sequence[torch.cuda.Event | None] = (),
    ) -> Any:
        items = [(op, tensor.data_ptr(), nbytes_of(tensor)) for op, tensor in ops]
        return self._enqueue(items, after, [tensor for _, tensor in ops])

    def post_range(
        self, op: Literal["send", "recv"], base: torch.Tensor, start: int, nbytes: int, stream: torch.cuda.Stream,
        after: torch.cuda.Event | None = None,
    ) -> Any:
        check_range(base, start, nbytes)
        return self._enqueue([(op, base.data_ptr() + start, nbytes)], [after], [base])

    def _enqueue(self, items: Sequence[tuple[Literal["send", "recv"], int, int]], after: Sequence[torch.cuda.Event | None],
                 keep: list[torch.Tensor]) -> Any:
        sent: list[int] = []

        def steps() -> list[torch.Tensor]:
            self._wait_for(after)
            for step, i, seq in group_steps([op for op, _, _ in items], self.sent, self.received):
                _, ptr, n = items[i]
                if step == "announce":
                    self._announce(ptr, n, seq)
                elif step == "send":
                    self._send(ptr, n, seq)
                    sent.append(seq)
                else:
                    self.drv.wait_value(self._sp, self.my_arrived(seq), seq)
            return keep

        return self._posted("an op", steps, sends=sent)

    def _posted(self, what: str, enqueue: Callable[[], list[torch.Tensor]],
                ends: torch.cuda.Stream | PendingEnd | None = None, sends: Sequence[int] = ()) -> StreamWork:
        """Run `enqueue` (one group's steps on this communicator's stream) under the lock,
        with this GPU's context current; a failure ends the communicator, since the peer
        may have paired part of it. The work: an event after the group (on `ends`, if
        given, where `enqueue` put the op's end; a `PendingEnd`: the op's end, recorded
        by its last launch), holding the tensors `enqueue` returns; it is also the end
        of the sends numbered in `sends` (filled by `enqueue`)."""
        self._check_open()
        with self.lock:
            try:
                self.drv.make_current(self.ctx)
                keep = enqueue()
            except BaseException:
                self.fail(f"posting {what} failed")
                raise
            if isinstance(ends, PendingEnd):
                done: torch.cuda.Event | PendingEnd = ends
            else:
                done = torch.cuda.Event()
                done.record(ends or self.stream)
            for seq in sends:
                self._send_ends[seq % _TALLIES] = done
        return StreamWork(done, keep)

    def _wait_room(self, seq: int) -> None:
        """Until receive `seq` has a slot: only with SLOTS receives unread by the sender."""
        box, deadline = self.page.box, time.monotonic() + self.op_timeout_s
        while not box.room(self.into, seq):
            if box.dead or time.monotonic() > deadline:
                raise RecvTimeout("-", f"{self.peer} stopped reading receives (IPC mailbox full)")
            time.sleep(1e-4)

    def _wait_for(self, events: Sequence[torch.cuda.Event | None], stream: torch.cuda.Stream | None = None) -> None:
        for event in events:
            if event is not None:
                (stream or self.stream).wait_event(event)

    def my_arrived(self, seq: int) -> int:
        """The word that says this side's receive `seq` landed (once it reaches `seq`)."""
        return self._my_arrived + 8 * (seq % _TALLIES)

    def peer_arrived(self, seq: int) -> int:
        """The peer's word that this side's send `seq` sets once it landed."""
        return self._peer_arrived + 8 * (seq % _TALLIES)

    def _send_stream(self, seq: int) -> torch.cuda.Stream:
        """Where whole staged send `seq` copies, after what it depends on there: the send
        whose tally and arrival word it reuses, and the peer's layer table's copy."""
        stream = self.sends[seq % SEND_STREAMS]
        self._after_reuse(stream, seq)
        if stream is not self.stream and self._table_copied is not None:
            stream.wait_event(self._table_copied)
        return stream

    def _after_reuse(self, stream: torch.cuda.Stream, seq: int) -> None:
        """`stream` waits for the end of send `seq - _TALLIES`, whose words send `seq` reuses;
        if that one's last layers are still to be launched (it follows a forward pass),
        the host first waits for that launch (`send_ready` says so beforehand)."""
        prior = self._send_ends[seq % _TALLIES]
        if isinstance(prior, PendingEnd):
            if not prior.wait_recorded(self.op_timeout_s):
                raise SendTimeout("-", f"send {seq - _TALLIES} to {self.peer}, whose counters send {seq} reuses, "
                                  "was not launched whole in time")
            prior.wait_on(stream)
        elif prior is not None:
            stream.wait_event(prior)

    def _announce(self, ptr: int, nbytes: int, seq: int) -> None:
        """Receive `seq`: publish where the bytes go, and (on the GPU, after the op's
        events) that the buffer may be written."""
        box = self.page.box
        handle, offset, base = self.drv.export(ptr)
        self._wait_room(seq)
        box.post(self.into, Descriptor(seq, handle, offset, nbytes, base))
        self.received = seq
        self.drv.write_value(self._sp, self.peer_ready, seq)

    def _send(self, ptr: int, nbytes: int, seq: int) -> None:
        box = self.page.box
        desc = self._descriptor(seq)
        if desc.kind == BLOCKS:
            raise ValueError(f"{self.peer}'s receive {seq} takes {desc.count} blocks straight into its cache, but "
                             f"this send is {nbytes} bytes from a buffer: both sides must post the same transfers in "
                             "the same order.")
        if desc.nbytes != nbytes:
            raise ValueError(f"{self.peer}'s receive {seq} takes {desc.nbytes} bytes, but the send has {nbytes}: "
                             "both sides must post the same sizes in the same order.")
        box.consume(self.out, seq)
        base = desc.base if self.same_process else self._mapped.get(desc.handle)
        if base is None:
            base = self._mapped[desc.handle] = _map_peer(self.drv, desc.handle, self.peer)
        self.sent = seq
        self._after_reuse(self.stream, seq)
        self._copy(self.stream, ptr, base + desc.offset, nbytes, ready=self.my_ready, arrived=self.peer_arrived(seq),
                   tally=self._tally(seq), seq=seq)

    # -- a whole staged transfer, straight into the receiver's blocks ----------------------

    @staticmethod
    def takes_blocks(paged: PagedKv, num_blocks: int) -> bool:
        """Whether a staged transfer of `num_blocks` blocks of `paged`'s shape goes as one
        BLOCKS op (`send_blocks`, `post_blocks`). Both sides decide alike: the shape is
        the same on both (the broker refuses peers whose layouts differ)."""
        return (0 < num_blocks <= MAX_BLOCKS and paged.row_nbytes % 8 == 0 and paged.num_layers <= MAX_LAYERS
                and bool(paged.use_triton))

    def post_blocks(self, paged: PagedKv, block_ids: torch.Tensor | Sequence[int],
                    after: Sequence[torch.cuda.Event | None] = (), *, tag: bytes = UNTAGGED) -> Any:
        """Receive a staged transfer straight into `block_ids` of `paged` (this side's
        cache), as one op: no pool, no scatter. The op waits for `after` (whatever may
        still use those blocks; with ids on this GPU, what made them too) before the
        sender may write them. `tag` names the transfer (`ipc_mailbox.transfer_tag`): the
        sender's send must carry the same one.

        Its block ids go into the sender's arena (from this GPU, or from host memory
        when given as a list), then the sender's `ready` says they are there; the
        sender's kernel reads them before it copies.
        """
        on_gpu = isinstance(block_ids, torch.Tensor) and block_ids.is_cuda
        # From host memory: copied from pageable memory at once (into the driver's
        # staging), then sent on, no host wait. On a GPU: converted below, on this
        # communicator's stream after `after`, so the ids' copy follows it in stream order.
        ids = block_ids if on_gpu else torch.as_tensor(block_ids, dtype=torch.int64).contiguous()
        n = ids.numel()
        if not self.takes_blocks(paged, n):
            raise ValueError(f"{n} blocks of this cache cannot go as one IPC op (at most {MAX_BLOCKS} blocks, rows "
                             "of whole 8-byte words, Triton on the GPU).")
        box = self.page.box

        def steps() -> list[torch.Tensor]:
            version = self._publish_layers(paged)
            seq = self.received + 1
            self._wait_room(seq)
            self._wait_for(after)
            held = ids
            if on_gpu:
                with torch.cuda.stream(self.stream):
                    held = ids.to(device=self.device, dtype=torch.int64).contiguous()
            # Slot seq % _ID_SLOTS: its last user, receive seq - _ID_SLOTS, has landed by
            # now in this stream's order (waited for here), and the sender's kernel reads
            # the ids before it tells that arrival. Only that far back: the receives
            # between are told `ready` without waiting for one another's arrival, so the
            # sender's next copy never waits for this GPU's stream to see the last one land
            # (two processes on one GPU take turns on it: that wait cost a time slice).
            if seq > _ID_SLOTS:
                self.drv.wait_value(self._sp, self.my_arrived(seq - _ID_SLOTS), seq - _ID_SLOTS)
            slot = _Counters.arena(self.peer_arena, seq)
            self.drv.copy(self._sp, slot, held.data_ptr(), n * 8)
            box.post(self.into, Descriptor(seq, tag, version, n * paged.staged_block_nbytes, kind=BLOCKS, count=n))
            self.ringer.ring()  # the sender may be waiting for it to start the send before its Go
            self.received = seq
            self.drv.write_value(self._sp, self.peer_ready, seq)
            self.drv.wait_value(self.arrivals.cuda_stream, self.my_arrived(seq), seq)  # the receive's end
            return [ids, held]  # the caller's ids too: this stream reads them after `after`

        return self._posted("a block receive", steps, ends=self.arrivals)

    def _publish_layers(self, paged: PagedKv) -> int:
        """The version of this side's layer table for `paged`, published once per cache
        (a `PagedKv` is made once, at `register_kv_caches`)."""
        if self._table is not None and self._table[0] is paged:
            return self._table[1]
        version = 1 if self._table is None else self._table[1] + 1
        entries = tuple(self.drv.export(r.data_ptr()) for r in paged.rows)
        self.page.box.publish_layers(self.into, LayerTable(version, paged.num_blocks, paged.pre, paged.row_nbytes,
                                                           entries))
        self._table = (paged, version)
        return version

    @property
    def next_send(self) -> int:
        """The number the next send gets (hold `lock` from reading it to posting it)."""
        return self.sent + 1

    def _tally(self, seq: int) -> int:
        return self.counters.addr + _Counters.TALLY + 4 * (seq % _TALLIES)

    def receive_posted(self, seq: int) -> bool:
        """Whether the peer's receive `seq` is posted (never waits)."""
        return self.page.box.take(self.out, seq) is not None

    def send_ready(self) -> bool:
        """A send first reads its receive's descriptor, waiting on the host until D wrote
        it, and the end of the send whose counters it reuses, waiting on the host until
        that one's last layers are launched."""
        seq = self.next_send
        prior = self._send_ends[seq % _TALLIES]
        return self.receive_posted(seq) and not (isinstance(prior, PendingEnd) and not prior.recorded)

    def next_receive_takes_blocks(self) -> bool:
        return self.receive_kind(self.next_send) == BLOCKS

    def next_block_receive(self) -> tuple[int, bytes, int] | None:
        # Under `lock`, which an abort holds to close the page; not waited for: a post
        # holding it may wait on the host. The caller looks again soon.
        if not self.lock.acquire(blocking=False):
            raise BlockingIOError(f"the IPC communicator with {self.peer} is busy posting")
        try:
            if self.closed:
                return None
            seq = self.next_send
            desc = self.page.box.take(self.out, seq)
        finally:
            self.lock.release()
        return None if desc is None or desc.kind != BLOCKS else (seq, desc.handle, desc.nbytes)

    def receive_kind(self, seq: int) -> int:
        """What the peer's receive `seq` takes (`BYTES` or `BLOCKS`), once it is posted
        (waiting for it under the op deadline): a sender that can do either follows it."""
        self._check_open()
        return self._descriptor(seq).kind

    def send_blocks(self, seq: int, paged: PagedKv, src: int, num_blocks: int, *,
                    after: Sequence[torch.cuda.Event | None] = (), keep: Sequence[torch.Tensor] = (),
                    programs: int | None = None, feed: LayerFeed | None = None, tag: bytes = UNTAGGED) -> Any:
        """Send `num_blocks` staged blocks of `paged`'s shape at address `src` (block-major
        staging, on this GPU or pinned) whole, as send number `seq` (`next_send`, under
        `lock`), straight into the blocks the receiver's BLOCKS receive names: at once,
        after the events `after`, or, with `feed` (the producer's layers, maybe still
        being gathered), a group of layers at a time as the feed counts them gathered
        (`_BlockSend`). `keep`: tensors to hold until the send's end. `tag`: the
        transfer's, which the receive must name too.

        Raises:
            ValueError: the receiver posted another size or kind of receive, one for
                another transfer, or its cache has another shape: the message says which.
        """
        if seq != self.sent + 1:
            raise RuntimeError(f"send {seq} is not the next one ({self.sent + 1}); hold the lock from next_send on.")
        end = PendingEnd()

        def steps() -> list[torch.Tensor]:
            desc = self._descriptor(seq)
            refused = pairing_error(self.peer, desc, num_blocks, tag)
            if refused:
                raise ValueError(refused)
            layers, table = self._layers_of(desc.offset)
            if (table.rows_per_block, table.row_nbytes, len(table.entries)) != (paged.pre, paged.row_nbytes,
                                                                                paged.num_layers):
                raise ValueError(f"{self.peer}'s cache has {len(table.entries)} layers of {table.rows_per_block} "
                                 f"rows of {table.row_nbytes} bytes a block, this side's {paged.num_layers} of "
                                 f"{paged.pre} of {paged.row_nbytes}: serve the same model and KV cache dtype "
                                 "on both.")
            self.page.box.consume(self.out, seq)
            stream = self._send_stream(seq)
            self._wait_for(after, stream)
            self.sent = seq
            arena = _Counters.arena(self.counters.addr + _Counters.ARENA, seq)
            args = block_args(seq, src=src, layers=layers.data_ptr(), ids=arena, num_cache_blocks=table.num_blocks,
                              ready=self.my_ready, arrived=self.peer_arrived(seq), tally=self._tally(seq),
                              shape=(num_blocks, paged.num_layers, paged.pre, paged.row_nbytes))
            send = _BlockSend(self, stream, args, paged.num_layers, programs or COPY_PROGRAMS, end)
            self._following = [*(f for f in self._following if not f.end.recorded), send]
            if feed is None:
                send.launch(paged.num_layers, None)
            else:
                feed.follow(send)
            return [*keep, layers]

        return self._posted("a block send", steps, ends=end, sends=[seq])

    def _descriptor(self, seq: int) -> Descriptor:
        """Receive descriptor `seq`, waiting for it under the op deadline: spinning first
        (it is normally a few microseconds away: the receiver posts right after Ready),
        then in pauses."""
        box = self.page.box
        spin_until = time.monotonic() + 2e-3
        deadline, pause = time.monotonic() + self.op_timeout_s, 0.0
        while (desc := box.take(self.out, seq)) is None:
            if box.dead:
                raise SendTimeout("-", f"the IPC communicator with {self.peer} was aborted")
            now = time.monotonic()
            if now > deadline:
                raise SendTimeout("-", f"{self.peer} posted no receive for send {seq} in time")
            if now > spin_until:
                pause = min(max(pause * 2, 1e-6), 1e-4)
                time.sleep(pause)
        return desc

    def _layers_of(self, version: int) -> tuple[torch.Tensor, LayerTable]:
        """The peer's layer table `version`, its layers mapped here: their addresses as a
        GPU tensor the kernel reads, and the table."""
        if self._peer_layers is not None and self._peer_layers[0] == version:
            return self._peer_layers[1], self._peer_layers[2]
        table = self.page.box.layers(self.out)
        if table is None or table.version != version:
            raise RuntimeError(f"{self.peer}'s layer table {version} is not in the IPC page.")
        addrs = []
        for handle, offset, base in table.entries:
            if not self.same_process:
                if handle not in self._mapped:
                    self._mapped[handle] = _map_peer(self.drv, handle, self.peer)
                base = self._mapped[handle]
            addrs.append(base + offset)
        # Copied on this communicator's stream, ahead of the kernels that read it, into
        # memory made at connect: no host wait and no allocation (either could wait on a
        # peer's stream in this process). A new table comes only with a new cache.
        n = len(addrs)
        for other in self.sends[1:]:  # kernels there may still read the table this replaces
            self.stream.wait_stream(other)
        self.counters.layers_host[:n] = torch.tensor(addrs, dtype=torch.int64)
        self.drv.copy(self._sp, self.counters.addr + _Counters.LAYERS, self.counters.layers_host.data_ptr(), n * 8)
        self._table_copied = torch.cuda.Event()
        self._table_copied.record(self.stream)
        layers = self.counters.tensor[_Counters.LAYERS // 8 : _Counters.LAYERS // 8 + n]
        self._peer_layers = (version, layers, table)
        return layers, table

    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError(f"the IPC communicator with {self.peer} is closed; get a new one from the cache.")
        if self.page.box.dead:
            self.fail(f"{self.peer} dropped it")
            raise RuntimeError(f"{self.peer} dropped the IPC communicator; get a new one from the cache.")

    def _abort(self) -> None:
        box = self.page.box
        box.abort()  # the peer's host stops waiting for this side's descriptors
        for send in self._following:  # layers not launched yet never will be: their sends end here
            send.give_up()
        # Its own stream: the communicator's stream may be the one waiting.
        releases = torch.cuda.Stream(self.device)
        self._release_waits(releases)
        with self.lock:  # a post waiting for a descriptor sees the page dead and lets go
            deadline = time.monotonic() + 5.0
            while not self._idle() and time.monotonic() < deadline:
                self._release_waits(releases)  # again: the peer may have written a count since
                time.sleep(1e-4)
            idle = self._idle()
            for dptr in self._mapped.values():
                try:
                    self.drv.close(dptr)
                except RuntimeError as exc:
                    log.warning("ipc.unmap_failed", peer=self.peer, error=str(exc))
            self._mapped.clear()
            self.page.close()
            self.ringer.close()
            if not idle:  # a wait that never ended: keep the counters it waits on allocated
                log.warning("ipc.stream_stuck", peer=self.peer)
                _STUCK.append(self.counters)

    def _idle(self) -> bool:
        return all(s.query() for s in self.sends) and self.arrivals.query()

    def _release_waits(self, stream: torch.cuda.Stream) -> None:
        """End this side's GPU waits (its sends' `ready`, its receives' `arrived`) and gate
        the peer's copies into its buffers off (the peer's `ready`), through `stream`. The
        peer's `arrived` is left alone, so none of the peer's receives looks done without
        its bytes."""
        self.drv.make_current(self.ctx)
        for addr in (self.my_ready, *(self.my_arrived(k) for k in range(_TALLIES)), self.peer_ready):
            try:
                self.drv.write_value(stream.cuda_stream, addr, ABORT)
            except RuntimeError as exc:  # the peer's memory may be gone with the peer
                log.warning("ipc.release_failed", peer=self.peer, error=str(exc))
        stream.synchronize()


_STUCK: list[_Counters] = []  # counters a stuck stream may still wait on: never freed


def _map_peer(drv: CudaDriver, handle: bytes, peer: str) -> int:
    """Map one of `peer`'s allocations here; raises a RuntimeError that says what to do."""
    try:
        return drv.open(handle)
    except RuntimeError as exc:
        raise RuntimeError(f"cannot map {peer}'s GPU memory ({exc}); the two GPUs need peer access for the ipc "
                           "backend: use the direct backend.") from exc


# -- rendezvous -----------------------------------------------------------------------------


def connect_ipc(cache: Owner, peer: str, info: dict[str, Any] | None,
                cancelled: threading.Event | None = None, purpose: str = "") -> IpcCommunicator:
    """Build an ipc communicator with `peer` (initiator: `info` None), as
    `CommunicatorCache._connect_direct` does a direct one.

    Raises:
        IpcDeclined: the two cannot share the page (different hosts, no common /dev/shm,
            no CUDA driver on the acceptor). The acceptor tells the initiator so before it
            raises, and both raise it with the initiator's fallback, which
            `CommunicatorCache._connect` then builds ("" none: the error stands, on both
            sides at once rather than at the initiator's connect deadline).
        RendezvousError: the peer did not answer in time, or the warm-up exchange failed.
    """
    key = cache.key(cache.local_id, peer) if info is None else cache.key(peer, cache.local_id)
    deadline = time.monotonic() + cache.connect_timeout_s
    if info is not None:  # acceptor: whether it can share the initiator's page at all, before any GPU work
        page, why = _join_page(info, cache.local_id, peer)
        if page is None:
            decline(cache.rendezvous, peer, key, info["nonce"], why)
            raise IpcDeclined(why, info.get("fallback", ""))
    drv = driver()
    if drv is None:  # an initiator's (an acceptor's was checked with the page)
        raise RendezvousError(f"the ipc backend with {peer} needs the CUDA driver: {driver_error()}")
    device = cache.device
    ordinal = device.index if device.index is not None else torch.cuda.current_device()
    torch.cuda.set_device(device)
    ctx = drv.primary_context(ordinal)
    try:
        bell = cache.bell_token()
    except OSError as exc:
        raise RendezvousError(f"the ipc backend needs a FIFO in {SHM_DIR} ({exc}); use the direct backend.") from exc
    counters = _Counters(device, drv)
    where = Counters(counters.handle, counters.offset, _PROCESS, ordinal, counters.base, bell)
    rank = 0 if info is None else 1
    if info is None:
        nonce = secrets.token_hex(8)
        path = os.path.join(SHM_DIR, f"{IPC_PAGE_PREFIX}{nonce}")
        page = _Page(path, create=True)
        try:
            page.box.publish_flags(rank, where)
            offer = {"v": IPC_VERSION, "backend": "ipc", "page": path, "boot": boot_id(), "nonce": nonce, "for": purpose}
            if cache.fallback:
                offer["fallback"] = cache.fallback
            cache.rendezvous.publish(peer, key, json.dumps(offer).encode())
            declined = await_join(cache.rendezvous, peer, key, nonce, cancelled, deadline, "IPC")
            if declined is not None:
                raise IpcDeclined(declined, cache.fallback)
        except BaseException:
            page.close()
            raise
        finally:
            os.unlink(path)  # both sides have it mapped (or it is not needed): no file stays behind
    else:
        nonce = info["nonce"]
        page.box.publish_flags(rank, where)
        join(cache.rendezvous, peer, key, nonce)
    theirs = page.box.flags_of(1 - rank)
    try:
        if theirs is None:
            raise RendezvousError(f"{peer} published no counters in IPC rendezvous {nonce}.")
        if theirs.process == _PROCESS:  # both ends in one process: CUDA cannot open its own handles
            drv.make_current(ctx)
            if theirs.ordinal != ordinal:
                drv.enable_peer_access(drv.primary_context(theirs.ordinal))
            peer_counters = (theirs.handle, theirs.base, theirs.offset, True)
        else:
            peer_counters = (theirs.handle, _map_peer(drv, theirs.handle, peer), theirs.offset, False)
        try:
            ringer = Ringer(SHM_DIR, theirs.bell)
        except OSError as exc:
            raise RendezvousError(f"cannot open {peer}'s bell in {SHM_DIR} ({exc}): both workers need the same "
                                  f"{SHM_DIR} for the ipc backend, or use the direct backend.") from exc
    except BaseException as exc:
        page.close()
        if isinstance(exc, RendezvousError):
            raise
        raise RendezvousError(str(exc)) from exc
    comm = IpcCommunicator(peer=peer, rank=rank, device=device, page=page, drv=drv, ctx=ctx, counters=counters,
                           peer_counters=peer_counters, nonce=nonce, cache=cache, ringer=ringer)
    try:
        comm._copy.check(counters.scratch, peer)
        comm._blocks.load(counters.scratch)
        _warm_up(comm, deadline)
    except BaseException as exc:
        comm.abort()
        if isinstance(exc, RendezvousError):
            raise
        raise RendezvousError(f"the IPC warm-up exchange with {peer} (rendezvous {nonce}) failed: {exc}") from exc
    log.info("nccl.connected", peer=peer, rank=rank, nonce=nonce, backend="ipc", mem_mib=0.0)
    return comm


def _join_page(info: dict[str, Any], local: str, peer: str) -> tuple[_Page | None, str]:
    """The acceptor's side of an ipc build: the initiator's page, mapped, or why this
    worker cannot share it, in one sentence that holds on both sides."""
    if info["boot"] != boot_id():
        return None, (f"{local} and {peer} run on different hosts: the ipc backend moves bytes only between "
                      "GPUs of one host; use the direct backend between hosts, or KVBROKER_NCCL_BACKEND=ipc,direct "
                      "on the prefill side for ipc within a host and direct between hosts.")
    if driver() is None:
        return None, f"{local} cannot use the ipc backend ({driver_error()}); use the direct backend."
    try:
        return _Page(info["page"], create=False), ""
    except (OSError, MailboxError) as exc:
        return None, (f"{local} cannot share {peer}'s IPC page {info['page']} ({exc}); both workers need the "
                      f"same {SHM_DIR}, or use the direct backend.")


def _warm_up(comm: Any, deadline: float) -> None:
    """One small exchange each way: it maps each side's buffer in the other and checks the bytes."""
    mine = torch.full((4096,), 17 + comm.rank, dtype=torch.uint8, device=comm.device)
    theirs = torch.zeros_like(mine)
    torch.cuda.current_stream(comm.device).synchronize()
    work = comm.post([("recv", theirs), ("send", mine)], torch.cuda.current_stream(comm.device))
    while not work.event.query():
        if time.monotonic() >= deadline or comm.page.box.dead:
            raise RendezvousError(f"the IPC warm-up exchange with {comm.peer} did not finish in time.")
        time.sleep(1e-4)
    if comm.page.box.dead or not bool((theirs == 17 + comm.peer_rank).all()):
        raise RendezvousError(f"the IPC warm-up exchange with {comm.peer} delivered other bytes.")
