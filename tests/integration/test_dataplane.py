"""The data plane end to end: staged saves, backpressure, oversized transfers, dead workers.

The simulated workers (`sim/`) carry real paged caches, a real broker and real
TCP; process tests kill them with SIGKILL and check that nothing hangs, nothing is
corrupted and every credit comes back.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import queue
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
import torch

from broker.status import fetch_status
from sim.decode import DecodeConfig, DecodeWorker
from sim.demo import Child
from sim.kv import CacheGeometry, PagedCache
from sim.prefill import PrefillConfig, PrefillWorker
from tests.support import BrokerProcess, wait_until
from workers.pool import BufferPool
from workers.transports.tcp import TcpReceiver, TcpSender

MiB = 1 << 20
PY = [sys.executable, "-m"]


def digest(t: torch.Tensor) -> bytes:
    return hashlib.blake2b(memoryview(t.numpy())).digest()


# -- the seed's bug: repeated prompts, blocks reused right after the save ------------------


@pytest.fixture
def one_torch_thread():
    """On a small host, torch's intra-op workers spin between ops and starve the transport's
    threads (a 2-core machine ran this test 15x slower); a worker process sets this too."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_repeated_prompts_arrive_as_saved_although_their_blocks_are_reused_at_once(one_torch_thread: None) -> None:
    """2,000 saves of three identical prompts; each source block is overwritten as soon as
    the save returns, and the bytes are sent only afterwards, from another thread."""
    g = CacheGeometry()
    p_cache, d_cache = PagedCache(g), PagedCache(g)
    staging, receive = BufferPool(8 * MiB, alignment=4096), BufferPool(8 * MiB, alignment=4096)
    lengths = {0: 4, 1: 5, 2: 6}
    reference = {}
    for seed, n in lengths.items():
        blocks = p_cache.allocate(n)
        p_cache.fill(seed, blocks)
        with staging.acquire_nowait(g.transfer_nbytes(n)) as lease:
            p_cache.stage(blocks, lease.tensor)
            reference[seed] = digest(lease.tensor)
            p_cache.overwrite(blocks)
            after = torch.empty_like(lease.tensor)
            p_cache.stage(blocks, after)
            assert digest(after) != reference[seed], "overwriting must change what the source blocks hold"
        p_cache.free(blocks)

    to_send: queue.Queue[Any] = queue.Queue(maxsize=4)
    errors: list[BaseException] = []
    with TcpReceiver() as rx, TcpSender() as tx:

        def send_loop() -> None:
            while (item := to_send.get()) is not None:
                tid, lease = item
                try:
                    tx.send_blocking(rx.endpoint, tid, 0, lease.tensor)
                except BaseException as exc:  # noqa: BLE001 - reported below
                    errors.append(exc)
                finally:
                    lease.release()

        sender = threading.Thread(target=send_loop, name="test-sender")
        sender.start()
        pending: list[tuple[int, int, Any, Any]] = []
        checked = 0

        def check_oldest() -> None:
            nonlocal checked
            i, seed, done, lease = pending.pop(0)
            done.wait_blocking(10)
            assert digest(lease.tensor) == reference[seed], f"transfer {i} (prompt {seed}) arrived altered"
            if i % 97 == 0:  # through the decode side's cache as well, now and then
                blocks = d_cache.allocate(lengths[seed])
                d_cache.load(blocks, lease.tensor)
                assert d_cache.verify(seed, blocks) == 0
                d_cache.free(blocks)
            lease.release()
            checked += 1

        try:
            for i in range(2000):
                seed = i % 3
                n = lengths[seed]
                nbytes = g.transfer_nbytes(n)
                d_lease = receive.acquire_nowait(nbytes)
                done = rx.expect(f"rep-{i}-s{seed}", 0, d_lease.tensor)
                blocks = p_cache.allocate(n)
                p_cache.fill(seed, blocks)  # the prefill
                p_lease = staging.acquire_nowait(nbytes)
                p_cache.stage(blocks, p_lease.tensor)  # the save: complete on return
                p_cache.overwrite(blocks)  # the blocks go to the next request at once
                p_cache.free(blocks)
                to_send.put((f"rep-{i}-s{seed}", p_lease))
                pending.append((i, seed, done, d_lease))
                if len(pending) > 6:
                    check_oldest()
            while pending:
                check_oldest()
        finally:
            to_send.put(None)
            sender.join(30)
    assert not errors, errors[:3]
    assert checked == 2000
    assert staging.statistics().free == staging.capacity
    assert receive.statistics().free == receive.capacity


# -- broker process + in-process workers ----------------------------------------------------


