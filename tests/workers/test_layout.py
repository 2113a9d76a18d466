"""KV layout: detection from shape + spec, exact gather/scatter, block-major staging, prefix tail."""

from __future__ import annotations

import random
import zlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.layout import (
    CachePlaces,
    CacheRows,
    CacheSpec,
    LayerLayout,
    LayoutError,
    detect_layout,
    gather,
    gather_layer_into_staging,
    layer_major_view,
    scatter,
    scatter_layer_from_staging,
    scatter_layers_from_staging,
    staging_view,
    tail,
    tail_range,
    wire_layout,
)

KINDS = ["kv_first", "blocks_first", "cpu", "mla", "mla3d"]
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.uint8]


def spec_for(kind: str, *, block_size: int = 4, heads: int = 2, head_size: int = 8) -> CacheSpec:
    if kind.startswith("mla"):
        return CacheSpec(block_size=block_size, num_kv_heads=1, head_size=head_size, use_mla=True)
    return CacheSpec(block_size=block_size, num_kv_heads=heads, head_size=head_size)


def shape_for(kind: str, num_blocks: int, spec: CacheSpec) -> tuple[int, ...]:
    bs, h, d = spec.block_size, spec.num_kv_heads, spec.head_size
    return {
        "kv_first": (2, num_blocks, bs, h, d),
        "blocks_first": (num_blocks, 2, bs, h, d),
        "cpu": (num_blocks, h, bs, 2 * d),
        "mla": (num_blocks, 1, bs, d),
        "mla3d": (num_blocks, bs, d),
    }[kind]


