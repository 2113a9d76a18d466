"""Gather a request's blocks out of a paged KV cache, and scatter them into another.

Theory of operation
-------------------
vLLM keeps one tensor per attention layer whose shape depends on the attention
backend. Every such tensor has a *block axis*; once we view the tensor as raw bytes
and move that axis to the front (a view, never a copy), one block of one layer is a
fixed number of bytes, `block_nbytes`, with K and V both inside. Gather is then a
single ``index_select`` along that axis into a byte buffer, and scatter a single
``index_copy_`` back: one kernel per call, whatever the number of blocks. Working on
bytes makes both exact bit copies (bf16 NaN payloads and fp8 codes survive), and makes
the code the same for every dtype.

The layout is derived from the tensor's shape and the layer's KV cache spec (block
size, KV heads, head size, MLA or not), never from attention metadata, which may be
None or a dict (a failure seen in other connectors). Kinds, with bs = block size,
H = KV heads, D/Dv = K/V head size:

- ``kv_first``: ``[2, num_blocks, bs, H, D]`` (flash-attn style). Block bytes: K
  ``[bs, H, D]`` then V ``[bs, H, D]``.
- ``blocks_first``: ``[num_blocks, 2, bs, H, D]`` (FlashInfer style). Same block bytes.
- ``cpu``: ``[num_blocks, H, bs, D + Dv]``, K and V side by side on the last axis.
  Block bytes: ``[H, bs, K|V]``.
- ``mla``: ``[num_blocks, bs, D]``, or ``[num_blocks, 1, bs, D]`` as the installed vLLM
  hands it out. Block bytes: ``[bs, D]``, one latent per token, no V.

The ``cpu`` shape comes from the installed vLLM's CPU backend
(``vllm/v1/attention/backends/cpu_attn.py``: ``kv_cache: shape = [num_blocks,
num_kv_heads, block_size, 2 * head_size]``, split into K and V along the last axis).
That vLLM gives every attention backend's layer this logical ``[B, H, N, C]`` view of
one shared buffer (``vllm/v1/worker/utils.py: create_kv_cache_views``), strided when
the physical layout is head/token-permuted or block-outermost; the byte view handles
strides, so those work too.

A block's bytes are in the tensor's *logical* order, with K ahead of V wherever the
layout keeps them apart. For a tensor that is contiguous per block this is a straight
copy; for a permuted view the kernel does the strided read. Logical order also means
two vLLM instances whose physical layouts differ (LBHNC vs LBNHC) stage identical
bytes. P and D must still agree on the kind, which the compatibility hash covers.
When ``num_blocks == 2`` a 5-D ``[2, 2, bs, H, D]`` fits both ``kv_first`` and
``blocks_first``; neither the shape nor the spec can tell them apart, so
`detect_layout` then requires an explicit `hint` (the caller maps its attention
backend to the kind).

Staging is block-major (see `protocols.messages.Layout`): ``[num_blocks, num_layers,
block_nbytes]``. P stages all of a request's blocks, layer by layer. D already holds
the first ``num_cached_blocks`` in its prefix cache, so it asks for the byte range
`tail_range` returns, receives it into a buffer viewed with ``staging_view(buf, n - k,
...)``, and scatters into ``tail(its_block_ids, k)`` only: a prefix-cached block is
never written.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal, Sequence, get_args

import torch

from protocols.errors import KvBrokerError
from protocols.messages import Layout

__all__ = [
    "CachePlaces",
    "CacheRows",
    "CacheSpec",
    "LayerLayout",
    "LayoutError",
    "LayoutKind",
    "StepGather",
    "detect_layout",
    "gather",
    "gather_layer_into_staging",
    "layer_major_view",
    "scatter",
    "scatter_layer_from_staging",
    "scatter_layers_from_staging",
    "staging_view",
    "tail",
    "tail_range",
    "wire_layout",
]

LayoutKind = Literal["kv_first", "blocks_first", "cpu", "mla"]
LAYOUT_KINDS: tuple[str, ...] = get_args(LayoutKind)

BlockIds = Sequence[int] | torch.Tensor


class LayoutError(KvBrokerError, ValueError):
    """A cache tensor, buffer or block list does not fit the layout."""


@dataclass(frozen=True)
class CacheSpec:
    """What the layout is derived from: one layer's KV cache spec.

    `head_size_v` is V's head size where it differs from K's (None: the same). MLA
    layers store one latent of `head_size` per token and ignore it.
    """

    block_size: int
    num_kv_heads: int
    head_size: int
    use_mla: bool = False
    head_size_v: int | None = None

    @classmethod
    def from_vllm(cls, spec: Any) -> CacheSpec:
        """Read a vLLM ``AttentionSpec``-like object (duck-typed, so no vLLM import)."""
        use_mla = getattr(spec, "use_mla", None)
        if use_mla is None:
            use_mla = any("MLA" in klass.__name__ for klass in type(spec).__mro__)
        heads = getattr(spec, "num_head_slots", None) or spec.num_kv_heads
        head_size_v = getattr(spec, "head_size_v", None)
        return cls(
            block_size=int(spec.block_size),
            num_kv_heads=int(heads),
            head_size=int(spec.head_size),
            use_mla=bool(use_mla),
            head_size_v=None if use_mla or head_size_v is None else int(head_size_v),
        )


@dataclass(frozen=True)
class LayerLayout:
    """How one layer's cache tensor is arranged; `block_nbytes` is one block, K and V."""

    kind: LayoutKind
    shape: tuple[int, ...]
    dtype: torch.dtype
    num_blocks: int
    block_nbytes: int

    def describe(self) -> str:
        return f"{self.kind} {list(self.shape)} {_dtype_name(self.dtype)}"