@pytest.fixture
def broker(tmp_path: Path):
    # A lease of a few heartbeats: short enough for fast eviction tests, long enough that a
    # busy 2-core machine does not evict a live worker.
    b = BrokerProcess(tmp_path, "--heartbeat", "0.3", "--peer-lease", "3.0", "--transfer-lease", "20")
    b.start()
    yield b
    assert b.stop() == 0, b.log_path.read_text()


def lines(out: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.getvalue().splitlines() if line.strip()]


@pytest.mark.slow
@pytest.mark.anyio
async def test_backpressure_with_a_pool_a_tenth_of_the_demand(broker: BrokerProcess, one_torch_thread: None) -> None:
    g = CacheGeometry()
    prefill = PrefillWorker(
        PrefillConfig(broker=broker.endpoint, instance="p-bp", prompts=60, distinct=12, min_blocks=8, max_blocks=16)
    )
    demand = sum(g.transfer_nbytes(prefill.blocks_for(s)) for s in prefill.workload)
    pool_bytes = -(-demand // 10 // 4096) * 4096
    assert pool_bytes >= g.transfer_nbytes(16), "the pool must still fit the largest transfer"
    decode = DecodeWorker(DecodeConfig(broker=broker.endpoint, instance="d-bp", pool_bytes=pool_bytes))
    samples = 0
    waiting_seen = 0

    async def watch() -> None:
        nonlocal samples, waiting_seen
        while True:
            status = await fetch_status(broker.endpoint, 5)
            for pool in status.pools:
                assert 0 <= pool.reserved <= pool.capacity, pool
                assert pool.reserved + pool.free == pool.capacity, pool
                waiting_seen = max(waiting_seen, pool.waiting)
            local = decode.pool.statistics()
            assert local.reserved <= local.capacity == pool_bytes
            samples += 1

    result: dict[str, Any] = {}
    finished = anyio.Event()

    async def run_prefill() -> None:
        result.update(await prefill.run())
        finished.set()

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            # All the demand is staged and offered before the decode worker joins, so it
            # lands on the pool at once.
            tg.start_soon(run_prefill)
            while len((await fetch_status(broker.endpoint, 5)).transfers) < 60:
                pass
            await tg.start(decode.serve)
            tg.start_soon(watch)
            await finished.wait()
            decode.stop()
            tg.cancel_scope.cancel()
    summary = result
    assert summary["released"] == summary["prompts"] == 60, summary
    assert summary["failures"] == 0 and summary["lost"] == 0
    d = decode.summary()
    assert d["completed"] == 60 and d["corrupt"] == 0 and d["failed"] == 0
    assert d["pool"]["peak_reserved"] <= pool_bytes and d["pool"]["over_capacity"] == 0
    assert d["pool"]["peak_reserved"] > pool_bytes // 2, "the pool was never under pressure"
    assert waiting_seen > 0, "no transfer ever waited for credit"
    assert samples > 5
    assert d["pool"]["free"] == pool_bytes


@pytest.mark.slow
@pytest.mark.anyio
async def test_a_transfer_larger_than_the_whole_pool_fails_at_once(broker: BrokerProcess, one_torch_thread: None) -> None:
    g = CacheGeometry()
    out = io.StringIO()
    prefill = PrefillWorker(
        PrefillConfig(broker=broker.endpoint, instance="p-big", prompts=2, min_blocks=64, max_blocks=64), out=out
    )
    decode = DecodeWorker(DecodeConfig(broker=broker.endpoint, instance="d-small", pool_bytes=MiB))
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            await tg.start(decode.serve)
            t0 = time.monotonic()
            summary = await prefill.run()
            elapsed = time.monotonic() - t0
            decode.stop()
    assert summary["aborted"] == 2 and summary["released"] == 0 and summary["lost"] == 0, summary
    assert elapsed < 5, f"P waited {elapsed:.1f} s for an Abort that should come at once"
    failed = [line for line in lines(out) if line.get("event") == "progress" and "failed" in line]
    assert len(failed) == 2
    reason = failed[0]["failed"]
    assert str(g.transfer_nbytes(64)) in reason and str(MiB) in reason, reason
    assert decode.summary()["prepared"] == 0


# -- real processes, killed with SIGKILL ------------------------------------------------------


class Cluster:
    """Simulated workers as child processes; every one is ended by its PID."""

    def __init__(self, tmp: Path, broker: str) -> None:
        self.tmp, self.broker = tmp, broker
        self.events: queue.Queue[tuple[str, dict[str, Any]]] = queue.Queue()
        self.children: list[Child] = []

    def decode(self, name: str, *args: str) -> Child:
        return self._start(name, ["sim.decode", "--broker", self.broker, "--instance", name, *args])

    def prefill(self, name: str, *args: str) -> Child:
        return self._start(name, ["sim.prefill", "--broker", self.broker, "--instance", name, *args])

    def _start(self, name: str, args: list[str]) -> Child:
        child = Child(name, PY + args, self.tmp, self.events)
        self.children.append(child)
        return child

    def wait_line(self, child: Child, event: str, timeout: float) -> dict[str, Any]:
        def found() -> dict[str, Any] | None:
            line = child.last(event)
            if line is None and not child.alive() and child.last(event) is None:
                raise AssertionError(f"{child.name} exited ({child.proc.returncode}): {child.log_path.read_text()[-3000:]}")
            return line

        return wait_until(found, timeout, f"{child.name} to print {event}")

    def close(self) -> None:
        for child in reversed(self.children):
            child.end()


@pytest.fixture
def cluster(tmp_path: Path, broker: BrokerProcess):
    c = Cluster(tmp_path, broker.endpoint)
    try:
        yield c
    finally:
        c.close()


def status(broker: BrokerProcess) -> dict[str, Any]:
    """The broker's state as `kvbroker status --json` prints it, fetched in-process."""
    return msgspec.to_builtins(anyio.run(fetch_status, broker.endpoint, 5.0))


def outcomes(*children: Child) -> list[str]:
    return [line["outcome"] for c in children for line in c.lines if line.get("event") == "transfer"]


@pytest.mark.slow
def test_kill_9_of_a_decode_worker_mid_transfer_redelivers_from_the_staged_copy(
    cluster: Cluster, broker: BrokerProcess
) -> None:
    d1 = cluster.decode("d1", "--stall-after", "2")  # then holds what it received, never Done
    d2 = cluster.decode("d2")
    cluster.wait_line(d1, "ready", 60)
    cluster.wait_line(d2, "ready", 60)
    p = cluster.prefill("p1", "--prompts", "40", "--distinct", "5", "--min-blocks", "4", "--max-blocks", "12")
    cluster.wait_line(d1, "holding", 60)  # d1 has the bytes of a transfer it will never finish
    os.kill(d1.proc.pid, signal.SIGKILL)
    d1.proc.wait(10)
    s = cluster.wait_line(p, "summary", 60)
    assert s["prefills"] == s["prompts"] == 40, "a transfer was prefilled again instead of re-sent"
    assert s["retries"] > 0, s
    assert s["released"] == 40 and s["failures"] == 0 and s["lost"] == 0, s
    assert "corrupt" not in outcomes(d1, d2)
    assert outcomes(d2).count("done") + outcomes(d1).count("done") >= 40

    def settled() -> dict[str, Any] | None:
        st = status(broker)
        return st if not st["transfers"] and all(q["free"] == q["capacity"] for q in st["pools"]) else None

    st = wait_until(settled, 10, "every transfer to end and every pool to be full")
    assert [q["peer_id"] for q in st["pools"]] == ["d2:0"], "the dead worker's pool must be gone"
    d2.end()
    final = d2.last("summary")
    assert final is not None and final["pool"]["free"] == final["pool"]["capacity"], final
    assert final["corrupt"] == 0 and final["redelivered"] > 0


@pytest.mark.slow
def test_kill_9_of_the_prefill_worker_ends_the_decode_wait_with_a_load_error(
    cluster: Cluster, broker: BrokerProcess
) -> None:
    d = cluster.decode("d1", "--recv-timeout", "30")
    cluster.wait_line(d, "ready", 60)
    p = cluster.prefill("p1", "--prompts", "3", "--distinct", "3", "--min-blocks", "4", "--max-blocks", "6", "--stall-after", "0")
    cluster.wait_line(p, "stalled", 60)  # a Go arrived: D has sent Ready and waits for bytes
    # The first Go can come before P has offered its other prompts; D learns of a transfer
    # only through its Prepare, so all three must have reached D (a Go sent) before P dies.
    wait_until(lambda: [t["state"] for t in status(broker)["transfers"]] == ["sending"] * 3, 30,
               "all three transfers to have their Go sent")
    killed = time.monotonic()
    os.kill(p.proc.pid, signal.SIGKILL)
    p.proc.wait(10)

    def failed() -> list[dict[str, Any]]:
        return [line for line in d.lines if line.get("event") == "transfer" and line["outcome"] == "failed"]

    ended = wait_until(lambda: len(failed()) == 3 and failed(), 15, "D to report its three transfers failed")
    waited = time.monotonic() - killed
    assert waited < 10, f"D waited {waited:.1f} s; the peer lease is 3 s and the transfer lease 20 s"
    for line in ended:
        assert "prefill peer p1:0 was lost" in line["reason"], line
    st = wait_until(lambda: (s := status(broker)) and not s["transfers"] and s, 10, "the broker to forget the transfers")
    assert all(q["free"] == q["capacity"] for q in st["pools"])
    d.end()
    final = d.last("summary")
    assert final is not None and final["failed"] == 3 and final["completed"] == 0
    assert final["pool"]["free"] == final["pool"]["capacity"]
