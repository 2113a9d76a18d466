"""Heterogeneous TP at the layout level: lanes between ranks, and heads cut out of one
rank's staging and joined into another's, for every layout the connector moves."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from protocols.heads import Lane, lane_refusal, lanes, rank_heads, split_refusal
from workers.heads import head_count, merge_heads, part_nbytes, split_heads
from workers.layout import (
    CacheSpec,
    LayoutError,
    detect_layout,
    gather_layer_into_staging,
    scatter_layers_from_staging,
    staging_view,
)

TPS = [1, 2, 4, 8]
KINDS = ["kv_first", "kv_first_hnd", "blocks_first", "cpu", "mla"]


# -- lanes ---------------------------------------------------------------------------------


def test_hetero_rank_heads_follow_vllm_split_and_replication() -> None:
    assert [rank_heads(8, 2, r) for r in range(2)] == [(0, 4), (4, 8)]
    # 2 heads on 4 ranks: each head on two ranks, in rank order
    assert [rank_heads(2, 4, r) for r in range(4)] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert rank_heads(1, 8, 5, replicated=True) == (0, 1)


def test_hetero_equal_tp_is_rank_to_rank() -> None:
    assert lanes(8, 4, 4) == [Lane(r, r, 2 * r, 2 * r + 2) for r in range(4)]
    assert lanes(0, 2, 2) == [Lane(0, 0, 0, 0), Lane(1, 1, 0, 0)]
    assert lanes(2, 4, 4) == [Lane(r, r, r // 2, r // 2 + 1) for r in range(4)]


def test_hetero_lanes_for_split_and_merge() -> None:
    assert lanes(4, 1, 2) == [Lane(0, 0, 0, 2), Lane(0, 1, 2, 4)]
    assert lanes(4, 2, 1) == [Lane(0, 0, 0, 2), Lane(1, 0, 2, 4)]
    assert lanes(8, 2, 4) == [Lane(0, 0, 0, 2), Lane(0, 1, 2, 4), Lane(1, 2, 4, 6), Lane(1, 3, 6, 8)]
    # MLA: every decode rank takes one prefill rank's copy, spread over them
    assert lanes(1, 2, 4, replicated=True) == [Lane(0, 0, 0, 1), Lane(1, 1, 0, 1), Lane(0, 2, 0, 1), Lane(1, 3, 0, 1)]


def test_hetero_refusals_name_the_heads_and_the_side() -> None:
    assert split_refusal(8, 4) is None and split_refusal(2, 8) is None
    assert lane_refusal(6, 2, 4) == "6 KV heads do not split over 4 ranks (neither count divides the other) on the decode side"
    assert "prefill TP 1 and decode TP 2 must be equal" in (lane_refusal(0, 1, 2) or "")
    with pytest.raises(ValueError, match="6 KV heads do not split over 4 ranks"):
        lanes(6, 4, 2)


@settings(max_examples=200, deadline=None)
@given(total=st.sampled_from([1, 2, 4, 8, 16, 32]), p_tp=st.sampled_from(TPS), d_tp=st.sampled_from(TPS))
def test_hetero_lanes_cover_each_decode_rank_once_from_holders(total: int, p_tp: int, d_tp: int) -> None:
    got = lanes(total, p_tp, d_tp)
    for r in range(d_tp):
        start, stop = rank_heads(total, d_tp, r)
        mine = [lane for lane in got if lane.rank == r]
        assert [h for lane in mine for h in range(lane.start, lane.stop)] == list(range(start, stop))
        for lane in mine:
            p_start, p_stop = rank_heads(total, p_tp, lane.source)
            assert p_start <= lane.start < lane.stop <= p_stop
    # every prefill rank that holds a head someone needs is used when nothing is replicated
    if total >= p_tp:
        assert {lane.source for lane in got} == set(range(p_tp))


# -- split and merge -------------------------------------------------------------------------


def make_cache(kind: str, num_blocks: int, heads: int, bs: int, d: int, dtype: torch.dtype) -> torch.Tensor:
    shape = {
        "kv_first": (2, num_blocks, bs, heads, d),
        "kv_first_hnd": (2, num_blocks, heads, bs, d),  # physical HND, seen through the logical NHD view
        "blocks_first": (num_blocks, 2, bs, heads, d),
        "cpu": (num_blocks, heads, bs, 2 * d),
        "mla": (num_blocks, bs, d),
    }[kind]
    cache = torch.zeros(shape, dtype=dtype)
    return cache.transpose(2, 3) if kind == "kv_first_hnd" else cache


def fill_random(cache: torch.Tensor, gen: torch.Generator) -> None:
    flat = cache.view(torch.uint8)
    flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=gen))


def heads_of(cache: torch.Tensor, kind: str, block: int, start: int, stop: int) -> torch.Tensor:
    """One block's heads [start, stop), read with plain indexing (not the module under test)."""
    if kind.startswith("kv_first"):
        return cache[:, block, :, start:stop]
    if kind == "blocks_first":
        return cache[block, :, :, start:stop]
    if kind == "cpu":
        return cache[block, start:stop]
    return cache[block]