def detect_layout(tensor: torch.Tensor, spec: CacheSpec, *, hint: LayoutKind | None = None) -> LayerLayout:
    """Work out a layer's layout from its tensor's shape and its KV cache spec.

    Args:
        tensor: the layer's KV cache.
        spec: the layer's cache spec (`CacheSpec.from_vllm` reads vLLM's).
        hint: the kind, when the caller knows it; required only for the ambiguous
            ``[2, 2, block_size, H, D]``, and checked against the shape otherwise.

    Raises:
        LayoutError: the shape fits no kind, fits two and no hint decides, or
            contradicts the hint; the message names the shape and the spec.
    """
    if hint is not None and hint not in LAYOUT_KINDS:
        raise LayoutError(f"unknown layout hint {hint!r}; use one of {', '.join(LAYOUT_KINDS)}.")
    shape = tuple(tensor.shape)
    bs, heads, d = spec.block_size, spec.num_kv_heads, spec.head_size
    dv = d if spec.head_size_v is None else spec.head_size_v
    fits: dict[str, int] = {}  # kind -> num_blocks
    if spec.use_mla:
        if len(shape) == 3 and shape[1:] == (bs, d):
            fits["mla"] = shape[0]
        if len(shape) == 4 and shape[1:] == (1, bs, d):
            fits["mla"] = shape[0]
    else:
        if len(shape) == 5 and dv == d:
            if shape[0] == 2 and shape[2:] == (bs, heads, d):
                fits["kv_first"] = shape[1]
            if shape[1] == 2 and shape[2:] == (bs, heads, d):
                fits["blocks_first"] = shape[0]
        if len(shape) == 4 and shape[1:] == (heads, bs, d + dv):
            fits["cpu"] = shape[0]
    where = f"KV cache of shape {list(shape)} with {spec}"
    if hint is not None:
        if hint not in fits:
            fit = f"it fits {', '.join(fits)}" if fits else "it fits no known layout"
            raise LayoutError(f"{where} is not a {hint!r} layout; {fit}.")
        kind = hint
    elif len(fits) == 1:
        kind = next(iter(fits))
    elif fits:
        raise LayoutError(
            f"{where} fits both {' and '.join(fits)} (num_blocks == 2); pass hint= with the "
            f"attention backend's layout kind."
        )
    else:
        raise LayoutError(
            f"{where} fits no known layout ({', '.join(LAYOUT_KINDS)}); check that the spec "
            f"is this layer's, or that the backend is supported."
        )
    block_nbytes = _block_elems(shape, kind) * tensor.element_size()
    return LayerLayout(kind, shape, tensor.dtype, fits[kind], block_nbytes)  # type: ignore[arg-type]


