"""ZmqChannel and MessageChannel over real zmq sockets on loopback, on both backends.

Nothing sleeps: waits are bounded by `fail_after`, and connection changes are observed
through zmq's socket monitor rather than guessed with delays.
"""

from __future__ import annotations

import select
from collections.abc import Iterator
from typing import cast

import anyio
import pytest
import zmq
from zmq.utils.monitor import parse_monitor_message

from protocols.channel import (
    MessageChannel,
    PeerUnreachable,
    ZmqChannel,
    dealer,
    router,
)
from protocols.codec import Codec
from protocols.errors import ChannelClosed, InvalidMessage, OversizedMessage, RemoteProtocolError
from protocols.messages import Heartbeat, Layout, Offer, Register, Registered

LOOPBACK = "tcp://127.0.0.1:0"
DEADLINE = 10.0


@pytest.fixture
def ctx() -> Iterator[zmq.Context]:
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def make_pair(
    ctx: zmq.Context, identity: bytes = b"d1", *, router_kw: dict | None = None, dealer_kw: dict | None = None
) -> tuple[ZmqChannel, ZmqChannel]:
    sock, endpoint = router(ctx, LOOPBACK, **(router_kw or {}))
    return ZmqChannel(sock), ZmqChannel(dealer(ctx, endpoint, identity, **(dealer_kw or {})))


async def introduce(r: ZmqChannel, d: ZmqChannel) -> bytes:
    """One DEALER -> ROUTER message, so the ROUTER knows the DEALER's identity."""
    await d.send([b"hello"])
    identity, payload = await r.receive()
    assert payload == b"hello"
    return identity


async def wait_event(monitor: ZmqChannel, *events: int) -> int:
    while True:
        event = parse_monitor_message(await monitor.receive())["event"]
        if event in events:
            return event


@pytest.mark.parametrize("addr", ["tcp://127.0.0.1:0", "tcp://127.0.0.1:*"])
def test_router_reports_the_bound_port(ctx: zmq.Context, addr: str) -> None:
    sock, endpoint = router(ctx, addr)
    host, port = endpoint.rsplit(":", 1)
    assert host == "tcp://127.0.0.1"
    assert int(port) > 0
    sock.close()


@pytest.mark.anyio
async def test_round_trip_of_multipart_frames(ctx: zmq.Context) -> None:
    r, d = make_pair(ctx)
    async with r, d:
        with anyio.fail_after(DEADLINE):
            await d.send([b"a", b"", b"c" * 100_000])
            assert await r.receive() == [b"d1", b"a", b"", b"c" * 100_000]
            await r.send([b"d1", b"x", b"y"])
            assert await d.receive() == [b"x", b"y"]


@pytest.mark.anyio
@pytest.mark.parametrize("hwm", [10_000, 4])
async def test_many_messages_both_ways_arrive_in_order(ctx: zmq.Context, hwm: int) -> None:
    """Four tasks share two sockets' fds; a tiny HWM makes senders block often."""
    n = 5000
    opts = {"hwm": hwm}
    r, d = make_pair(ctx, router_kw=opts, dealer_kw=opts)
    up: list[int] = []
    down: list[int] = []

    async def dealer_sends() -> None:
        for i in range(n):
            await d.send([i.to_bytes(4, "big")])

    async def router_sends() -> None:
        for i in range(n):
            await r.send([b"d1", i.to_bytes(4, "big")])

    async def router_receives() -> None:
        for _ in range(n):
            identity, payload = await r.receive()
            assert identity == b"d1"
            up.append(int.from_bytes(payload, "big"))

    async def dealer_receives() -> None:
        for _ in range(n):
            (payload,) = await d.receive()
            down.append(int.from_bytes(payload, "big"))

    async with r, d:
        with anyio.fail_after(60):
            await introduce(r, d)
            async with anyio.create_task_group() as tg:
                for task in (router_receives, dealer_receives, dealer_sends, router_sends):
                    tg.start_soon(task)
    assert up == list(range(n))
    assert down == list(range(n))


