"""Posts the link refuses at once, with no GPU: a receive whose ticket names a
communicator that was dropped before the post (an abort of a transfer ahead on the
pair) builds nothing, since the producer will not build a communicator for a Go that
names one; and an op cancelled before its post."""

from __future__ import annotations

import threading
from collections import OrderedDict
from types import SimpleNamespace
from typing import Any

import anyio
import pytest

from connector.nccl_link import CANCELLED_KEPT, NcclLink, RecvOrder
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


def _bare_link() -> NcclLink:
    """D's link with its communicator `c1` (`_Cache`) and nothing else: no GPU, no broker."""
    link = NcclLink.__new__(NcclLink)
    link.cache = _Cache()  # type: ignore[assignment]
    link._lock, link._inflight, link._receiving = threading.Lock(), {}, {}
    link._cancelled = OrderedDict()
    link.device = -1  # type: ignore[assignment]  # no GPU: set_device(-1) does nothing
    link._recv_order = RecvOrder()
    return link


async def test_a_ticket_naming_a_dropped_communicator_fails_its_post_at_once() -> None:
    link = _bare_link()
    cache = link.cache
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


async def test_an_op_cancelled_before_its_post_is_refused_when_it_comes() -> None:
    """An Abort can reach P while the Go's send still waits for its turn (or for its
    lane's heads to be cut): `cancel` finds nothing posted, and the post that follows is
    refused instead of waiting for a receive that D already gave up."""
    link = _bare_link()
    link.cancel(PEER, "t")
    with anyio.fail_after(5):
        with pytest.raises(TransferFailed, match="cancelled before it was posted"):
            await link.post_recv(PEER, "t", SimpleNamespace(offset=0), 64, float("inf"), ("c1", 0))  # type: ignore[arg-type]
    assert (PEER, "t") not in link._cancelled  # refused once: the memory is spent
    assert link.cache.comm is not None  # type: ignore[attr-defined]  # nothing was posted: nothing to abort


def test_the_cancels_remembered_are_bounded_oldest_first() -> None:
    link = _bare_link()
    for k in range(CANCELLED_KEPT + 10):
        link.cancel(PEER, f"t{k}")
    assert len(link._cancelled) == CANCELLED_KEPT
    assert (PEER, "t0") not in link._cancelled and (PEER, f"t{CANCELLED_KEPT + 9}") in link._cancelled
