"""The simulated prefill worker: prefill, save synchronously, reuse the blocks, offer, send on Go.

For each prompt of its workload (a seed each; repeated prompts repeat a seed) it:

1. allocates blocks from its paged cache and writes the prompt's KV into them (the
   "prefill", counted in `prefills`);
2. saves synchronously: gathers the blocks into a lease of its staging pool, so the
   copy is complete when the save returns (the fix for the seed's corruption);
3. overwrites and frees those blocks at once, as vLLM reuses freed blocks for the next
   request: from now on only the staged copy holds the prompt's KV;
4. offers the transfer to the broker (nbytes and Layout).

On Go it sends the requested byte range of the staged copy straight to the decode
worker's TCP endpoint; a Go with attempt > 0 is a re-delivery to another decode
worker after one died (`retries`), sent again from the same staged copy: the prefill
is never re-run. A failed send changes nothing: the broker re-routes or aborts. The
staging lease is freed only on Release (D has the bytes) or Abort (`failures`).

Progress goes to stdout as JSON lines (``{"event": "progress", ...}`` per finished
transfer, then one ``{"event": "summary", ...}``); logs go to stderr as JSON.
"""

from __future__ import annotations

import argparse
import random
import secrets
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import anyio
import anyio.abc
import anyio.to_thread
import structlog
import torch

from protocols.errors import TransferFailed
from protocols.messages import Abort, Go, Prepare, Register, Relay, Release
from workers.client import BrokerClient, ClientConfig
from workers.pool import BufferPool, Lease, PoolError
from sim.kv import CacheGeometry, PagedCache, transfer_id
from sim.report import add_geometry_args, describe_error, emit, geometry_from_args
from workers.transports.tcp import TcpConfig, TcpSender

MiB = 1 << 20
T = TypeVar("T")


@dataclass(frozen=True)
class PrefillConfig:
    broker: str = "tcp://127.0.0.1:7100"
    instance: str = "p0"
    prompts: int = 300
    distinct: int = 40
    min_blocks: int = 8
    max_blocks: int = 64
    seed: int = 0
    staging_bytes: int = 64 * MiB
    geometry: CacheGeometry = field(default_factory=CacheGeometry)
    stage_timeout_s: float = 30.0  # longest wait for staging room (Releases free it)
    send_timeout_s: float = 30.0  # longest one send may take, ack included
    finish_timeout_s: float = 60.0  # after the last offer, longest wait for every Release/Abort
    release_grace_s: float = 1.0  # on Release/Abort, let a send in flight finish before cutting it
    stall_after: int | None = None  # fault injection: ignore every Go after this many sends
    tcp: TcpConfig = field(default_factory=TcpConfig)


@dataclass
class _Staged:
    lease: Lease
    nbytes: int
    sends: set[anyio.CancelScope] = field(default_factory=set)
    idle: anyio.Event | None = None  # set when the last send in flight ends