@pytest.mark.anyio
@pytest.mark.parametrize("direction", ["dealer_to_router", "router_to_dealer"])
async def test_send_at_high_water_mark_waits_then_completes(ctx: zmq.Context, direction: str) -> None:
    """Past the HWM, send_nowait says WouldBlock and send parks on the fd until the reader
    catches up; ~26 MB with nobody reading overflows zmq's pipes and the kernel's buffers.

    Router -> dealer covers ROUTER_MANDATORY, where d1's full pipe gives EAGAIN while the
    socket still reports POLLOUT (the idle peer has room). A sender that retried on
    POLLOUT alone would spin there and never park, and the test would hang.
    """
    opts = {"hwm": 2}
    r, d = make_pair(ctx, router_kw=opts, dealer_kw=opts)
    idle = ZmqChannel(dealer(ctx, cast(bytes, r.socket.getsockopt(zmq.LAST_ENDPOINT)).decode(), b"idle"))
    frame = b"x" * 65536
    total = 400
    async with r, d, idle:
        with anyio.fail_after(DEADLINE):
            await introduce(r, d)
            await introduce(r, idle)
        sender, receiver, head = (d, r, []) if direction == "dealer_to_router" else (r, d, [b"d1"])

        queued = 0
        while queued < total:
            try:
                sender.send_nowait([*head, queued.to_bytes(4, "big"), frame])
            except anyio.WouldBlock:
                break
            queued += 1
        assert queued < total, "send_nowait never hit the high-water mark"

        got: list[int] = []

        async def send_rest() -> None:
            for i in range(queued, total):
                await sender.send([*head, i.to_bytes(4, "big"), frame])

        async def drain() -> None:
            for _ in range(total):
                frames = await receiver.receive()
                got.append(int.from_bytes(frames[-2], "big"))

        with anyio.fail_after(DEADLINE):
            async with anyio.create_task_group() as tg:
                tg.start_soon(send_rest)
                await anyio.wait_all_tasks_blocked()  # the sender has parked
                tg.start_soon(drain)
        assert got == list(range(total))


@pytest.mark.anyio
async def test_cancelled_receive_loses_no_message(ctx: zmq.Context) -> None:
    r, d = make_pair(ctx)
    async with r, d:
        with anyio.fail_after(DEADLINE):
            await introduce(r, d)
            with anyio.move_on_after(0.05) as scope:
                await r.receive()
            assert scope.cancelled_caught
            await d.send([b"after"])
            assert await r.receive() == [b"d1", b"after"]


@pytest.mark.anyio
async def test_receives_cancelled_at_random_points_lose_no_message(ctx: zmq.Context) -> None:
    """Deadlines expire before, during and after messages arrive; every message survives."""
    n = 1000
    r, d = make_pair(ctx)
    got: list[int] = []

    async def produce() -> None:
        for i in range(n):
            await d.send([i.to_bytes(4, "big")])
            if i % 7 == 0:
                await anyio.lowlevel.checkpoint()

    async with r, d:
        with anyio.fail_after(30):
            await introduce(r, d)
            async with anyio.create_task_group() as tg:
                tg.start_soon(produce)
                deadlines = (0.0, 0.00001, 0.0001, 0.001)
                attempts = 0
                while len(got) < n:
                    with anyio.move_on_after(deadlines[attempts % len(deadlines)]):
                        _, payload = await r.receive()
                        got.append(int.from_bytes(payload, "big"))
                    attempts += 1
    assert got == list(range(n))


@pytest.mark.anyio
async def test_spurious_wakes_keep_the_receiver_waiting(ctx: zmq.Context) -> None:
    r, d = make_pair(ctx)
    got: list[list[bytes]] = []

    async def receive_one() -> None:
        got.append(await r.receive())

    async with r, d:
        with anyio.fail_after(DEADLINE):
            await introduce(r, d)
            async with anyio.create_task_group() as tg:
                tg.start_soon(receive_one)
                await anyio.wait_all_tasks_blocked()
                for _ in range(3):
                    r._wake()  # as if the fd fired with nothing to read
                    await anyio.wait_all_tasks_blocked()
                assert got == []
                await d.send([b"late"])
    assert got == [[b"d1", b"late"]]


