"""`PagedKv`'s copies between a paged KV cache and block-major staging, and the chunk
plan both sides of a transfer derive (`pipeline_bounds`): on the CPU, and on one or two
GPUs where Triton's kernel does the copying."""

from __future__ import annotations

import pytest
import torch

from workers.gpu_staging import PagedKv, pipeline_bounds

two_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs"
)
one_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

LAYERS, BLOCKS, BLOCK, HEADS, DIM = 4, 64, 16, 8, 128
REQ_P = [3, 17, 18, 40, 41, 42, 9, 60]  # a request's blocks on P
REQ_D = [50, 2, 33, 34, 7, 8, 61, 20]  # where D puts them


def _cache(device: torch.device | str, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (2, BLOCKS, BLOCK, HEADS, DIM)
    return [torch.randn(shape, generator=g).to(torch.bfloat16).to(device) for _ in range(LAYERS)]


# -- CPU: the chunk plan and the layout ----------------------------------------------------


def test_pipeline_bounds_cover_and_ramp() -> None:
    mib = 1 << 20
    assert pipeline_bounds(0, 2 * mib) == []
    assert pipeline_bounds(40, 2 * mib) == [40]  # first + last chunk or less: one piece
    # The defaults for Llama-3-8B-like KV (2 MiB a block): 2048 and 8192 tokens.
    assert pipeline_bounds(128, 2 * mib) == [48, 96, 120, 128]
    assert pipeline_bounds(512, 2 * mib) == [48, 192, 408, 480, 504, 512]
    for first, last, growth in ((128, 32, 4), (64, 32, 4), (256, 32, 4), (128, 16, 4), (32, 32, 2)):
        f, b = first // 2, last // 2
        for n in list(range(1, 300)) + [512, 1000, 4096]:
            ends = pipeline_bounds(n, 2 * mib, first_nbytes=first * mib, last_nbytes=last * mib, growth=growth)
            assert ends[-1] == n and ends == sorted(set(ends))
            sizes = [y - x for x, y in zip([0] + ends, ends)]
            if n <= f + b:
                assert sizes == [n]
                continue
            # The last chunk stays small (a short scatter after the last byte) and the
            # first one near `first` (a tiny remainder may fold into it).
            assert b <= sizes[-1] < f + b and f <= sizes[0] < f + b
            assert max(sizes) <= 512 + b
            # No dip: a middle chunk smaller than both neighbours would be an op for nothing.
            assert not any(sizes[k] < min(sizes[k - 1], sizes[k + 1]) and sizes[k] < min(f, b)
                           for k in range(1, len(sizes) - 1))


def test_pipeline_bounds_back_growth() -> None:
    mib = 1 << 20
    # A slower front ramp (capped gathers) and the back ramp at its own growth.
    ends = pipeline_bounds(512, 2 * mib, first_nbytes=64 * mib, last_nbytes=16 * mib, growth=2, back_growth=4)
    sizes = [y - x for x, y in zip([0] + ends, ends)]
    assert ends[-1] == 512 and sizes[:2] == [32, 64] and sizes[-3:] == [128, 32, 8]
    assert pipeline_bounds(512, 2 * mib, growth=3, back_growth=None) == pipeline_bounds(
        512, 2 * mib, growth=3, back_growth=3)


@pytest.mark.parametrize("block_dim", [0, 1])
def test_gather_scatter_roundtrip_cpu(block_dim: int) -> None:
    shape = (BLOCKS, 2, BLOCK, HEADS, DIM) if block_dim == 0 else (2, BLOCKS, BLOCK, HEADS, DIM)
    src = [torch.randn(shape).to(torch.bfloat16) for _ in range(LAYERS)]
    dst = [torch.zeros(shape, dtype=torch.bfloat16) for _ in range(LAYERS)]
    p, d = PagedKv(src, block_dim=block_dim), PagedKv(dst, block_dim=block_dim)
    words = p.staging_view(torch.empty(len(REQ_P) * p.staged_block_nbytes, dtype=torch.uint8), len(REQ_P))
    p.gather(p.block_ids(REQ_P), words)
    # Block-major: staged block i holds every layer of P's block REQ_P[i].
    row = words.view(len(REQ_P), LAYERS, -1)
    want = src[2].select(block_dim, REQ_P[5]).reshape(-1).view(torch.int64)
    assert torch.equal(row[5, 2], want)
    d.scatter(d.block_ids(REQ_D), words)
    for s, t in zip(src, dst):
        idx = (slice(None),) * block_dim
        assert torch.equal(t[idx + (REQ_D,)], s[idx + (REQ_P,)])


# -- one GPU: the Triton gather equals the per-layer one --------------------------------


@pytest.mark.gpu
@one_gpu
@pytest.mark.parametrize("streaming", [False, True])
def test_triton_and_per_layer_gather_agree(streaming: bool) -> None:
    kv = _cache("cuda")
    fast, slow = PagedKv(kv, use_triton=None), PagedKv(kv, use_triton=False)
    fast.streaming = streaming  # the cache hints change where lines live, never the bytes
    ids = fast.block_ids(REQ_P)
    a = torch.empty(len(REQ_P) * fast.staged_block_nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    fast.gather(ids, fast.staging_view(a, len(REQ_P)))
    slow.gather(ids, slow.staging_view(b, len(REQ_P)))
    assert torch.equal(a, b)
    for programs in (1, 3, 1000):  # a capped grid loops over the rows it does not cover at once
        c = torch.zeros_like(a)
        fast.gather(ids, fast.staging_view(c, len(REQ_P)), programs=programs)
        assert torch.equal(c, b), programs
        out = _cache("cuda", seed=7)
        back = PagedKv(out)
        back.streaming = streaming
        back.scatter(ids, fast.staging_view(a, len(REQ_P)), programs=programs)
        for s, t in zip(kv, out):
            assert torch.equal(s[:, REQ_P], t[:, REQ_P])
    # One layer at a time (what save_kv_layer does), into and out of the same block-major rows.
    e = torch.zeros_like(a)
    for layer in range(fast.num_layers):
        fast.gather_layer(layer, ids, fast.staging_view(e, len(REQ_P)))
    assert torch.equal(e, b)
    out = _cache("cuda", seed=8)
    back = PagedKv(out)
    back.streaming = streaming
    for layer in range(back.num_layers):
        back.scatter_layer(layer, ids, back.staging_view(e, len(REQ_P)))
    for src, dst in zip(kv, out):
        assert torch.equal(src[:, REQ_P], dst[:, REQ_P])
    print(f"triton gather used: {fast.use_triton}, compiled-kernel launch: {fast._launch and fast._launch.fast}")


def _precompiled(device: str) -> tuple[list[torch.Tensor], list[torch.Tensor], PagedKv]:
    """A cache on `device`, a copy of it as it was, and its `PagedKv` after `precompile`."""
    kv = _cache(device)
    before = [t.clone() for t in kv]
    paged = PagedKv(kv)
    if not paged.use_triton:
        pytest.skip("no Triton here")
    paged.precompile()
    return kv, before, paged


@pytest.mark.gpu
@one_gpu
def test_precompile_compiles_every_copy_and_leaves_the_cache_alone() -> None:
    """`precompile` compiles each copy a transfer launches (gather and scatter, whole
    blocks and one layer, with and without cache hints): a first compile loads a module,
    which on D waited for a receive posted just before it. Block 0 goes out and back."""
    kv, before, paged = _precompiled("cuda")
    assert paged.streaming
    assert all(torch.equal(a, b) for a, b in zip(before, kv))
    assert len(paged._launch.compiled) >= 8, paged._launch.compiled.keys()
    known = set(paged._launch.compiled)
    ids = paged.block_ids(REQ_P)
    staging = torch.empty(len(REQ_P) * paged.staged_block_nbytes, dtype=torch.uint8, device="cuda")
    paged.gather(ids, paged.staging_view(staging, len(REQ_P)))
    paged.scatter(ids, paged.staging_view(staging, len(REQ_P)), programs=64)
    paged.gather_layer(3, ids, paged.staging_view(staging, len(REQ_P)))
    paged.scatter_layer(3, ids, paged.staging_view(staging, len(REQ_P)))
    torch.cuda.synchronize()
    assert set(paged._launch.compiled) == known  # nothing new compiled on the transfer's path
    assert all(torch.equal(a, b) for a, b in zip(before, kv))


@pytest.mark.gpu
@two_gpus
def test_a_cache_registered_from_another_gpus_thread_compiles_for_its_own_gpu() -> None:
    """Two workers in one process (cuda:0 current while D's cache on cuda:1 is made and
    precompiled): the check and every compile run on the cache's GPU, the fast launch
    is on, the cache is unchanged, and a transfer's copies there compile nothing new and
    stage the same bytes as torch's."""
    torch.cuda.set_device(0)
    kv, before, paged = _precompiled("cuda:1")
    assert torch.cuda.current_device() == 0
    assert paged._launch.fast
    assert all(torch.equal(a, b) for a, b in zip(before, kv))
    known = set(paged._launch.compiled)
    ids = paged.block_ids(REQ_P)
    with torch.cuda.device(1):
        staging = torch.empty(len(REQ_P) * paged.staged_block_nbytes, dtype=torch.uint8, device="cuda:1")
        paged.gather(ids, paged.staging_view(staging, len(REQ_P)))
        torch.cuda.synchronize()
    assert set(paged._launch.compiled) == known
    reference = PagedKv(kv, use_triton=False)
    expect = torch.empty_like(staging)
    reference.gather(ids, reference.staging_view(expect, len(REQ_P)))
    torch.cuda.synchronize(1)
    assert torch.equal(staging, expect)