def random_cache(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Arbitrary bit patterns, NaN payloads and all, so only a bit copy round-trips."""
    cache = torch.empty(shape, dtype=dtype)
    flat = cache.view(torch.uint8).view(-1)
    flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=gen))
    return cache


# What the tests of a transfer's layers at once draw: `layer_caches`' arguments, and block ids.
LAYER_CASES = {
    "kind": st.sampled_from(KINDS),
    "dtype": st.sampled_from(DTYPES),
    "num_layers": st.integers(1, 4),
    "ids": st.lists(st.integers(0, 11), min_size=1, max_size=6, unique=True),
    "views": st.booleans(),
    "seed": st.integers(0, 2**16),
}


def layer_caches(kind: str, dtype: torch.dtype, num_layers: int, views: bool,
                 gen: torch.Generator) -> tuple[list[torch.Tensor], LayerLayout]:
    """`num_layers` caches of 12 blocks of `kind`, random bytes: tensors of their own, or
    (`views`) views of one allocation, as vLLM's CPU backend makes them; their layout."""
    spec = spec_for(kind)
    shape = shape_for(kind, 12, spec)
    if views:
        whole = random_cache((num_layers, *shape), dtype, gen)
        caches = [whole[i] for i in range(num_layers)]
    else:
        caches = [random_cache(shape, dtype, gen) for _ in range(num_layers)]
    return caches, detect_layout(caches[0], spec, hint=None if kind != "mla3d" else "mla")


def block_bytes(cache: torch.Tensor, layout: LayerLayout, block: int) -> bytes:
    """One block's bytes, read independently of the module under test."""
    t = cache[:, block] if layout.kind == "kv_first" else cache[block]
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def snapshot(cache: torch.Tensor, layout: LayerLayout) -> list[bytes]:
    return [block_bytes(cache, layout, b) for b in range(layout.num_blocks)]


# -- detection -------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_detect_each_kind(kind: str) -> None:
    spec = spec_for(kind)
    cache = torch.zeros(shape_for(kind, 7, spec), dtype=torch.bfloat16)
    layout = detect_layout(cache, spec)
    assert layout.kind == ("mla" if kind == "mla3d" else kind)
    assert layout.num_blocks == 7
    per_block = spec.block_size * spec.head_size * 2 * (1 if kind.startswith("mla") else 2 * spec.num_kv_heads)
    assert layout.block_nbytes == per_block
    assert layout.block_nbytes * 7 == cache.numel() * cache.element_size()


def test_detect_rejects_a_bad_shape_naming_shape_and_spec() -> None:
    spec = spec_for("cpu")
    with pytest.raises(LayoutError, match=r"\[7, 3, 4, 16\].*block_size=4.*fits no known layout"):
        detect_layout(torch.zeros(7, 3, 4, 16), spec)
    with pytest.raises(LayoutError, match="fits no known layout"):
        detect_layout(torch.zeros(7, 4, 8), spec)  # 3-D but not an MLA spec


def test_two_blocks_are_ambiguous_without_a_hint() -> None:
    spec = spec_for("kv_first")
    cache = torch.zeros(2, 2, 4, 2, 8)
    with pytest.raises(LayoutError, match="kv_first and blocks_first.*hint"):
        detect_layout(cache, spec)
    assert detect_layout(cache, spec, hint="kv_first").kind == "kv_first"
    assert detect_layout(cache, spec, hint="blocks_first").kind == "blocks_first"
    with pytest.raises(LayoutError, match="not a 'cpu' layout"):
        detect_layout(cache, spec, hint="cpu")
    with pytest.raises(LayoutError, match="unknown layout hint"):
        detect_layout(cache, spec, hint="nhd")  # type: ignore[arg-type]


def test_hint_must_agree_with_the_shape() -> None:
    spec = spec_for("blocks_first")
    cache = torch.zeros(5, 2, 4, 2, 8)
    with pytest.raises(LayoutError, match="not a 'kv_first' layout; it fits blocks_first"):
        detect_layout(cache, spec, hint="kv_first")


def test_head_size_v_in_the_cpu_layout() -> None:
    spec = CacheSpec(block_size=4, num_kv_heads=2, head_size=8, head_size_v=4)
    layout = detect_layout(torch.zeros(3, 2, 4, 12, dtype=torch.float16), spec)
    assert (layout.kind, layout.block_nbytes) == ("cpu", 2 * 4 * 12 * 2)


# -- gather / scatter round trips ------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_gather_scatter_round_trip_is_bit_exact(kind: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(zlib.crc32(f"{kind}{dtype}".encode()))
    rng = random.Random(str((kind, dtype)))
    spec = spec_for(kind)
    src = random_cache(shape_for(kind, 11, spec), dtype, gen)
    dst = random_cache(shape_for(kind, 13, spec), dtype, gen)
    src_layout, dst_layout = detect_layout(src, spec), detect_layout(dst, spec)
    src_ids = rng.sample(range(11), 6)  # unordered, non-contiguous
    dst_ids = rng.sample(range(13), 6)
    before = snapshot(dst, dst_layout)

    buf = torch.empty(6 * src_layout.block_nbytes, dtype=torch.uint8)
    staged = gather(src, src_layout, src_ids, buf)
    assert staged.shape == (6, src_layout.block_nbytes)
    for i, b in enumerate(src_ids):
        assert staged[i].numpy().tobytes() == block_bytes(src, src_layout, b)
    scatter(dst, dst_layout, dst_ids, buf)

    after = snapshot(dst, dst_layout)
    for b in range(13):
        if b in dst_ids:
            assert after[b] == block_bytes(src, src_layout, src_ids[dst_ids.index(b)])
        else:
            assert after[b] == before[b], f"block {b} was not in the scatter list but changed"


def test_bf16_nan_payloads_survive() -> None:
    spec = spec_for("blocks_first")
    src = torch.zeros(shape_for("blocks_first", 3, spec), dtype=torch.bfloat16)
    patterns = torch.tensor([0x7FC1, 0xFFFF, 0x7F81, 0x0001, 0x8000], dtype=torch.int32).to(torch.int16)
    src.view(torch.int16)[1].view(-1)[: len(patterns)] = patterns
    layout = detect_layout(src, spec)
    buf = torch.empty(layout.block_nbytes, dtype=torch.uint8)
    gather(src, layout, [1], buf)
    dst = torch.zeros_like(src)
    scatter(dst, layout, [2], buf)
    assert torch.equal(dst.view(torch.int16)[2], src.view(torch.int16)[1])


def test_typed_out_buffer_and_tensor_ids() -> None:
    spec = spec_for("cpu")
    gen = torch.Generator().manual_seed(3)
    src = random_cache(shape_for("cpu", 9, spec), torch.float16, gen)
    layout = detect_layout(src, spec)
    out = torch.empty(3, layout.block_nbytes // 2, dtype=torch.float16)  # a typed view works too
    gather(src, layout, torch.tensor([8, 0, 4], dtype=torch.int32), out)
    assert out.view(torch.uint8).numpy().tobytes() == b"".join(block_bytes(src, layout, b) for b in (8, 0, 4))


def test_bad_arguments_are_clear_errors() -> None:
    spec = spec_for("cpu")
    cache = torch.zeros(shape_for("cpu", 5, spec), dtype=torch.float16)
    layout = detect_layout(cache, spec)
    with pytest.raises(LayoutError, match="outside the cache's 5 blocks"):
        gather(cache, layout, [0, 5], torch.empty(2 * layout.block_nbytes, dtype=torch.uint8))
    with pytest.raises(LayoutError, match=r"1 block\(s\) of 256 B .* need a 256 B buffer, not 100 B"):
        gather(cache, layout, [0], torch.empty(100, dtype=torch.uint8))
    with pytest.raises(LayoutError, match="distinct"):
        scatter(cache, layout, [1, 1], torch.empty(2 * layout.block_nbytes, dtype=torch.uint8))
    with pytest.raises(LayoutError, match="detect the layout of this very tensor"):
        gather(cache.float(), layout, [0], torch.empty(layout.block_nbytes, dtype=torch.uint8))


@settings(max_examples=60, deadline=None)
@given(
    kind=st.sampled_from(KINDS),
    dtype=st.sampled_from(DTYPES),
    num_blocks=st.integers(1, 12),
    block_size=st.sampled_from([1, 2, 16]),
    heads=st.integers(1, 3),
    head_size=st.sampled_from([1, 4, 8]),
    data=st.data(),
)
def test_round_trip_any_geometry(
    kind: str, dtype: torch.dtype, num_blocks: int, block_size: int, heads: int, head_size: int, data: st.DataObject
) -> None:
    spec = spec_for(kind, block_size=block_size, heads=heads, head_size=head_size)
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    src = random_cache(shape_for(kind, num_blocks, spec), dtype, gen)
    dst = random_cache(shape_for(kind, num_blocks, spec), dtype, gen)
    hint = None if num_blocks != 2 or kind not in ("kv_first", "blocks_first") else kind
    layout = detect_layout(src, spec, hint=hint)  # type: ignore[arg-type]
    src_ids = data.draw(st.lists(st.integers(0, num_blocks - 1), max_size=num_blocks))  # repeats allowed
    dst_ids = data.draw(st.permutations(range(num_blocks)))[: len(src_ids)]
    before = snapshot(dst, layout)
    buf = torch.empty(len(src_ids) * layout.block_nbytes, dtype=torch.uint8)
    gather(src, layout, src_ids, buf)
    scatter(dst, layout, dst_ids, buf)
    after = snapshot(dst, layout)
    for b in range(num_blocks):
        want = block_bytes(src, layout, src_ids[dst_ids.index(b)]) if b in dst_ids else before[b]
        assert after[b] == want


# -- block-major staging and the prefix-cache tail -------------------------------------


@pytest.mark.parametrize("kind", ["kv_first", "blocks_first", "cpu", "mla"])
@pytest.mark.parametrize("num_cached", [0, 2, 5])
def test_staging_round_trip_skips_prefix_cached_blocks(kind: str, num_cached: int) -> None:
    num_layers, n = 3, 5
    gen = torch.Generator().manual_seed(num_cached)
    rng = random.Random(f"{kind}{num_cached}")
    spec = spec_for(kind)
    p_caches = [random_cache(shape_for(kind, 16, spec), torch.bfloat16, gen) for _ in range(num_layers)]
    d_caches = [random_cache(shape_for(kind, 20, spec), torch.bfloat16, gen) for _ in range(num_layers)]
    layout_p, layout_d = detect_layout(p_caches[0], spec), detect_layout(d_caches[0], spec)
    p_ids, d_ids = rng.sample(range(16), n), rng.sample(range(20), n)

    # P stages every block of the request, layer by layer.
    buf = torch.empty(n * num_layers * layout_p.block_nbytes, dtype=torch.uint8)
    staging = staging_view(buf, n, num_layers, layout_p.block_nbytes)
    for layer, cache in enumerate(p_caches):
        gather_layer_into_staging(staging, layer, cache, layout_p, p_ids)
    for i, b in enumerate(p_ids):
        for layer in range(num_layers):
            assert staging[i, layer].numpy().tobytes() == block_bytes(p_caches[layer], layout_p, b)

    # D holds the first num_cached blocks: it asks for the tail range only...
    offset, nbytes = tail_range(n, num_cached, num_layers, layout_p.block_nbytes)
    assert offset == num_cached * num_layers * layout_p.block_nbytes
    assert offset + nbytes == buf.numel()
    received = buf[offset : offset + nbytes].clone()  # what the transport delivers
    before = [snapshot(c, layout_d) for c in d_caches]

    # ...and writes only its blocks after the cached ones.
    d_tail = tail(d_ids, num_cached)
    recv_staging = staging_view(received, n - num_cached, num_layers, layout_d.block_nbytes)
    for layer, cache in enumerate(d_caches):
        scatter_layer_from_staging(recv_staging, layer, cache, layout_d, d_tail)

    for layer in range(num_layers):
        after = snapshot(d_caches[layer], layout_d)
        for b in range(20):
            if b in d_tail:
                src_block = p_ids[d_ids.index(b)]
                assert after[b] == block_bytes(p_caches[layer], layout_p, src_block)
            else:  # prefix-cached and unrelated blocks are byte-identical to before
                assert after[b] == before[layer][b]


@settings(max_examples=60, deadline=None)
@given(**LAYER_CASES)
def test_every_layer_at_once_writes_what_one_layer_at_a_time_does(
    kind: str, dtype: torch.dtype, num_layers: int, ids: list[int], views: bool, seed: int
) -> None:
    """`scatter_layers_from_staging` is the per-layer scatter, run for every layer: the same
    bytes land, whether the layers are tensors of their own or views of one allocation."""
    gen = torch.Generator().manual_seed(seed)
    caches, layout = layer_caches(kind, dtype, num_layers, views, gen)
    want = [c.clone() for c in caches]
    buf = torch.randint(0, 256, (len(ids) * num_layers * layout.block_nbytes,), dtype=torch.uint8, generator=gen)
    staging = staging_view(buf, len(ids), num_layers, layout.block_nbytes)
    for layer, cache in enumerate(want):
        scatter_layer_from_staging(staging, layer, cache, layout, ids)
    scatter_layers_from_staging(staging, [(c, layout) for c in caches], ids)
    for got, expected in zip(caches, want, strict=True):
        assert got.view(torch.uint8).numpy().tobytes() == expected.view(torch.uint8).numpy().tobytes()


@settings(max_examples=80, deadline=None)
@given(**LAYER_CASES, repeat=st.booleans(), at=st.integers(0, 3))
def test_a_steps_gathers_worked_out_once_copy_what_one_call_a_layer_does(
    kind: str, dtype: torch.dtype, num_layers: int, ids: list[int], views: bool, seed: int, repeat: bool, at: int
) -> None:
    """`CacheRows.step` (P's copies of a step on a CPU) writes into staging the bytes that
    `gather_layer_into_staging` writes, layer by layer, whatever the layout, word, block
    ids (a repeated id too) and where in its buffer the staging starts, and nothing else
    of the buffer; where the staging's bytes do not take the caches' word, it declines."""
    gen = torch.Generator().manual_seed(seed)
    caches, layout = layer_caches(kind, dtype, num_layers, views, gen)
    if repeat:
        ids = [*ids, ids[0]]
    rows = CacheRows([(c, layout) for c in caches])
    assert rows.rows is not None
    nbytes = len(ids) * num_layers * layout.block_nbytes
    want_buf = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    want = staging_view(want_buf, len(ids), num_layers, layout.block_nbytes)
    for layer, cache in enumerate(caches):
        gather_layer_into_staging(want, layer, cache, layout, ids)
    # the staging `at` bytes into a larger buffer, as a lease is into the pool
    buf = torch.randint(0, 256, (nbytes + 16,), dtype=torch.uint8, generator=gen)
    before = buf.clone()
    staging = staging_view(buf[at : at + nbytes], len(ids), num_layers, layout.block_nbytes)
    step = rows.step(staging, ids)
    word = rows.rows[0].element_size()
    if at % word:
        assert step is None
        return
    assert step is not None
    for layer in range(num_layers):
        step.layer(layer)
    assert buf[at : at + nbytes].numpy().tobytes() == want_buf.numpy().tobytes()
    assert torch.equal(buf[:at], before[:at]) and torch.equal(buf[at + nbytes :], before[at + nbytes :])


def test_a_steps_gathers_decline_what_one_call_a_layer_must_name() -> None:
    """Ids outside the cache, staging of another shape or dtype, layers of other rows:
    no plan, so the per-layer copy raises its own clear error."""
    gen = torch.Generator().manual_seed(0)
    caches, layout = layer_caches("cpu", torch.bfloat16, 2, False, gen)
    rows = CacheRows([(c, layout) for c in caches])
    staging = staging_view(torch.zeros(2 * 2 * layout.block_nbytes, dtype=torch.uint8), 2, 2, layout.block_nbytes)
    assert rows.step(staging, [0, 1]) is not None
    assert rows.step(staging, [0, 12]) is None  # 12 blocks: id 12 is outside
    assert rows.step(staging, [0]) is None  # two staged blocks, one id
    assert rows.step(staging.view(torch.int16), [0, 1]) is None
    assert rows.step(staging_view(torch.zeros(2 * 3 * layout.block_nbytes, dtype=torch.uint8), 2, 3,
                                  layout.block_nbytes), [0, 1]) is None  # three layers staged, two registered
    other_spec = spec_for("cpu", head_size=4)
    other = torch.zeros(shape_for("cpu", 12, other_spec), dtype=torch.bfloat16)
    assert CacheRows([(caches[0], layout), (other, detect_layout(other, other_spec))]).rows is None
    assert CacheRows([]).rows is None


def test_every_layer_at_once_checks_ids_and_layers() -> None:
    spec = spec_for("cpu")
    small = torch.zeros(shape_for("cpu", 4, spec), dtype=torch.float16)
    large = torch.zeros(shape_for("cpu", 8, spec), dtype=torch.float16)
    layers = [(large, detect_layout(large, spec)), (small, detect_layout(small, spec))]
    bn = layers[0][1].block_nbytes
    staging = staging_view(torch.zeros(3 * bn, dtype=torch.uint8), 1, 3, bn)
    with pytest.raises(LayoutError, match="does not hold 2 layers"):
        scatter_layers_from_staging(staging, layers, [0])
    staging = staging_view(torch.zeros(2 * bn, dtype=torch.uint8), 1, 2, bn)
    with pytest.raises(LayoutError, match="block id 5 is outside the cache's 4 blocks"):
        scatter_layers_from_staging(staging, layers, [5])  # fits the first layer, not the second
    with pytest.raises(LayoutError, match="must be distinct"):
        scatter_layers_from_staging(staging_view(torch.zeros(4 * bn, dtype=torch.uint8), 2, 2, bn), layers, [1, 1])
    assert not large.any() and not small.any()


def test_tail_helpers_validate() -> None:
    assert list(tail([4, 9, 1], 1)) == [9, 1]
    assert tail_range(3, 3, 2, 100) == (600, 0)
    with pytest.raises(LayoutError, match="outside 0..3"):
        tail([4, 9, 1], 4)
    with pytest.raises(LayoutError, match="needs 600 B but holds 599 B"):
        staging_view(torch.empty(599, dtype=torch.uint8), 3, 2, 100)


def test_staging_checks_shape_and_layer() -> None:
    spec = spec_for("cpu")
    cache = torch.zeros(shape_for("cpu", 4, spec), dtype=torch.float16)
    layout = detect_layout(cache, spec)
    staging = staging_view(torch.empty(2 * 2 * layout.block_nbytes, dtype=torch.uint8), 2, 2, layout.block_nbytes)
    with pytest.raises(LayoutError, match="layer 2 is outside"):
        gather_layer_into_staging(staging, 2, cache, layout, [0, 1])
    with pytest.raises(LayoutError, match="does not fit 3 blocks"):
        gather_layer_into_staging(staging, 0, cache, layout, [0, 1, 2])


def test_wire_layout() -> None:
    spec = spec_for("blocks_first")
    layout = detect_layout(torch.zeros(shape_for("blocks_first", 4, spec), dtype=torch.bfloat16), spec)
    wire = wire_layout(layout, num_layers=28, num_blocks=3)
    assert (wire.kind, wire.dtype, wire.num_layers, wire.num_blocks, wire.block_nbytes) == (
        "blocks_first",
        "bfloat16",
        28,
        3,
        layout.block_nbytes,
    )


# -- the installed vLLM's own specs and cache views ------------------------------------


def test_real_vllm_specs_and_strided_views() -> None:
    """vLLM builds each layer as a (possibly strided) [B, H, N, C] view of one buffer;
    layer-outermost, block-outermost and head/token-permuted layouts all round-trip."""
    kvi = pytest.importorskip("vllm.v1.kv_cache_interface")
    from vllm.v1.kv_cache_layout import KVCacheLayout

    full = kvi.FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=32, dtype=torch.bfloat16)
    mla = kvi.MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=48, dtype=torch.bfloat16)
    assert CacheSpec.from_vllm(full) == CacheSpec(block_size=16, num_kv_heads=4, head_size=32, head_size_v=32)
    assert CacheSpec.from_vllm(mla) == CacheSpec(block_size=16, num_kv_heads=1, head_size=48, use_mla=True)

    num_blocks, num_layers = 6, 3
    gen = torch.Generator().manual_seed(0)
    for vspec, kind in ((full, "cpu"), (mla, "mla")):
        page = vspec.page_size_bytes
        for vlayout in (KVCacheLayout.LBHNC, KVCacheLayout.LBNHC, KVCacheLayout.BLHNC, KVCacheLayout.BLNHC):
            layer_outer = vlayout.is_layer_compact
            placement = kvi.KVCacheTensor(
                size=page * num_blocks * num_layers,
                layers=[f"layer.{i}" for i in range(num_layers)],
                layer_stride=page * num_blocks if layer_outer else page,
                block_stride=page if layer_outer else page * num_layers,
            )

            def views() -> list[torch.Tensor]:
                raw = torch.randint(-128, 128, (placement.size,), dtype=torch.int8, generator=gen)
                return kvi.create_kv_cache_views(raw, vspec, num_blocks, vlayout, placement)

            src, dst_layers = views()[1], views()
            dst = dst_layers[2]
            layout = detect_layout(src, CacheSpec.from_vllm(vspec))
            assert (layout.kind, layout.block_nbytes) == (kind, page)
            before = [snapshot(v, layout) for v in dst_layers]
            buf = torch.empty(3 * page, dtype=torch.uint8)
            gather(src, layout, [5, 0, 3], buf)
            scatter(dst, layout, [1, 4, 2], buf)
            after = [snapshot(v, layout) for v in dst_layers]
            assert [after[2][b] for b in (1, 4, 2)] == [block_bytes(src, layout, b) for b in (5, 0, 3)]
            assert [after[2][b] for b in (0, 3, 5)] == [before[2][b] for b in (0, 3, 5)], vlayout
            assert after[:2] == before[:2], f"{vlayout}: another layer's pages changed"