def gather(layer_cache: torch.Tensor, layout: LayerLayout, block_ids: BlockIds, out: torch.Tensor) -> torch.Tensor:
    """Copy blocks `block_ids` of a layer, in that order, into `out`; one kernel.

    Args:
        out: a contiguous buffer (any dtype) of exactly ``len(block_ids) * block_nbytes``
            bytes, such as a pool lease's tensor.

    Returns:
        `out` viewed as uint8 ``[len(block_ids), block_nbytes]``.

    Raises:
        LayoutError: the cache does not match `layout`, a block id is out of range, or
            `out` has the wrong size.
    """
    src = _blocks(layer_cache, layout)
    idx = _index(block_ids, layout, src.device, unique=False)
    dst = _out_bytes(out, len(idx), layout)
    rows, into = _as_words(src, dst.view(len(idx), *src.shape[1:]))
    torch.index_select(rows, 0, idx, out=into)
    return dst


def scatter(layer_cache: torch.Tensor, layout: LayerLayout, block_ids: BlockIds, src: torch.Tensor) -> None:
    """Copy `src` (as `gather` wrote it) into blocks `block_ids`; no other byte changes.

    Raises:
        LayoutError: as for `gather`, or a block id repeats (its final value would be
            undefined).
    """
    dst = _blocks(layer_cache, layout)
    idx = _index(block_ids, layout, dst.device, unique=True)
    data = _out_bytes(src, len(idx), layout)
    rows, data = _as_words(dst, data.view(len(idx), *dst.shape[1:]))
    rows.index_copy_(0, idx, data)


def staging_view(buf: torch.Tensor, num_blocks: int, num_layers: int, block_nbytes: int) -> torch.Tensor:
    """View a contiguous buffer of exactly the right size as ``[num_blocks, num_layers, block_nbytes]`` uint8."""
    need = num_blocks * num_layers * block_nbytes
    flat = _flat_bytes(buf)
    if flat.numel() != need:
        raise LayoutError(
            f"a staging buffer for {num_blocks} blocks x {num_layers} layers x {block_nbytes} B "
            f"needs {need} B but holds {flat.numel()} B."
        )
    return flat.view(num_blocks, num_layers, block_nbytes)


def layer_major_view(buf: torch.Tensor, num_blocks: int, num_layers: int, block_nbytes: int) -> torch.Tensor:
    """View a buffer holding ``[num_layers, num_blocks, block_nbytes]`` bytes (a transfer sent
    layer by layer) as `staging_view`'s ``[num_blocks, num_layers, block_nbytes]``: a strided
    view, no copy; each layer's blocks stay contiguous."""
    return staging_view(buf, num_layers, num_blocks, block_nbytes).permute(1, 0, 2)


def gather_layer_into_staging(
    staging: torch.Tensor, layer_idx: int, layer_cache: torch.Tensor, layout: LayerLayout, block_ids: BlockIds
) -> None:
    """Write layer `layer_idx` of each block into block-major `staging` (see `staging_view`)."""
    src = _blocks(layer_cache, layout)
    idx = _index(block_ids, layout, src.device, unique=False)
    dst = _staging_slice(staging, layer_idx, len(idx), layout)
    rows, into = _as_words(src, dst.view(len(idx), *src.shape[1:]))
    torch.index_select(rows, 0, idx, out=into)


def scatter_layer_from_staging(
    staging: torch.Tensor, layer_idx: int, layer_cache: torch.Tensor, layout: LayerLayout, block_ids: BlockIds
) -> None:
    """Copy layer `layer_idx` of each staged block into `block_ids`; inverse of the gather."""
    dst = _blocks(layer_cache, layout)
    idx = _index(block_ids, layout, dst.device, unique=True)
    src = _staging_slice(staging, layer_idx, len(idx), layout)
    rows, data = _as_words(dst, src.view(len(idx), *dst.shape[1:]))
    rows.index_copy_(0, idx, data)


