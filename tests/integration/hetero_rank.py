"""One tensor-parallel rank of a prefill or decode instance, for heterogeneous-TP tests:
a real paged KV cache holding this rank's heads, a real BrokerClient and the tcp transport.

The model's KV of transfer i is random bytes seeded by (seed, i), over all heads; a rank
holds its heads of it (`protocols.heads.rank_heads`), read with plain indexing.

prefill: gathers each transfer's blocks into block-major staging, offers it naming the
    decode instance, and on each Go cuts out the heads the Go names (`split_heads`) and
    sends the byte range asked for. Exits once each transfer was released or aborted.
decode: expects each transfer naming the prefill instance; on each Prepare receives its
    lane's part after the blocks it "holds" already (transfer i holds i % 2 leading blocks),
    joins it into its staging (`merge_heads`), and once its heads are all in, scatters
    into its own blocks, says Done for each lane, and compares every block with the
    model's heads: a block it held is unchanged, every other one holds exactly its heads.

Both wait for a line on stdin before the first message, so every rank of both
instances is registered when lanes are planned. One JSON line of results on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys

import anyio
import torch

from protocols.heads import rank_heads
from protocols.logs import configure_logging
from protocols.messages import Abort, Go, Prepare, Register, Release
from workers.client import BrokerClient, ClientConfig, NullHandler
from workers.heads import merge_heads, split_heads
from workers.layout import (
    CacheSpec,
    detect_layout,
    gather_layer_into_staging,
    scatter_layers_from_staging,
    staging_view,
    tail,
    tail_range,
    wire_layout,
)
from workers.transports.tcp import TcpSender
from workers.transports.tcp_receiver import TcpReceiver

BLOCK_SIZE, HEAD_SIZE = 4, 8


def make_cache(kind: str, num_blocks: int, heads: int) -> torch.Tensor:
    bs, d = BLOCK_SIZE, HEAD_SIZE
    if kind == "cpu":
        return torch.empty(num_blocks, heads, bs, 2 * d, dtype=torch.bfloat16)
    if kind == "kv_first_hnd":  # physical HND, seen through the logical NHD view
        return torch.empty(2, num_blocks, heads, bs, d, dtype=torch.bfloat16).transpose(2, 3)
    return torch.empty(2, num_blocks, bs, heads, d, dtype=torch.bfloat16)


def heads_of(cache: torch.Tensor, kind: str, block: int, start: int, stop: int) -> torch.Tensor:
    if kind == "cpu":
        return cache[block, start:stop]
    return cache[:, block, :, start:stop]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """Compare bits, not values: random bytes hold NaNs, which equal nothing."""
    return t.contiguous().view(torch.uint8)


def model_kv(args: argparse.Namespace, i: int) -> list[torch.Tensor]:
    """Transfer i's KV over all heads, one [blocks]-block cache a layer."""
    gen = torch.Generator().manual_seed(args.seed * 1000 + i)
    out = []
    for _ in range(args.layers):
        t = make_cache(args.kind, args.blocks, args.heads)
        t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8, generator=gen))
        out.append(t)
    return out