def spec_of(kind: str, heads: int, bs: int, d: int) -> CacheSpec:
    if kind == "mla":
        return CacheSpec(block_size=bs, num_kv_heads=1, head_size=d, use_mla=True)
    return CacheSpec(block_size=bs, num_kv_heads=heads, head_size=d)


@settings(max_examples=80, deadline=None)
@given(
    kind=st.sampled_from(KINDS),
    total=st.sampled_from([1, 2, 4, 8, 16]),
    p_tp=st.sampled_from(TPS),
    d_tp=st.sampled_from(TPS),
    layers=st.integers(1, 3),
    blocks=st.integers(1, 5),
    bs=st.sampled_from([1, 2, 4]),
    d=st.sampled_from([2, 4, 8]),
    dtype=st.sampled_from([torch.bfloat16, torch.float32, torch.uint8]),
    seed=st.integers(0, 2**31 - 1),
)
def test_hetero_split_then_merge_returns_every_head_of_every_block(
    kind: str, total: int, p_tp: int, d_tp: int, layers: int, blocks: int, bs: int, d: int,
    dtype: torch.dtype, seed: int,
) -> None:
    """Each P rank gathers its heads of a request's blocks into staging; each lane cuts its
    heads out and the D rank joins them into its own staging and scatters it: every D
    rank's cache then holds exactly its heads of every block, bit for bit."""
    gen = torch.Generator().manual_seed(seed)
    mla = kind == "mla"
    if mla:
        total = 1
    num_blocks = blocks + 3
    p_ids = torch.randperm(num_blocks, generator=gen)[:blocks].tolist()
    d_ids = torch.randperm(num_blocks, generator=gen)[:blocks].tolist()

    def rank_caches(tp: int, fill: bool) -> list[list[torch.Tensor]]:
        out = []
        for r in range(tp):
            start, stop = rank_heads(total, tp, r, replicated=mla)
            per_layer = []
            for _ in range(layers):
                cache = make_cache(kind, num_blocks, stop - start, bs, d, dtype)
                if fill:
                    fill_random(cache, gen)
                per_layer.append(cache)
            out.append(per_layer)
        return out

    # The model's heads, as P's ranks hold them: a replicated head is the same on each rank.
    p_caches = rank_caches(p_tp, fill=True)
    if not mla:
        for r in range(p_tp):
            start, _ = rank_heads(total, p_tp, r)
            first = next(q for q in range(p_tp) if rank_heads(total, p_tp, q)[0] == start)
            for layer in range(layers):
                p_caches[r][layer].copy_(p_caches[first][layer])
    else:
        for r in range(1, p_tp):
            for layer in range(layers):
                p_caches[r][layer].copy_(p_caches[0][layer])
    d_caches = rank_caches(d_tp, fill=True)  # garbage before, so every written byte counts

    def layout_of(cache: torch.Tensor, heads: int):
        return detect_layout(cache, spec_of(kind, heads, bs, d), hint="kv_first" if kind.startswith("kv_first") else None)

    p_staging = []
    for r in range(p_tp):
        start, stop = rank_heads(total, p_tp, r, replicated=mla)
        lay = layout_of(p_caches[r][0], stop - start)
        staging = staging_view(torch.empty(blocks * layers * lay.block_nbytes, dtype=torch.uint8), blocks, layers,
                               lay.block_nbytes)
        for layer in range(layers):
            gather_layer_into_staging(staging, layer, p_caches[r][layer], lay, p_ids)
        p_staging.append((staging, lay, start))

    d_staging: dict[int, torch.Tensor] = {}
    for lane in lanes(total, p_tp, d_tp, replicated=mla):
        staging, p_lay, p_start = p_staging[lane.source]
        part = torch.empty(blocks * layers * part_nbytes(p_lay, lane.start - p_start, lane.stop - p_start),
                           dtype=torch.uint8)
        split_heads(staging, p_lay, lane.start - p_start, lane.stop - p_start, part)
        d_start, d_stop = rank_heads(total, d_tp, lane.rank, replicated=mla)
        d_lay = layout_of(d_caches[lane.rank][0], d_stop - d_start)
        if lane.rank not in d_staging:
            d_staging[lane.rank] = staging_view(torch.zeros(blocks * layers * d_lay.block_nbytes, dtype=torch.uint8),
                                                blocks, layers, d_lay.block_nbytes)
        merge_heads(part, d_lay, lane.start - d_start, lane.stop - d_start, d_staging[lane.rank])
    assert sorted(d_staging) == list(range(d_tp))
    for r, staged in d_staging.items():
        d_start, d_stop = rank_heads(total, d_tp, r, replicated=mla)
        d_lay = layout_of(d_caches[r][0], d_stop - d_start)
        scatter_layers_from_staging(staged, [(c, d_lay) for c in d_caches[r]], d_ids)

    def holder(h: int) -> tuple[int, int]:
        """A P rank holding global head h, and h's place in it (replicas are equal)."""
        for q in range(p_tp):
            q_start, q_stop = rank_heads(total, p_tp, q, replicated=mla)
            if q_start <= h < q_stop:
                return q, h - q_start
        raise AssertionError(h)

    for r in range(d_tp):
        d_start, d_stop = rank_heads(total, d_tp, r, replicated=mla)
        for layer in range(layers):
            for p_blk, d_blk in zip(p_ids, d_ids):
                got = heads_of(d_caches[r][layer], kind, d_blk, 0, d_stop - d_start)
                pieces = [heads_of(p_caches[q][layer], kind, p_blk, i, i + 1)
                          for q, i in map(holder, range(d_start, d_stop))]
                want = pieces[0] if mla else torch.cat(pieces, dim=0 if kind == "cpu" else 2)
                assert torch.equal(got.contiguous().view(torch.uint8), want.contiguous().view(torch.uint8)), (
                    f"D rank {r} layer {layer} block {d_blk}")


