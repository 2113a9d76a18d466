"""Cut a run of KV heads out of block-major staging, and join runs back into it.

When prefill and decode run different tensor-parallel sizes, a decode rank needs some
of a prefill rank's heads, or heads from several prefill ranks (`protocols.heads` says
which). Staging holds ``[num_blocks, num_layers, block_nbytes]`` in the layer's logical
order (`workers.layout`), so one block's bytes view as ``[outer, heads, inner]``:

- ``kv_first`` / ``blocks_first`` (flash-attn NHD; an HND cache is the same logical view
  with other strides, and stages the same bytes): ``[2 * block_size, H, head_size]``,
  K's tokens then V's, each token's heads side by side.
- ``cpu``: ``[1, H, block_size * (head_size + head_size_v)]``: a head's K and V for
  every token are one run.
- ``mla``: ``[1, 1, block_nbytes]``: the latent has no head axis; it is replicated on
  every rank, so a decode rank takes a whole block from one prefill rank.

`split_heads` copies heads ``[start, stop)`` of every block and layer into a buffer of
``[num_blocks, num_layers, part_nbytes]``, the part a lane moves; `merge_heads` writes
such a part into heads ``[start, stop)`` of a staging buffer of another head count.
A prefill rank splits, a decode rank merges each of its lanes' parts, then scatters the
staging as for equal TP. Both are one strided copy, exact at the bit level.
"""

from __future__ import annotations

import torch

from .layout import LayerLayout, LayoutError

__all__ = ["head_count", "merge_heads", "part_nbytes", "split_heads"]


def head_count(layout: LayerLayout) -> int:
    """The KV heads one block of this layout holds (1 for MLA's latent)."""
    if layout.kind in ("kv_first", "blocks_first"):
        return layout.shape[3]
    if layout.kind == "cpu":
        return layout.shape[1]
    return 1


def part_nbytes(layout: LayerLayout, start: int, stop: int) -> int:
    """Bytes of one block's heads ``[start, stop)`` (local to this layout's heads)."""
    heads = head_count(layout)
    _check_run(heads, start, stop, layout)
    return layout.block_nbytes // heads * (stop - start)


def split_heads(staging: torch.Tensor, layout: LayerLayout, start: int, stop: int, out: torch.Tensor) -> torch.Tensor:
    """Copy heads ``[start, stop)`` of every staged block and layer into `out`.

    Args:
        staging: uint8 ``[num_blocks, num_layers, block_nbytes]`` (see `layout.staging_view`).
        layout: the layout the staging was gathered with.
        start, stop: heads of this layout, not global ones.
        out: a contiguous buffer of exactly ``num_blocks * num_layers * part_nbytes`` bytes.

    Returns:
        `out` viewed as uint8 ``[num_blocks, num_layers, part_nbytes]``.
    """
    src = _heads_view(staging, layout)[:, :, :, start:stop, :]
    part = _part(out, staging, layout, start, stop)
    part.view(src.shape).copy_(src)
    return part


def merge_heads(part: torch.Tensor, layout: LayerLayout, start: int, stop: int, staging: torch.Tensor) -> None:
    """Write `part` (as `split_heads` made it) into heads ``[start, stop)`` of `staging`,
    which is staging of `layout` (the receiving rank's); no other byte changes."""
    dst = _heads_view(staging, layout)[:, :, :, start:stop, :]
    data = _part(part, staging, layout, start, stop)
    dst.copy_(data.view(dst.shape))


# -- internals -------------------------------------------------------------------------


def _check_run(heads: int, start: int, stop: int, layout: LayerLayout) -> None:
    if not 0 <= start < stop <= heads:
        raise LayoutError(f"heads [{start}, {stop}) are not a run of the {heads} heads of {layout.describe()}.")


def _heads_view(staging: torch.Tensor, layout: LayerLayout) -> torch.Tensor:
    """`staging` as ``[num_blocks, num_layers, outer, heads, inner]`` uint8; a view."""
    if staging.dtype != torch.uint8 or staging.dim() != 3 or staging.shape[2] != layout.block_nbytes:
        raise LayoutError(
            f"staging must be uint8 [num_blocks, num_layers, {layout.block_nbytes}] for {layout.describe()}, "
            f"not {str(staging.dtype).removeprefix('torch.')} {list(staging.shape)}."
        )
    heads = head_count(layout)
    if layout.kind in ("kv_first", "blocks_first"):
        outer = 2 * layout.shape[2]
    else:
        outer = 1
    inner = layout.block_nbytes // (outer * heads)
    n, layers, _ = staging.shape
    return staging.view(n, layers, outer, heads, inner)


def _part(buf: torch.Tensor, staging: torch.Tensor, layout: LayerLayout, start: int, stop: int) -> torch.Tensor:
    nbytes = part_nbytes(layout, start, stop)
    n, layers, _ = staging.shape
    if not buf.is_contiguous():
        raise LayoutError(f"a head part must be contiguous (shape {list(buf.shape)}, strides {buf.stride()}).")
    flat = buf.reshape(-1).view(torch.uint8)
    if flat.numel() != n * layers * nbytes:
        raise LayoutError(
            f"heads [{start}, {stop}) of {n} blocks x {layers} layers need a {n * layers * nbytes} B buffer, "
            f"not {flat.numel()} B ({layout.describe()})."
        )
    return flat.view(n, layers, nbytes)
