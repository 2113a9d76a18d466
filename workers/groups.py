"""Staging for models with several KV cache groups (hybrid models, e.g. Gemma-3, gpt-oss).

Theory of operation
-------------------
vLLM's hybrid KV cache manager keeps one block table per KV cache group: the layers of
a group share it, and each group's block ids are its own (a block id names memory that
layers of different groups may share, but the pool hands a block to one group at a
time). So layer ``l`` of a request lives in the blocks its group ``g(l)`` holds, and a
copy that read or wrote another group's ids would move another request's KV.

A sliding-window group keeps only the blocks its window still reaches: once ``n``
tokens are computed, the first ``max(0, n - window + 1) // block_size`` blocks of the
group are retired and vLLM puts its null block (block id 0, shared by every group, never
to be written) in their place. A decode instance that loads a prompt of ``n`` tokens
allocates those blocks as null blocks from the start, so they are not staged either:
row ``i`` (the request's block ``i``) holds, layer by layer, only the layers whose
group still keeps block ``i``.

Staging therefore stays block-major, as `workers.layout` describes, but rows differ in
width: a row holds every live layer's ``block_nbytes``, in layer order. Because a
group's live rows are a suffix of the rows, the rows cut into a few *segments* of equal
width (at most one per distinct window), each a plain ``[rows, layers, block_nbytes]``
block; and skipping D's prefix-cache hit of ``k`` blocks is still one byte offset, so
D asks for one contiguous range (`GroupRows.tail_cells`). With one full-attention group
the rows are the single segment ``[n, num_layers, block_nbytes]`` of `workers.layout`.

`KvGroups` and `GroupRows` are plain values, so both sides compute the same rows from
the same prompt length; `gather_layer_rows` and `scatter_rows` copy between
a layer's cache and such a staging.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from protocols.errors import KvBrokerError

from .layout import LayerLayout, gather_layer_into_staging, scatter_layer_from_staging

__all__ = ["NULL_BLOCK", "GroupError", "GroupRows", "KvGroups", "Segment", "gather_layer_rows", "scatter_rows"]

# vLLM's null block: the block pool's first, standing in for retired sliding-window
# blocks in every group's table; never read for attention and never written.
NULL_BLOCK = 0


class GroupError(KvBrokerError, ValueError):
    """Block ids that do not fit the groups' rows (a null block where KV must be, or the reverse)."""


@dataclass(frozen=True)
class Segment:
    """Rows ``[start, stop)``, each holding `layers` (staged layer indices, ascending);
    its first cell is cell `offset` of the staging (a cell is one layer of one block)."""

    start: int
    stop: int
    layers: tuple[int, ...]
    offset: int

    @property
    def cells(self) -> int:
        return (self.stop - self.start) * len(self.layers)


@dataclass(frozen=True)
class GroupRows:
    """The staged rows of one request (see the module docstring)."""

    num_blocks: int
    segments: tuple[Segment, ...]

    @property
    def cells(self) -> int:
        return sum(seg.cells for seg in self.segments)

    def row_cell(self, row: int) -> int:
        """The first cell of row `row` (``cells`` for ``row == num_blocks``)."""
        if not 0 <= row <= self.num_blocks:
            raise GroupError(f"row {row} is outside the request's {self.num_blocks} blocks.")
        for seg in self.segments:
            if row < seg.stop:
                return seg.offset + (max(row, seg.start) - seg.start) * len(seg.layers)
        return self.cells

    def tail(self, skip: int) -> GroupRows:
        """The rows from `skip` on, as D receives them (cells counted from row `skip`)."""
        base = self.row_cell(skip)
        segs = []
        for seg in self.segments:
            if seg.stop <= skip:
                continue
            start = max(seg.start, skip)
            segs.append(Segment(start, seg.stop, seg.layers, seg.offset + (start - seg.start) * len(seg.layers) - base))
        return GroupRows(self.num_blocks, tuple(segs))

    def tail_cells(self, skip: int) -> tuple[int, int]:
        """``(first cell, cells)`` of the rows from `skip` on: the one range D asks for."""
        first = self.row_cell(skip)
        return first, self.cells - first

    def live(self, layer: int) -> list[tuple[Segment, int]]:
        """The segments that hold `layer`, with its column in each."""
        return [(seg, seg.layers.index(layer)) for seg in self.segments if layer in seg.layers]


