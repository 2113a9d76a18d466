"""Copies between a worker's paged KV cache on the GPU and block-major staging.

The seed bug: KV was read out of P's paged cache later, from another thread, with no
ordering against the compute stream. By then vLLM had freed the blocks and the next
step had written other KV into them, so a repeated identical prompt (same block ids)
sent garbage. The rule every copy here keeps:

    a gather is enqueued on the *current* (compute) stream before the call that asks for
    it returns (`save_kv_layer`), and a send waits for an event recorded after it.

Stream order then guarantees the gather reads the blocks as they were when the call
was made, whatever later kernels on that stream write.

Layout
------
Staging is block-major, as `protocols.messages.Layout` says: request block ``i``
holds every layer of that block, ``block_nbytes`` bytes per layer. Each layer's paged
cache is viewed as ``[pre, num_blocks, row]`` where ``pre`` is the product of the dims
before the block dim (2 for vLLM's ``[2, num_blocks, ...]`` FlashAttention layout, 1
for FlashInfer's ``[num_blocks, 2, ...]`` and for MLA's 3-D cache). So the staging
tensor is ``[n, num_layers, pre, row]``: skipping D's first k cached blocks is a byte
offset, and any block range is contiguous, which is what lets a transfer go in block
chunks (`pipeline_bounds`). Rows are copied as 8-byte words when they allow it.

On CUDA with Triton one kernel copies a layer of many requests (`gather_layer_at`) or
every layer of a block range (`copy_range`, D's scatters); elsewhere `index_select`.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Sequence
from math import prod
from typing import TYPE_CHECKING, Any

import structlog
import torch


if TYPE_CHECKING:  # pragma: no cover
    from workers.transports.communicator import LayerSend

try:  # Triton is optional: the per-layer path needs only torch.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the host
    triton = None

__all__ = ["PagedKv", "StepLayers", "current_stream", "layer_groups", "layers_in_order", "pipeline_bounds",
           "pipeline_defaults"]

log = structlog.get_logger()

_WORDS = (torch.int64, torch.int32, torch.int16, torch.uint8)


def _word_dtype(row_nbytes: int) -> torch.dtype:
    """The widest integer dtype that divides a row: fewer, wider element copies."""
    for dtype in _WORDS:
        if row_nbytes % dtype.itemsize == 0:
            return dtype
    return torch.uint8  # pragma: no cover - uint8 always divides


if triton is not None:

    @triton.jit(do_not_specialize=["num_cache_blocks", "first_row", "end_row", "stage_offset", "layer_sel"])
    def _copy_rows_kernel(
        layer_ptrs,
        block_ids,
        staging,
        num_cache_blocks,
        first_row,
        end_row,
        stage_offset,
        layer_sel,
        ROW: tl.constexpr,
        NUM_LAYERS: tl.constexpr,
        PRE: tl.constexpr,
        BLOCK: tl.constexpr,
        TO_STAGING: tl.constexpr,
        STREAM: tl.constexpr,
        ONE_LAYER: tl.constexpr,
    ):
        # Staging row r is (block i, layer, pre p) with r = (i * NUM_LAYERS + layer) * PRE + p;
        # the transfer's row 0 starts `stage_offset` words into `staging` (a whole pool).
        # [first_row, end_row) covers whole blocks; ONE_LAYER copies only layer `layer_sel`'s
        # rows of them (`save_kv_layer`, as each layer is computed). Program k copies the
        # k-th row, the (k + G)-th, ... (G programs): a grid capped below one program per row
        # leaves the other SMs to NCCL's kernels.
        if ONE_LAYER:
            count = (end_row - first_row) // NUM_LAYERS
        else:
            count = end_row - first_row
        for t in tl.range(tl.program_id(0), count, tl.num_programs(0)):
            if ONE_LAYER:
                i = first_row // (NUM_LAYERS * PRE) + t.to(tl.int64) // PRE
                layer = layer_sel.to(tl.int64)
                p = t.to(tl.int64) % PRE
                row = (i * NUM_LAYERS + layer) * PRE + p
            else:
                row = first_row + t.to(tl.int64)
                i = row // (NUM_LAYERS * PRE)
                layer = (row // PRE) % NUM_LAYERS
                p = row % PRE
            base = tl.load(layer_ptrs + layer).to(tl.pointer_type(staging.dtype.element_ty))
            blk = tl.load(block_ids + i).to(tl.int64)
            cache_row = base + (p * num_cache_blocks + blk) * ROW
            stage_row = staging + stage_offset + row * ROW
            for start in tl.range(0, ROW, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                mask = offs < ROW
                # STREAM: read once, evict first; write through L2 without keeping the lines,
                # so a copy that overlaps NCCL's traffic leaves L2 to NCCL's buffers.
                if TO_STAGING:
                    if STREAM:
                        tl.store(stage_row + offs, tl.load(cache_row + offs, mask=mask, eviction_policy="evict_first"),
                                 mask=mask, cache_modifier=".cs")
                    else:
                        tl.store(stage_row + offs, tl.load(cache_row + offs, mask=mask), mask=mask)
                else:
                    if STREAM:
                        tl.store(cache_row + offs, tl.load(stage_row + offs, mask=mask, eviction_policy="evict_first"),
                                 mask=mask, cache_modifier=".cs")
                    else:
                        tl.store(cache_row + offs, tl.load(stage_row + offs, mask=mask), mask=mask)


class _Launcher:
    """Launches `_copy_rows_kernel` through its compiled kernel, skipping Triton's
    per-call argument binding and cache-key building (about half of a launch's host
    time, and a gather launch is on P's critical path).

    Each variant (direction, the pointer alignments and int widths Triton specializes
    on; the int values are `do_not_specialize`) is launched through Triton once, which
    compiles it and returns the compiled kernel kept here; later launches call that
    kernel's launcher directly. `check()` runs once, when the cache is registered: a
    one-block gather both ways, compared. If this Triton's launcher takes other
    arguments, the fast path raises or copies wrong there and stays off (every launch
    then goes through Triton).
    """

    # The compiled launcher takes a pointer argument as a plain int without asking the
    # driver about it; a tensor costs it a `cuPointerGetAttribute` each (three a launch).
    int_pointers = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self.compiled: dict[tuple[bool, ...], Any] = {}
        self.fast = False

    def __call__(self, grid: tuple[int], args: tuple[Any, ...]) -> None:
        ptrs = (args[0].data_ptr(), args[1].data_ptr(), args[2].data_ptr())
        # What Triton specializes the compiled kernel on: the direction, 16-byte alignment
        # of the two tensors that vary, and whether the int arguments need 64 bits.
        key = (bool(args[12]), bool(args[13]), bool(args[14]), ptrs[1] % 16 == 0, ptrs[2] % 16 == 0,
               max(args[3], args[5], args[6]) >= 1 << 31)
        kernel = self.compiled.get(key)
        if kernel is not None and self.fast and torch.cuda.current_device() == self.index:
            stream = _RAW_STREAM(self.index) if _RAW_STREAM is not None else current_stream(self.device).cuda_stream
            # The tensors stay alive in the caller until the launch returns, as with Triton's own.
            kernel.run(grid[0], 1, 1, stream, kernel.function, kernel.packed_metadata, None, None, None,
                       *(ptrs if self.int_pointers else args[:3]), *args[3:])
            return
        with torch.cuda.device(self.index):  # Triton launches on the current GPU: make it the cache's
            kernel = _copy_rows_kernel[grid](*args[:8], ROW=args[8], NUM_LAYERS=args[9], PRE=args[10],
                                             BLOCK=args[11], TO_STAGING=args[12], STREAM=args[13], ONE_LAYER=args[14],
                                             num_warps=8)
        self.compiled.setdefault(key, kernel)

    def check(self, args: tuple[Any, ...]) -> None:
        """Switch the fast path on if it copies as Triton's launch does (`args` gather
        rows 0 and up into ``args[2]``; this synchronizes the current stream)."""
        staging = args[2]
        want, got = torch.full_like(staging, -1), torch.full_like(staging, -2)
        try:
            with torch.cuda.device(self.index):  # the fast path runs only with the cache's GPU current
                self((1,), (*args[:2], want, *args[3:]))
                self.fast = True
                self((1,), (*args[:2], got, *args[3:]))
                torch.cuda.current_stream(self.index).synchronize()
            self.fast = torch.equal(want, got)
        except Exception as exc:  # another Triton's launcher: keep Triton's path
            self.fast = False
            log.info("gpu_staging.fast_launch_off", reason=repr(exc))
            return
        if not self.fast:
            log.warning("gpu_staging.fast_launch_off", reason="the fast launch copied other bytes")


class PagedKv:
    """Word views of one worker's paged KV cache, made once at `register_kv_caches`.

    Args:
        kv_caches: one tensor per layer, all the same shape, dtype and device, contiguous.
        block_dim: the index of the num_blocks dim in each layer's shape (1 for
            ``[2, num_blocks, ...]``, 0 for ``[num_blocks, ...]``).
        use_triton: None picks Triton on CUDA when it is installed.

    Raises:
        ValueError: the layers disagree, or are not contiguous.
    """

    def __init__(
        self, kv_caches: Sequence[torch.Tensor], *, block_dim: int = 1, use_triton: bool | None = None
    ) -> None:
        if not kv_caches:
            raise ValueError("PagedKv needs at least one layer.")
        first = kv_caches[0]
        for i, t in enumerate(kv_caches):
            if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
                raise ValueError(
                    f"layer {i} is {tuple(t.shape)} {t.dtype} on {t.device}, but layer 0 is "
                    f"{tuple(first.shape)} {first.dtype} on {first.device}; all layers must match."
                )
            if not t.is_contiguous():
                raise ValueError(f"layer {i} is not contiguous; the KV cache must be one dense tensor per layer.")
        self.device = first.device
        self.num_layers = len(kv_caches)
        self.pre = prod(first.shape[:block_dim])
        self.num_blocks = first.shape[block_dim]
        self.row_nbytes = prod(first.shape[block_dim + 1 :]) * first.element_size()
        self.word = _word_dtype(self.row_nbytes)
        self.row_words = self.row_nbytes // self.word.itemsize
        self.rows = [
            t.view(self.pre, self.num_blocks, -1).view(torch.uint8).view(self.word) for t in kv_caches
        ]
        on_cuda = self.device.type == "cuda"
        self.use_triton = (triton is not None and on_cuda) if use_triton is None else use_triton
        self._block = min(triton.next_power_of_2(self.row_words), 4096) if self.use_triton else 0
        self._layer_ptrs = (
            torch.tensor([r.data_ptr() for r in self.rows], dtype=torch.int64, device=self.device)
            if self.use_triton
            else None
        )
        self._launch = _Launcher(self.device) if self.use_triton else None
        # Triton copies with streaming cache hints (`_copy_rows_kernel`'s STREAM): a gather
        # that overlaps NCCL's send then slows it less (docs/PERFORMANCE.md).
        self.streaming = True
        if self._launch is not None:  # compiles the gather now, not on the first transfer
            self._launch.check(self._one_block_args(to_staging=True))

    def precompile(self) -> None:
        """Compile every variant of the copy a transfer may launch (gather and scatter,
        whole blocks and one layer, with and without cache hints) now, on the cache's
        GPU whichever is current. Compiling loads a module, and a first scatter on
        D compiled while a receive it had just posted was still waiting for its sender;
        where that sender waited for D in turn (a benchmark's barrier), both hung. Block
        0 of every layer goes out and back unchanged, in stream order: call this before
        the cache is in use."""
        if self._launch is None:
            return
        streaming = self.streaming
        one = None
        try:
            for hints in (False, True):
                self.streaming = hints
                for layer in (None, 0):
                    for to_staging in (True, False):  # the scatter puts back what the gather took
                        args = self._one_block_args(to_staging=to_staging, layer=layer, staging=one)
                        one = args[2]
                        self._launch((1,), args)
        finally:
            self.streaming = streaming

    def _one_block_args(self, *, to_staging: bool, layer: int | None = None,
                        staging: torch.Tensor | None = None) -> tuple[Any, ...]:
        """A copy of block 0 (of `layer`, or every layer) to or from `staging` (default: new)."""
        ids = torch.zeros(1, dtype=torch.int64, device=self.device)
        if staging is None:
            staging = torch.empty(self.num_layers * self.pre * self.row_words, dtype=self.word, device=self.device)
        return self._args(ids, staging, 0, self.num_layers * self.pre, 0, to_staging=to_staging, layer=layer)

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block of one layer (all `pre` rows)."""
        return self.pre * self.row_nbytes

    @property
    def staged_block_nbytes(self) -> int:
        """Bytes of one staged block: every layer of it."""
        return self.num_layers * self.block_nbytes

    def staging_view(self, buf: torch.Tensor, num_blocks: int) -> torch.Tensor:
        """View `num_blocks` staged blocks of a uint8 buffer as ``[n, layers, pre, row]`` words."""
        need = num_blocks * self.staged_block_nbytes
        return buf[:need].view(self.word).view(num_blocks, self.num_layers, self.pre, self.row_words)

    def block_ids(self, ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        """Block ids as an int64 tensor on the cache's device (one small copy)."""
        if isinstance(ids, torch.Tensor) and ids.is_cuda and ids.dtype is torch.int64 and ids.device == self.device:
            return ids  # already converted (the caller's critical path pays nothing)
        if isinstance(ids, torch.Tensor):
            t = ids.to(torch.int64)
            # Only host ids are checked: checking device ids would synchronize the stream.
            if t.device.type == "cpu" and t.numel() and (int(t.min()) < 0 or int(t.max()) >= self.num_blocks):
                raise ValueError(f"block ids must lie in [0, {self.num_blocks}); got {t.tolist()[:8]}...")
        else:
            if ids and (min(ids) < 0 or max(ids) >= self.num_blocks):
                raise ValueError(f"block ids must lie in [0, {self.num_blocks}); got {list(ids)[:8]}...")
            # Pinned, so the copy is queued and the host goes on: from pageable memory it
            # held P's bind 0.2-0.3 ms on an H200, before the forward pass's first kernel
            # (torch's pinned allocator keeps the buffer until the copy has run).
            t = torch.tensor(ids, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        if t.device.type == "cpu" and self.device.type == "cuda" and not t.is_pinned():
            t = t.pin_memory()
        return t.to(self.device, non_blocking=True)

    # -- copies; all run on the current stream ---------------------------------------

    def gather_layer(self, layer: int, ids: torch.Tensor, staged: torch.Tensor) -> None:
        """Copy one layer's blocks `ids` into `staged` (``[n, layers, pre, row]``, contiguous),
        one kernel: Triton's where it runs (an `index_select` into the strided rows of one
        layer copies at about a tenth of its rate, measured on an H200)."""
        if self.use_triton and ids.numel():
            self._triton_layer(layer, ids, staged, to_staging=True)
            return
        out = staged[:, layer].permute(1, 0, 2)
        torch.index_select(self.rows[layer], 1, ids, out=out)

    def scatter_layer(self, layer: int, ids: torch.Tensor, staged: torch.Tensor) -> None:
        """Copy one layer of `staged` into the blocks `ids`, one kernel."""
        if self.use_triton and ids.numel():
            self._triton_layer(layer, ids, staged, to_staging=False)
            return
        self.rows[layer].index_copy_(1, ids, staged[:, layer].permute(1, 0, 2))

    def gather_layer_at(self, layer: int, ids: torch.Tensor, staging: torch.Tensor, offset: int) -> None:
        """Copy one layer of the blocks `ids` into staged block-major rows that start
        `offset` words into `staging` (a pool's word view): one Triton kernel, however
        many requests `ids` joins, as long as their staged bytes lie back to back."""
        if not self.use_triton:
            raise RuntimeError("gather_layer_at needs Triton on a CUDA cache; use gather_layer.")
        n, per_block = ids.numel(), self.num_layers * self.pre
        if n:
            self._launch((n * self.pre,),
                         self._args(ids, staging, 0, n * per_block, offset, to_staging=True, layer=layer))

    def _triton_layer(self, layer: int, ids: torch.Tensor, staged: torch.Tensor, *, to_staging: bool) -> None:
        assert staged.is_contiguous() and staged.shape[0] == ids.numel()
        n, per_block = ids.numel(), self.num_layers * self.pre
        self._launch((n * self.pre,), self._args(ids, staged, 0, n * per_block, 0, to_staging=to_staging, layer=layer))

    def _args(
        self, ids: torch.Tensor, staging: torch.Tensor, first_row: int, end_row: int, offset: int, *,
        to_staging: bool, layer: int | None = None,
    ) -> tuple[Any, ...]:
        """`_copy_rows_kernel`'s arguments, in its order (`_Launcher` reads the flags by
        position): rows ``[first_row, end_row)``, only `layer`'s when it is given."""
        return (self._layer_ptrs, ids, staging, self.num_blocks, first_row, end_row, offset,
                0 if layer is None else layer, self.row_words, self.num_layers, self.pre, self._block,
                to_staging, self.streaming, layer is not None)

    def gather(self, ids: torch.Tensor, staged: torch.Tensor, *, programs: int | None = None) -> None:
        """Copy every layer of the blocks `ids` into `staged`: one kernel with Triton.

        `programs` caps the kernel's grid (Triton only; None: one program per row, all
        SMs). A copy that overlaps NCCL traffic on the same GPU should be capped: at
        full width it takes the SMs and memory bandwidth NCCL's kernels need.
        """
        if self.use_triton and ids.numel():
            self._triton(ids, staged, to_staging=True, programs=programs)
            return
        for layer in range(self.num_layers):
            self.gather_layer(layer, ids, staged)

    def scatter(self, ids: torch.Tensor, staged: torch.Tensor, *, programs: int | None = None) -> None:
        """Copy every layer of `staged` into the blocks `ids`: one kernel with Triton
        (`programs` as in `gather`)."""
        if self.use_triton and ids.numel():
            self._triton(ids, staged, to_staging=False, programs=programs)
            return
        for layer in range(self.num_layers):
            self.scatter_layer(layer, ids, staged)

    def copy_range(
        self, ids: torch.Tensor, staging: torch.Tensor, start: int, end: int, *, to_staging: bool,
        programs: int | None = None, offset: int = 0,
    ) -> None:
        """Gather (or scatter) blocks ``[start, end)`` of a whole transfer, one Triton kernel.

        `ids` are the transfer's block ids; `staging` holds its staged bytes in words
        (any shape, contiguous), block 0 at word `offset` (a whole pool's word view and
        a lease's offset, say). So a chunk costs no tensor slicing or view on the host:
        only the launch, which is on P's critical path.
        """
        per_block = self.num_layers * self.pre
        first, rows = start * per_block, (end - start) * per_block
        grid = (rows if programs is None else max(1, min(rows, programs)),)
        self._launch(grid, self._args(ids, staging, first, first + rows, offset, to_staging=to_staging))

    def _triton(self, ids: torch.Tensor, staged: torch.Tensor, *, to_staging: bool, programs: int | None) -> None:
        assert staged.is_contiguous() and staged.shape[0] == ids.numel()
        self.copy_range(ids, staged, 0, ids.numel(), to_staging=to_staging, programs=programs)


def pipeline_defaults() -> dict[str, Any]:
    """`pipeline_bounds`'s default plan parameters by name: what a benchmark sweeps
    around and what both sides of a transfer must share (`connector.nccl_link.plan`)."""
    return {k: p.default for k, p in inspect.signature(pipeline_bounds).parameters.items()
            if p.default is not inspect.Parameter.empty}


def pipeline_bounds(
    num_blocks: int, block_nbytes: int, *, first_nbytes: int = 96 << 20, last_nbytes: int = 16 << 20,
    growth: int = 3, back_growth: int | None = 3, cap_nbytes: int = 1 << 30,
) -> list[int]:
    """Chunk ends (in blocks) for a pipelined transfer; both sides must use the same.

    What each chunk costs, measured on an H200 pair: about 10-30 us of wire time per
    extra NCCL op, and 30-60 us of host time to launch its gather and post its send.
    What chunks buy: the scatter of chunk k overlaps the receive of chunk k+1, and the
    sender's gather and post of chunk k+1 overlap the send of chunk k. So the last
    chunk is small (`last_nbytes`: the scatter after the last byte is all of the
    copying left on the clock); the first is small too, since its gather runs before
    any byte moves, yet large enough (`first_nbytes`) that its send outlasts the
    sender's host work for the next chunk; and going inward each chunk may be `growth`
    times its outer neighbour (up to `cap_nbytes`), because a gather or scatter runs
    about five times faster than NCCL moves the bytes (1.8 TB/s against 0.35 TB/s; a
    gather capped at 64 programs still 1.6 TB/s), so it still ends in time.
    `back_growth` (None: `growth`) is the growth of the back ramp alone, whose chunks
    wait on the receiver's scatters rather than the sender's gathers: a scatter at full
    width slows the receive it overlaps, so the chunks before the last one stay
    smaller. A transfer of at most `first_nbytes + last_nbytes` goes in one piece. The
    defaults (96 MiB first, 16 MiB last, growth 3, back ramp 3) were the best end-to-end
    schedule on an H200 pair at 2048 and 8192 tokens of Llama-3-8B-like KV, with the
    copies' streaming cache hints, against first chunks of 64, 80, 112 and 128 MiB, front
    growth 2, 4 and 5, last chunks of 24 MiB and back ramps of 2 and 4: a larger first
    chunk gives the gather behind it longer to run at a lower rate, which slows the wire
    it overlaps less (docs/PERFORMANCE.md, "Figures the code quotes").
    """
    if num_blocks <= 0:
        return []
    bn = max(1, block_nbytes)
    first, last = max(1, first_nbytes // bn), max(1, last_nbytes // bn)
    cap = max(first, last, cap_nbytes // bn)
    if num_blocks <= first + last:
        return [num_blocks]
    g = (max(1, growth), max(1, growth if back_growth is None else back_growth))  # front, back
    sides: tuple[list[int], list[int]] = ([], [])  # the front ramp and the back ramp, outside in
    nxt = [first, last]
    rem, turn, piece = num_blocks, 0, 0
    while rem:
        mine, theirs = sides[turn], sides[1 - turn]
        size = min(cap, nxt[turn], rem)
        if size == rem and theirs and size > g[1 - turn] * theirs[-1] and nxt[1 - turn] < rem:
            turn = 1 - turn  # as the middle piece it would outgrow its other neighbour
            continue
        mine.append(size)
        nxt[turn] = min(cap, nxt[turn] * g[turn])
        rem -= size
        piece, turn = turn, 1 - turn
    front, back = sides
    sizes = front + back[::-1]
    # The last piece taken sits in the middle. Smaller than both its neighbours, it is
    # an op that buys nothing: fold it into the smaller inner neighbour (the first and
    # last chunks keep their sizes) or, if it is tiny and has none, into the first.
    i = len(front) - 1 if piece == 0 else len(front)
    m = sizes[i]
    near = [j for j in (i - 1, i + 1) if 0 <= j < len(sizes)]
    if near and m < min(sizes[j] for j in near):
        inner = [j for j in near if 0 < j < len(sizes) - 1 and (sizes[j] + m <= cap or m < min(first, last))]
        if inner or m < min(first, last):
            j = min(inner, key=lambda j: sizes[j]) if inner else 0
            sizes[j] += m
            del sizes[i]
    ends, acc = [], 0
    for size in sizes:
        acc += size
        ends.append(acc)
    return ends


_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_STREAMS: dict[tuple[int, int], torch.cuda.Stream] = {}


def current_stream(device: torch.device) -> torch.cuda.Stream:
    """`torch.cuda.current_stream(device)`, without building a new Stream object each
    call (a few microseconds on a transfer's critical path): the objects are kept by
    raw stream handle, which is all a Stream object holds."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if _RAW_STREAM is None:
        return torch.cuda.current_stream(index)
    key = (index, _RAW_STREAM(index))
    stream = _STREAMS.get(key)
    if stream is None:
        stream = _STREAMS[key] = torch.cuda.current_stream(index)
    return stream


def layers_in_order(done: set[int], prefix: int) -> int:
    """How many layers from 0 are in `done`, counting on from `prefix` (all below it are)."""
    while prefix in done:
        prefix += 1
    return prefix


def layer_groups(num_layers: int) -> list[int]:
    """Where a send that follows a forward pass is cut into launches (`StepLayers`): the
    end of each group of layers, halving towards the end (for 32 layers 16, 8, 4, 2, 1,
    1). Few launches (each is host time on the forward pass's thread), and the copy left
    once the last layer is gathered is one layer's."""
    ends, back = {num_layers}, 1
    while back < num_layers:
        ends.add(num_layers - back)
        back *= 2
    return sorted(ends)


def _record_event(stream: Any) -> torch.cuda.Event:
    event = torch.cuda.Event()
    event.record(stream)
    return event


def _event_ran(event: torch.cuda.Event) -> bool:
    return event.query()


class StepLayers:
    """A step's layers as its gathers are enqueued on the compute stream (`gathered`),
    counted in order: the `LayerFeed` that block sends posted during the forward pass
    follow (`workers.transports.communicator`).

    Each time the count reaches the end of a group (`layer_groups`), an event is recorded
    on the compute stream after those gathers, and every send that follows is launched
    up to there, behind it. A send that starts following later is launched at once for
    each group reached, each behind that group's event: the host runs ahead of the GPU,
    so when the Go comes every layer may be enqueued while few are computed, and one
    launch behind the last event would copy the whole transfer after the forward pass.
    Launching up to a group's end behind its event is right whichever thread gets there
    first: the event comes after every gather before it in stream order, and a send
    skips layers it has launched already.

    Groups whose gathers the GPU has already run go in one launch, behind the latest of
    their events: a send that starts after a short forward pass (no prefill to overlap)
    is one launch, not one a group, each of them host time on the client's loop.

    `record(stream)` makes the event and `ran(event)` asks whether it completed
    (injected by the CPU tests, which have no CUDA)."""

    def __init__(self, num_layers: int, *, record: Callable[[Any], Any] = _record_event,
                 ran: Callable[[Any], bool] = _event_ran) -> None:
        self.num_layers = num_layers
        self._ends = layer_groups(num_layers)
        self._record, self._ran = record, ran
        self._lock = threading.Lock()  # the forward pass's thread counts; the broker client's loop follows
        self._done: set[int] = set()
        self._prefix = 0  # layers [0, prefix) are gathered
        self._next = 0  # the group whose end is still to be reached
        self._reached: list[tuple[int, Any]] = []  # each group end reached, and its event
        self._followers: list[LayerSend] = []

    def gathered(self, layer: int, stream: Any) -> None:
        """Layer `layer`'s gathers are enqueued on `stream`. In the forward pass: a send's
        launch that fails is logged, not raised (its transfer then ends at its deadline)."""
        with self._lock:
            self._done.add(layer)
            self._prefix = layers_in_order(self._done, self._prefix)
            reached = self._next
            while reached < len(self._ends) and self._ends[reached] <= self._prefix:
                reached += 1
            if reached == self._next:
                return
            self._next = reached
            end = self._ends[reached - 1]
            event = self._record(stream)
            self._reached.append((end, event))
            # A copy: `follow` may add to the list (under the lock) while these launch outside it.
            followers = list(self._followers)
            if end >= self.num_layers:
                self._followers = []
        for send in followers:
            try:
                send.launch(end, event)
            except Exception as exc:  # never into vLLM's forward pass
                log.error("transfer.launch_failed", layers=end, error=repr(exc))

    def follow(self, send: LayerSend) -> None:
        """`send` is launched up to each group reached now (in one launch for those the
        GPU has run), and then as each is."""
        with self._lock:
            reached = list(self._reached)
            if not reached or reached[-1][0] < self.num_layers:
                self._followers.append(send)
        for k in range(len(reached) - 1, 0, -1):  # the latest group already run, and those after it
            if self._ran(reached[k][1]):
                reached = reached[k:]
                break
        for end, event in reached:
            send.launch(end, event)

    def end(self) -> None:
        """The step is over: a send still following it (its step missed a layer) is never
        launched further; its transfer was aborted, and the abort ends it."""
        with self._lock:
            self._followers = []