@pytest.mark.anyio
async def test_a_cancelled_waiter_hands_the_fd_to_the_next(ctx: zmq.Context) -> None:
    """The first waiter watches the fd; when it is cancelled, a parked one takes over."""
    r, d = make_pair(ctx)
    got: list[list[bytes]] = []

    async def give_up(scope: anyio.CancelScope) -> None:
        with scope:
            await r.receive()

    async def receive_one() -> None:
        got.append(await r.receive())

    async with r, d:
        with anyio.fail_after(DEADLINE):
            await introduce(r, d)
            first = anyio.CancelScope()
            async with anyio.create_task_group() as tg:
                tg.start_soon(give_up, first)
                await anyio.wait_all_tasks_blocked()
                tg.start_soon(receive_one)
                await anyio.wait_all_tasks_blocked()
                first.cancel()
                await anyio.wait_all_tasks_blocked()
                await d.send([b"for the second"])
    assert got == [[b"d1", b"for the second"]]


def _refused(chan: ZmqChannel) -> None:
    with pytest.raises(PeerUnreachable):
        chan.send_nowait([b"gone", b"Go"])


@pytest.mark.anyio
@pytest.mark.parametrize("poke", ["send", "refused send"])
async def test_a_send_does_not_strand_a_waiting_receiver(ctx: zmq.Context, poke: str) -> None:
    """A send may drain the mailbox whose signal a waiting receiver sleeps on (the fd is
    edge-triggered); the channel must then wake the receiver itself. A send that fails
    drains it as well: a ROUTER's to a departed peer, which the broker makes whenever a
    peer leaves with a Go or an Abort on its way. Stranded, the broker's receive loop
    would sleep until some other pipe signalled, and peer leases would lapse meanwhile."""
    r, d = make_pair(ctx)
    got: list[list[bytes]] = []
    # Who waits, what arrives for it, and the sends on its own socket that drain the signal.
    if poke == "send":
        waiter, arrive, drain, want = d, lambda: r.send_nowait([b"d1", b"ping"]), lambda: d.send_nowait([b"pong"]), [b"ping"]
    else:
        waiter, arrive, drain, want = r, lambda: d.send_nowait([b"heartbeat"]), lambda: _refused(r), [b"d1", b"heartbeat"]

    async def receive_one() -> None:
        got.append(await waiter.receive())

    fd = cast(int, waiter.socket.getsockopt(zmq.FD))

    def fd_readable() -> bool:
        return bool(select.select([fd], [], [], 0)[0])

    async with r, d:
        with anyio.fail_after(DEADLINE):
            await introduce(r, d)
            async with anyio.create_task_group() as tg:
                tg.start_soon(receive_one)
                await anyio.wait_all_tasks_blocked()
                arrive()
                # Without yielding to the receiver: wait for the signal, then send until a
                # send has drained it (libzmq processes commands in send at most every ~1 ms).
                select.select([fd], [], [], DEADLINE)
                sends = 0
                while fd_readable():
                    drain()
                    sends += 1
                    assert sends < 1_000_000
    assert got == [want]


@pytest.mark.anyio
async def test_close_ends_every_waiter_with_channel_closed(ctx: zmq.Context) -> None:
    """One receiver on the ROUTER; a receiver and a blocked sender on one DEALER."""
    r, _ = make_pair(ctx)
    lonely = ZmqChannel(dealer(ctx, "tcp://127.0.0.1:1", hwm=1))  # nothing there: sends block
    outcomes: list[str] = []

    async def expect_closed(call) -> None:  # type: ignore[no-untyped-def]
        with pytest.raises(ChannelClosed):
            await call()
        outcomes.append("closed")

    async def flood() -> None:
        while True:
            await lonely.send([b"x"])

    with anyio.fail_after(DEADLINE):
        async with anyio.create_task_group() as tg:
            tg.start_soon(expect_closed, r.receive)
            tg.start_soon(expect_closed, lonely.receive)
            tg.start_soon(expect_closed, flood)
            await anyio.wait_all_tasks_blocked()
            assert outcomes == []
            await r.aclose()
            await lonely.aclose()
    assert outcomes == ["closed"] * 3


@pytest.mark.anyio
async def test_use_after_close_raises_channel_closed(ctx: zmq.Context) -> None:
    r, d = make_pair(ctx)
    await r.aclose()
    d.close()
    d.close()  # idempotent
    assert r.closed and d.closed
    with pytest.raises(ChannelClosed):
        await r.receive()
    with pytest.raises(ChannelClosed):
        await d.send([b"x"])
    with pytest.raises(ChannelClosed):
        d.send_nowait([b"x"])