@dataclass(frozen=True)
class KvGroups:
    """An engine's KV cache groups as staging sees them.

    `layer_group[l]` is the group of staged layer ``l``; `windows[g]` the tokens group
    ``g`` looks back (its sliding window, plus any blocks vLLM retains past it), 0 for
    full attention.
    """

    layer_group: tuple[int, ...]
    windows: tuple[int, ...]
    block_size: int

    def __post_init__(self) -> None:
        if self.block_size <= 0 or any(w < 0 for w in self.windows):
            raise GroupError(f"block size {self.block_size} and windows {self.windows} must not be negative.")
        if any(not 0 <= g < len(self.windows) for g in self.layer_group):
            raise GroupError(f"layer groups {self.layer_group} name a group outside {len(self.windows)} groups.")

    def first_blocks(self, num_tokens: int) -> tuple[int, ...]:
        """Per group, its first block still inside the window once `num_tokens` are computed
        (vLLM's ``SlidingWindowManager.get_num_skipped_tokens``, in whole blocks)."""
        return tuple(0 if w == 0 else max(0, num_tokens - w + 1) // self.block_size for w in self.windows)

    def rows(self, num_blocks: int, num_tokens: int) -> GroupRows:
        """The staged rows of a request of `num_tokens` tokens in `num_blocks` blocks."""
        firsts = self.first_blocks(num_tokens)
        starts = sorted({min(firsts[g], num_blocks) for g in set(self.layer_group)} | {num_blocks})
        segments, offset = [], 0
        for start, stop in zip(starts, starts[1:]):
            layers = tuple(l for l, g in enumerate(self.layer_group) if firsts[g] <= start)
            seg = Segment(start, stop, layers, offset)
            segments.append(seg)
            offset += seg.cells
        return GroupRows(num_blocks, tuple(segments))

    def describe(self) -> str:
        """The groups for the compatibility fields: P and D must agree on them."""
        return ";".join(f"{w}:{','.join(str(l) for l, g in enumerate(self.layer_group) if g == gi)}"
                        for gi, w in enumerate(self.windows))


def _seg_view(staging: torch.Tensor, seg: Segment, block_nbytes: int) -> torch.Tensor:
    flat = staging.reshape(-1).view(torch.uint8)
    rows = seg.stop - seg.start
    return flat[seg.offset * block_nbytes : (seg.offset + seg.cells) * block_nbytes].view(rows, len(seg.layers), block_nbytes)


def gather_layer_rows(staging: torch.Tensor, rows: GroupRows, layer: int, cache: torch.Tensor,
                      layout: LayerLayout, block_ids: Sequence[int]) -> None:
    """Copy layer `layer` of its group's blocks `block_ids` (the whole request's) into the
    rows that hold it.

    Raises:
        GroupError: a row that holds this layer has the null block in `block_ids`.
        LayoutError: as `workers.layout.gather_layer_into_staging`.
    """
    for seg, col in rows.live(layer):
        ids = list(block_ids[seg.start : seg.stop])
        if len(ids) != seg.stop - seg.start or NULL_BLOCK in ids:
            raise GroupError(f"layer {layer} has no KV in blocks {seg.start}..{seg.stop - 1} (block ids {ids}), "
                             "inside its sliding window.")
        gather_layer_into_staging(_seg_view(staging, seg, layout.block_nbytes), col, cache, layout, ids)


def scatter_rows(staging: torch.Tensor, rows: GroupRows, layers: Sequence[tuple[torch.Tensor, LayerLayout]],
                 group_ids: Sequence[Sequence[int]], layer_group: Sequence[int]) -> None:
    """Write received rows (`rows`, from `GroupRows.tail`) into each layer's group's blocks.

    `group_ids[g]` are group ``g``'s block ids for the whole request. A row a layer's group
    holds as the null block is not staged for it, and never written.

    Raises:
        GroupError: a group holds a real block in a row with no staged KV for it (its
            window and the producer's disagree), or the null block where KV came.
    """
    first_row = rows.segments[0].start if rows.segments else rows.num_blocks
    for layer, (cache, layout) in enumerate(layers):
        ids = group_ids[layer_group[layer]]
        live = rows.live(layer)
        staged_from = live[0][0].start if live else rows.num_blocks
        unfilled = [b for b in ids[first_row:staged_from] if b != NULL_BLOCK]
        if unfilled:
            raise GroupError(f"layer {layer} holds blocks {unfilled} outside the KV the producer staged for it "
                             "(the sliding windows of P and D disagree).")
        for seg, col in live:
            targets = list(ids[seg.start : seg.stop])
            if len(targets) != seg.stop - seg.start or NULL_BLOCK in targets:
                raise GroupError(f"layer {layer} has the null block among blocks {targets} where KV arrived.")
            scatter_layer_from_staging(_seg_view(staging, seg, layout.block_nbytes), col, cache, layout, targets)
