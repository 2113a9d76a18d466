"""The broker client used inside worker processes.

`BrokerClient` is async and lives on one anyio event loop: it registers, sends
heartbeats, hands the broker's messages to a `TransferHandler`, and when the broker
stops answering (a restart, a network cut) it reconnects with backoff, registers again
and re-sends what it still has staged or expects, so a broker restart loses no transfer
that has not started moving.

`SyncBrokerClient` runs that loop in a background thread behind a blocking portal, for
synchronous callers such as vLLM's connector hooks: each method is one `portal.call`.
"""

from __future__ import annotations

import random
import secrets
import sys
import time
from concurrent.futures import Future
from dataclasses import dataclass
from functools import partial
from typing import Any, Awaitable, Callable, Protocol

import anyio
import anyio.abc
import anyio.from_thread
import msgspec
import structlog
import zmq

from protocols.channel import ZmqChannel, dealer
from protocols.codec import Codec
from protocols.errors import BrokerUnavailable, ChannelClosed, Refused, RemoteProtocolError
from protocols.messages import (
    Abort,
    Cancel,
    Done,
    Error,
    Expect,
    Go,
    Goodbye,
    Heartbeat,
    Layout,
    Message,
    Offer,
    Prepare,
    Ready,
    Register,
    Registered,
    Relay,
    Release,
)
from workers.waker import Spawner

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

log = structlog.get_logger("kvbroker.client")


@dataclass(frozen=True)
class ClientConfig:
    broker: str = "tcp://127.0.0.1:7100"
    register_timeout_s: float = 5.0
    reconnect_max_s: float = 2.0
    max_frame: int = 1 << 20
    # (client public, client secret, server public) for CURVE; None for plain TCP.
    curve: tuple[bytes, bytes, bytes] | None = None


class TransferHandler(Protocol):
    """What a worker does when the broker speaks. Each call runs in its own task."""

    async def on_prepare(self, msg: Prepare) -> None: ...
    async def on_go(self, msg: Go) -> None: ...
    async def on_release(self, msg: Release) -> None: ...
    async def on_abort(self, msg: Abort) -> None: ...
    async def on_relay(self, msg: Relay) -> None: ...


class NullHandler:
    async def on_prepare(self, msg: Prepare) -> None: ...
    async def on_go(self, msg: Go) -> None: ...
    async def on_release(self, msg: Release) -> None: ...
    async def on_abort(self, msg: Abort) -> None: ...
    async def on_relay(self, msg: Relay) -> None: ...


