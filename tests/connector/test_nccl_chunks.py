"""The chunk plan both sides of an nccl transfer derive on their own (`connector.nccl_link.chunks`).

P posts one send per chunk and D one receive per chunk, and NCCL pairs them by order
alone, so the plan must depend only on what both sides know (the transfer's size and
the staged block size) and must cover the transfer exactly. The GPU runs of it:
tests/gpu/test_connector_nccl.py.
"""

from __future__ import annotations

from itertools import pairwise

import pytest
from hypothesis import given
from hypothesis import strategies as st

from connector.nccl_link import chunks
from workers.gpu_staging import pipeline_bounds

MIB = 1 << 20
LLAMA_BLOCK = 32 * 2 * 16 * 8 * 128 * 2  # one staged block of Llama-3-8B-shaped KV: 2 MiB


@given(st.integers(1, 4096), st.sampled_from([4096, MIB, LLAMA_BLOCK, 3 * MIB + 512]))
def test_chunks_cover_the_transfer_in_order_without_gaps(blocks: int, block_nbytes: int) -> None:
    parts = chunks(blocks * block_nbytes, block_nbytes)
    assert parts[0][0] == 0 and parts[-1][1] == blocks
    assert all(b0 < b1 for b0, b1 in parts)
    assert all(a[1] == b[0] for a, b in pairwise(parts))
    assert parts == chunks(blocks * block_nbytes, block_nbytes)  # the other side gets the same


def test_the_plan_is_the_transports_pipeline() -> None:
    # 2,048 and 8,192 tokens of Llama-3-8B-shaped KV: the plans measured on GPUs.
    for blocks in (128, 512):
        ends = [b1 for _, b1 in chunks(blocks * LLAMA_BLOCK, LLAMA_BLOCK)]
        assert ends == pipeline_bounds(blocks, LLAMA_BLOCK)
    sizes = [(b1 - b0) * 2 for b0, b1 in chunks(128 * LLAMA_BLOCK, LLAMA_BLOCK)]
    assert sizes == [96, 96, 48, 16]  # MiB


def test_a_small_transfer_goes_in_one_op() -> None:
    assert chunks(32 * LLAMA_BLOCK, LLAMA_BLOCK) == [(0, 32)]  # 512 tokens: 64 MiB


@pytest.mark.parametrize(("nbytes", "block_nbytes"), [(1000, 0), (MIB + 1, MIB), (0, MIB)])
def test_sizes_that_are_not_whole_blocks_go_in_one_op(nbytes: int, block_nbytes: int) -> None:
    # One op, which `NcclLink` sends or receives as all of `nbytes`.
    assert chunks(nbytes, block_nbytes) == [(0, 1)]