@pytest.mark.parametrize("kind", KINDS)
def test_hetero_split_leaves_other_heads_and_checks_sizes(kind: str) -> None:
    heads = 1 if kind == "mla" else 4
    cache = make_cache(kind, 3, heads, 2, 4, torch.bfloat16)
    lay = detect_layout(cache, spec_of(kind, heads, 2, 4), hint="kv_first" if kind.startswith("kv_first") else None)
    assert head_count(lay) == heads
    staging = staging_view(torch.zeros(2 * lay.block_nbytes, dtype=torch.uint8), 2, 1, lay.block_nbytes)
    part = torch.full((2 * part_nbytes(lay, 0, 1),), 7, dtype=torch.uint8)
    merge_heads(part, lay, 0, 1, staging)
    view = staging.view(2, 1, -1, heads, lay.block_nbytes // heads // (4 if kind.startswith(("kv", "blocks")) else 1))
    assert bool((view[:, :, :, 0] == 7).all())
    if heads > 1:
        assert int(view[:, :, :, 1:].count_nonzero()) == 0
    with pytest.raises(LayoutError, match="need a"):
        split_heads(staging, lay, 0, 1, torch.empty(3, dtype=torch.uint8))
    with pytest.raises(LayoutError, match="are not a run"):
        part_nbytes(lay, 0, heads + 1)
