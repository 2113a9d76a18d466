"""The broker daemon: a ZMQ ROUTER socket driven by anyio around the pure core.

Every frame is decoded, handed to `Broker.handle` without awaiting, and the returned
messages are sent without blocking: a peer whose queue is full loses that message (it
will time out and retry) rather than stall the broker for everyone. One task group
holds the receive loop, the lease timer and the status snapshot for metrics.

A broker that stops running (a stopped process, a starved host, a call that blocks)
says so: a watch thread logs where the loop's thread is while it is stuck, and once it
runs again it logs how long it was away and lets nothing end until its peers have had a
heartbeat to be heard (`Broker.resume`): their heartbeats wait in its own queue.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import structlog
import zmq

from protocols.channel import PeerUnreachable, ZmqChannel, router
from protocols.codec import Codec
from protocols.errors import ChannelClosed, LocalProtocolError, RemoteProtocolError
from protocols.messages import Error, Status
from protocols.signals import run_until_signalled

from .core import Broker, BrokerConfig, Note, Send
from .metrics import serve_metrics

log = structlog.get_logger("kvbroker.broker")

DRAIN_BATCH = 256
SEND_BATCH = 32
# The loop away this long is a stall worth a warning; its timer wakes at least every 100 ms.
STALL_S = 1.0


@dataclass(frozen=True)
class DaemonConfig:
    bind: str = "tcp://127.0.0.1:7100"
    max_frame: int = 1 << 20
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    curve_secret_key: bytes | None = None
    # Z85 public keys of the peers allowed in (with curve_secret_key); None: any peer
    # that knows the broker's public key.
    curve_client_keys: frozenset[bytes] | None = None
    # Written with the bound endpoint once serving, so a launcher can use port 0.
    port_file: str | None = None
    core: BrokerConfig = field(default_factory=BrokerConfig)


class _ListedKeys:
    """ZAP credentials: a CURVE client gets in only with a listed public key."""

    def __init__(self, keys: frozenset[bytes]) -> None:
        self.keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.keys:
            return True
        log.warning(
            "peer.refused_key",
            client_key=key.decode(errors="replace"),
            reason="its CURVE public key is not listed; add its .key file to the --curve-clients folder",
        )
        return False


def _admit_only(ctx: zmq.Context, keys: frozenset[bytes]) -> Any:
    """Run a ZAP handler on `ctx` (a thread of pyzmq's) that admits only `keys`."""
    from zmq.auth.thread import ThreadAuthenticator

    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback("*", credentials_provider=_ListedKeys(keys))
    return auth


class BrokerDaemon:
    def __init__(self, config: DaemonConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self.core = Broker(config.core)
        self.codec = Codec(config.max_frame)
        self.endpoint: str | None = None
        self.dropped_sends = 0
        self.snapshot: Status = Status()
        # When the timer is next due to run; whichever task runs first well after it
        # finds the broker was away (`_check_stall`).
        self._due: float | None = None
        # The core's notes at each level that the log writes (see `run`): one that would be
        # dropped is not built into a log call at all (about 1 us of the broker's thread each,
        # two a handshake).
        self._noted = {"info": True, "debug": True}

    async def run(self, *, task_status: anyio.abc.TaskStatus[str] = anyio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled. `task_status.started` reports the bound endpoint (port 0 too)."""
        self._noted = {"info": log.is_enabled_for(logging.INFO), "debug": log.is_enabled_for(logging.DEBUG)}
        ctx = zmq.Context()
        # Started before the bind, so no connection is ever admitted unchecked.
        auth = _admit_only(ctx, self.config.curve_client_keys) if self.config.curve_client_keys is not None else None
        try:
            sock, self.endpoint = router(
                ctx, self.config.bind, max_frame=self.config.max_frame, curve_secret=self.config.curve_secret_key
            )
        except zmq.ZMQError as exc:
            if auth is not None:
                auth.stop()
            ctx.term()
            raise SystemExit(f"cannot bind {self.config.bind}: {exc}; pick a free address with --bind") from None
        structlog.contextvars.bind_contextvars(role="broker", instance=self.endpoint)
        metrics = None
        async with ZmqChannel(sock) as chan, anyio.create_task_group() as tg:
            if self.config.metrics_port is not None:
                metrics = serve_metrics(lambda: self.snapshot, self.config.metrics_host, self.config.metrics_port)
            tg.start_soon(self._timer, chan)
            log.info("broker.serving", endpoint=self.endpoint, metrics_port=self.config.metrics_port)
            if self.config.port_file:
                tmp = anyio.Path(f"{self.config.port_file}.tmp")
                await tmp.write_text(self.endpoint)
                await tmp.replace(self.config.port_file)  # whole or absent: a reader never sees half
            task_status.started(self.endpoint)
            try:
                await self._receive_loop(chan)
            finally:
                tg.cancel_scope.cancel()
                if metrics is not None:
                    metrics.shutdown()
        if auth is not None:
            auth.stop()
        ctx.term()

    async def _receive_loop(self, chan: ZmqChannel) -> None:
        while True:
            try:
                frames = await chan.receive()
            except ChannelClosed:
                return
            # Drain a burst without a scheduler round trip per message, bounded so the
            # lease timer still runs under sustained load. Its replies go out a few at a
            # time (`SEND_BATCH`): each send that finds zmq's I/O thread asleep wakes it,
            # and on the broker's one core that wake-up took the core from this thread
            # once a message (docs/PERFORMANCE.md, control plane).
            held: list[Send] = []
            try:
                self.on_frames(chan, frames, held)
                for _ in range(DRAIN_BATCH):
                    if len(held) >= SEND_BATCH:
                        self._send_all(chan, held)
                    self.on_frames(chan, chan.receive_nowait(), held)
            except anyio.WouldBlock:
                pass
            except ChannelClosed:
                return
            finally:
                self._send_all(chan, held)

    def _send_all(self, chan: ZmqChannel, held: list[Send]) -> None:
        for send in held:
            self._send(chan, send)
        held.clear()

    def on_frames(self, chan: ZmqChannel, frames: list[bytes], held: list[Send]) -> None:
        """Handle one ROUTER message: [identity, payload]. Never raises on bad input. Its
        replies go into `held`, in order (the caller sends them); its notes are logged now."""
        counters = self.core.counters
        if len(frames) != 2:
            counters["bad_frames"] += 1
            log.warning("frame.dropped", reason=f"expected 2 frames, got {len(frames)}")
            return
        identity, payload = frames
        effects: list[Send | Note]
        try:
            msg = self.codec.decode(payload)
        except RemoteProtocolError as exc:
            counters["bad_frames"] += 1
            if counters["bad_frames"] <= 10 or counters["bad_frames"] % 1000 == 0:
                log.warning("frame.rejected", code=exc.code, detail=str(exc), bad_frames=counters["bad_frames"])
            effects = [Send(identity, Error(code=exc.code, detail=str(exc)[:2000]))]
        else:
            now = self.clock()
            self._check_stall(now)  # before this message renews its sender's lease
            try:
                effects = self.core.handle(now, identity, msg)
            except Exception:
                # A fault in the broker's own decisions fails this message's transfer, not
                # the broker that every other transfer shares: its peer hears at once.
                counters["internal_errors"] += 1
                tid = getattr(msg, "transfer_id", "")
                log.exception("message.failed", message=type(msg).__name__, transfer_id=tid or None)
                detail = f"the broker failed handling this {type(msg).__name__}; its log says why"
                effects = [Send(identity, Error(code="internal", detail=detail, transfer_id=tid))]
        for effect in effects:
            if type(effect) is Send:
                held.append(effect)
            else:
                self._apply(chan, effect)

    def _check_stall(self, now: float) -> None:
        """The loop runs `now`: if that is long after the timer was due, the broker was
        away, and it says so (and lets the core know) before anything else happens."""
        if self._due is None or now - self._due <= STALL_S:
            return
        away, self._due = now - self._due, now
        log.warning(
            "broker.stalled", stalled_s=round(away, 3),
            reason="the broker did not run for that long (a stopped process, a starved host or a "
            "blocking call); nothing ends until its peers have had a heartbeat to be heard. On a host "
            "shared with vLLM engines, start them under nice or give the broker a core of its own",
        )
        self.core.resume(now)

    def _apply(self, chan: ZmqChannel, effect: Send | Note) -> None:
        if isinstance(effect, Send):
            self._send(chan, effect)
        elif self._noted[effect.level]:
            fields: dict[str, Any] = dict(effect.fields)
            if "transfer_id" in fields:
                fields.setdefault("phase", effect.event.split(".", 1)[-1])
            (log.debug if effect.level == "debug" else log.info)(effect.event, **fields)

    def _send(self, chan: ZmqChannel, send: Send) -> None:
        try:
            chan.send_nowait([send.identity, self.codec.encode(send.msg)])
        except (PeerUnreachable, anyio.WouldBlock, LocalProtocolError) as exc:
            # The peer is gone or not reading; its lease will expire and the core cleans up.
            self.dropped_sends += 1
            log.warning(
                "send.dropped",
                msg=type(send.msg).__name__,
                transfer_id=getattr(send.msg, "transfer_id", None),
                reason=type(exc).__name__,
            )
        except ChannelClosed:
            pass

    async def _timer(self, chan: ZmqChannel) -> None:
        """Run the core's lease clock; sleep until its next deadline, but at least every 100 ms."""
        watch = _StallWatch(self.clock, lambda: self._due, self.endpoint)
        watch.start()
        try:
            while True:
                now = self.clock()
                self._check_stall(now)
                for effect in self.core.tick(now):
                    self._apply(chan, effect)
                self.snapshot = self.core.status(now)
                deadline = self.core.next_deadline()
                wait = 0.1 if deadline is None else min(0.1, max(0.005, deadline - now))
                self._due = now + wait
                await anyio.sleep(wait)
        finally:
            watch.stop()


class _StallWatch(threading.Thread):
    """Logs where the event loop's thread is when the loop is `STALL_S` past `due()`.

    The loop can only say how long it was away once it runs again; this says where it
    was stuck, which tells a blocking call (its stack) from a process that was not
    scheduled at all (the loop's own wait for events).
    """

    def __init__(self, clock: Callable[[], float], due: Callable[[], float | None], endpoint: str | None) -> None:
        super().__init__(name="kvbroker-stall-watch", daemon=True)
        self.clock = clock
        self.due = due
        self.endpoint = endpoint
        self.loop_thread = threading.get_ident()
        self._stopped = threading.Event()

    def stop(self) -> None:
        self._stopped.set()

    def run(self) -> None:
        reported = None
        while not self._stopped.wait(STALL_S / 2):
            due = self.due()
            if due is None or self.clock() - due <= STALL_S or due == reported:
                continue
            reported = due  # once per stall
            frame = sys._current_frames().get(self.loop_thread)
            where = "".join(traceback.format_stack(frame)[-6:]) if frame is not None else "(gone)"
            log.warning("broker.stuck", role="broker", instance=self.endpoint,
                        since_s=round(self.clock() - due, 3), where=where)


def serve(config: DaemonConfig, backend: str = "asyncio") -> None:
    """Run the daemon in the foreground until SIGINT or SIGTERM."""
    run_until_signalled(lambda: BrokerDaemon(config).run, "broker.stopping", backend)
