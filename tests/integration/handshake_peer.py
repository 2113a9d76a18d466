"""A control-plane-only peer process: real BrokerClient, no data.

prefill: offers --count transfers and exits once each was released or aborted.
decode:  answers Prepare with Ready then Done, until --count transfers are done.
Prints one JSON line of counts on stdout when finished.
"""

from __future__ import annotations

import argparse
import json
import sys

import anyio

from protocols.logs import configure_logging
from protocols.messages import Abort, Go, Prepare, Register, Release
from workers.client import BrokerClient, ClientConfig, NullHandler


class Peer(NullHandler):
    def __init__(self, count: int) -> None:
        self.count = count
        self.counts = {"go": 0, "released": 0, "aborted": 0, "done": 0}
        self.finished = anyio.Event()
        self.client: BrokerClient | None = None

    def _tick(self, key: str) -> None:
        self.counts[key] += 1
        if self.counts["released"] + self.counts["aborted"] >= self.count or self.counts["done"] >= self.count:
            self.finished.set()

    async def on_prepare(self, msg: Prepare) -> None:
        assert self.client is not None
        await self.client.ready(msg.transfer_id, msg.nbytes)
        await self.client.done(msg.transfer_id, msg.nbytes)
        self._tick("done")

    async def on_go(self, msg: Go) -> None:
        self.counts["go"] += 1

    async def on_release(self, msg: Release) -> None:
        self._tick("released")

    async def on_abort(self, msg: Abort) -> None:
        self._tick("aborted")


async def main(args: argparse.Namespace) -> None:
    peer = Peer(args.count)
    reg = Register(
        role=args.role,
        instance_id=args.instance,
        pool_capacity=args.pool if args.role == "decode" else 0,
        compat_hash="test-model",
        endpoints={"tcp": "tcp://127.0.0.1:1"},
    )
    client = BrokerClient(ClientConfig(broker=args.broker, register_timeout_s=10), reg, peer)
    peer.client = client
    async with anyio.create_task_group() as tg:
        await tg.start(client.run)
        print(json.dumps({"registered": True}), flush=True)
        with anyio.fail_after(args.timeout):
            if args.role == "prefill":
                for i in range(args.count):
                    await client.offer(f"{args.instance}-{i}", args.nbytes)
            await peer.finished.wait()
        await client.goodbye()
        tg.cancel_scope.cancel()
    print(json.dumps({**peer.counts, "registrations": client.registrations}), flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--broker", required=True)
    ap.add_argument("--role", choices=["prefill", "decode"], required=True)
    ap.add_argument("--instance", required=True)
    ap.add_argument("--count", type=int, default=100)
    ap.add_argument("--nbytes", type=int, default=1 << 20)
    ap.add_argument("--pool", type=int, default=8 << 20)
    ap.add_argument("--timeout", type=float, default=60)
    ap.add_argument("--backend", default="asyncio")
    a = ap.parse_args()
    configure_logging("json", "warning", sys.stderr)
    anyio.run(main, a, backend=a.backend)
