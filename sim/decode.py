"""The simulated decode worker: reserve pool room, receive over TCP, scatter, verify, report Done.

On each Prepare it:

1. leases `nbytes` from its receive pool (under `prepare_timeout_s`; the broker only
   sends Prepare once its credit ledger has room, so the wait is short);
2. registers the lease with its `TcpReceiver`, *then* tells the broker Ready, so P's
   bytes land straight in the lease;
3. waits for the payload under `recv_timeout_s`; a failed or missing stream, or an
   Abort from the broker (P died, the lease ended), ends the wait with a load error:
   the transfer is counted `failed` and reported, never left hanging;
4. scatters the staged blocks into blocks of its own paged cache and compares every
   byte with the content recomputed from the seed in the transfer id; a mismatch is
   counted `corrupt` and aborted, a match is reported Done (remote visibility: the
   bytes are in D's cache);
5. frees the lease and the blocks. Cache work (steps 4-5) runs on a worker thread, one
   step at a time, like a model beside the connector's event loop; blocks are taken
   and freed within one step, so concurrent transfers never compete for cache blocks.

The pool's free bytes ride on every heartbeat. stdout gets one JSON ``transfer`` line
per transfer and a ``summary`` on SIGTERM/SIGINT; logs go to stderr as JSON.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc
import anyio.to_thread
import structlog
import torch

from protocols.errors import TransferFailed
from protocols.messages import Abort, Go, Prepare, Register, Registered, Relay, Release
from workers.client import BrokerClient, ClientConfig
from workers.pool import BufferPool, Lease, PoolTooSmall
from sim.kv import CacheGeometry, PagedCache, seed_of
from sim.report import add_geometry_args, describe_error, emit, geometry_from_args
from workers.transports.tcp import TcpConfig, TcpReceiver

MiB = 1 << 20


@dataclass(frozen=True)
class DecodeConfig:
    broker: str = "tcp://127.0.0.1:7100"
    instance: str = "d0"
    pool_bytes: int = 32 * MiB
    host: str = "127.0.0.1"
    port: int = 0
    geometry: CacheGeometry = field(default_factory=CacheGeometry)
    prepare_timeout_s: float = 10.0  # longest wait for pool room after Prepare
    recv_timeout_s: float = 30.0  # longest wait for the payload after Ready
    stall_after: int | None = None  # fault injection: hold every transfer after this many completions
    tcp: TcpConfig = field(default_factory=TcpConfig)


@dataclass
class _Receiving:
    attempt: int
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    lease: Lease | None = None
    expecting: bool = False
    abort_reason: str | None = None


class DecodeWorker:
    """One simulated decode instance: a cache, a receive pool, a TCP receiver and a broker client."""

    def __init__(self, config: DecodeConfig, *, out: Any = None) -> None:
        self.config = config
        self.out = out
        self.cache = PagedCache(config.geometry)
        self.pool = BufferPool(-(-config.pool_bytes // 4096) * 4096, alignment=4096)
        ctx = {"role": "decode", "instance": config.instance}
        self.log = structlog.get_logger("kvbroker.sim").bind(**ctx)
        self.receiver = TcpReceiver(config.host, config.port, config=config.tcp, log_context=ctx)
        self.client: BrokerClient | None = None
        self.active: dict[str, _Receiving] = {}
        self.counters = {
            k: 0 for k in ("prepared", "redelivered", "completed", "corrupt", "failed", "bytes", "held")
        }
        self.peak_reserved = 0
        self.over_capacity = 0
        self._stop = anyio.Event()
        # Cache work runs on a worker thread, one step at a time, like a model beside the
        # connector's loop; blocks are taken and freed within one step.
        self._model_thread = anyio.CapacityLimiter(1)
        self._started = 0.0

    async def serve(self, *, task_status: anyio.abc.TaskStatus[Registered] = anyio.TASK_STATUS_IGNORED) -> dict[str, Any]:
        """Register and receive until `stop()` (or cancellation); return the summary."""
        self._started = time.monotonic()
        g = self.config.geometry
        endpoint = self.receiver.start()
        self.client = BrokerClient(
            ClientConfig(broker=self.config.broker),
            Register(
                role="decode",
                instance_id=self.config.instance,
                endpoints={"tcp": endpoint},
                pool_capacity=self.pool.capacity,
                pool_alignment=self.pool.alignment,
                compat_hash=g.compat_hash(),
                compat=g.compat(),
            ),
            handler=self,
            pool_free=lambda: self.pool.statistics().free,
        )
        try:
            async with anyio.create_task_group() as tg:
                registered = await tg.start(self.client.run)
                emit(
                    self.out,
                    {
                        "event": "ready",
                        "role": "decode",
                        "instance": self.config.instance,
                        "peer": registered.peer_id,
                        "endpoint": endpoint,
                        "pool_capacity": self.pool.capacity,
                    },
                )
                task_status.started(registered)
                try:
                    await self._stop.wait()
                finally:
                    with anyio.CancelScope(shield=True):
                        await self.client.goodbye()
                    tg.cancel_scope.cancel()
        finally:
            # Shielded: a cancelled serve must still join the receiver's threads.
            with anyio.CancelScope(shield=True):
                await self.receiver.aclose()
        summary = self.summary()
        emit(self.out, summary)
        return summary

    def stop(self) -> None:
        self._stop.set()

    # -- TransferHandler ----------------------------------------------------------

    async def on_prepare(self, msg: Prepare) -> None:
        tid = msg.transfer_id
        rec = _Receiving(msg.attempt)
        self.active[tid] = rec
        self.counters["prepared"] += 1
        if msg.attempt:
            self.counters["redelivered"] += 1
        self._step("prepare", tid, attempt=msg.attempt, nbytes=msg.nbytes, prefill=msg.source)
        outcome, reason = "failed", ""
        try:
            with rec.scope:
                outcome, reason = await self._receive(msg, rec)
            if rec.scope.cancelled_caught:
                outcome, reason = "failed", f"aborted by the broker: {rec.abort_reason}"
        except Exception as exc:  # never let one transfer take the client down
            outcome, reason = "failed", f"decode worker error: {describe_error(exc)}"
            self.log.exception("transfer.crashed", transfer_id=tid, phase="crashed")
            await self._abort(tid, reason)
        finally:
            if rec.expecting:
                await self.receiver.cancel(tid, reason or "transfer ended")
            if rec.lease is not None:
                rec.lease.release()
            self.active.pop(tid, None)
        if outcome != "done":
            self.counters["failed" if outcome == "failed" else "corrupt"] += 1
            self._step(outcome, tid, level="warning", attempt=msg.attempt, reason=reason)
            self._report(tid, msg.attempt, outcome, msg.nbytes, reason)

    async def _receive(self, msg: Prepare, rec: _Receiving) -> tuple[str, str]:
        """Steps 1-4 of the module docstring; returns (outcome, reason)."""
        tid, nbytes = msg.transfer_id, msg.nbytes
        assert self.client is not None
        problem = self._check(msg)
        if problem:
            return "failed", await self._abort(tid, problem)
        try:
            with anyio.fail_after(self.config.prepare_timeout_s):
                rec.lease = await self.pool.acquire(nbytes)
        except PoolTooSmall as exc:
            return "failed", await self._abort(tid, str(exc))
        except TimeoutError:
            return "failed", await self._abort(
                tid, f"no room for {nbytes} B in the {self.pool.capacity} B receive pool within {self.config.prepare_timeout_s:g} s"
            )
        self._note_pool()
        completion = self.receiver.expect(tid, msg.attempt, rec.lease.tensor, nbytes)
        rec.expecting = True
        await self.client.ready(tid, nbytes)
        self._step("ready", tid, attempt=msg.attempt, nbytes=nbytes)
        try:
            with anyio.fail_after(self.config.recv_timeout_s):
                await completion.wait()
        except TimeoutError:
            return "failed", await self._abort(tid, f"no data within {self.config.recv_timeout_s:g} s after Ready")
        except TransferFailed as exc:
            rec.expecting = False
            return "failed", await self._abort(tid, exc.reason)
        rec.expecting = False
        self._step("received", tid, attempt=msg.attempt, nbytes=nbytes)
        if self.config.stall_after is not None and self.counters["completed"] >= self.config.stall_after:
            self.counters["held"] += 1
            emit(self.out, {"event": "holding", "role": "decode", "instance": self.config.instance, "transfer_id": tid})
            await anyio.sleep_forever()  # a hung decode worker: only an Abort or a kill ends this
        seed = seed_of(tid)
        assert seed is not None  # checked by _check
        wrong = await anyio.to_thread.run_sync(
            self._load_and_verify, seed, msg.layout.num_blocks, rec.lease, limiter=self._model_thread
        )
        if wrong:
            return "corrupt", await self._abort(tid, f"corrupt: {wrong} of {msg.layout.num_layers} layers differ from prompt {seed}")
        # The bytes are in the cache now: free the lease before Done, so the credit the
        # broker hands out again on Done is free in the pool too.
        rec.lease.release()
        rec.lease = None
        self.counters["completed"] += 1
        self.counters["bytes"] += nbytes
        self._report(tid, msg.attempt, "done", nbytes)
        await self.client.done(tid, nbytes)
        self._step("done", tid, attempt=msg.attempt, nbytes=nbytes)
        return "done", ""

    def _load_and_verify(self, seed: int, num_blocks: int, lease: Lease) -> int:
        """On the model thread: scatter into fresh blocks, compare with the seed's content, free them."""
        blocks = self.cache.allocate(num_blocks)
        try:
            self.cache.load(blocks, lease.tensor)
            return self.cache.verify(seed, blocks)
        finally:
            self.cache.free(blocks)

    def _check(self, msg: Prepare) -> str:
        """Why this transfer cannot be received and verified here, or "" if it can."""
        g, lay = self.config.geometry, msg.layout
        if seed_of(msg.transfer_id) is None:
            return f"transfer id {msg.transfer_id!r} carries no prompt seed (-s<seed>); the simulator cannot verify it"
        if lay.num_layers != g.num_layers or lay.block_nbytes != self.cache.layer_layout.block_nbytes:
            return (
                f"layout {lay.num_layers} layers x {lay.block_nbytes} B blocks does not match this cache's "
                f"{g.num_layers} x {self.cache.layer_layout.block_nbytes} B"
            )
        if msg.nbytes != g.transfer_nbytes(lay.num_blocks) or lay.num_blocks > g.num_blocks:
            return f"{msg.nbytes} B is not {lay.num_blocks} whole blocks of this cache ({g.num_blocks} blocks)"
        return ""

    async def on_abort(self, msg: Abort) -> None:
        rec = self.active.get(msg.transfer_id)
        if rec is None:
            self._step("abort_ignored", msg.transfer_id, reason=msg.reason)
            return
        rec.abort_reason = msg.reason
        rec.scope.cancel()

    async def on_go(self, msg: Go) -> None:
        self._step("unexpected", msg.transfer_id, level="warning", reason="Go sent to a decode worker")

    async def on_release(self, msg: Release) -> None:
        self._step("unexpected", msg.transfer_id, level="warning", reason="Release sent to a decode worker")

    async def on_relay(self, msg: Relay) -> None:
        pass

    async def _abort(self, tid: str, reason: str) -> str:
        """Tell the broker this transfer failed here (P frees its staging); return `reason`."""
        assert self.client is not None
        with anyio.move_on_after(2, shield=True):
            await self.client.abort(tid, reason)
        return reason

    # -- reporting ------------------------------------------------------------------

    def _note_pool(self) -> None:
        s = self.pool.statistics()
        self.peak_reserved = max(self.peak_reserved, s.reserved)
        if s.reserved > s.capacity or s.reserved + s.free != s.capacity:
            self.over_capacity += 1

    def _report(self, tid: str, attempt: int, outcome: str, nbytes: int, reason: str = "") -> None:
        line: dict[str, Any] = {
            "event": "transfer",
            "role": "decode",
            "instance": self.config.instance,
            "transfer_id": tid,
            "attempt": attempt,
            "outcome": outcome,
            "nbytes": nbytes,
        }
        if reason:
            line["reason"] = reason
        emit(self.out, line)

    def summary(self) -> dict[str, Any]:
        s = self.pool.statistics()
        r = self.receiver.statistics()
        return {
            "event": "summary",
            "role": "decode",
            "instance": self.config.instance,
            **self.counters,
            "pool": {
                "capacity": s.capacity,
                "reserved": s.reserved,
                "free": s.free,
                "peak_reserved": self.peak_reserved,
                "over_capacity": self.over_capacity,
            },
            "tcp": {"received": r.received, "bytes": r.bytes, "failed": r.failed, "rejected": r.rejected},
            "elapsed_s": round(time.monotonic() - self._started, 3),
        }

    def _step(self, phase: str, tid: str, level: str = "info", **fields: Any) -> None:
        getattr(self.log, level)(f"transfer.{phase}", transfer_id=tid, phase=phase, **fields)


