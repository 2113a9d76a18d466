"""D's Ready against its receive's post, with no GPU (`ConsumerSide.post_receive`): over a
communicator that writes into D's blocks, D posts the receive first, in the producer's
turn, and sends the Ready once the turn is passed on. So the next transfer's receive is
posted while this Ready is still on its way, and P, which watches D's mailbox, may start
that send too. The link and the broker client stand in for the real ones; what runs for
real is the turn (an anyio lock held as the connector holds it) and the handler's order."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import anyio
import pytest
import structlog

from connector.consumer import ConsumerSide, _Load
from connector.scheduler import LoadSpec
from protocols.messages import Prepare

pytestmark = pytest.mark.anyio


class _Link:
    """The calls `post_receive` makes on `NcclLink`, into D's blocks, recording the posts."""

    def __init__(self, events: list[tuple[str, str]], first: bool) -> None:
        self.events, self.first = events, first
        self._turn = anyio.Lock()
        self._next = 0

    def receiving(self, producer: str) -> anyio.Lock:
        return self._turn

    def ticket(self, producer: str) -> tuple[str, int]:
        return ("c1", self._next)

    def receives_into_blocks(self, producer: str, paged: Any, num_blocks: int) -> bool:
        return True

    def posts_first(self, producer: str, ticket: tuple[str, int]) -> bool:
        return self.first

    async def post_recv(self, producer: str, transfer_id: str, lease: Any, nbytes: int, deadline: float,
                        ticket: tuple[str, int], **kw: Any) -> str:
        assert ticket == ("c1", self._next), "a receive posted out of its ticket's order"
        self._next += 1
        self.events.append(("post", transfer_id))
        return transfer_id

    async def give_up(self, producer: str) -> None:
        raise AssertionError("every ticket here is posted")


class _Client:
    """The broker client's `ready`: the first Ready waits until `release` is set."""

    def __init__(self, events: list[tuple[str, str]]) -> None:
        self.events, self.release = events, anyio.Event()

    async def ready(self, transfer_id: str, nbytes: int, offset: int, **kw: Any) -> None:
        self.events.append(("ready sent", transfer_id))
        if transfer_id == "t1":
            await self.release.wait()
        self.events.append(("ready out", transfer_id))


class _Pool:
    """Room for a receive that goes through the pool (the Ready-first case)."""

    async def acquire(self, nbytes: int) -> object:
        return object()


def _consumer(events: list[tuple[str, str]], *, first: bool) -> tuple[ConsumerSide, _Client]:
    client = _Client(events)
    w = SimpleNamespace(pool=_Pool(), nccl=_Link(events, first), client=SimpleNamespace(client=client),
                        log=structlog.get_logger())
    side = ConsumerSide.__new__(ConsumerSide)
    side.w = w  # type: ignore[assignment]
    return side, client


def _load(tid: str) -> tuple[Prepare, _Load]:
    spec = LoadSpec(req_id=f"req-{tid}", block_ids=[1, 2], num_cached_blocks=0, num_tokens=31)
    load = _Load(transfer_id=tid, spec=spec, deadline=time.monotonic() + 30)
    load.prepared_at = time.monotonic()
    return Prepare(transfer_id=tid, nbytes=4096, source="p0:0"), load


@pytest.mark.parametrize("first", [True, False], ids=["posted first", "ready first"])
async def test_the_next_receive_is_posted_while_a_ready_sent_after_its_post_is_still_on_its_way(first: bool) -> None:
    events: list[tuple[str, str]] = []
    side, client = _consumer(events, first=first)
    into = (object(), [1, 2], None)
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            for tid in ("t1", "t2"):
                msg, load = _load(tid)
                tg.start_soon(side.post_receive, msg, load, load, 0, 4096, 4096, into)
                await anyio.wait_all_tasks_blocked()
            if first:
                # t1's Ready is held; t2's receive is posted meanwhile, and its Ready goes too.
                assert events == [("post", "t1"), ("ready sent", "t1"), ("post", "t2"), ("ready sent", "t2"),
                                  ("ready out", "t2")]
            else:
                # Ready first: the post follows its Ready in the same turn, so t2 waits for t1's.
                assert events == [("ready sent", "t1")]
            client.release.set()
    if not first:
        assert events == [("ready sent", "t1"), ("ready out", "t1"), ("post", "t1"), ("ready sent", "t2"),
                          ("ready out", "t2"), ("post", "t2")]
