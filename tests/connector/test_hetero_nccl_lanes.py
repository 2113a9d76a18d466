"""Heterogeneous TP over the nccl transport's link, with no GPU: prefill and decode ranks
are `ConnectorWorker`s with CPU caches and a real broker process between them, and their
`NcclLink` is replaced by an in-process wire that pairs the k-th send a prefill rank
posts to a decode rank with the k-th receive that decode rank posts from it (as NCCL pairs
ops by posting order) and copies the bytes in the chunks each side derived on its own.

What runs for real: the broker's lanes, tickets and credits; P cutting a lane's heads out
of its staging (`connector.lanes.cut_lane`) and sending them through the link's `send`;
D receiving each lane into its own lease through `ticket`/`post_recv`/`wait` under the
producer's turn, joining the lanes and scattering. The GPU run of the same path:
tests/gpu/test_connector_hetero.py.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.to_thread
import pytest
import torch

from connector.config import EngineInfo
from connector.lanes import Part
from connector.nccl_link import Waited, chunks
from connector.scheduler import KvBrokerMetadata, LoadSpec, SaveSpec
from connector.worker import ConnectorWorker, compat_fields
from protocols.errors import TransferFailed
from protocols.heads import lanes, rank_heads
from tests.connector.test_hetero_worker import (
    BLOCK,
    HEADS,
    LAYERS,
    NUM_BLOCKS,
    Spec,
    bits,
    heads_of,
    model,
    rank_worker,
)
from tests.support import BrokerProcess, engine_step_pause, wait_until
from workers.layout import CacheSpec, detect_layout



@dataclass
class _Sent:
    transfer_id: str
    data: torch.Tensor
    plan: list[tuple[int, int]]
    taken: threading.Event = field(default_factory=threading.Event)


@dataclass
class _Posted:
    producer: str
    transfer_id: str
    lease: Any
    nbytes: int
    plan: list[tuple[int, int]]
    place: int
    into_blocks: bool = False  # the wire never receives straight into blocks (`connector.nccl_link.Posted`)


class Wire:
    """Every (prefill peer, decode peer) pair's communicator, in one process."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.sent: dict[tuple[str, str], list[_Sent]] = defaultdict(list)
        self.posted: dict[tuple[str, str], int] = defaultdict(int)
        self.cancelled: set[str] = set()
        self.ops: list[tuple[str, str, str, str, bool]] = []  # (op, transfer, from, to, into blocks / from blocks)
        self.unpaired: list[tuple[str, str]] = []  # (send's transfer, receive's transfer) paired by order
        self.cut: dict[tuple[str, str], bool] = {}  # (from, to) -> whether the send went from a cut of the staging