class BrokerClient:
    def __init__(
        self,
        config: ClientConfig,
        registration: Register,
        handler: TransferHandler | None = None,
        pool_free: Callable[[], int] | None = None,
    ) -> None:
        self.config = config
        if not registration.incarnation:  # this client is this process's one registration
            registration = msgspec.structs.replace(registration, incarnation=secrets.token_hex(8))
        self.registration = registration
        self.handler: TransferHandler = handler or NullHandler()
        self.pool_free = pool_free
        self.codec = Codec(config.max_frame)
        self.registered: Registered | None = None
        self.registrations = 0
        self._chan: ZmqChannel | None = None
        self._connected: anyio.Event | None = None
        self._offers: dict[str, Offer] = {}
        # Until its Done, an Abort either way, or a refusal: a session registered again
        # re-announces every transfer still awaited, so the broker can say what became of it.
        self._expects: dict[str, Expect] = {}
        self._log = log.bind(role=registration.role, instance=registration.instance_id, rank=registration.rank)

    @property
    def connected(self) -> bool:
        """True while registered on a live session with the broker."""
        return self._chan is not None

    # -- lifecycle ----------------------------------------------------------------

    async def run(self, *, task_status: anyio.abc.TaskStatus[Registered] = anyio.TASK_STATUS_IGNORED) -> None:
        """Stay registered until cancelled; `task_status.started` gets the first `Registered`.

        Raises `BrokerUnavailable` if the first registration gets no answer in time and
        `Refused` if the broker turns this peer away; later outages are retried forever.
        """
        try:
            await self._run(task_status)
        except BaseExceptionGroup as group:
            # A refusal or a startup timeout is one sentence for the operator, not a group.
            inner: BaseException = group
            while isinstance(inner, BaseExceptionGroup) and len(inner.exceptions) == 1:
                inner = inner.exceptions[0]
            if isinstance(inner, (BrokerUnavailable, Refused)):
                raise inner from None
            raise

    async def _run(self, task_status: anyio.abc.TaskStatus[Registered]) -> None:
        ctx = zmq.Context()
        backoff = 0.05
        self._connected = anyio.Event()
        try:
            async with anyio.create_task_group() as tasks:
                while True:
                    sock = dealer(ctx, self.config.broker, max_frame=self.config.max_frame, curve=self.config.curve)
                    async with ZmqChannel(sock) as chan:
                        try:
                            with anyio.fail_after(self.config.register_timeout_s):
                                reg = await self._register(chan)
                        except TimeoutError:
                            if self.registered is None:
                                raise BrokerUnavailable(
                                    f"the broker at {self.config.broker} did not answer within "
                                    f"{self.config.register_timeout_s:g} s; start `kvbroker serve --bind "
                                    f"{self.config.broker}` or fix the broker address"
                                ) from None
                            self._log.warning("broker.unreachable", broker=self.config.broker, retry_s=backoff)
                        except Refused as exc:
                            if self.registered is None:
                                raise
                            # A restarted broker may refuse us for now (say, a peer of another
                            # model registered first); keep trying rather than detach for good.
                            self._log.error("broker.refused", code=exc.code, detail=exc.detail, retry_s=backoff)
                        else:
                            backoff = 0.05
                            first = self.registered is None
                            self.registered = reg
                            self.registrations += 1
                            self._chan = chan
                            self._connected.set()  # type: ignore[union-attr]
                            if first:
                                task_status.started(reg)
                            else:
                                self._log.info("broker.reregistered", peer=reg.peer_id)
                                await self._resend()
                            try:
                                await self._session(chan, reg, tasks)
                            finally:
                                self._chan = None
                                self._connected = anyio.Event()
                    await anyio.sleep(backoff * (0.5 + random.random()))
                    backoff = min(backoff * 2, self.config.reconnect_max_s)
        finally:
            self._chan = None
            ctx.destroy(linger=0)

    async def goodbye(self) -> None:
        """Tell the broker we leave, so it re-routes at once instead of waiting for our lease."""
        if self._chan is not None:
            with anyio.move_on_after(0.5, shield=True):
                await self.send(Goodbye())

    async def _register(self, chan: ZmqChannel) -> Registered:
        await chan.send([self.codec.encode(self.registration)])
        while True:
            msg = self._decode(await chan.receive())
            if isinstance(msg, Registered):
                return msg
            if isinstance(msg, Error):
                raise Refused(msg.code, f"the broker refused {self.registration.instance_id}: {msg.detail}")

    async def _session(self, chan: ZmqChannel, reg: Registered, tasks: anyio.abc.TaskGroup) -> None:
        """Receive and heartbeat until the broker is silent for a whole lease."""
        last_rx = time.monotonic()

        async def heartbeat(scope: anyio.CancelScope) -> None:
            seq = 0
            while True:
                await anyio.sleep(reg.heartbeat_s)
                if time.monotonic() - last_rx > reg.lease_s:
                    self._log.warning("broker.lost", silent_s=round(time.monotonic() - last_rx, 2))
                    scope.cancel()
                    return
                seq += 1
                free = self.pool_free() if self.pool_free else -1
                await chan.send([self.codec.encode(Heartbeat(seq=seq, pool_free=free))])

        async with anyio.create_task_group() as tg:
            tg.start_soon(heartbeat, tg.cancel_scope)
            while True:
                try:
                    frames = await chan.receive()
                except ChannelClosed:
                    tg.cancel_scope.cancel()
                    return
                last_rx = time.monotonic()
                msg = self._decode(frames)
                if msg is None:
                    continue
                if isinstance(msg, Error) and msg.code == "not_registered":
                    self._log.warning("broker.forgot_us", detail=msg.detail)
                    tg.cancel_scope.cancel()
                    return
                self._dispatch(msg, tasks)

    def _decode(self, frames: list[bytes]) -> Message | None:
        if len(frames) != 1:
            self._log.warning("frame.dropped", frames=len(frames))
            return None
        try:
            return self.codec.decode(frames[0])
        except RemoteProtocolError as exc:
            self._log.warning("frame.rejected", code=exc.code, detail=str(exc))
            return None

    def _dispatch(self, msg: Message, tasks: anyio.abc.TaskGroup) -> None:
        h = self.handler
        if isinstance(msg, Prepare):
            tasks.start_soon(self._guarded, h.on_prepare, msg)
        elif isinstance(msg, Go):
            tasks.start_soon(self._guarded, h.on_go, msg)
        elif isinstance(msg, Release):
            self._offers.pop(msg.transfer_id, None)
            tasks.start_soon(self._guarded, h.on_release, msg)
        elif isinstance(msg, Abort):
            self._offers.pop(msg.transfer_id, None)
            self._expects.pop(msg.transfer_id, None)
            tasks.start_soon(self._guarded, h.on_abort, msg)
        elif isinstance(msg, Relay):
            tasks.start_soon(self._guarded, h.on_relay, msg)
        elif isinstance(msg, Error):
            self._log.warning("broker.error", code=msg.code, detail=msg.detail, transfer_id=msg.transfer_id or None)
            if msg.transfer_id and (msg.transfer_id in self._offers or msg.transfer_id in self._expects):
                self._offers.pop(msg.transfer_id, None)
                self._expects.pop(msg.transfer_id, None)
                tasks.start_soon(self._guarded, h.on_abort, Abort(transfer_id=msg.transfer_id, reason=msg.detail))
        # Heartbeat echoes only refresh last_rx.

    async def _guarded(self, handler: Callable[[Any], Awaitable[None]], msg: Message) -> None:
        """Run one handler; its failure is logged and ends that transfer's handling only,
        never the broker session that every other transfer shares."""
        try:
            await handler(msg)
        except Exception:
            self._log.exception(
                "handler.failed", handler=getattr(handler, "__name__", "?"), transfer_id=getattr(msg, "transfer_id", None)
            )

    async def _resend(self) -> None:
        for offer in list(self._offers.values()):
            await self.send(offer)
        for expect in list(self._expects.values()):
            await self.send(expect)

    # -- requests -----------------------------------------------------------------

    async def send(self, msg: Message, *, tracked: bool = False) -> None:
        """Send one message, waiting (under the caller's deadline) while reconnecting.

        `tracked`: `msg` is one of the Offers or Expects re-sent on registering again; if
        that happened while this waited, it went out then and is not sent twice.
        """
        generation = self.registrations
        while self._chan is None:
            if self._connected is None:
                raise BrokerUnavailable("the broker client is not running; start it with run() first")
            await self._connected.wait()
        if tracked and generation and self.registrations != generation:
            return  # only registering *again* re-sends (`_resend`), not the first time
        await self._chan.send([self.codec.encode(msg)])

    async def offer(
        self, transfer_id: str, nbytes: int, layout: Layout | None = None, decode: str = "", prompt: str = ""
    ) -> None:
        msg = Offer(transfer_id=transfer_id, nbytes=nbytes, layout=layout or Layout(), decode=decode, prompt=prompt)
        self._offers[transfer_id] = msg
        await self.send(msg, tracked=True)

    async def expect(self, transfer_id: str, prefill: str = "", *, nbytes: int = 0, into_blocks: bool = False,
                     announce: bool = True) -> None:
        """Await a transfer; `nbytes`: the room its Offer will take here (0: not known),
        reserved by the broker at once, unless `into_blocks` (it is received straight into
        the cache blocks, and takes none). `announce=False`: its Prepare already came, so
        only on registering again is the Expect sent (the broker may have lost track
        meanwhile)."""
        msg = Expect(transfer_id=transfer_id, prefill=prefill, nbytes=nbytes, into_blocks=into_blocks)
        self._expects[transfer_id] = msg
        if announce:
            await self.send(msg, tracked=True)

    async def ready(
        self, transfer_id: str, nbytes: int, offset: int = 0, *, comm: str = "", seq: int = 0, source: str = ""
    ) -> None:
        """`source`: the Prepare's, where several lanes (prefill ranks) feed this rank."""
        await self.send(Ready(transfer_id=transfer_id, offset=offset, nbytes=nbytes, comm=comm, seq=seq, source=source))

    async def done(self, transfer_id: str, nbytes: int, *, source: str = "") -> None:
        self._expects.pop(transfer_id, None)
        await self.send(Done(transfer_id=transfer_id, nbytes=nbytes, source=source))

    async def abort(self, transfer_id: str, reason: str) -> None:
        self._offers.pop(transfer_id, None)
        self._expects.pop(transfer_id, None)
        await self.send(Abort(transfer_id=transfer_id, reason=reason[:2000]))

    async def cancel(self, transfer_id: str, reason: str) -> None:
        """End every lane of a transfer this peer will not take part in (the broker answers
        with a Cancelled, which needs no handling here)."""
        await self.send(Cancel(transfer_id=transfer_id, reason=reason[:2000]))

    async def relay(self, to: str, key: str, payload: bytes) -> None:
        await self.send(Relay(to=to, key=key, payload=payload))