def scatter_layers_from_staging(
    staging: torch.Tensor, layers: Sequence[tuple[torch.Tensor, LayerLayout]], block_ids: BlockIds
) -> None:
    """`scatter_layer_from_staging` for every layer of one transfer, layer i of `staging`
    into ``layers[i]``: the ids are checked and indexed once, and the widest word found
    once, not per layer. A per-layer call costs 10-15 us of host time on a CPU, which D
    spends in the engine's step, so a request's 32 layers cost 0.4-0.5 ms before a byte moved."""
    if not layers:
        return
    if staging.dim() != 3 or staging.shape[1] != len(layers):
        raise LayoutError(f"staging {list(staging.shape)} does not hold {len(layers)} layers.")
    first_cache, first = layers[0]
    bound = min(layout.num_blocks for _, layout in layers)
    idx = _index(block_ids, replace(first, num_blocks=bound), first_cache.device, unique=True)
    word: torch.dtype | None = None
    for i, (cache, layout) in enumerate(layers):
        dst = _blocks(cache, layout)
        src = _staging_slice(staging, i, len(idx), layout).view(len(idx), *dst.shape[1:])
        if word is not None and layout == first:
            try:
                rows, data = dst.view(word), src.view(word)
            except RuntimeError:  # a stride this word does not fit: work it out for this layer
                rows, data = _as_words(dst, src)
        else:
            rows, data = _as_words(dst, src)
            if layout == first:
                word = rows.dtype
        rows.index_copy_(0, idx, data)


class CacheRows:
    """Where P's copies of a step read a cache: each registered layer's blocks as rows of
    the widest integer word its bytes allow (`_blocks`, `_as_words`), worked out once per
    cache (`register_kv_caches`). A step's gather of a layer is then one `index_select`
    into its staging (`StepGather`), with no views, checks or index tensor made for each
    layer: made per layer (`gather_layer_into_staging`), they held a save of one block
    at 86-120 us of the forward pass's host time on a 2-core VM, against 36-37 us now
    (docs/PERFORMANCE.md).

    `rows` is None where the layers' rows differ in shape or word (they are then copied
    one call a layer)."""

    def __init__(self, layers: Sequence[tuple[torch.Tensor, LayerLayout]]) -> None:
        self.rows: list[torch.Tensor] | None = None
        try:
            rows = [_as_words(_blocks(cache, layout))[0] for cache, layout in layers]
        except LayoutError:  # each save's copy names it
            return
        if len({(r.dtype, tuple(r.shape[1:]), r.device) for r in rows}) == 1:
            self.rows = rows
            bound = min(layout.num_blocks for _, layout in layers)
            self._layout = replace(layers[0][1], num_blocks=bound)  # what block ids are checked against

    def step(self, staging: torch.Tensor, block_ids: BlockIds) -> StepGather | None:
        """The gathers of a step's blocks `block_ids` into block-major `staging` (``[n,
        layers, block_nbytes]`` uint8, see `staging_view`); None where its bytes do not
        take the caches' word (then copy one call a layer, which names what is wrong)."""
        if self.rows is None or staging.dtype != torch.uint8 or staging.dim() != 3 \
                or staging.shape[1] != len(self.rows):
            return None
        first = self.rows[0]
        k = first.element_size()
        # the widest word the staging's bytes allow; a wider one allows the narrower too
        if _as_words(staging)[0].element_size() < k or staging.device != first.device:
            return None
        tail = tuple(first.shape[1:])
        if staging.shape[2] // k != _prod(tail):
            return None
        try:
            idx = _index(block_ids, self._layout, first.device, unique=False)
        except LayoutError:
            return None
        if len(idx) != staging.shape[0]:
            return None
        into = staging.view(first.dtype).view(staging.shape[0], staging.shape[1], *tail).unbind(1)
        return StepGather(self.rows, idx, into)


class StepGather:
    """One step's copies of its blocks, layer by layer, into its staging (`CacheRows.step`)."""

    def __init__(self, rows: list[torch.Tensor], idx: torch.Tensor, into: Sequence[torch.Tensor]) -> None:
        self._rows, self._idx, self._into = rows, idx, into

    def layer(self, layer_idx: int) -> None:
        """Copy layer `layer_idx` of the step's blocks into its staging: one `index_select`."""
        torch.index_select(self._rows[layer_idx], 0, self._idx, out=self._into[layer_idx])