class PrefillWorker:
    """One simulated prefill instance: a cache, a staging pool, a broker client and a TCP sender."""

    def __init__(self, config: PrefillConfig, *, out: Any = None) -> None:
        self.config = config
        self.out = out
        g = config.geometry
        biggest = g.transfer_nbytes(config.max_blocks)
        if not 1 <= config.min_blocks <= config.max_blocks <= g.num_blocks:
            raise ValueError(
                f"prompt lengths must satisfy 1 <= min_blocks ({config.min_blocks}) <= max_blocks "
                f"({config.max_blocks}) <= cache blocks ({g.num_blocks})"
            )
        if config.staging_bytes < biggest:
            raise ValueError(
                f"the staging pool ({config.staging_bytes} B) cannot hold the largest prompt "
                f"({config.max_blocks} blocks = {biggest} B); raise --staging-mib"
            )
        self.cache = PagedCache(g)
        self.pool = BufferPool(-(-config.staging_bytes // 4096) * 4096, alignment=4096)
        ctx = {"role": "prefill", "instance": config.instance}
        self.log = structlog.get_logger("kvbroker.sim").bind(**ctx)
        self.sender = TcpSender(config.tcp, log_context=ctx)
        self.client = BrokerClient(
            ClientConfig(broker=config.broker),
            Register(
                role="prefill",
                instance_id=config.instance,
                compat_hash=g.compat_hash(),
                compat=g.compat(),
            ),
            handler=self,
        )
        rng = random.Random(config.seed)
        self.workload = [rng.randrange(config.distinct) for _ in range(config.prompts)]
        self.run_id = secrets.token_hex(3)
        self.staged: dict[str, _Staged] = {}
        self.counters = {
            k: 0
            for k in (
                "prompts", "prefills", "offered", "released", "aborted", "local_failures",
                "retries", "sends", "send_failures", "bytes_staged", "bytes_released", "bytes_sent",
            )
        }
        self.send_s = 0.0  # summed wall time of successful sends, for the data-plane rate
        self.counters["prompts"] = config.prompts
        self.stalled = False
        self._resolved = 0
        self._all_resolved = anyio.Event()
        self._model_thread = anyio.CapacityLimiter(1)
        self._started = self._first_offer = self._last_resolved = 0.0

    def blocks_for(self, seed: int) -> int:
        """A prompt's length in blocks; the same seed gives the same length."""
        span = self.config.max_blocks - self.config.min_blocks + 1
        return self.config.min_blocks + (seed * 7919) % span

    # -- the run --------------------------------------------------------------------

    async def run(self) -> dict[str, Any]:
        """Register, run the workload, wait for every transfer to end; return the summary."""
        self._started = time.monotonic()
        async with anyio.create_task_group() as tg:
            registered = await tg.start(self.client.run)
            emit(self.out, {"event": "ready", "role": "prefill", "instance": self.config.instance, "peer": registered.peer_id})
            for index, seed in enumerate(self.workload):
                await self._prefill_and_save(index, seed)
            with anyio.move_on_after(self.config.finish_timeout_s):
                await self._all_resolved.wait()
            await self.client.goodbye()
            tg.cancel_scope.cancel()
        self.sender.close()
        summary = self.summary()
        emit(self.out, summary)
        return summary

    async def _prefill_and_save(self, index: int, seed: int) -> None:
        g = self.config.geometry
        num_blocks = self.blocks_for(seed)
        nbytes = g.transfer_nbytes(num_blocks)
        tid = transfer_id(self.config.instance, self.run_id, index, seed)
        blocks = await self._in_model_thread(self._prefill, seed, num_blocks)
        self.counters["prefills"] += 1
        try:
            with anyio.fail_after(self.config.stage_timeout_s):
                lease = await self.pool.acquire(nbytes)
        except (TimeoutError, PoolError) as exc:
            await self._in_model_thread(self._reuse, blocks)
            reason = f"no staging room for {nbytes} B within {self.config.stage_timeout_s:g} s: {exc}"
            self._step("stage_failed", tid, level="warning", reason=reason)
            self.counters["local_failures"] += 1
            self._resolve(tid)
            return
        await self._in_model_thread(self._save, blocks, lease)  # the copy is complete on return
        self.counters["bytes_staged"] += nbytes
        self.staged[tid] = _Staged(lease, nbytes)
        self._step("staged", tid, nbytes=nbytes, blocks=num_blocks, seed=seed)
        if not self._first_offer:
            self._first_offer = time.monotonic()
        await self.client.offer(tid, nbytes, self.cache.wire_layout(num_blocks))
        self.counters["offered"] += 1
        self._step("offered", tid, nbytes=nbytes)

    # -- the model thread ----------------------------------------------------------
    # Cache work runs on a worker thread, one step at a time, as a model runs beside the
    # connector's event loop: the loop keeps answering the broker and sending meanwhile.

    async def _in_model_thread(self, fn: Callable[..., T], *args: Any) -> T:
        return await anyio.to_thread.run_sync(fn, *args, limiter=self._model_thread)

    def _prefill(self, seed: int, num_blocks: int) -> list[int]:
        """The "prefill": blocks for the prompt, filled with its KV."""
        blocks = self.cache.allocate(num_blocks)
        self.cache.fill(seed, blocks)
        return blocks

    def _save(self, blocks: list[int], lease: Lease) -> None:
        """Stage the blocks into `lease`, then hand the blocks to the next request at once."""
        try:
            self.cache.stage(blocks, lease.tensor)
        finally:
            self._reuse(blocks)

    def _reuse(self, blocks: list[int]) -> None:
        self.cache.overwrite(blocks)
        self.cache.free(blocks)

    # -- TransferHandler ----------------------------------------------------------

    async def on_go(self, msg: Go) -> None:
        tid = msg.transfer_id
        staged = self.staged.get(tid)
        if staged is None:
            self._step("go_ignored", tid, level="warning", reason="nothing staged (already released or aborted)")
            return
        if msg.attempt > 0:
            self.counters["retries"] += 1
        endpoint = msg.endpoints.get("tcp")
        if endpoint is None:
            await self.client.abort(tid, f"decode peer {msg.decode} advertises no tcp endpoint; start it with the tcp transport")
            return
        if self.config.stall_after is not None and self.counters["sends"] >= self.config.stall_after:
            if not self.stalled:
                self.stalled = True
                emit(self.out, {"event": "stalled", "role": "prefill", "instance": self.config.instance})
            self._step("go_stalled", tid, level="warning", attempt=msg.attempt)
            return
        self.counters["sends"] += 1
        self._step("sending", tid, attempt=msg.attempt, decode=msg.decode, offset=msg.offset, nbytes=msg.nbytes)
        data = staged.lease.tensor[msg.offset : msg.offset + msg.nbytes]
        if not staged.sends:
            staged.idle = anyio.Event()
        t0 = time.monotonic()
        with anyio.CancelScope() as scope:
            staged.sends.add(scope)
            try:
                with anyio.fail_after(self.config.send_timeout_s):
                    await self.sender.send(endpoint, tid, msg.attempt, data)
            except (TransferFailed, TimeoutError, OSError) as exc:
                self.counters["send_failures"] += 1
                reason = getattr(exc, "reason", None) or f"no ack within {self.config.send_timeout_s:g} s"
                # The broker re-routes (a dead D) or aborts (a lease ends); nothing to do here.
                self._step("send_failed", tid, level="warning", attempt=msg.attempt, decode=msg.decode, reason=reason)
            else:
                self.counters["bytes_sent"] += msg.nbytes
                self.send_s += time.monotonic() - t0
                ms = round((time.monotonic() - t0) * 1e3, 3)
                self._step("sent", tid, attempt=msg.attempt, decode=msg.decode, nbytes=msg.nbytes, ms=ms)
            finally:
                staged.sends.discard(scope)
                if not staged.sends and staged.idle is not None:
                    staged.idle.set()
        if scope.cancelled_caught:
            self._step("send_cancelled", tid, attempt=msg.attempt, decode=msg.decode)

    async def on_release(self, msg: Release) -> None:
        staged = await self._unstage(msg.transfer_id)
        if staged is not None:
            self.counters["released"] += 1
            self.counters["bytes_released"] += staged.nbytes
            self._step("released", msg.transfer_id, nbytes=staged.nbytes)
            self._resolve(msg.transfer_id)

    async def on_abort(self, msg: Abort) -> None:
        staged = await self._unstage(msg.transfer_id)
        if staged is not None:
            self.counters["aborted"] += 1
            self._step("aborted", msg.transfer_id, level="warning", reason=msg.reason)
            self._resolve(msg.transfer_id, failed=msg.reason)

    async def on_prepare(self, msg: Prepare) -> None:
        self._step("unexpected", msg.transfer_id, level="warning", reason="Prepare sent to a prefill worker")

    async def on_relay(self, msg: Relay) -> None:
        pass

    async def _unstage(self, tid: str) -> _Staged | None:
        """Forget a staged transfer and free its lease once no send reads it any more."""
        staged = self.staged.pop(tid, None)
        if staged is None:
            return None
        if staged.sends and staged.idle is not None:
            with anyio.move_on_after(self.config.release_grace_s):
                await staged.idle.wait()
            for scope in list(staged.sends):
                scope.cancel()
            with anyio.CancelScope(shield=True):
                await staged.idle.wait()  # bounded: a cancelled send lets go within io_timeout_s
        staged.lease.release()
        return staged

    # -- reporting ------------------------------------------------------------------

    def _resolve(self, tid: str, failed: str | None = None) -> None:
        self._resolved += 1
        self._last_resolved = time.monotonic()
        line: dict[str, Any] = {
            "event": "progress",
            "role": "prefill",
            "instance": self.config.instance,
            "resolved": self._resolved,
            "total": self.config.prompts,
            "transfer_id": tid,
        }
        if failed is not None:
            line["failed"] = failed
        emit(self.out, line)
        if self._resolved >= self.config.prompts:
            self._all_resolved.set()

    def summary(self) -> dict[str, Any]:
        c = dict(self.counters)
        lost = c["prompts"] - c["released"] - c["aborted"] - c["local_failures"]
        span = (self._last_resolved - self._first_offer) if self._first_offer and self._last_resolved else 0.0
        stats = self.pool.statistics()
        return {
            "event": "summary",
            "role": "prefill",
            "instance": self.config.instance,
            **c,
            "failures": c["aborted"] + c["local_failures"],
            "lost": lost,
            "transfer_s": round(span, 3),
            "elapsed_s": round(time.monotonic() - self._started, 3),
            "gbps": round(c["bytes_released"] / span / 1e9, 3) if span else 0.0,
            # Bytes over the time spent inside sends: the TCP data plane alone, per stream.
            "send_gbps": round(c["bytes_sent"] / self.send_s / 1e9, 3) if self.send_s else 0.0,
            "staging": {"capacity": stats.capacity, "reserved": stats.reserved, "free": stats.free},
        }

    def _step(self, phase: str, tid: str, level: str = "info", **fields: Any) -> None:
        getattr(self.log, level)(f"transfer.{phase}", transfer_id=tid, phase=phase, **fields)


def parse_args(argv: list[str] | None = None) -> tuple[PrefillConfig, str]:
    p = argparse.ArgumentParser(prog="python -m sim.prefill", description="Simulated prefill worker.")
    p.add_argument("--broker", default="tcp://127.0.0.1:7100")
    p.add_argument("--instance", default="p0")
    p.add_argument("--prompts", type=int, default=300, help="prompts in the workload")
    p.add_argument("--distinct", type=int, default=40, help="distinct prompts (seeds) among them; the rest repeat")
    p.add_argument("--min-blocks", type=int, default=8)
    p.add_argument("--max-blocks", type=int, default=64)
    p.add_argument("--seed", type=int, default=0, help="seed of the workload's prompt order")
    p.add_argument("--staging-mib", type=float, default=64)
    p.add_argument("--send-timeout", type=float, default=30.0)
    p.add_argument("--stage-timeout", type=float, default=30.0)
    p.add_argument("--finish-timeout", type=float, default=60.0)
    p.add_argument("--stall-after", type=int, default=None, help="fault injection: ignore Go after this many sends")
    p.add_argument("--log-level", default="info")
    add_geometry_args(p)
    a = p.parse_args(argv)
    return PrefillConfig(
        broker=a.broker,
        instance=a.instance,
        prompts=a.prompts,
        distinct=a.distinct,
        min_blocks=a.min_blocks,
        max_blocks=a.max_blocks,
        seed=a.seed,
        staging_bytes=int(a.staging_mib * MiB),
        geometry=geometry_from_args(a),
        send_timeout_s=a.send_timeout,
        stage_timeout_s=a.stage_timeout,
        finish_timeout_s=a.finish_timeout,
        stall_after=a.stall_after,
    ), a.log_level


def main(argv: list[str] | None = None) -> int:
    from protocols.logs import configure_logging

    config, level = parse_args(argv)
    configure_logging("json", level)
    torch.set_num_threads(1)
    try:
        worker = PrefillWorker(config, out=sys.stdout)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    async def guarded() -> dict[str, Any] | None:
        async with anyio.create_task_group() as tg:
            result: dict[str, Any] = {}

            async def work() -> None:
                result.update(await worker.run())
                tg.cancel_scope.cancel()

            tg.start_soon(work)
            with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for _ in signals:
                    emit(worker.out, worker.summary())
                    tg.cancel_scope.cancel()
                    break
        return result or None

    try:
        summary = anyio.run(guarded)
    except Exception as exc:  # noqa: BLE001 - one clear line for the orchestrator
        emit(sys.stdout, {"event": "error", "role": "prefill", "instance": config.instance, "error": describe_error(exc)})
        return 1
    return 0 if summary is not None and summary["lost"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