class SyncBrokerClient:
    """A `BrokerClient` on a background event-loop thread, for synchronous code.

    Args:
        on_task_error: called on the loop with a task's name and exception when a task
            handed over by `spawn` raises (default: logged).
    """

    def __init__(self, client: BrokerClient, backend: str = "asyncio",
                 on_task_error: Callable[[str, Exception], None] | None = None) -> None:
        self.client = client
        self._portal_cm = anyio.from_thread.start_blocking_portal(backend)
        self.portal = self._portal_cm.__enter__()
        self._spawner = Spawner(on_task_error or _log_task_error)
        spawner: Future[None] | None = None
        try:
            spawner, _ = self.portal.start_task(self._spawner.run, name="kvbroker-spawner")
            self._future, self.registered = self.portal.start_task(client.run, name="kvbroker-client")
        except BaseException:
            if spawner is not None:
                spawner.cancel()  # else the portal would wait for it forever
            self._portal_cm.__exit__(None, None, None)
            raise
        self._spawner_future = spawner

    def spawn(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> None:
        """Start ``fn(*args)`` on the loop and return at once, without waiting for the loop
        thread (`portal.start_task_soon` waits for it).

        Raises:
            RuntimeError: the loop has stopped.
        """
        self._spawner.spawn(fn, *args)

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return self.portal.call(fn, *args)

    def offer(
        self, transfer_id: str, nbytes: int, layout: Layout | None = None, decode: str = "", prompt: str = ""
    ) -> None:
        self.portal.call(self.client.offer, transfer_id, nbytes, layout, decode, prompt)

    def expect(self, transfer_id: str, prefill: str = "", nbytes: int = 0) -> None:
        self.portal.call(partial(self.client.expect, nbytes=nbytes), transfer_id, prefill)

    def abort(self, transfer_id: str, reason: str) -> None:
        self.portal.call(self.client.abort, transfer_id, reason)

    def close(self) -> None:
        """Say goodbye, stop the loop and join its thread."""
        try:
            self.portal.call(self.client.goodbye)
        finally:
            self._spawner_future.cancel()
            self._future.cancel()
            self._portal_cm.__exit__(None, None, None)

    def __enter__(self) -> SyncBrokerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _log_task_error(name: str, exc: Exception) -> None:
    log.error("client.task_failed", task=name, error=repr(exc))