class WireLink:
    """One worker's side of the wire, with the `NcclLink` calls the connector makes."""

    def __init__(self, wire: Wire, me: str) -> None:
        self.wire, self.me = wire, me
        self._receiving: dict[str, anyio.Lock] = {}

    # -- D --------------------------------------------------------------------------------

    def receiving(self, producer: str) -> anyio.Lock:
        return self._receiving.setdefault(producer, anyio.Lock())

    def ticket(self, producer: str) -> tuple[str, int]:
        with self.wire.cond:
            return ("wire", self.wire.posted[(producer, self.me)])

    async def post_recv(self, producer: str, transfer_id: str, lease: Any, nbytes: int, deadline: float,
                        ticket: tuple[str, int], *, block_nbytes: int = 0, into: Any = None) -> _Posted:
        with self.wire.cond:
            pair = (producer, self.me)
            assert ticket[1] == self.wire.posted[pair], "a receive posted out of its ticket's order"
            self.wire.posted[pair] += 1
            self.wire.ops.append(("recv", transfer_id, producer, self.me, into is not None))
            self.wire.cond.notify_all()
        return _Posted(producer, transfer_id, lease, nbytes, chunks(nbytes, block_nbytes), ticket[1])

    async def wait(self, posted: _Posted, deadline: float, landed: Any = None, before: Any = None) -> Waited:
        return await anyio.to_thread.run_sync(self._take, posted, deadline)

    def _take(self, posted: _Posted, deadline: float) -> Waited:
        pair = (posted.producer, self.me)
        with self.wire.cond:
            while len(self.wire.sent[pair]) <= posted.place:
                if posted.transfer_id in self.wire.cancelled or not self.wire.cond.wait(deadline - time.monotonic()):
                    raise TransferFailed(posted.transfer_id, "the wire's receive was cancelled or timed out")
            sent = self.wire.sent[pair][posted.place]
        if sent.transfer_id != posted.transfer_id:
            self.wire.unpaired.append((sent.transfer_id, posted.transfer_id))
        if sent.plan != posted.plan or sent.data.numel() != posted.nbytes:
            with self.wire.cond:
                sent.taken.set()
                self.wire.cond.notify_all()
            raise TransferFailed(posted.transfer_id, f"chunks {sent.plan} sent, {posted.plan} received")
        lease = posted.lease
        lease.base[lease.offset:lease.offset + posted.nbytes].copy_(sent.data)
        with self.wire.cond:
            sent.taken.set()
            self.wire.cond.notify_all()
        now = time.monotonic()
        return Waited(now, now, now)

    async def give_up(self, producer: str) -> None:
        return None

    def posts_first(self, producer: str, ticket: tuple[str, int]) -> bool:
        return False  # no receive into blocks: the Ready goes first

    # P finds no receive of D's on this wire before the Go: nothing to watch.
    def watch_receive(self, transfer_id: str, seen: Any) -> None:
        return None

    def unwatch_receive(self, transfer_id: str) -> None:
        return None

    # -- P --------------------------------------------------------------------------------

    async def send(self, decode: str, transfer_id: str, lease: Any, offset: int, nbytes: int, after: Any,
                   deadline: float, *, block_nbytes: int = 0, ticket: tuple[str, int] = ("", 0),
                   paged: Any = None, streaming: Any = None) -> Waited:
        # A lane is cut from the whole staged copy: it never streams during the forward pass.
        assert streaming is None, f"{transfer_id}: a lane's send was posted streaming"
        data = lease.base[lease.offset + offset:lease.offset + offset + nbytes].clone()
        sent = _Sent(transfer_id, data, chunks(nbytes, block_nbytes))
        pair = (self.me, decode)
        with self.wire.cond:
            # P posts in D's ticket order, as `SendOrder` makes the link do.
            while len(self.wire.sent[pair]) != ticket[1]:
                if not self.wire.cond.wait(deadline - time.monotonic()):
                    raise TransferFailed(transfer_id, "its turn on the wire did not come")
            if transfer_id in self.wire.cancelled:  # as `NcclLink.cancel` refuses a post after it
                raise TransferFailed(transfer_id, "the wire's send was cancelled before it was posted")
            self.wire.sent[pair].append(sent)
            self.wire.ops.append(("send", transfer_id, self.me, decode, paged is not None))
            self.wire.cut[(self.me, decode)] = isinstance(lease, Part)
            self.wire.cond.notify_all()
        if not await anyio.to_thread.run_sync(self._given, sent, transfer_id, deadline):
            raise TransferFailed(transfer_id, "the wire's send was cancelled or not received by its deadline")
        now = time.monotonic()
        return Waited(now, now, now)

    def _given(self, sent: _Sent, transfer_id: str, deadline: float) -> bool:
        """Until D took `sent` (True), or it was cancelled or its deadline passed (False):
        a cancel ends a posted send, as aborting its communicator does."""
        with self.wire.cond:
            while not sent.taken.is_set():
                if transfer_id in self.wire.cancelled or not self.wire.cond.wait(deadline - time.monotonic()):
                    return False
        return True

    def abandon(self, decode: str, ticket: tuple[str, int]) -> None:
        return None

    # -- both -----------------------------------------------------------------------------

    def cancel(self, peer: str, transfer_id: str) -> None:
        with self.wire.cond:
            self.wire.cancelled.add(transfer_id)
            self.wire.cond.notify_all()

    def close(self) -> None:
        return None


def on_wire(wire: Wire, worker: ConnectorWorker) -> ConnectorWorker:
    assert worker.client is not None
    worker.nccl = WireLink(wire, worker.client.registered.peer_id)  # type: ignore[assignment]
    return worker


def _compat(tp: int, kv_heads: int) -> dict[str, str]:
    local = HEADS // tp
    info = EngineInfo(model="tiny", spec=Spec(num_kv_heads=local), block_size=BLOCK, backend="FLASH_ATTN",
                      world_size=tp, rank=tp - 1, kv_heads=kv_heads)
    cache = torch.empty(2, NUM_BLOCKS, BLOCK, local, 64, dtype=torch.bfloat16)
    return compat_fields(info, detect_layout(cache, CacheSpec(BLOCK, local, 64)), len(LAYERS), "nccl")