@pytest.mark.anyio
async def test_send_to_unknown_identity_raises_peer_unreachable(ctx: zmq.Context) -> None:
    r, d = make_pair(ctx)
    async with r, d:
        with anyio.fail_after(DEADLINE):
            with pytest.raises(PeerUnreachable) as info:
                await r.send([b"nobody", b"x"])
            assert info.value.identity == b"nobody"
            with pytest.raises(PeerUnreachable):
                r.send_nowait([b"nobody", b"x"])
            # The channel is still usable.
            await introduce(r, d)
            await r.send([b"d1", b"still here"])
            assert await d.receive() == [b"still here"]


@pytest.mark.anyio
async def test_receive_nowait_takes_only_what_is_queued(ctx: zmq.Context) -> None:
    r, d = make_pair(ctx)
    async with r, d:
        with pytest.raises(anyio.WouldBlock):
            r.receive_nowait()
        with anyio.fail_after(DEADLINE):
            await introduce(r, d)
            for i in range(3):
                await d.send([b"%d" % i])
            assert await r.receive() == [b"d1", b"0"]  # waits until the burst is here
        drained: list[list[bytes]] = []
        while len(drained) < 2:  # the rest may still be in flight: poll, but never sleep
            try:
                drained.append(r.receive_nowait())
            except anyio.WouldBlock:
                with anyio.fail_after(DEADLINE):
                    drained.append(await r.receive())
        assert drained == [[b"d1", b"1"], [b"d1", b"2"]]
        with pytest.raises(anyio.WouldBlock):
            r.receive_nowait()
    with pytest.raises(ChannelClosed):
        r.receive_nowait()


@pytest.mark.anyio
async def test_send_rejects_an_empty_message(ctx: zmq.Context) -> None:
    r, d = make_pair(ctx)
    async with r, d:
        with pytest.raises(ValueError):
            await d.send([])


@pytest.mark.anyio
async def test_a_message_with_a_frame_that_is_not_bytes_is_refused_whole(ctx: zmq.Context) -> None:
    """A later frame zmq would refuse must fail the send before the first frame goes out
    with SNDMORE: else the message stays open, and the next one, glued onto it, goes to
    the first one's peer."""
    sock, endpoint = router(ctx, LOOPBACK)
    r, d1, d2 = ZmqChannel(sock), ZmqChannel(dealer(ctx, endpoint, b"d1")), ZmqChannel(dealer(ctx, endpoint, b"d2"))
    async with r, d1, d2:
        with anyio.fail_after(DEADLINE):
            await introduce(r, d1)
            await introduce(r, d2)
            with pytest.raises(TypeError) as text:
                await r.send([b"d1", "not bytes"])
            with pytest.raises(TypeError) as number:
                r.send_nowait([b"d1", b"fine", 7])
            await r.send([b"d2", b"for d2"])
            await r.send([b"d1", bytearray(b"for"), memoryview(b" d1")])  # bytes-like frames still go
            assert await d1.receive() == [b"for", b" d1"], "a refused message's first frames went out"
            assert await d2.receive() == [b"for d2"]
    assert "frame 1 of the message is of type str" in str(text.value)
    assert "frame 2 of the message is of type int" in str(number.value)


@pytest.mark.anyio
async def test_message_channel_round_trip(ctx: zmq.Context) -> None:
    r, d = make_pair(ctx)
    broker, worker = MessageChannel(r), MessageChannel(d)
    hello = Register(role="prefill", instance_id="p0", endpoints={"tcp": "127.0.0.1:9"}, pool_capacity=1 << 30)
    offer = Offer(transfer_id="t-1", nbytes=4096, layout=Layout(kind="standard", num_blocks=2, block_nbytes=2048))
    async with broker, worker:
        with anyio.fail_after(DEADLINE):
            await worker.send(hello)
            identity, frames = await broker.receive_from()
            assert identity == b"d1"
            assert [broker.codec.decode(f) for f in frames] == [hello]
            reply = Registered(peer_id="peer-1", heartbeat_s=1.0, lease_s=5.0)
            await broker.send_to(identity, reply)
            assert await worker.receive() == reply
            await worker.send(offer)
            _, frames = await broker.receive_from()
            assert broker.codec.decode(frames[0]) == offer
            with pytest.raises(PeerUnreachable):
                await broker.send_to(b"gone", Heartbeat())


