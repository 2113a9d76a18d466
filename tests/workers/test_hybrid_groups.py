"""Staging of a hybrid model's KV cache groups (`workers.groups`): which rows hold which
layers, D's one byte range after its prefix hit, and copies that use each layer's own
group's blocks and never the null block."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.groups import NULL_BLOCK, GroupError, KvGroups, gather_layer_rows, scatter_rows
from workers.layout import CacheSpec, detect_layout

BLOCK = 4


@st.composite
def hybrids(draw: st.DrawFn) -> tuple[KvGroups, int, int]:
    windows = tuple(draw(st.lists(st.sampled_from([0, 1, 3, 4, 5, 9, 16]), min_size=1, max_size=3)))
    layer_group = tuple(draw(st.lists(st.integers(0, len(windows) - 1), min_size=1, max_size=6)))
    num_tokens = draw(st.integers(1, 40))
    return KvGroups(layer_group=layer_group, windows=windows, block_size=BLOCK), num_tokens, -(-num_tokens // BLOCK)


def live_cells(groups: KvGroups, num_tokens: int, num_blocks: int) -> list[tuple[int, int]]:
    """(row, layer) of every cell P must send, computed cell by cell from vLLM's rule."""
    out = []
    for row in range(num_blocks):
        for layer, g in enumerate(groups.layer_group):
            w = groups.windows[g]
            retired = 0 if w == 0 else max(0, num_tokens - w + 1) // BLOCK
            if row >= retired:
                out.append((row, layer))
    return out


@settings(max_examples=300, deadline=None)
@given(hybrids())
def test_hybrid_rows_hold_exactly_the_cells_inside_each_window_in_block_major_order(case) -> None:
    groups, num_tokens, num_blocks = case
    rows = groups.rows(num_blocks, num_tokens)
    cells = [(row, layer) for seg in rows.segments for row in range(seg.start, seg.stop) for layer in seg.layers]
    assert cells == live_cells(groups, num_tokens, num_blocks)  # each once, row by row, layers ascending
    assert rows.cells == len(cells)
    for seg in rows.segments:  # the offsets number the cells in that order
        assert cells[seg.offset] == (seg.start, seg.layers[0])


@settings(max_examples=300, deadline=None)
@given(hybrids(), st.data())
def test_hybrid_tail_after_a_prefix_hit_is_one_range_of_the_rows_past_it(case, data) -> None:
    groups, num_tokens, num_blocks = case
    skip = data.draw(st.integers(0, num_blocks))
    rows = groups.rows(num_blocks, num_tokens)
    first, count = rows.tail_cells(skip)
    cells = live_cells(groups, num_tokens, num_blocks)
    assert cells[first : first + count] == [c for c in cells if c[0] >= skip]
    tail = rows.tail(skip)
    assert tail.cells == count
    tail_cells = [(row, layer) for seg in tail.segments for row in range(seg.start, seg.stop) for layer in seg.layers]
    assert tail_cells == cells[first:]
    assert all(cells[first + seg.offset] == (seg.start, seg.layers[0]) for seg in tail.segments)


def test_hybrid_one_full_attention_group_is_the_plain_block_major_staging() -> None:
    rows = KvGroups(layer_group=(0, 0, 0), windows=(0,), block_size=BLOCK).rows(5, 19)
    assert [(s.start, s.stop, s.layers, s.offset) for s in rows.segments] == [(0, 5, (0, 1, 2), 0)]
    assert rows.tail_cells(2) == (6, 9)


def _caches(seed: int, layers: int, blocks: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(blocks, 2, BLOCK, 2 * 8, generator=g).to(torch.bfloat16) for _ in range(layers)]


def test_hybrid_copies_move_each_layer_between_its_own_groups_blocks_and_skip_null_blocks() -> None:
    # Layers 0 and 2 slide over 6 tokens, 1 and 3 attend to all: 19 tokens in 5 blocks, so
    # the window group retires max(0, 19 - 6 + 1) // 4 = 3 blocks.
    groups = KvGroups(layer_group=(0, 1, 0, 1), windows=(6, 0), block_size=BLOCK)
    spec = CacheSpec(block_size=BLOCK, num_kv_heads=2, head_size=8)
    p = _caches(1, 4, 24)
    d = _caches(2, 4, 24)
    d_before = [c.clone() for c in d]
    layouts = [detect_layout(c, spec) for c in p]
    p_ids = [[NULL_BLOCK, 7, 3, 9, 11], [2, 5, 8, 13, 17]]  # P already retired one window block
    d_ids = [[NULL_BLOCK, NULL_BLOCK, NULL_BLOCK, 4, 6], [10, 12, 14, 16, 18]]
    rows = groups.rows(5, 19)
    assert [(s.start, s.stop, s.layers) for s in rows.segments] == [(0, 3, (1, 3)), (3, 5, (0, 1, 2, 3))]
    staging = torch.empty(rows.cells * layouts[0].block_nbytes, dtype=torch.uint8)
    for layer in range(4):
        gather_layer_rows(staging, rows, layer, p[layer], layouts[layer], p_ids[groups.layer_group[layer]])
    skip = 1  # D's prefix-cache hit: its first block of each group is its own
    first, cells = rows.tail_cells(skip)
    nbytes = layouts[0].block_nbytes
    scatter_rows(staging[first * nbytes : (first + cells) * nbytes], rows.tail(skip), list(zip(d, layouts)),
                 d_ids, groups.layer_group)
    written: set[tuple[int, int]] = set()
    for layer in range(4):
        g = groups.layer_group[layer]
        for row in range(skip, 5):
            if d_ids[g][row] == NULL_BLOCK:
                continue
            assert torch.equal(d[layer][d_ids[g][row]], p[layer][p_ids[g][row]]), (layer, row)
            written.add((layer, d_ids[g][row]))
    assert written  # and nothing else changed, the null block included
    for layer in range(4):
        for block in range(24):
            if (layer, block) not in written:
                assert torch.equal(d[layer][block], d_before[layer][block]), (layer, block)


def test_hybrid_copies_refuse_the_null_block_inside_a_window_and_real_blocks_outside_it() -> None:
    groups = KvGroups(layer_group=(0, 1), windows=(6, 0), block_size=BLOCK)
    spec = CacheSpec(block_size=BLOCK, num_kv_heads=2, head_size=8)
    cache = _caches(3, 1, 8)[0]
    layout = detect_layout(cache, spec)
    rows = groups.rows(5, 19)
    staging = torch.zeros(rows.cells * layout.block_nbytes, dtype=torch.uint8)
    with pytest.raises(GroupError, match="inside its sliding window"):
        gather_layer_rows(staging, rows, 0, cache, layout, [0, 0, 0, NULL_BLOCK, 6])
    layers = [(cache, layout), (cache.clone(), layout)]
    with pytest.raises(GroupError, match="the sliding windows of P and D disagree"):
        scatter_rows(staging, rows, layers, [[0, 0, 1, 2, 3], [4, 5, 6, 7, 1]], groups.layer_group)
    with pytest.raises(GroupError, match="null block"):
        scatter_rows(staging, rows, layers, [[0, 0, 0, 2, 3], [4, 5, NULL_BLOCK, 7, 1]], groups.layer_group)
