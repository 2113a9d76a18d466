"""The broker daemon in this process, behind its real ROUTER socket, driven by a real
DEALER: a fault in the core's handling of one message fails that transfer only."""

from __future__ import annotations

from typing import Any

import anyio
import pytest
import zmq

from broker.daemon import BrokerDaemon, DaemonConfig
from protocols.codec import Codec
from protocols.messages import Error, Message, Offer, Register, Registered, Status, StatusRequest

pytestmark = pytest.mark.anyio


def exchange(endpoint: str, messages: list[Message], replies: int) -> list[Any]:
    """Send `messages` from one DEALER and return the first `replies` answers (5 s each)."""
    codec = Codec()
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        for msg in messages:
            sock.send(codec.encode(msg))
        got = []
        for _ in range(replies):
            assert sock.poll(5000), f"no answer after {got}"
            got.append(codec.decode(sock.recv()))
        return got
    finally:
        ctx.destroy(linger=0)


async def test_a_fault_handling_one_offer_fails_that_transfer_and_the_broker_serves_on() -> None:
    daemon = BrokerDaemon(DaemonConfig(bind="tcp://127.0.0.1:0"))
    offer = daemon.core._handlers[Offer]

    def faulty(now: float, peer: Any, msg: Offer, out: list[Any]) -> None:  # the fault, injected here
        if msg.transfer_id == "boom":
            raise KeyError(msg.transfer_id)
        offer(now, peer, msg, out)

    daemon.core._handlers[Offer] = faulty
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            endpoint = await tg.start(daemon.run)
            register = Register(role="prefill", instance_id="p0", compat_hash="h")
            registered, error, status = await anyio.to_thread.run_sync(
                exchange, endpoint,
                [register, Offer(transfer_id="boom", nbytes=10), Offer(transfer_id="fine", nbytes=10), StatusRequest()],
                3,
            )
            tg.cancel_scope.cancel()
    assert isinstance(registered, Registered)
    assert isinstance(error, Error) and error.code == "internal" and error.transfer_id == "boom"
    assert isinstance(status, Status) and [t.transfer_id for t in status.transfers] == ["fine"]
    assert status.counters["internal_errors"] == 1
