"""D's receive whose ticket names a communicator that was dropped before the post (an
abort of a transfer ahead on the pair), with no GPU: it fails at once, and builds
nothing: the producer will not build a communicator for a Go that names one."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import anyio
import pytest

from connector.nccl_link import NcclLink, RecvOrder
from protocols.errors import TransferFailed

PEER = "p0:0"
pytestmark = pytest.mark.anyio


class _Cache:
    """D's communicators with the producer: `c1`, until dropped."""

    def __init__(self) -> None:
        self.comm: Any = SimpleNamespace(nonce="c1")
        self.built: list[str] = []

    def current(self, peer: str) -> Any:
        return self.comm

    def usable(self, peer: str, nonce: str, *, initiator: bool) -> Any:
        return None  # the post goes the worker thread's way, as for a communicator being replaced

    def discard(self, peer: str) -> None:
        self.comm = None

    def get(self, peer: str, **kw: Any) -> Any:
        self.built.append(kw.get("purpose", ""))
        raise AssertionError("a ticket naming a dropped communicator must not build one")


async def test_a_ticket_naming_a_dropped_communicator_fails_its_post_at_once() -> None:
    link = NcclLink.__new__(NcclLink)
    cache = _Cache()
    link.cache = cache  # type: ignore[assignment]
    link._lock, link._inflight, link._receiving = threading.Lock(), {}, {}
    link.device = -1  # type: ignore[assignment]  # no GPU: set_device(-1) does nothing
    link._recv_order = RecvOrder()
    link._recv_order.posted(PEER, ("", 0), "c1")  # an earlier transfer went on c1
    with anyio.fail_after(5):
        async with link.receiving(PEER):
            ticket = link.ticket(PEER)
            assert ticket == ("c1", 1)
            cache.discard(PEER)  # a transfer ahead was aborted after this one's Ready went out
            with pytest.raises(TransferFailed, match="was dropped"):
                await link.post_recv(PEER, "t", SimpleNamespace(offset=0), 64, float("inf"), ticket)  # type: ignore[arg-type]
    assert cache.built == []
    assert link.ticket(PEER) == ("", 0)  # the next transfer starts over