def parse_args(argv: list[str] | None = None) -> tuple[DecodeConfig, str]:
    p = argparse.ArgumentParser(prog="python -m sim.decode", description="Simulated decode worker.")
    p.add_argument("--broker", default="tcp://127.0.0.1:7100")
    p.add_argument("--instance", default="d0")
    p.add_argument("--pool-mib", type=float, default=32, help="receive pool size")
    p.add_argument("--host", default="127.0.0.1", help="address the TCP receiver binds and advertises")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--prepare-timeout", type=float, default=10.0)
    p.add_argument("--recv-timeout", type=float, default=30.0)
    p.add_argument("--stall-after", type=int, default=None, help="fault injection: hold transfers after this many")
    p.add_argument("--log-level", default="info")
    add_geometry_args(p)
    a = p.parse_args(argv)
    return DecodeConfig(
        broker=a.broker,
        instance=a.instance,
        pool_bytes=int(a.pool_mib * MiB),
        host=a.host,
        port=a.port,
        geometry=geometry_from_args(a),
        prepare_timeout_s=a.prepare_timeout,
        recv_timeout_s=a.recv_timeout,
        stall_after=a.stall_after,
    ), a.log_level


def main(argv: list[str] | None = None) -> int:
    from protocols.logs import configure_logging

    config, level = parse_args(argv)
    configure_logging("json", level)
    torch.set_num_threads(1)
    worker = DecodeWorker(config, out=sys.stdout)

    async def guarded() -> None:
        async with anyio.create_task_group() as tg:

            async def on_signal() -> None:
                with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                    async for _ in signals:
                        worker.stop()
                        return

            tg.start_soon(on_signal)
            await worker.serve()
            tg.cancel_scope.cancel()

    try:
        anyio.run(guarded)
    except Exception as exc:  # noqa: BLE001 - one clear line for the orchestrator
        emit(sys.stdout, {"event": "error", "role": "decode", "instance": config.instance, "error": describe_error(exc)})
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
