"""Rendezvous data between two workers, relayed by the broker (`Relay` messages).

The NCCL transport needs one small payload (a store address and a nonce) to travel
from the side that creates a communicator to its peer before both can join it. The
workers already share a broker, so the payload rides on it instead of a second
discovery channel. Torch-free: the NCCL transport imports this, not the reverse.
"""

from __future__ import annotations

import threading
import time

from protocols.errors import RendezvousError
from protocols.messages import Relay

from .client import SyncBrokerClient


class RendezvousTimeout(RendezvousError):
    """The peer's rendezvous payload did not arrive in time."""


class BrokerRendezvous:
    """A `Rendezvous` (`workers.transports.communicator`) over the broker's `Relay`.

    The worker's `TransferHandler.on_relay` must forward to `on_relay` here. Payloads are
    kept per (sender peer, key), newest wins, so a rebuilt communicator's data replaces
    the stale one. Thread-safe: `receive` blocks the calling thread, never the loop.
    """

    def __init__(self, client: SyncBrokerClient, timeout_s: float = 30.0) -> None:
        self.client = client
        self.timeout_s = timeout_s
        self._unread: dict[tuple[str, str], bytes] = {}
        self._cond = threading.Condition()

    async def on_relay(self, msg: Relay) -> None:
        with self._cond:
            self._unread[(msg.sender, msg.key)] = msg.payload
            self._cond.notify_all()

    def publish(self, peer: str, key: str, payload: bytes) -> None:
        self.client.call(self.client.client.relay, peer, key, payload)

    def receive(self, peer: str, key: str, cancelled: threading.Event | None = None) -> bytes:
        """The payload `peer` relays under `key`, once it arrives.

        Raises:
            RendezvousTimeout: none within `timeout_s`.
            RendezvousError: `cancelled` was set (and `wake` called) while waiting.
        """
        deadline = time.monotonic() + self.timeout_s
        with self._cond:
            while (peer, key) not in self._unread:
                if cancelled is not None and cancelled.is_set():
                    raise RendezvousError(f"the wait for rendezvous data under {key!r} from {peer} was cancelled.")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RendezvousTimeout(
                        f"no rendezvous data under {key!r} from {peer} within {self.timeout_s:g} s; "
                        "is that peer registered with the same broker?"
                    )
                self._cond.wait(left)
            return self._unread.pop((peer, key))

    def wake(self) -> None:
        """Wake every `receive` waiting, so one whose cancel flag is set raises now."""
        with self._cond:
            self._cond.notify_all()

    def poll(self, peer: str, key: str) -> bytes | None:
        with self._cond:
            return self._unread.pop((peer, key), None)