def test_hetero_over_nccl_the_compatibility_fields_hold_the_models_heads_not_the_tp_size() -> None:
    """P TP 1 and D TP 2 ranks over nccl register the same fields (the model's KV heads,
    the chunk plan), so the broker pairs them and plans lanes; where vLLM reports no head
    count, the TP size and a rank's heads stay in the fields, and they differ."""
    one, two = _compat(1, HEADS), _compat(2, HEADS)
    assert one == two and one["kv_heads"] == str(HEADS) and one["transport"].startswith("nccl, chunks")
    assert "world_size" not in one and "num_kv_heads" not in one
    unknown_one, unknown_two = _compat(1, 0), _compat(2, 0)
    assert unknown_one["world_size"] == "1" and unknown_two["world_size"] == "2"
    assert unknown_one["num_kv_heads"] != unknown_two["num_kv_heads"]


@pytest.mark.slow
@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 2), (2, 1), (1, 1)])
def test_hetero_lanes_over_the_nccl_link_give_each_decode_rank_exactly_its_heads(
    broker: BrokerProcess, p_tp: int, d_tp: int
) -> None:
    """Three transfers, every other one with a one-block prefix hit on D, P's blocks
    overwritten right after each step (with equal TP sizes, 1-1, the plain staged path
    that nccl takes without the copy kernel: D scatters its pool block by block): each D
    rank's blocks after its hit hold exactly its heads of what P held at save_kv_layer,
    its other blocks are untouched; each lane went as a chunked receive into a lease
    (never into the blocks), both sides derived the same chunks, every send paired with its own transfer's receive, every lease came
    back, and the broker counted each lane completed."""
    wire = Wire()
    p_caches = [heads_of(model(seed=7), p_tp, r) for r in range(p_tp)]
    d_caches = [heads_of(model(seed=8), d_tp, r) for r in range(d_tp)]
    ps = [on_wire(wire, rank_worker(broker.endpoint, "p", "p", r, p_tp, p_caches[r])) for r in range(p_tp)]
    ds = [on_wire(wire, rank_worker(broker.endpoint, "d", "d", r, d_tp, d_caches[r], load_timeout_s=20.0))
          for r in range(d_tp)]
    plan = lanes(HEADS, p_tp, d_tp)
    try:
        for i in range(3):
            tid, cached = f"t{i}", i % 2
            p_blocks, d_blocks = [3 + i, 7, 1, 12 - i], [5, 2 + i, 9, 14]
            g = torch.Generator().manual_seed(100 + i)
            whole = {n: torch.randn(4, HEADS, BLOCK, p_caches[0][n].shape[-1], generator=g).to(torch.bfloat16)
                     for n in LAYERS}  # this prompt's KV over every head
            for r, caches in enumerate(p_caches):
                a, b = rank_heads(HEADS, p_tp, r)
                for n in LAYERS:
                    caches[n][p_blocks] = whole[n][:, a:b]
            d_before = [{n: c.clone() for n, c in dc.items()} for dc in d_caches]
            for d in ds:
                d.bind(KvBrokerMetadata(loads={tid: LoadSpec(req_id=f"r{i}", block_ids=d_blocks,
                                                             num_cached_blocks=cached, num_tokens=4 * BLOCK - 5,
                                                             prefill="p")}))
                d.start_load_kv()
                d.clear()
            for p, caches in zip(ps, p_caches):
                p.bind(KvBrokerMetadata(saves={tid: SaveSpec(req_id=f"r{i}", block_ids=p_blocks,
                                                             num_tokens=4 * BLOCK - 5, decode="d")}))
                for name in LAYERS:
                    p.save_kv_layer(name, caches[name])
                    caches[name][p_blocks] = -7.0  # the next step writes these blocks at once
                p.wait_for_save()
                p.clear()
            deadline = time.monotonic() + 60
            for d in ds:
                finished: set[str] = set()
                while f"r{i}" not in finished:
                    assert time.monotonic() < deadline, f"no decode rank reported {tid}"
                    finished |= d.get_finished(set())[1] or set()
                    assert d.get_block_ids_with_load_errors() == set(), d.statistics()
                    engine_step_pause()
            for r, dc in enumerate(d_caches):
                a, b = rank_heads(HEADS, d_tp, r)
                for n in LAYERS:
                    for k in range(cached, 4):
                        assert torch.equal(bits(dc[n][d_blocks[k]]), bits(whole[n][k, a:b])), (tid, r, n, k)
                    untouched = [x for x in range(NUM_BLOCKS) if x not in d_blocks[cached:]]
                    assert torch.equal(bits(dc[n][untouched]), bits(d_before[r][n][untouched])), (tid, r, n)
        sends = [op for op in wire.ops if op[0] == "send"]
        recvs = [op for op in wire.ops if op[0] == "recv"]
        assert len(sends) == len(recvs) == 3 * len(plan)
        assert {(src, dst) for _, _, src, dst, _ in sends} == {(f"p:{lane.source}", f"d:{lane.rank}") for lane in plan}
        assert not any(blocks for *_, blocks in wire.ops), "a lane went from or into whole blocks"
        assert wire.unpaired == []
        # A lane of all the source rank's heads goes from its staging as it is; others from a cut.
        assert wire.cut == {(f"p:{lane.source}", f"d:{lane.rank}"):
                            (lane.start, lane.stop) != rank_heads(HEADS, p_tp, lane.source) for lane in plan}
        wait_until(lambda: broker.status()["counters"]["completed"] == 3 * len(plan), 10, "the lanes' Dones")
        wait_until(lambda: all(p.statistics()["staged_now"] == 0 for p in ps), 10, "every prefill rank released")
        for w in ps + ds:
            assert w.pool is not None
            wait_until(lambda w=w: w.pool.statistics().reserved == 0, 10, "every lease back in its pool")
        assert sum(d.statistics()["loaded"] for d in ds) == 3 * d_tp
    finally:
        for w in ds + ps:
            w.close()


