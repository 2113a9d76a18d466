"""Rendezvous payloads travel between two real clients through a real broker process."""

from __future__ import annotations

import queue
import threading
import time
from pathlib import Path

import pytest

from protocols.messages import Register
from tests.support import BrokerProcess
from workers.client import BrokerClient, ClientConfig, NullHandler, SyncBrokerClient
from protocols.errors import RendezvousError
from workers.rendezvous import BrokerRendezvous, RendezvousTimeout

pytestmark = pytest.mark.slow


class Relaying(NullHandler):
    def __init__(self) -> None:
        self.rendezvous: BrokerRendezvous | None = None

    async def on_relay(self, msg) -> None:  # type: ignore[no-untyped-def]
        assert self.rendezvous is not None
        await self.rendezvous.on_relay(msg)


def peer(endpoint: str, role: str, name: str) -> tuple[SyncBrokerClient, BrokerRendezvous]:
    handler = Relaying()
    reg = Register(role=role, instance_id=name, pool_capacity=1 << 20 if role == "decode" else 0, compat_hash="h")  # type: ignore[arg-type]
    sync = SyncBrokerClient(BrokerClient(ClientConfig(broker=endpoint), reg, handler))
    handler.rendezvous = BrokerRendezvous(sync, timeout_s=5)
    return sync, handler.rendezvous


def test_payload_is_relayed_newest_first_and_a_missing_one_times_out(tmp_path: Path) -> None:
    broker = BrokerProcess(tmp_path)
    broker.start()
    p, d = peer(broker.endpoint, "prefill", "p"), peer(broker.endpoint, "decode", "d")
    try:
        (p_client, p_rv), (d_client, d_rv) = p, d
        assert p_client.registered.peer_id == "p:0" and d_client.registered.peer_id == "d:0"
        p_rv.publish("d:0", "nccl/p:0->d:0", b"store=127.0.0.1:1234 nonce=1")
        assert d_rv.receive("p:0", "nccl/p:0->d:0") == b"store=127.0.0.1:1234 nonce=1"
        assert d_rv.poll("p:0", "nccl/p:0->d:0") is None  # taken once
        p_rv.publish("d:0", "k", b"old")
        p_rv.publish("d:0", "k", b"new")
        got = d_rv.receive("p:0", "k")
        assert got in (b"old", b"new")
        if got == b"old":  # the second may still be in flight: the newest replaces it
            assert d_rv.receive("p:0", "k") == b"new"
        with pytest.raises(RendezvousTimeout, match="from p:0 within"):
            BrokerRendezvous(d_client, timeout_s=0.2).receive("p:0", "never")
    finally:
        p[0].close()
        d[0].close()
        assert broker.stop() == 0


def _cancelled_while_waiting(receive, wake) -> tuple[BaseException | None, float]:  # type: ignore[no-untyped-def]
    """Run `receive(flag)` on a thread, cancel it once it waits; (what it raised, seconds)."""
    flag, started, out = threading.Event(), threading.Event(), {}

    def run() -> None:
        started.set()
        t0 = time.monotonic()
        try:
            receive(flag)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["exc"] = exc
        out["s"] = time.monotonic() - t0

    thread = threading.Thread(target=run)
    thread.start()
    assert started.wait(5)
    flag.set()
    wake()
    thread.join(10)
    assert not thread.is_alive()
    return out.get("exc"), out["s"]


def test_a_cancelled_wait_for_rendezvous_data_ends_at_once(tmp_path: Path) -> None:
    """A communicator being built waits for its peer's data; when its transfer is aborted
    the wait ends now with RendezvousError, not at its (here 30 s) timeout."""
    from workers.transports.nccl_comm import QueueRendezvous

    broker = BrokerProcess(tmp_path)
    broker.start()
    d_client, _ = peer(broker.endpoint, "decode", "d")
    try:
        rv = BrokerRendezvous(d_client, timeout_s=30)
        exc, seconds = _cancelled_while_waiting(lambda flag: rv.receive("p:0", "never", flag), rv.wake)
        assert isinstance(exc, RendezvousError) and not isinstance(exc, RendezvousTimeout)
        assert "cancelled" in str(exc) and seconds < 5
        qr = QueueRendezvous(queue.Queue(), queue.Queue(), timeout_s=30)
        exc, seconds = _cancelled_while_waiting(lambda flag: qr.receive("p", "never", flag), qr.wake)
        assert isinstance(exc, RendezvousError) and "cancelled" in str(exc) and seconds < 5
    finally:
        d_client.close()
        assert broker.stop() == 0


@pytest.mark.parametrize("kind", ["thread", "process"])
def test_queue_rendezvous_with_a_drain_thread_delivers_polls_and_closes(kind: str) -> None:
    """With `drain_thread`, payloads land in memory as they arrive (as a broker client's
    loop delivers Relay messages): `receive` waits on a condition, `poll` takes what has
    arrived without touching the queue, and `close` ends the thread. `kind`: the queues
    of threads, or of processes (what the GPU benchmark passes)."""
    import multiprocessing

    from workers.transports.nccl_comm import QueueRendezvous

    make = queue.Queue if kind == "thread" else multiprocessing.get_context("spawn").Queue
    a_to_b, b_to_a = make(), make()
    a = QueueRendezvous(a_to_b, b_to_a, timeout_s=30)
    b = QueueRendezvous(b_to_a, a_to_b, timeout_s=30, drain_thread=True)
    try:
        assert b.poll("a", "k") is None
        a.publish("b", "k", b"one")
        assert b.receive("a", "k") == b"one"
        assert b.poll("a", "k") is None  # taken
        a.publish("b", "early", b"x")
        a.publish("b", "k", b"two")
        assert b.receive("a", "k") == b"two"
        assert b.poll("a", "early") == b"x"  # it came before "k", so it is in memory by now
        exc, seconds = _cancelled_while_waiting(lambda flag: b.receive("a", "never", flag), b.wake)
        assert isinstance(exc, RendezvousError) and "cancelled" in str(exc) and seconds < 5
        thread = b._thread
        assert thread is not None and thread.is_alive()
    finally:
        b.close()
    assert not thread.is_alive() and b._thread is None
