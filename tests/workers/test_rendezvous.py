"""Rendezvous payloads travel between two real clients through a real broker process."""

from __future__ import annotations

from pathlib import Path

import pytest

from protocols.messages import Register
from tests.support import BrokerProcess
from workers.client import BrokerClient, ClientConfig, NullHandler, SyncBrokerClient
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