@pytest.mark.slow
def test_hetero_a_lane_the_wire_cannot_pair_fails_the_load_and_frees_every_lease(broker: BrokerProcess) -> None:
    """P TP 2 -> D TP 1 over the link: P rank 1's send is cut short (its op aborted, as a
    communicator's timeout does). D's one rank cannot have all its heads: its load fails
    with every block reported, well before its deadline, the other lane's op is ended
    too, and every lease on both sides goes back."""
    wire = Wire()
    p_caches = [heads_of(model(seed=9), 2, r) for r in range(2)]
    d_caches = heads_of(model(seed=10), 1, 0)
    ps = [on_wire(wire, rank_worker(broker.endpoint, "p", "p", r, 2, p_caches[r], load_timeout_s=40.0))
          for r in range(2)]
    d = on_wire(wire, rank_worker(broker.endpoint, "d", "d", 0, 1, d_caches, load_timeout_s=40.0))
    real_send = WireLink.send

    async def cut_short(self: WireLink, decode: str, transfer_id: str, *args: Any, **kw: Any) -> Waited:
        if self.me == "p:1":
            raise TransferFailed(transfer_id, "the NCCL send with d:0 was cut short: its communicator was aborted")
        return await real_send(self, decode, transfer_id, *args, **kw)

    ps[1].nccl.send = cut_short.__get__(ps[1].nccl)  # type: ignore[union-attr,method-assign]
    try:
        d.bind(KvBrokerMetadata(loads={"t": LoadSpec(req_id="r", block_ids=[4, 5], num_cached_blocks=0,
                                                     num_tokens=2 * BLOCK - 3, prefill="p")}))
        d.start_load_kv()
        d.clear()
        for p, caches in zip(ps, p_caches):
            p.bind(KvBrokerMetadata(saves={"t": SaveSpec(req_id="r", block_ids=[1, 2], num_tokens=2 * BLOCK - 3,
                                                         decode="d")}))
            for name in LAYERS:
                p.save_kv_layer(name, caches[name])
            p.wait_for_save()
            p.clear()
        t0 = time.monotonic()
        errors: set[int] = set()
        finished: set[str] = set()
        while "r" not in finished:
            assert time.monotonic() - t0 < 25, "the load did not fail well before its deadline"
            finished |= d.get_finished(set())[1] or set()
            errors |= d.get_block_ids_with_load_errors()
            engine_step_pause()
        assert errors == {4, 5} and d.statistics()["failed"] == 1 and d.statistics()["loaded"] == 0
        wait_until(lambda: all(p.statistics()["staged_now"] == 0 for p in ps), 10, "both prefill ranks released")
        for w in [*ps, d]:
            assert w.pool is not None
            wait_until(lambda w=w: w.pool.statistics().reserved == 0, 10, "every lease back in its pool")
    finally:
        for w in [d, *ps]:
            w.close()