class CachePlaces:
    """Where a transfer's bytes go in a CPU cache, in the order the tcp wire carries them
    (layer by layer, each layer's blocks in `block_ids` order, a block's row as staged: K
    then V where they are planes of their own): writable byte views a receiver fills one
    after another, so the bytes land in the blocks with no scatter after them.

    Built once per cache (`register_kv_caches`): each layer's bytes are viewed here, not
    again for every transfer. A transfer's places (`of`) are then only slices, one per
    run of consecutive blocks where a block's row is whole in the cache (vLLM hands out
    fresh blocks mostly in runs), else one per block and plane: for 32 layers of 32
    blocks that took D's loop 1.2-4.3 ms before each Ready, worked out per transfer on
    this VM (docs/PERFORMANCE.md)."""

    def __init__(self, layers: Sequence[tuple[torch.Tensor, LayerLayout]]) -> None:
        # Per layer: its bytes, where its planes start in them, a block's step, a row, blocks.
        self._layers: list[tuple[memoryview, list[int], int, int, int]] | None = []
        for cache, layout in layers:
            if cache.device.type != "cpu" or not cache.is_contiguous():
                self._layers = None  # a GPU or non-contiguous cache: receive into staging, scatter
                return
            dst = _blocks(cache, layout)  # uint8, the block axis first: a view of `cache`
            base = dst.data_ptr() - cache.data_ptr()
            planes = [base + k * dst.stride(1) for k in range(dst.shape[1])] if dst.dim() == 3 else [base]
            row = dst.shape[-1]
            if dst.stride(-1) != 1 or row * len(planes) != layout.block_nbytes:
                self._layers = None
                return
            whole = memoryview(cache.detach().reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
            self._layers.append((whole, planes, dst.stride(0), row, layout.num_blocks))

    def of(self, block_ids: Sequence[int]) -> list[memoryview] | None:
        """The places of a transfer into `block_ids`. None where it cannot be received in
        place (a GPU or non-contiguous cache, an id outside it): receive into staging and
        scatter, which names what is wrong."""
        if self._layers is None:
            return None
        places: list[memoryview] = []
        if not block_ids:
            return places
        lo, hi = min(block_ids), max(block_ids)
        runs: list[tuple[int, int]] = []  # (first block, blocks) of each run of consecutive ids
        for b in block_ids:
            if runs and runs[-1][0] + runs[-1][1] == b:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1)
            else:
                runs.append((b, 1))
        for whole, planes, step, row, num_blocks in self._layers:
            if lo < 0 or hi >= num_blocks:
                return None
            if len(planes) == 1 and step == row:  # blocks back to back: a run is one place
                p = planes[0]
                places += [whole[p + b * step : p + (b + n) * step] for b, n in runs]
            else:
                places += [whole[p + b * step : p + b * step + row] for b in block_ids for p in planes]
        return places


def tail(block_ids: Sequence[int], num_cached_blocks: int) -> Sequence[int]:
    """The blocks after the first `num_cached_blocks`: the only ones D may write."""
    _check_cached(len(block_ids), num_cached_blocks)
    return block_ids[num_cached_blocks:]


def tail_range(num_blocks: int, num_cached_blocks: int, num_layers: int, block_nbytes: int) -> tuple[int, int]:
    """``(offset, nbytes)`` of the staged bytes D needs when it holds the first `num_cached_blocks`.

    Staging is block-major, so skipping a head of blocks is an offset and the rest is
    one contiguous range (these go into `protocols.messages.Ready`).
    """
    _check_cached(num_blocks, num_cached_blocks)
    per_block = num_layers * block_nbytes
    return num_cached_blocks * per_block, (num_blocks - num_cached_blocks) * per_block


def wire_layout(layout: LayerLayout, num_layers: int, num_blocks: int) -> Layout:
    """The wire description of a staged transfer of `num_blocks` blocks."""
    return Layout(
        kind=layout.kind,
        dtype=_dtype_name(layout.dtype),
        num_layers=num_layers,
        num_blocks=num_blocks,
        block_nbytes=layout.block_nbytes,
    )


# -- internals -------------------------------------------------------------------------


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _prod(shape: Sequence[int]) -> int:
    out = 1
    for n in shape:
        out *= n
    return out


def _block_elems(shape: tuple[int, ...], kind: str) -> int:
    if kind == "kv_first":
        return 2 * _prod(shape[2:])
    return _prod(shape[1:])


def _merge_tail(t: torch.Tensor, start: int) -> torch.Tensor:
    """Merge dims ``start:`` into one when that is a view; keep them apart otherwise."""
    try:
        return t.view(*t.shape[:start], -1)
    except RuntimeError:
        return t


