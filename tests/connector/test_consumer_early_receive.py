"""D's receive posted before its Prepare, with no GPU (`ConsumerSide._receive_early`): the
producer told D it staged the load's transfer (`NcclLink.watch_staged`), so D posts the
receive straight into its blocks at once. The Prepare, when it comes, is checked against
that receive and answered with the Ready naming it; only then is the load reported and its
Done sent, whenever its bytes landed. A Prepare that does not fit, an Abort, or no Prepare
by the deadline end the posted receive (its communicator goes). The link and the broker
client stand in for the real ones (the GPU tests run the real link); what runs for real
is the consumer's handling, its producer's turn and its tasks."""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from types import SimpleNamespace
from typing import Any

import anyio
import pytest
import structlog

from connector.consumer import ConsumerSide, _Load
from connector.nccl_link import Waited
from connector.scheduler import LoadSpec
from protocols.messages import Abort, Layout, Prepare

pytestmark = pytest.mark.anyio

LAYERS, BLOCK_NBYTES, BLOCKS = 2, 1024, 3
STAGED = BLOCKS * LAYERS * BLOCK_NBYTES


class _Link:
    """What the consumer calls on `NcclLink`, recording it: a communicator "c1" with the
    producer that writes into D's blocks, whose receive has landed by the time it is
    waited for."""

    def __init__(self, events: list[tuple[Any, ...]]) -> None:
        self.events = events
        self.turn = anyio.Lock()
        self.nonce, self.next = "c1", 0
        self.watched: dict[str, tuple[str, Any]] = {}

    def watch_staged(self, transfer_id: str, producer: str, noted: Any) -> None:
        self.watched[transfer_id] = (producer, noted)

    def unwatch_staged(self, transfer_id: str) -> None:
        self.watched.pop(transfer_id, None)

    def receiving(self, producer: str) -> anyio.Lock:
        return self.turn

    def ticket(self, producer: str) -> tuple[str, int]:
        return (self.nonce, self.next)

    def posts_first(self, producer: str, ticket: tuple[str, int]) -> bool:
        return bool(ticket[0])

    def receives_into_blocks(self, producer: str, paged: Any, count: int) -> bool:
        return True

    async def post_recv(self, producer: str, transfer_id: str, lease: Any, nbytes: int, deadline: float,
                        ticket: tuple[str, int], *, block_nbytes: int = 0, into: Any = None) -> Any:
        assert ticket == (self.nonce, self.next), "a receive posted out of its ticket's order"
        self.next += 1
        self.events.append(("post", transfer_id, producer, nbytes, lease is None))
        return SimpleNamespace(transfer_id=transfer_id, completions=[SimpleNamespace(event=None)], into_blocks=True)

    async def wait(self, posted: Any, deadline: float, landed: Any = None, before: Any = None) -> Waited:
        self.events.append(("wait", posted.transfer_id))
        landed(0, BLOCKS, 0)
        now = time.monotonic()
        return Waited(now, now, now)

    def cancel(self, peer: str, transfer_id: str) -> None:
        self.events.append(("cancel", transfer_id, peer))


class _Client:
    def __init__(self, events: list[tuple[Any, ...]]) -> None:
        self.events = events

    async def ready(self, transfer_id: str, nbytes: int, offset: int, **kw: Any) -> None:
        self.events.append(("ready", transfer_id, kw["comm"], kw["seq"]))

    async def done(self, transfer_id: str, nbytes: int) -> None:
        self.events.append(("done", transfer_id))

    async def abort(self, transfer_id: str, reason: str) -> None:
        self.events.append(("abort", transfer_id))


class _Pool:
    """A receive pool that is never used: every receive here goes into the blocks."""

    async def acquire(self, nbytes: int) -> object:
        raise AssertionError("a receive into the blocks leased pool room")


class _D:
    """A decode worker's consumer side over the stand-ins, its tasks in `tg`."""

    def __init__(self, tg: anyio.abc.TaskGroup, *, load_timeout_s: float = 30.0) -> None:
        self.events: list[tuple[Any, ...]] = []
        self.link = _Link(self.events)
        client = _Client(self.events)
        counts: defaultdict[str, int] = defaultdict(int)

        async def send_bounded(what: str, tid: str, send: Any, *args: Any) -> bool:
            await send(*args)
            return True

        w = SimpleNamespace(
            lock=threading.Lock(), nccl=self.link, paged=object(), groups=None, pool=_Pool(),
            layers={f"l{i}": i for i in range(LAYERS)}, block_nbytes=BLOCK_NBYTES, chunk_nbytes=BLOCK_NBYTES,
            info=SimpleNamespace(rank=0), client=SimpleNamespace(client=client), log=structlog.get_logger(),
            config=SimpleNamespace(transport="nccl", load_timeout_s=load_timeout_s, instance_id="d0"),
            spawn=lambda fn, *args: tg.start_soon(fn, *args), send_bounded=send_bounded,
            counters=counts, count=lambda key, n=1: counts.__setitem__(key, counts[key] + n),
        )
        self.side = ConsumerSide(w)  # type: ignore[arg-type]
        self.counts = counts

    def load(self, tid: str, *, prompt: str = "abc") -> _Load:
        spec = LoadSpec(req_id=f"req-{tid}", block_ids=list(range(1, BLOCKS + 1)), num_cached_blocks=0, num_tokens=47,
                        prefill="p0", tokens=prompt)
        load = _Load(transfer_id=tid, spec=spec, deadline=time.monotonic() + self.side.w.config.load_timeout_s)
        self.side._loads[tid] = load
        self.link.watch_staged(tid, "p0:0", lambda nonce, nbytes: self.side._noted(load, nonce, nbytes))
        return load

    def noted(self, tid: str, nonce: str = "c1", nbytes: int = STAGED) -> None:
        """The producer's note, as D's poller hands it over."""
        self.link.watched.pop(tid)[1](nonce, nbytes)