class Rank(NullHandler):
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.start, self.stop = rank_heads(args.heads, args.tp, args.rank)
        self.mine = self.stop - self.start
        n = args.blocks * args.transfers + 3
        self.caches = [make_cache(args.kind, n, self.mine) for _ in range(args.layers)]
        gen = torch.Generator().manual_seed(args.seed + 7 + args.rank)
        for c in self.caches:  # garbage: every byte a transfer writes counts
            c.view(torch.uint8).copy_(torch.randint(0, 256, c.view(torch.uint8).shape, dtype=torch.uint8, generator=gen))
        hint = "kv_first" if args.kind.startswith("kv_first") else None
        self.layout = detect_layout(self.caches[0], CacheSpec(BLOCK_SIZE, self.mine, HEAD_SIZE), hint=hint)
        order = torch.randperm(n, generator=gen).tolist()
        self.block_ids = {f"t{i}": order[i * args.blocks:(i + 1) * args.blocks] for i in range(args.transfers)}
        self.client: BrokerClient | None = None
        self.peer_id = f"{args.instance}:{args.rank}"
        self.counts = {"released": 0, "aborted": 0, "sent": 0, "lanes": 0, "checked": 0, "mismatched": 0,
                       "cached_changed": 0, "aborts_seen": 0}
        self.finished = anyio.Event()
        self.sending = 0  # Gos whose send has not returned yet: a Release may come first
        self.staging: dict[str, torch.Tensor] = {}
        self.arrived: dict[str, list[tuple[str, int]]] = {}
        self.covered: dict[str, int] = {}
        self.sender: TcpSender | None = None
        self.receiver: TcpReceiver | None = None

    # -- prefill ---------------------------------------------------------------------------

    def stage_all(self) -> None:
        a = self.args
        for i in range(a.transfers):
            tid = f"t{i}"
            model = model_kv(a, i)
            ids = self.block_ids[tid]
            for layer, cache in enumerate(self.caches):
                for b, blk in enumerate(ids):
                    target = heads_of(cache, a.kind, blk, 0, self.mine)
                    target.copy_(heads_of(model[layer], a.kind, b, self.start, self.stop))
            staging = staging_view(torch.empty(a.blocks * a.layers * self.layout.block_nbytes, dtype=torch.uint8),
                                   a.blocks, a.layers, self.layout.block_nbytes)
            for layer, cache in enumerate(self.caches):
                gather_layer_into_staging(staging, layer, cache, self.layout, ids)
            self.staging[tid] = staging

    async def on_go(self, msg: Go) -> None:
        assert self.client is not None and self.sender is not None
        staging = self.staging[msg.transfer_id]
        if msg.head_stop:
            a, b = msg.head_start - self.start, msg.head_stop - self.start
            part = torch.empty(staging.shape[0] * staging.shape[1] * (self.layout.block_nbytes // self.mine * (b - a)),
                               dtype=torch.uint8)
            data = split_heads(staging, self.layout, a, b, part).view(-1)
        else:
            data = staging.view(-1)
        self.sending += 1
        try:
            await self.sender.send(msg.endpoints["tcp"], f"{msg.transfer_id}|{self.peer_id}", msg.attempt,
                                   data[msg.offset:msg.offset + msg.nbytes])
            self.counts["sent"] += 1
        finally:
            self.sending -= 1
        self._maybe_finished()

    async def on_release(self, msg: Release) -> None:
        self.counts["released"] += 1
        self._maybe_finished()

    async def on_abort(self, msg: Abort) -> None:
        self.counts["aborted" if self.args.role == "prefill" else "aborts_seen"] += 1
        print(json.dumps({"abort": msg.transfer_id, "reason": msg.reason}), file=sys.stderr, flush=True)
        self._maybe_finished()

    def _maybe_finished(self) -> None:
        c = self.counts
        # D's Done, and the Release it brings, can overtake the end of the send that fed it.
        if self.args.role == "prefill" and c["released"] + c["aborted"] >= self.args.transfers and not self.sending:
            self.finished.set()
        if self.args.role == "decode" and c["checked"] + c["aborts_seen"] >= self.args.transfers:
            self.finished.set()

    # -- decode ----------------------------------------------------------------------------

    async def on_prepare(self, msg: Prepare) -> None:
        assert self.client is not None and self.receiver is not None
        a, tid = self.args, msg.transfer_id
        cached = int(tid[1:]) % 2
        num = a.blocks - cached
        part_block = msg.layout.block_nbytes
        offset, nbytes = tail_range(a.blocks, cached, a.layers, part_block)
        buf = torch.empty(nbytes, dtype=torch.uint8)
        done = self.receiver.expect(f"{tid}|{msg.source}", msg.attempt, buf)
        await self.client.ready(tid, nbytes, offset, source=msg.source)
        with anyio.fail_after(a.timeout):
            await done.wait()
        part = staging_view(buf, num, a.layers, part_block)
        staging = self.staging.setdefault(tid, staging_view(
            torch.zeros(num * a.layers * self.layout.block_nbytes, dtype=torch.uint8), num, a.layers,
            self.layout.block_nbytes))
        if msg.head_stop:
            merge_heads(part, self.layout, msg.head_start - self.start, msg.head_stop - self.start, staging)
            got = msg.head_stop - msg.head_start
        else:
            staging.copy_(part)
            got = self.mine
        self.counts["lanes"] += 1
        arrived = self.arrived.setdefault(tid, [])
        arrived.append((msg.source, nbytes))
        self.covered[tid] = self.covered.get(tid, 0) + got
        if self.covered[tid] < self.mine:
            return  # more lanes to come: the rank's heads are not all in
        ids = self.block_ids[tid]
        before = [heads_of(c, a.kind, blk, 0, self.mine).clone() for c in self.caches for blk in ids[:cached]]
        scatter_layers_from_staging(staging, [(c, self.layout) for c in self.caches], list(tail(ids, cached)))
        for source, n in arrived:
            await self.client.done(tid, n, source=source)
        after = [heads_of(c, a.kind, blk, 0, self.mine) for c in self.caches for blk in ids[:cached]]
        self.counts["cached_changed"] += sum(not torch.equal(_bytes(x), _bytes(y)) for x, y in zip(before, after))
        model = model_kv(a, int(tid[1:]))
        for layer, cache in enumerate(self.caches):
            for b in range(cached, a.blocks):
                got_t = heads_of(cache, a.kind, ids[b], 0, self.mine)
                want = heads_of(model[layer], a.kind, b, self.start, self.stop)
                if not torch.equal(_bytes(got_t), _bytes(want)):
                    self.counts["mismatched"] += 1
        self.counts["checked"] += 1
        self._maybe_finished()


async def main(args: argparse.Namespace) -> None:
    rank = Rank(args)
    decode = args.role == "decode"
    endpoints = {}
    if decode:
        rank.receiver = TcpReceiver("127.0.0.1", 0)
        endpoints["tcp"] = rank.receiver.start()
    else:
        rank.sender = TcpSender()
        rank.stage_all()
    reg = Register(
        role=args.role, instance_id=args.instance, rank=args.rank, world_size=args.tp, endpoints=endpoints,
        pool_capacity=64 << 20 if decode else 0, compat_hash="tiny", kv_heads=args.heads, claims_only=decode,
    )
    client = BrokerClient(ClientConfig(broker=args.broker, register_timeout_s=20), reg, rank)
    rank.client = client
    async with anyio.create_task_group() as tg:
        await tg.start(client.run)
        print(json.dumps({"registered": True}), flush=True)
        await anyio.to_thread.run_sync(sys.stdin.readline)
        with anyio.fail_after(args.timeout):
            for i in range(args.transfers):
                if decode:
                    await client.expect(f"t{i}", args.other)
                else:
                    nbytes = int(rank.staging[f"t{i}"].numel())
                    await client.offer(f"t{i}", nbytes, wire_layout(rank.layout, args.layers, args.blocks), args.other)
            await rank.finished.wait()
        await client.goodbye()
        tg.cancel_scope.cancel()
    if rank.sender is not None:
        rank.sender.close()
    if rank.receiver is not None:
        rank.receiver.close()
    print(json.dumps(rank.counts), flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--broker", required=True)
    ap.add_argument("--role", choices=["prefill", "decode"], required=True)
    ap.add_argument("--instance", required=True)
    ap.add_argument("--other", required=True, help="the other role's instance id")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kind", default="kv_first")
    ap.add_argument("--transfers", type=int, default=4)
    ap.add_argument("--blocks", type=int, default=3)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=60)
    configure_logging("json", "warning", sys.stderr)
    torch.set_num_threads(1)
    anyio.run(main, ap.parse_args())
