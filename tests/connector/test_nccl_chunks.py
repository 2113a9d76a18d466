"""The chunk plan both sides of an nccl transfer derive on their own (`connector.nccl_link.chunks`).

P posts one send per chunk and D one receive per chunk, and NCCL pairs them by order
alone, so the plan must depend only on what both sides know (the transfer's size and
the staged block size) and must cover the transfer exactly; D lands each chunk, in
order, once its receive ended on a communicator still whole. The GPU runs of it:
tests/gpu/test_connector_nccl.py.
"""

from __future__ import annotations

import threading
from itertools import pairwise
from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from connector.nccl_link import NcclLink, Posted, chunks
from protocols.errors import TransferFailed
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


class _Done:
    """A chunk's op completion that ends when the test says (`wait` returns at once);
    `done()` is true only for chunks the test says ended before anyone waited for them."""

    def __init__(self, k: int, log: list[str], comm: Any, abort_at: int | None, early: set[int]) -> None:
        self.k, self.log, self.comm, self.abort_at, self.early = k, log, comm, abort_at, early

    def done(self) -> bool:
        if self.k in self.early and self.k == self.abort_at:
            self.comm.broken = True
        return self.k in self.early

    def wait(self, deadline: float, *, spin_s: float = 0.0) -> None:
        self.log.append(f"ended {self.k}")
        if self.k == self.abort_at:  # the communicator was aborted: its kernel ended early
            self.comm.broken = True


def _posted(n: int, log: list[str], abort_at: int | None = None, early: frozenset[int] = frozenset()) -> Posted:
    comm = SimpleNamespace(closed=False, broken=False)
    parts = chunks(n * LLAMA_BLOCK, LLAMA_BLOCK)
    return Posted(peer="p0:0", op="recv", transfer_id="t", comm=comm,
                  completions=[_Done(k, log, comm, abort_at, set(early)) for k in range(len(parts))], parts=parts,
                  flag=threading.Event())


def _link() -> Any:
    """`NcclLink`'s waiting half without a GPU: only its cache is touched, to drop a
    communicator whose later ops could pair with another transfer's."""
    link = NcclLink.__new__(NcclLink)
    link.cache = SimpleNamespace(discarded=[], discard=lambda peer: link.cache.discarded.append(peer))
    return link


def test_a_receive_sets_up_before_any_chunk_ends_then_lands_each_chunk_in_order() -> None:
    """D's setup for its scatters (`before`) runs before the first chunk is waited for;
    then each chunk lands once its op ended, in order, with how many are still to come."""
    log: list[str] = []
    posted = _posted(128, log)  # four chunks at 2,048 tokens
    _link()._wait_posted(posted, deadline=float("inf"),
                         landed=lambda b0, b1, left: log.append(f"landed {b0}-{b1} left {left}"),
                         before=lambda: log.append("before"))
    assert log == ["before", "ended 0", "landed 0-48 left 3", "ended 1", "landed 48-96 left 2",
                   "ended 2", "landed 96-120 left 1", "ended 3", "landed 120-128 left 0"]


def test_chunks_that_ended_while_the_receiver_was_busy_land_as_one_copy() -> None:
    """A receiving thread behind the wire finds the next chunks' ops ended too: they land
    with the chunk it waited for, as one range, still in order and with the right count
    of chunks to come; a chunk not ended yet is waited for on its own."""
    log: list[str] = []
    posted = _posted(128, log, early=frozenset({1, 2}))
    _link()._wait_posted(posted, deadline=float("inf"),
                         landed=lambda b0, b1, left: log.append(f"landed {b0}-{b1} left {left}"))
    assert log == ["ended 0", "ended 1", "ended 2", "landed 0-120 left 1", "ended 3", "landed 120-128 left 0"]


def test_an_abort_seen_among_ended_chunks_lands_none_of_them() -> None:
    log: list[str] = []
    with pytest.raises(TransferFailed, match="cut short"):
        _link()._wait_posted(_posted(128, log, abort_at=2, early=frozenset({1, 2})), deadline=float("inf"),
                             landed=lambda b0, b1, left: log.append(f"landed {b0}-{b1}"))
    assert not [line for line in log if line.startswith("landed")]


def test_a_chunk_cut_short_by_an_abort_never_lands_and_the_communicator_is_not_reused() -> None:
    log: list[str] = []
    posted = _posted(128, log, abort_at=1)
    link = _link()
    with pytest.raises(TransferFailed, match="cut short"):
        link._wait_posted(posted, deadline=float("inf"),
                          landed=lambda b0, b1, left: log.append(f"landed {b0}-{b1}"), before=lambda: None)
    assert log == ["ended 0", "landed 0-48", "ended 1"]


def test_a_landing_that_fails_before_the_last_chunk_drops_the_communicator() -> None:
    """Later chunks' receives are posted: left on that communicator they would pair with
    the next transfer's sends."""
    log: list[str] = []
    link = _link()

    def landed(b0: int, b1: int, left: int) -> None:
        raise RuntimeError("the scatter could not be launched")

    with pytest.raises(RuntimeError, match="scatter"):
        link._wait_posted(_posted(128, log), deadline=float("inf"), landed=landed)
    assert link.cache.discarded == ["p0:0"]