def _prepare(tid: str, *, prompt: str = "abc", source: str = "p0:0", blocks: int = BLOCKS) -> Prepare:
    layout = Layout(num_layers=LAYERS, num_blocks=blocks, block_nbytes=BLOCK_NBYTES)
    return Prepare(transfer_id=tid, nbytes=blocks * LAYERS * BLOCK_NBYTES, layout=layout, source=source,
                   prompt=prompt)


async def test_the_receive_goes_at_the_note_and_the_load_is_reported_only_after_its_prepare() -> None:
    """Posted at the note, with no pool room; nothing is waited for, reported or told
    until the Prepare: then the Ready names the receive's ticket, and the landing and
    the Done follow. Two loads' receives take the producer's turn one after the other
    (in the order their tasks run), and each Ready names its own place."""
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            d = _D(tg)
            t1, t2 = d.load("t1"), d.load("t2")
            d.noted("t1")
            d.noted("t2")
            await anyio.wait_all_tasks_blocked()
            order = [e[1] for e in d.events]
            assert sorted(order) == ["t1", "t2"]
            assert d.events == [("post", tid, "p0:0", STAGED, True) for tid in order]
            assert t1.state == t2.state == "receiving" and d.side.get_finished(set()) is None
            await d.side.on_prepare(_prepare("t2"))
            await d.side.on_prepare(_prepare("t1"))
            await anyio.wait_all_tasks_blocked()
    for tid in ("t1", "t2"):
        assert [e for e in d.events[2:] if e[1] == tid] == [("ready", tid, "c1", order.index(tid)), ("wait", tid),
                                                            ("done", tid)]
    assert d.side.get_finished(set()) == {"req-t1", "req-t2"}
    assert not d.side.get_block_ids_with_load_errors()


@pytest.mark.parametrize("why", ["another prompt", "another producer", "another size"])
async def test_a_prepare_that_does_not_fit_the_posted_receive_ends_it_and_fails_the_load(why: str) -> None:
    prepare = {"another prompt": _prepare("t1", prompt="xyz"), "another producer": _prepare("t1", source="p1:0"),
               "another size": _prepare("t1", blocks=BLOCKS + 1)}[why]
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            d = _D(tg)
            load = d.load("t1")
            d.noted("t1")
            await anyio.wait_all_tasks_blocked()
            await d.side.on_prepare(prepare)
            await anyio.wait_all_tasks_blocked()
    assert d.events == [("post", "t1", "p0:0", STAGED, True), ("cancel", "t1", "p0:0"), ("abort", "t1")]
    assert load.state == "failed" and load.reason
    assert d.side.get_finished(set()) == {"req-t1"}
    assert d.side.get_block_ids_with_load_errors() == set(range(1, BLOCKS + 1))


async def test_an_abort_before_the_prepare_ends_the_posted_receive() -> None:
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            d = _D(tg)
            load = d.load("t1")
            d.noted("t1")
            await anyio.wait_all_tasks_blocked()
            await d.side.on_abort(Abort(transfer_id="t1", reason="the producer died"))
            await anyio.wait_all_tasks_blocked()
    assert d.events == [("post", "t1", "p0:0", STAGED, True), ("cancel", "t1", "p0:0")]
    assert load.state == "failed" and "the producer died" in load.reason


async def test_no_prepare_by_the_deadline_ends_the_posted_receive() -> None:
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            d = _D(tg, load_timeout_s=0.2)
            load = d.load("t1")
            d.noted("t1")
    assert d.events == [("post", "t1", "p0:0", STAGED, True), ("cancel", "t1", "p0:0"), ("abort", "t1")]
    assert load.state == "failed" and "no Prepare" in load.reason


@pytest.mark.parametrize("case", ["prepare first", "another communicator", "another size"])
async def test_without_an_early_post_the_receive_goes_on_its_prepare_as_usual(case: str) -> None:
    """The Prepare came before the note's task ran; the note came over a communicator
    other than the producer's now (nothing posted before the Prepare); or the producer
    staged another size (another TP size). Each is posted once, after its Prepare."""
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            d = _D(tg)
            d.load("t1")
            if case == "prepare first":
                noted = d.link.watched["t1"][1]
                await d.side.on_prepare(_prepare("t1"))
                noted("c1", STAGED)
            elif case == "another communicator":
                d.noted("t1", nonce="c0")
                await anyio.wait_all_tasks_blocked()
                assert d.events == []
                await d.side.on_prepare(_prepare("t1"))
            else:
                d.noted("t1", nbytes=STAGED // 2)
                await anyio.wait_all_tasks_blocked()
                assert d.events == []
                await d.side.on_prepare(_prepare("t1"))
            await anyio.wait_all_tasks_blocked()
    posts = [e for e in d.events if e[0] == "post"]
    assert len(posts) == 1 and [e[0] for e in d.events].index("post") < [e[0] for e in d.events].index("done")
    assert d.side.get_finished(set()) == {"req-t1"}