@settings(max_examples=80, deadline=None)
@given(**LAYER_CASES, run=st.booleans())
def test_a_payload_written_into_its_cache_places_lands_as_its_scatter_does(
    kind: str, dtype: torch.dtype, num_layers: int, ids: list[int], views: bool, seed: int, run: bool
) -> None:
    """The tcp wire's bytes (layer by layer, each layer's blocks in order) written one
    place after another into `CachePlaces` land where the scatter from staging puts
    them, and nowhere else; `run`: the ids are consecutive, as vLLM mostly hands them out."""
    gen = torch.Generator().manual_seed(seed)
    caches, layout = layer_caches(kind, dtype, num_layers, views, gen)
    if run:
        ids = list(range(min(ids[0], 12 - len(ids)), min(ids[0], 12 - len(ids)) + len(ids)))
    want = [c.clone() for c in caches]
    wire = torch.randint(0, 256, (len(ids) * num_layers * layout.block_nbytes,), dtype=torch.uint8, generator=gen)
    scatter_layers_from_staging(layer_major_view(wire, len(ids), num_layers, layout.block_nbytes),
                                [(c, layout) for c in want], ids)
    places = CachePlaces([(c, layout) for c in caches]).of(ids)
    assert places is not None and sum(len(p) for p in places) == wire.numel()
    at, data = 0, wire.numpy().tobytes()
    for place in places:
        place[:] = data[at : at + len(place)]
        at += len(place)
    for got, expected in zip(caches, want, strict=True):
        assert got.view(torch.uint8).numpy().tobytes() == expected.view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize(("kind", "per_layer"), [("cpu", 2), ("blocks_first", 2), ("kv_first", 2 * 5)])