def _blocks(cache: torch.Tensor, layout: LayerLayout) -> torch.Tensor:
    """A uint8 view of `cache` with the block axis first; never a copy."""
    if tuple(cache.shape) != layout.shape or cache.dtype != layout.dtype:
        raise LayoutError(
            f"the cache tensor is {list(cache.shape)} {_dtype_name(cache.dtype)} but the layout "
            f"says {layout.describe()}; detect the layout of this very tensor."
        )
    if cache.element_size() > 1 and cache.stride(-1) != 1:
        raise LayoutError(
            f"the cache tensor's last axis has stride {cache.stride(-1)}; its bytes cannot be "
            f"viewed in place ({layout.describe()})."
        )
    raw = cache.view(torch.uint8)
    if layout.kind == "kv_first":
        return _merge_tail(raw, 2).transpose(0, 1)
    return _merge_tail(raw, 1)


_WORDS = (torch.int64, torch.int32, torch.int16)


def _as_words(*views: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The same uint8 views as the widest integer type all of them allow, or as they are.

    Torch's indexed copies move a row element by element, so wider elements copy it
    several times faster (`index_copy_` of 64 KiB rows on a 2-core CPU: 3.6 GB/s as
    uint8, 21 GB/s as int64)."""
    for dtype in _WORDS:
        k = dtype.itemsize
        if all(v.shape[-1] % k == 0 and (v.stride(-1) == 1 or v.shape[-1] == 1) and v.storage_offset() % k == 0
               and all(st % k == 0 for st in v.stride()[:-1]) for v in views):
            try:
                return tuple(v.view(dtype) for v in views)
            except RuntimeError:  # a stride torch will not reinterpret: try a narrower word
                continue
    return views


def _index(block_ids: BlockIds, layout: LayerLayout, device: torch.device, *, unique: bool) -> torch.Tensor:
    if isinstance(block_ids, torch.Tensor):
        if block_ids.dim() != 1 or block_ids.dtype.is_floating_point or block_ids.dtype == torch.bool:
            raise LayoutError(f"block ids must be a 1-D integer tensor, not {block_ids.dtype} {list(block_ids.shape)}.")
        idx = block_ids.to(dtype=torch.long)
        # A host-side check is free; on a device it would force a sync, so the kernel's
        # own bounds check stands in.
        ids = idx.tolist() if idx.device.type == "cpu" else None
        idx = idx.to(device)
    else:
        ids = [int(b) for b in block_ids]
        idx = torch.tensor(ids, dtype=torch.long).to(device)
    if ids is not None:
        bad = [b for b in ids if not 0 <= b < layout.num_blocks]
        if bad:
            raise LayoutError(f"block id {bad[0]} is outside the cache's {layout.num_blocks} blocks.")
        if unique and len(set(ids)) != len(ids):
            raise LayoutError(f"block ids to write must be distinct; got {ids}.")
    return idx


def _flat_bytes(buf: torch.Tensor) -> torch.Tensor:
    if not buf.is_contiguous():
        raise LayoutError(f"the buffer must be contiguous (shape {list(buf.shape)}, strides {buf.stride()}).")
    return buf.reshape(-1).view(torch.uint8)


def _out_bytes(buf: torch.Tensor, n: int, layout: LayerLayout) -> torch.Tensor:
    flat = _flat_bytes(buf)
    need = n * layout.block_nbytes
    if flat.numel() != need:
        raise LayoutError(
            f"{n} block(s) of {layout.block_nbytes} B ({layout.describe()}) need a {need} B "
            f"buffer, not {flat.numel()} B."
        )
    return flat.view(n, layout.block_nbytes)


def _staging_slice(staging: torch.Tensor, layer_idx: int, n: int, layout: LayerLayout) -> torch.Tensor:
    if staging.dtype != torch.uint8 or staging.dim() != 3:
        raise LayoutError(
            f"staging must be uint8 [num_blocks, num_layers, block_nbytes] (see staging_view), "
            f"not {_dtype_name(staging.dtype)} {list(staging.shape)}."
        )
    blocks, layers, nbytes = staging.shape
    if blocks != n or nbytes != layout.block_nbytes:
        raise LayoutError(
            f"staging {list(staging.shape)} does not fit {n} blocks of {layout.block_nbytes} B "
            f"({layout.describe()})."
        )
    if not 0 <= layer_idx < layers:
        raise LayoutError(f"layer {layer_idx} is outside the staging buffer's {layers} layers.")
    return staging[:, layer_idx, :]


def _check_cached(num_blocks: int, num_cached_blocks: int) -> None:
    if not 0 <= num_cached_blocks <= num_blocks:
        raise LayoutError(
            f"{num_cached_blocks} cached blocks is outside 0..{num_blocks} (the request's blocks)."
        )
