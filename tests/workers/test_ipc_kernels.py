"""The ipc backend's copy kernels, run by Triton's interpreter on the CPU: where each
staged row of a transfer lands in the receiver's blocks, and that a receiver that gave
its memory up gets nothing. On GPUs, tests/gpu/test_cuda_ipc.py runs the same kernels
compiled, between processes and under overwrites; here CI checks their addressing.

The interpreter runs a grid's programs one after another, so these give every kernel
its `ready` up front: a wait that another program would end cannot be run here (the GPU
tests cover those)."""

from __future__ import annotations

from collections.abc import Iterator
from types import ModuleType

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from workers.gpu_staging import PagedKv  # noqa: E402
from workers.transports import cuda_ipc  # noqa: E402

ready, arrived, tally = range(3)  # the counter words each kernel call gets


@pytest.fixture(scope="module")
def kernels() -> Iterator[ModuleType]:
    """`cuda_ipc` with its kernels built for Triton's interpreter (and rebuilt after)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        if not _interpreter_takes_addresses():
            pytest.skip("this Triton's interpreter cannot make a pointer of an address (3.6 cannot, 3.9 can)")
        mp.setattr(cuda_ipc, "_KERNEL", [])
        cuda_ipc._kernel()
        yield cuda_ipc


def _interpreter_takes_addresses() -> bool:
    """Whether Triton's interpreter runs what the kernels do first: an int64 address made
    a pointer (they take addresses in another process's memory, not tensors)."""
    import triton
    import triton.language as tl

    @triton.jit
    def store_seven(address):  # type: ignore[no-untyped-def]
        tl.store(address.to(tl.pointer_type(tl.int64)), 7)

    word = torch.zeros(1, dtype=torch.int64)
    try:
        store_seven[(1,)](word.data_ptr())
    except Exception:  # noqa: BLE001 - the interpreter's own error, whichever it raises
        return False
    return int(word[0]) == 7


def _counters(seq: int, *, given_up: bool) -> torch.Tensor:
    words = torch.zeros(8, dtype=torch.int64)
    words[ready] = cuda_ipc.ABORT + seq if given_up else seq
    return words


def _address(words: torch.Tensor, i: int) -> int:
    return words.data_ptr() + 8 * i


def _send_blocks(kernels: ModuleType, seq: int, staging: torch.Tensor, d: PagedKv, ids: torch.Tensor,
                 words: torch.Tensor, programs: int, layer_range: tuple[int, int] | None = None,
                 last: bool = True) -> None:
    """One launch of a block send as `IpcCommunicator.send_blocks` makes it, into `d`'s
    blocks `ids`: of every layer, or of `layer_range` (`last`: the send's last launch)."""
    layers = torch.tensor([r.data_ptr() for r in d.rows], dtype=torch.int64)
    args = kernels.block_args(
        seq, src=staging.data_ptr(), layers=layers.data_ptr(), ids=ids.data_ptr(), num_cache_blocks=d.num_blocks,
        ready=_address(words, ready), arrived=_address(words, arrived), tally=_address(words, tally),
        shape=(ids.numel(), d.num_layers, d.pre, d.row_nbytes), layer_range=layer_range, last=last)
    grid = kernels.block_grid(programs, args)
    kernels._blocks_kernel()[(grid,)](*args, BLOCK=kernels._COPY_BLOCK, ABORT_AT=kernels.ABORT)


def _caches(num_layers: int, pre: int, num_blocks: int, row_words: int, *, seed: int | None) -> PagedKv:
    shape = (pre, num_blocks, row_words)
    if seed is None:
        return PagedKv([torch.zeros(shape, dtype=torch.int64) for _ in range(num_layers)], use_triton=False)
    g = torch.Generator().manual_seed(seed)
    return PagedKv([torch.randint(-2**62, 2**62, shape, dtype=torch.int64, generator=g) for _ in range(num_layers)],
                   use_triton=False)


@st.composite
def transfers(draw: st.DrawFn) -> dict:
    num_layers = draw(st.integers(1, 4))
    pre = draw(st.sampled_from([1, 2]))  # MLA's one row a block, or K and V
    row_words = draw(st.sampled_from([1, 3, 8, cuda_ipc._COPY_BLOCK + 5]))  # past one step of a program too
    p_blocks, d_blocks = draw(st.integers(1, 9)), draw(st.integers(1, 9))
    n = draw(st.integers(1, min(p_blocks, d_blocks)))
    return {
        "shape": (num_layers, pre, row_words),
        "p_blocks": p_blocks, "d_blocks": d_blocks,
        "p_ids": draw(st.permutations(range(p_blocks)))[:n],
        "d_ids": draw(st.permutations(range(d_blocks)))[:n],
        "programs": draw(st.integers(1, 6)),
        "seq": draw(st.integers(1, 1000)),
    }


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(t=transfers())
def test_each_staged_row_lands_where_the_receivers_scatter_puts_it(kernels: ModuleType, t: dict) -> None:
    """P gathers its blocks into staging (its real gather); the block kernel copies the
    staging into D's blocks; D ends up exactly as if it had received the staging and
    scattered it (its real scatter), with every other block untouched, and the send's
    end counted once."""
    num_layers, pre, row_words = t["shape"]
    p = _caches(num_layers, pre, t["p_blocks"], row_words, seed=t["seq"])
    n = len(t["p_ids"])
    staging = torch.empty(n * p.staged_block_nbytes, dtype=torch.uint8)
    p.gather(torch.tensor(t["p_ids"]), p.staging_view(staging, n))
    d, scattered = (_caches(num_layers, pre, t["d_blocks"], row_words, seed=None) for _ in range(2))
    scattered.scatter(torch.tensor(t["d_ids"]), scattered.staging_view(staging, n))
    words = _counters(t["seq"], given_up=False)
    _send_blocks(kernels, t["seq"], staging, d, torch.tensor(t["d_ids"]), words, t["programs"])
    for layer in range(num_layers):
        assert torch.equal(d.rows[layer], scattered.rows[layer]), f"layer {layer} differs from the scatter's"
        assert torch.equal(d.rows[layer][:, t["d_ids"]], p.rows[layer][:, t["p_ids"]])
    assert int(words[arrived]) == t["seq"], "the receiver was not told, or told another send"
    assert int(words[tally]) == 0, "the programs' tally was not left at 0 for the send that reuses it"


@pytest.mark.parametrize("layer_range", [(0, 1), (1, 2), (0, 2)], ids=["first launch", "last launch", "whole"])
def test_a_receiver_that_gave_its_blocks_up_gets_no_row_and_no_end(kernels: ModuleType,
                                                                   layer_range: tuple[int, int]) -> None:
    """D's load failed and vLLM may reuse its blocks: past ABORT on `ready`, no launch of
    the send copies a row, and `arrived` stays as it was (so D never takes the transfer
    for landed)."""
    p = _caches(2, 2, 4, 8, seed=7)
    staging = torch.empty(4 * p.staged_block_nbytes, dtype=torch.uint8)
    p.gather(torch.arange(4), p.staging_view(staging, 4))
    d = _caches(2, 2, 6, 8, seed=None)
    words = _counters(3, given_up=True)
    _send_blocks(kernels, 3, staging, d, torch.tensor([5, 0, 2, 3]), words, programs=4, layer_range=layer_range,
                 last=layer_range[1] == 2)
    assert all(int(r.abs().sum()) == 0 for r in d.rows), "a row landed in blocks the receiver gave up"
    assert int(words[arrived]) == 0


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(nbytes=st.integers(1, 3 * 8 * cuda_ipc._COPY_BLOCK + 11), programs=st.integers(1, 5), given_up=st.booleans())
def test_a_byte_send_copies_exactly_its_bytes_unless_the_receiver_gave_up(
    kernels: ModuleType, nbytes: int, programs: int, given_up: bool,
) -> None:
    """The chunk kernel (`ipc_copy`): the send's bytes and not one past them, by words when
    the size and both addresses allow it, by bytes otherwise, as `_Copier` launches it."""
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dst = torch.zeros(nbytes + 64, dtype=torch.uint8)  # bytes past the send's end must stay 0
    words = _counters(9, given_up=given_up)
    grid, count, wide = kernels.copy_shape(src.data_ptr(), dst.data_ptr(), nbytes, programs)
    kernels._kernel()[(grid,)](src.data_ptr(), dst.data_ptr(), count, _address(words, ready),
                                   _address(words, arrived), _address(words, tally), 9,
                                   ABORT_AT=kernels.ABORT, WIDE=wide, BLOCK=kernels._COPY_BLOCK)
    if given_up:
        assert int(dst.sum()) == 0 and int(words[arrived]) == 0
    else:
        assert torch.equal(dst[:nbytes], src) and int(dst[nbytes:].sum()) == 0
        assert int(words[arrived]) == 9 and int(words[tally]) == 0


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(num_layers=st.integers(1, 6), programs=st.integers(1, 5), data=st.data())
def test_a_send_launched_in_groups_of_layers_lands_each_group_and_tells_once(
    kernels: ModuleType, num_layers: int, programs: int, data: st.DataObject,
) -> None:
    """A send that follows a forward pass is launched a group of layers at a time
    (`StepLayers`): each launch copies exactly its layers' rows, and only the last one
    tells the receiver, once every row is in."""
    from workers.gpu_staging import layer_groups

    p = _caches(num_layers, 2, 4, 8, seed=num_layers)
    staging = torch.empty(4 * p.staged_block_nbytes, dtype=torch.uint8)
    p.gather(torch.arange(4), p.staging_view(staging, 4))
    d = _caches(num_layers, 2, 6, 8, seed=None)
    ends = data.draw(st.sampled_from([layer_groups(num_layers), [num_layers], list(range(1, num_layers + 1))]))
    words, ids, start = _counters(5, given_up=False), torch.tensor([5, 0, 2, 3]), 0
    for end in ends:
        assert int(words[arrived]) == 0, "the receiver was told before the last launch"
        _send_blocks(kernels, 5, staging, d, ids, words, programs, layer_range=(start, end), last=end == num_layers)
        for layer in range(num_layers):
            copied = torch.equal(d.rows[layer][:, [5, 0, 2, 3]], p.rows[layer][:, [0, 1, 2, 3]])
            assert copied == (layer < end), f"layer {layer} after the launch of layers [{start}, {end})"
        start = end
    assert int(words[arrived]) == 5 and int(words[tally]) == 0
