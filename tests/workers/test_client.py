"""The broker client against a real broker process: it outlives handler bugs and refusals."""

from __future__ import annotations

import threading
from pathlib import Path

import anyio
import pytest
import zmq

from protocols.codec import Codec
from protocols.messages import Go, Goodbye, Prepare, Register, Registered
from broker.status import fetch_status
from tests.support import BrokerProcess, wait_until
from workers.client import BrokerClient, ClientConfig, NullHandler, SyncBrokerClient

pytestmark = [pytest.mark.slow, pytest.mark.anyio]


class Decode(NullHandler):
    client: BrokerClient

    async def on_prepare(self, msg: Prepare) -> None:
        await self.client.ready(msg.transfer_id, msg.nbytes)


async def test_a_failing_handler_does_not_end_the_session(tmp_path: Path, anyio_backend: str) -> None:
    broker = BrokerProcess(tmp_path)
    broker.start()

    class Prefill(NullHandler):
        def __init__(self) -> None:
            self.gone: list[str] = []
            self.second = anyio.Event()

        async def on_go(self, msg: Go) -> None:
            self.gone.append(msg.transfer_id)
            if msg.transfer_id == "t1":
                raise ValueError("a bug in one transfer's handling")
            self.second.set()

    handler, dec = Prefill(), Decode()
    cfg = ClientConfig(broker=broker.endpoint)
    p = BrokerClient(cfg, Register(role="prefill", instance_id="p", compat_hash="h"), handler)
    d = BrokerClient(cfg, Register(role="decode", instance_id="d", pool_capacity=1 << 20, compat_hash="h"), dec)
    dec.client = d
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(p.run)
            await tg.start(d.run)
            with anyio.fail_after(10):
                await p.offer("t1", 10)
                while handler.gone != ["t1"]:
                    await anyio.sleep(0.01)
                await p.offer("t2", 10)
                await handler.second.wait()
            assert p.connected and p.registrations == 1
            tg.cancel_scope.cancel()
    finally:
        broker.stop()


async def test_a_refused_reregistration_is_retried(tmp_path: Path, anyio_backend: str) -> None:
    broker = BrokerProcess(tmp_path, "--heartbeat", "0.2", "--peer-lease", "1")
    broker.start()
    p = BrokerClient(
        ClientConfig(broker=broker.endpoint, reconnect_max_s=0.5), Register(role="prefill", instance_id="p", compat_hash="A")
    )
    ctx = zmq.Context()
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(p.run)
            broker.stop()
            broker.start()
            # A decode peer of another model is first at the restarted broker: P is refused.
            codec = Codec()
            other = ctx.socket(zmq.DEALER)
            other.setsockopt(zmq.LINGER, 0)
            other.connect(broker.endpoint)
            other.send(codec.encode(Register(role="decode", instance_id="d-other", pool_capacity=10, compat_hash="B")))
            with anyio.fail_after(20):
                while not isinstance(codec.decode(other.recv(zmq.NOBLOCK)) if other.poll(0) else None, Registered):
                    await anyio.sleep(0.01)
                while '"code":"refused"' not in broker.log_path.read_text():
                    await anyio.sleep(0.02)
                assert p.registrations == 1 and not p.connected
                other.send(codec.encode(Goodbye()))
                while p.registrations < 2:
                    await anyio.sleep(0.02)
            assert p.connected
            tg.cancel_scope.cancel()
    finally:
        ctx.destroy(linger=0)
        broker.stop()


async def test_an_offer_made_while_the_broker_is_down_goes_out_once(tmp_path: Path, anyio_backend: str) -> None:
    """The Offer waits for the restarted broker; registering again re-sends it with the
    other tracked ones, and the waiting send then does not send it a second time."""
    broker = BrokerProcess(tmp_path, "--heartbeat", "0.2", "--peer-lease", "1")
    broker.start()
    p = BrokerClient(
        ClientConfig(broker=broker.endpoint, reconnect_max_s=0.2), Register(role="prefill", instance_id="p", compat_hash="A")
    )
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(p.run)
            broker.kill()
            with anyio.fail_after(10):
                while p.connected:  # the broker's silence ends the session after its 1 s lease
                    await anyio.sleep(0.02)
            sent = anyio.Event()

            async def offer() -> None:
                await p.offer("t-down", 64)
                sent.set()

            tg.start_soon(offer)
            broker.start()
            with anyio.fail_after(20):
                await sent.wait()
            assert p.registrations == 2
            counters = broker.status()["counters"]
            assert (counters["offered"], counters["repeated"], counters["errors"]) == (1, 0, 0), counters
            tg.cancel_scope.cancel()
    finally:
        broker.stop()


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_the_sync_client_runs_spawned_tasks_and_reports_their_failures(tmp_path: Path, backend: str) -> None:
    """`SyncBrokerClient` as a context manager: `spawn` runs a coroutine on the client's
    loop (here an Offer the broker then lists), a raising one reaches `on_task_error`,
    and leaving the block says goodbye and stops the loop."""
    broker = BrokerProcess(tmp_path)
    broker.start()
    failures: list[tuple[str, str]] = []
    failed = threading.Event()

    def on_error(name: str, exc: Exception) -> None:
        failures.append((name, str(exc)))
        failed.set()

    async def broken() -> None:
        raise ValueError("boom")

    try:
        reg = Register(role="prefill", instance_id="p", compat_hash="h")
        with SyncBrokerClient(BrokerClient(ClientConfig(broker=broker.endpoint), reg, NullHandler()), backend,
                              on_task_error=on_error) as sync:
            sync.spawn(sync.client.offer, "t-spawned", 1024)
            sync.spawn(broken)
            assert failed.wait(10), "the failing task was never reported"
            def offered() -> bool:
                status = anyio.run(fetch_status, broker.endpoint)
                return "t-spawned" in {t.transfer_id for t in status.transfers}

            wait_until(offered, 10, "the spawned Offer at the broker")
        assert failures == [("broken", "boom")]
        with pytest.raises(RuntimeError):
            sync.spawn(broken)  # the loop has stopped
    finally:
        broker.stop()