@pytest.mark.anyio
async def test_message_channel_raises_remote_errors_and_keeps_going(ctx: zmq.Context) -> None:
    r, d = make_pair(ctx)
    broker, worker = MessageChannel(r), MessageChannel(d)
    async with broker, worker:
        with anyio.fail_after(DEADLINE):
            await introduce(r, d)
            await r.send([b"d1", b"\x00garbage"])
            await r.send([b"d1", broker.codec.encode(Heartbeat()), b"extra frame"])
            await broker.send_to(b"d1", Heartbeat(seq=7))
            with pytest.raises(RemoteProtocolError):
                await worker.receive()
            with pytest.raises(InvalidMessage):
                await worker.receive()
            assert await worker.receive() == Heartbeat(seq=7)


@pytest.mark.anyio
async def test_oversized_frame_is_dropped_by_zmq_and_the_dealer_reconnects(ctx: zmq.Context) -> None:
    """What libzmq does: the ROUTER drops the connection, the frame is never delivered, and
    the DEALER reconnects on its own; frames sent after the reconnection arrive."""
    sock, endpoint = router(ctx, LOOPBACK, max_frame=1024)
    monitor = ZmqChannel(sock.get_monitor_socket())
    r, d = ZmqChannel(sock), ZmqChannel(dealer(ctx, endpoint, b"d1"))
    async with r, d, monitor:
        with anyio.fail_after(DEADLINE):
            await introduce(r, d)
            await d.send([b"y" * 1025])
            await wait_event(monitor, zmq.EVENT_DISCONNECTED)
            await wait_event(monitor, zmq.EVENT_HANDSHAKE_SUCCEEDED)
            await d.send([b"small"])
            assert await r.receive() == [b"d1", b"small"]
            await r.send([b"d1", b"and back"])
            assert await d.receive() == [b"and back"]
        sock.disable_monitor()


@pytest.mark.anyio
async def test_dealer_leaves_oversized_frames_to_the_codec(ctx: zmq.Context) -> None:
    """A DEALER sets no zmq limit by default, so a big frame reaches the codec, which
    rejects it, and the connection stays up (a zmq limit would kill it for good)."""
    r, d = make_pair(ctx)
    worker = MessageChannel(d, Codec(max_frame=1024))
    async with r, worker:
        with anyio.fail_after(DEADLINE):
            await introduce(r, d)
            await r.send([b"d1", b"k" * 4096])
            with pytest.raises(OversizedMessage):
                await worker.receive()
            await r.send([b"d1", worker.codec.encode(Heartbeat(seq=1))])
            assert await worker.receive() == Heartbeat(seq=1)


@pytest.mark.anyio
async def test_curve_round_trip(ctx: zmq.Context) -> None:
    server_public, server_secret = zmq.curve_keypair()
    client_public, client_secret = zmq.curve_keypair()
    sock, endpoint = router(ctx, LOOPBACK, curve_secret=server_secret)
    d = ZmqChannel(dealer(ctx, endpoint, b"d1", curve=(client_public, client_secret, server_public)))
    async with ZmqChannel(sock) as r, d:
        with anyio.fail_after(DEADLINE):
            await introduce(r, d)
            await r.send([b"d1", b"secret"])
            assert await d.receive() == [b"secret"]


@pytest.mark.anyio
async def test_curve_router_refuses_a_plain_dealer(ctx: zmq.Context) -> None:
    _, server_secret = zmq.curve_keypair()
    sock, endpoint = router(ctx, LOOPBACK, curve_secret=server_secret)
    monitor = ZmqChannel(sock.get_monitor_socket())
    async with ZmqChannel(sock), ZmqChannel(dealer(ctx, endpoint, b"d1")) as d, monitor:
        with anyio.fail_after(DEADLINE):
            await d.send([b"let me in"])
            event = await wait_event(
                monitor,
                zmq.EVENT_HANDSHAKE_SUCCEEDED,
                zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL,
                zmq.EVENT_HANDSHAKE_FAILED_AUTH,
            )
        assert event != zmq.EVENT_HANDSHAKE_SUCCEEDED
        sock.disable_monitor()
