"""Faults the tests inject into a prefill worker (no vLLM needed): none is in the product."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import structlog

from connector.producer import ProducerSide
from protocols.errors import TransferFailed
from workers.transports.tcp import TcpSender, byte_view

log = structlog.get_logger("kvbroker.tests")


def refuse_sends(producer: ProducerSide, prefix: str) -> None:
    """Make `producer` fail every tcp send of a transfer named `prefix`*: the real sender
    runs it, and its payload fails on the sending thread before the first byte, as a
    layer never copied would; `ProducerSide.on_go` then handles a failure of P's own."""
    assert producer.sender is not None
    producer.sender = _RefusingSender(producer.sender, prefix)  # type: ignore[assignment]


class _RefusingSender:
    def __init__(self, sender: TcpSender, prefix: str) -> None:
        self.sender, self.prefix = sender, prefix

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sender, name)

    async def send(self, endpoint: str, transfer_id: str, attempt: int, data: Any) -> None:
        if not transfer_id.startswith(self.prefix):
            await self.sender.send(endpoint, transfer_id, attempt, data)
            return
        await self.sender.send_parts(endpoint, transfer_id, attempt, len(byte_view(data)), self._failing(transfer_id))

    async def send_parts(self, endpoint: str, transfer_id: str, attempt: int, nbytes: int,
                         parts: Iterable[list[memoryview]], **kwargs: Any) -> None:
        if transfer_id.startswith(self.prefix):
            parts = self._failing(transfer_id)
        await self.sender.send_parts(endpoint, transfer_id, attempt, nbytes, parts, **kwargs)

    @staticmethod
    def _failing(transfer_id: str) -> Iterator[list[memoryview]]:
        log.warning("transfer.fault_injected", transfer_id=transfer_id, phase="fault", fault="refused_send")
        raise TransferFailed(transfer_id, "its payload failed (injected by the test)")
        yield []  # a generator: it raises where the sender iterates it, on the sending thread