def test_cache_places_take_a_run_of_blocks_as_one_place_where_a_block_is_whole(kind: str, per_layer: int) -> None:
    """Blocks 3-5 and 8-9: a layout whose block is one row in the cache gets a place per run
    and layer; one with K and V planes apart, a place per block and plane (the wire
    carries a block's K then its V)."""
    caches, layout = layer_caches(kind, torch.float16, 3, False, torch.Generator().manual_seed(0))
    places = CachePlaces([(c, layout) for c in caches]).of([3, 4, 5, 8, 9])
    assert places is not None and len(places) == 3 * per_layer
    assert sum(len(p) for p in places) == 3 * 5 * layout.block_nbytes


def test_cache_places_decline_what_they_cannot_write_in_place() -> None:
    spec = spec_for("cpu")
    cache = torch.zeros(shape_for("cpu", 4, spec), dtype=torch.float16)
    places = CachePlaces([(cache, detect_layout(cache, spec))])
    assert places.of([4]) is None  # outside the cache: the scatter names it
    assert places.of([-1]) is None
    assert places.of([3]) is not None
    odd = torch.zeros(shape_for("cpu", 8, spec), dtype=torch.float16)[::2]  # every other block
    assert CachePlaces([(odd, detect_layout(odd, spec))]).of([0]) is None  # not contiguous
