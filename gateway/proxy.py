"""`kvbroker gateway`: one OpenAI-compatible HTTP address in front of the vLLM servers.

For each completion request the gateway does what README's "What the proxy sends"
asks of a proxy, so clients need not know about prefill and decode:

1. `Router.route` picks a prefill (P) and a decode (D) instance and makes a transfer_id
   (`routes.random_transfer_id`, the one place ids are made; a Router takes another).
2. The request goes to P with `max_tokens` 1, and at the same time to D, each with
   `kv_transfer_params` naming the transfer and the other instance.
3. D's answer (streamed, if the client asked for a stream) is the client's answer.

When things go wrong:
- The broker is unreachable, has just restarted, or lists no instance of a role: the
  request still goes out as above, to the instances given (`gateway.routes`): P/D
  resumes as soon as they register, and D's `kv_load_failure_policy` covers a transfer
  that cannot happen. The broker's word only ranks instances; it never refuses a request.
- D cannot be reached, or answers 5xx, before any byte went to the client: the same
  request goes to another decode instance with the same transfer_id, so the broker
  hands it P's staged KV without a second prefill (README: a proxy that retries).
- P cannot be reached: D's request is cancelled and the whole request goes to another
  pair, under a new transfer_id. No prefill instance can be reached: a decode instance
  serves the request alone, as a plain request (it computes the prompt itself).
- No instance that the request needs can be reached: 503 with `Retry-After`.
- P refuses the request (4xx), or fails after taking it: D's request is cancelled unless
  D has started answering, and the client gets P's answer or a 502 that says which
  instance failed. Otherwise D would wait out its load timeout for KV that never comes.
- A D answer of 4xx is the client's: it is passed on as it is, and P's request is
  cancelled.
- D's answer went out whole while P's request still runs: P's request goes on in the
  background for `PREFILL_GRACE_S` at most, then is cancelled; the client's connection
  serves its next request meanwhile.
- An instance is passed over for a while (`Router.down_s`) only for its own failure: it
  could not be reached, its answer was not HTTP or broke off, or it answered 5xx; never
  for a request cancelled (the client left, the other side failed) or a 4xx.
- The broker, or whatever answers at its address, fails in any way (silent, another
  protocol or release, this process out of file descriptors): the gateway serves on as
  if it were silent, and logs the cause once, with what to change.
- Whenever no decode instance answered the request (it refused it, none could be
  reached, P failed, the client left, the deadline passed), the broker is told
  (`Cancel`): P's staged KV and D's room for it are freed at once, not at their
  deadlines.

HTTP is spoken through `gateway.http`: httptools' parser on both sides, over the
connections of `gateway.sockets` (the event loop's transports on asyncio, non-blocking
sockets on trio), and to the upstreams on HTTP/1.1 connections kept alive in a pool
(`gateway.pool`). The broker's status (registered instances, free
pool bytes) is asked for every `poll_s` and feeds the router.
"""

from __future__ import annotations

import asyncio
import errno
import socket
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio
import msgspec
import structlog
import zmq
from anyio.abc import TaskStatus

from protocols.ask import cancel_transfer, fetch_status
from protocols.errors import RemoteProtocolError
from protocols.grants import GRANT_PARAM, sign
from protocols.signals import run_until_signalled

from . import sockets
from .http import HttpConn, HttpError, Request, UpstreamFailed, UpstreamPool, UpstreamReply, error_body
from .metrics import gateway_metrics
from .pool import Slots
from .routes import Route, Router, Upstream, check_upstreams
from .sockets import SocketClosed, Stream

log = structlog.get_logger("kvbroker.gateway")

ROUTED = ("/v1/completions", "/v1/chat/completions")
# A 503 is sent only when no upstream could be reached; an instance that refused a
# connection is tried again at once when no other is left, so a second is enough.
RETRY_AFTER = [("Retry-After", "1")]
# How long P's request may go on once D's answer went out whole (in the background, the
# client's connection serving on): D loaded P's KV, so P's one-token answer is due.
PREFILL_GRACE_S = 5.0


@dataclass
class GatewayConfig:
    upstreams: list[Upstream]
    broker: str = "tcp://127.0.0.1:7100"
    host: str = "127.0.0.1"
    port: int = 8000
    # A client's whole request, P's and D's included; a generation can take minutes.
    request_timeout_s: float = 600.0
    connect_timeout_s: float = 5.0
    # Longest wait for a client's request head and body once its connection is open.
    read_timeout_s: float = 30.0
    max_body_bytes: int = 32 << 20
    decode_attempts: int = 2  # decode instances tried for one transfer
    prefill_attempts: int = 2  # (P, D) pairs tried when P cannot be reached
    poll_s: float = 1.0
    # Open connections to all upstreams together; a request over it waits for one to free.
    # A routed request holds one to P and one to D at once: half as many are routed at a
    # time, so D's requests, which wait for P's KV, never hold every slot P's need.
    max_upstream_connections: int = 1024
    curve_server_key: str | None = None
    curve_client_secret: bytes | None = None
    port_file: str | None = None
    # The secret of the decode instances' grant_key_file: D's requests then carry a grant.
    grant_key: bytes | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        for name in ("request_timeout_s", "connect_timeout_s", "read_timeout_s", "poll_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, not {getattr(self, name)!r}.")
        if self.decode_attempts < 1 or self.prefill_attempts < 1:
            raise ValueError("decode and prefill attempts must be at least 1.")
        if self.max_upstream_connections < 2:
            raise ValueError("max_upstream_connections must be at least 2: each request opens one to P and one to D.")
        check_upstreams(self.upstreams)


# --- what each side is sent ---------------------------------------------------------------


def prefill_body(request: dict[str, Any], route: Route) -> dict[str, Any]:
    """P computes the prompt and one token: its KV is what the request is for."""
    body = dict(request)
    body["max_tokens"] = 1
    if "max_completion_tokens" in body:
        body["max_completion_tokens"] = 1
    body["stream"] = False
    for key in ("stream_options", "min_tokens"):
        body.pop(key, None)
    body["kv_transfer_params"] = {"transfer_id": route.transfer_id, "decode_instance_id": route.decode.instance_id}
    return body


def decode_body(request: dict[str, Any], route: Route, grant: str | None = None) -> dict[str, Any]:
    """D loads the route's transfer from its prefill instance; `grant` signs that claim for a
    decode instance that loads only granted transfers (its `grant_key_file`)."""
    body = dict(request)
    params = {"transfer_id": route.transfer_id, "prefill_instance_id": route.prefill.instance_id}
    if grant is not None:
        params[GRANT_PARAM] = grant
    body["kv_transfer_params"] = params
    return body


def route_grant(key: bytes | None, route: Route, ttl_s: float, now: float) -> str | None:
    """The grant for `route`, valid `ttl_s` from Unix time `now` (None without a key). The
    gateway never sees token ids, so it binds no prompt: the broker still checks that P's
    and D's prompts agree."""
    if key is None:
        return None
    return sign(key, transfer_id=route.transfer_id, prefill=route.prefill.instance_id, expires=now + ttl_s)


def parse_request(raw: bytes) -> dict[str, Any]:
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise HttpError(400, f"the request body is not JSON ({exc}).") from None
    except RecursionError:
        raise HttpError(400, "the request body's JSON is nested too deeply.") from None
    if not isinstance(body, dict):
        raise HttpError(400, "the request body must be a JSON object.")
    if "kv_transfer_params" in body:
        raise HttpError(400, "the gateway sets kv_transfer_params itself; send the request without it.")
    return body


# --- the gateway ------------------------------------------------------------------------------


class _SharedSlot:
    """A routing slot held by a request and by its P's request, which may outlive it: given
    back once both have ended."""

    __slots__ = ("slots", "holders")

    def __init__(self, slots: Slots) -> None:
        self.slots, self.holders = slots, 1

    def hold(self) -> None:
        self.holders += 1

    def release(self) -> None:
        self.holders -= 1
        if self.holders == 0:
            self.slots.give_back()


@dataclass
class _Exchange:
    """One client request in flight: what the client has been sent so far."""

    conn: HttpConn
    committed: bool = False  # a response head went to the client: no retry from here
    decoded: bool = False  # a decode instance answered 2xx: it took the request, and its KV


class Gateway:
    def __init__(self, config: GatewayConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.clock = clock
        self.router = Router(config.upstreams, stale_s=max(5.0, 5 * config.poll_s))
        self.port: int | None = None
        self.broker_ok: bool | None = None  # whether the last status request was answered; None before one
        # Answers by status code, and events: decode_retries, prefill_retries, decode_alone
        # (no prefill instance reached), clients_gone, transfers_cancelled (Cancels sent).
        self.answers: Counter[int] = Counter()
        self.events: Counter[str] = Counter()
        self._tasks: anyio.abc.TaskGroup | None = None  # run()'s: the Cancels go on after their request
        self._pool: UpstreamPool | None = None  # run()'s
        self._routes = Slots(config.max_upstream_connections // 2)  # routed requests in flight
        self._zmq: zmq.Context | None = None  # run()'s, for every question to the broker

    async def run(self, *, task_status: TaskStatus[int] = anyio.TASK_STATUS_IGNORED) -> None:
        cfg = self.config
        listeners = await sockets.listen(cfg.host, cfg.port)
        self.port = listeners[0].getsockname()[1]
        self._zmq = zmq.Context()
        try:
            await self._serve(listeners, task_status)
        finally:
            self._zmq.destroy(linger=0)
            for sock in listeners:
                sock.close()

    async def _serve(self, listeners: list[socket.socket], task_status: TaskStatus[int]) -> None:
        cfg = self.config
        async with UpstreamPool(cfg.connect_timeout_s, cfg.max_upstream_connections) as pool, \
                anyio.create_task_group() as tg:
            self._pool, self._tasks = pool, tg
            tg.start_soon(self._watch_broker)
            if cfg.port_file:
                tmp = anyio.Path(f"{cfg.port_file}.tmp")
                await tmp.write_text(f"{self.port}\n")
                await tmp.replace(cfg.port_file)
            log.info("gateway.serving", host=cfg.host, port=self.port, broker=cfg.broker, event_loop=_event_loop(),
                     upstreams=[f"{u.role}:{u.instance_id}={u.url}" for u in cfg.upstreams])
            task_status.started(self.port)
            for sock in listeners:
                tg.start_soon(sockets.serve, sock, self._serve_client, tg)

    async def _watch_broker(self) -> None:
        cfg = self.config
        check = ""  # what the last failure's line said to check: logged again only when that changes
        while True:
            try:
                status = await fetch_status(cfg.broker, min(3.0, 2 * cfg.poll_s), cfg.curve_server_key,
                                            cfg.curve_client_secret, ctx=self._zmq)
                self.router.observe(status, self.clock())
            except Exception as exc:  # whatever answers at --broker (or not), the gateway serves on without it
                if self.broker_ok is not False or _broker_check(exc) != check:
                    check = _broker_check(exc)
                    log.warning("gateway.broker_silent", broker=cfg.broker, error=_broker_error(exc), check=check,
                                exc_info=not isinstance(exc, _BROKER_TROUBLE))
                self.broker_ok = False
            else:
                if self.broker_ok is not True:
                    log.info("gateway.broker_seen", broker=cfg.broker, peers=len(status.peers))
                self.broker_ok = True
            await anyio.sleep(cfg.poll_s)

    # --- one client connection ---

    async def _serve_client(self, stream: Stream) -> None:
        conn = HttpConn(stream, lambda: self.config.max_body_bytes)
        try:
            async with anyio.create_task_group() as tg:
                # One reader for the connection's life (not one per request): it parses the
                # next request, and notices a client that hangs up while being answered.
                tg.start_soon(self._pump, conn)
                try:
                    await self._serve_requests(conn)
                finally:
                    tg.cancel_scope.cancel()
        except Exception as exc:  # a bug must cost one connection, never the gateway
            log.exception("gateway.connection_crashed", error=repr(exc))
        finally:
            # An answer cut short (the deadline passed while a client that stopped reading was
            # sent it): what is left of it would hold the connection and its memory for ever.
            stream.close(cut_short=not conn.answered)

    async def _pump(self, conn: HttpConn) -> None:
        try:
            await conn.pump()
        except SocketClosed:
            pass

    async def _serve_requests(self, conn: HttpConn) -> None:
        cfg = self.config
        while True:
            ex: _Exchange | None = None
            # One scope per request: first the wait for it (--read-timeout), then its
            # answer (--request-timeout); `HttpConn.pump` cancels it if the client hangs up
            # meanwhile, and its upstream requests then end too, so vLLM frees what they hold.
            with anyio.CancelScope(deadline=anyio.current_time() + cfg.read_timeout_s) as scope:
                request = await conn.next_request()
                if request is None:
                    return  # closed, or an idle keep-alive connection ended
                if isinstance(request, HttpError):
                    await self._send_quietly(conn, request.status, request.message)
                    await conn.linger(cfg.read_timeout_s)
                    return
                scope.deadline = anyio.current_time() + cfg.request_timeout_s
                conn.request_scope = scope
                ex = _Exchange(conn)
                try:
                    await self._handle(ex, request)
                except HttpError as exc:
                    if ex.committed:
                        return
                    await self._send_quietly(conn, exc.status, exc.message, exc.headers)
                except SocketClosed:
                    return  # the client went away mid-answer
                except Exception as exc:
                    if conn.gone:
                        pass  # what broke was the client's leaving
                    else:  # a bug must cost one request, never the gateway
                        log.exception("gateway.request_crashed", error=repr(exc))
                        if not ex.committed:
                            await self._send_quietly(conn, 500, "the gateway failed on this request; its log says why.")
                        return
                finally:
                    conn.request_scope = None
            if conn.gone:
                log.info("gateway.client_gone", phase="client")
                self.events["clients_gone"] += 1
                return
            if scope.cancelled_caught:
                if ex is None or ex.committed:
                    return  # no request within --read-timeout, or an answer cut short
                await self._send_quietly(conn, 504, f"no answer within --request-timeout {cfg.request_timeout_s:g} s.")
            if not conn.keep_alive or not conn.answered:
                return

    async def _send_quietly(
        self, conn: HttpConn, status: int, message: str, headers: Sequence[tuple[str, str]] = ()
    ) -> None:
        if conn.head_sent:
            return
        try:
            await self._send_whole(conn, status, [("Content-Type", "application/json"), *headers], error_body(status, message))
        except SocketClosed:
            pass

    async def _reply(self, ex: _Exchange, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
        ex.committed = True
        await self._send_whole(ex.conn, status, headers, body)

    async def _send_whole(self, conn: HttpConn, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
        self.answers[status] += 1
        await conn.send_whole(status, headers, body)

    async def _handle(self, ex: _Exchange, request: Request) -> None:
        method, target = request.method, request.target.split("?", 1)[0]
        if target == "/health" and method == "GET":
            # Serving, whatever the broker says: a balancer in front must keep sending.
            why = self.router.degraded(self.clock())
            body = {"status": "degraded", "reason": why} if why else {"status": "ok"}
            return await self._reply(ex, 200, [("Content-Type", "application/json")], msgspec.json.encode(body))
        if target == "/metrics" and method == "GET":
            body, ctype = gateway_metrics(self.answers, self.events, self.router, self.clock())
            return await self._reply(ex, 200, [("Content-Type", ctype)], body)
        if target == "/v1/models" and method == "GET":
            return await self._forward_models(ex)
        if target not in ROUTED:
            raise HttpError(404, f"{method} {target} is not served here; the gateway serves POST {' and '.join(ROUTED)}.")
        if method != "POST":
            raise HttpError(405, f"{target} takes POST, not {method}.")
        passed = [(k.decode(), v.decode("latin-1")) for k, v in request.headers if k.lower() in (b"authorization",)]
        await self._routed(ex, target, parse_request(request.body), passed)

    async def _forward_models(self, ex: _Exchange) -> None:
        up = self.router.pick("decode", self.clock())
        assert up is not None  # every role has an instance given
        try:
            async with self._upstreams.request(up, "GET", "/v1/models", b"", []) as reply:
                body = await reply.body()
        except UpstreamFailed as exc:
            raise HttpError(502 if exc.reached else 503, str(exc), [] if exc.reached else RETRY_AFTER) from None
        await self._reply(ex, reply.status, [("Content-Type", reply.content_type)], body)

    # --- a routed request ---

    async def _routed(self, ex: _Exchange, target: str, request: dict[str, Any], headers: list[tuple[str, str]]) -> None:
        await self._routes.take()  # before routing: the pair is picked by the load once admitted
        slot = _SharedSlot(self._routes)
        try:
            await self._route(ex, target, request, headers, slot)
        finally:
            slot.release()

    async def _route(
        self, ex: _Exchange, target: str, request: dict[str, Any], headers: list[tuple[str, str]], slot: _SharedSlot,
    ) -> None:
        tried_p: list[str] = []
        for _ in range(self.config.prefill_attempts):
            route = self.router.route(self.clock(), exclude=tried_p)
            if route is None:
                break  # every prefill instance was tried
            # The transfer's logger, passed down (a bound logger costs less per request than
            # binding context variables, which every log line then walks).
            tlog = log.bind(transfer_id=route.transfer_id, role="gateway")
            tlog.debug("gateway.routed", phase="route", prefill=route.prefill.instance_id, decode=route.decode.instance_id,
                       path=target, stream=bool(request.get("stream")))
            p_failed = await self._one_route(ex, target, request, headers, route, tlog, slot)
            if p_failed is None:
                return
            tried_p.append(route.prefill.instance_id)
            self.events["prefill_retries"] += 1
        # No prefill instance could be reached: D computes the prompt itself, rather than
        # the client getting no answer.
        up = self.router.pick("decode", self.clock())
        assert up is not None  # every role has an instance given
        log.warning("gateway.decode_alone", phase="route", decode=up.instance_id, tried=tried_p)
        self.events["decode_alone"] += 1
        hdrs = [("Content-Type", "application/json"), *headers]
        got = await self._decode(ex, target, msgspec.json.encode(request), hdrs, up, log)
        if isinstance(got, HttpError):
            raise got

    async def _one_route(
        self, ex: _Exchange, target: str, request: dict[str, Any], headers: list[tuple[str, str]], route: Route,
        tlog: structlog.typing.FilteringBoundLogger, slot: _SharedSlot,
    ) -> UpstreamFailed | None:
        """Run P's and D's requests together. Returns P's failure when P was never reached
        and nothing went to the client (the caller tries another pair); otherwise the
        client has its answer, or an `HttpError` says what to send."""
        hdrs = [("Content-Type", "application/json"), *headers]
        p_raw = msgspec.json.encode(prefill_body(request, route))
        grant = route_grant(self.config.grant_key, route, self.config.request_timeout_s, time.time())
        d_raw = msgspec.json.encode(decode_body(request, route, grant))
        p_result: dict[str, Any] = {}
        # D's request is this task's; P's is a task of the gateway's, not of this request's:
        # once D's answer went out whole, P's must not hold the client's connection (its next
        # request waits behind it), so it may end in the background, for PREFILL_GRACE_S at
        # most, holding the routing slot until then. Either side still ends the other: P's
        # failure cancels D's request (`d_scope`), and D's end cancels P's (`p_scope`) unless D
        # took the request, and P's KV with it.
        d_scope = anyio.CancelScope()
        p_scope = anyio.CancelScope(deadline=anyio.current_effective_deadline())  # the request's
        p_done = anyio.Event()

        async def prefill() -> None:
            up = route.prefill
            self.router.started(up)
            failed = False  # an instance is passed over only for its own failure, never for a cancelled request
            try:
                with p_scope:
                    if p_scope.cancel_called:
                        return  # ended before it started: send nothing
                    async with self._upstreams.request(up, "POST", target, p_raw, hdrs) as reply:
                        body = await reply.body()
                    failed = reply.status >= 500
                    p_result["reply"] = (reply.status, reply.content_type, body)
                    tlog.debug("gateway.prefilled", phase="prefill", status=reply.status)
                    if reply.status >= 300:
                        tlog.warning("gateway.prefill_refused", phase="prefill", status=reply.status)
                    if reply.status >= 300 and not ex.committed:
                        d_scope.cancel()  # D would wait its load timeout for KV that is not coming
                if p_scope.cancelled_caught and ex.decoded:  # D answered; P did not within the grace
                    tlog.warning("gateway.prefill_abandoned", phase="prefill", prefill=up.instance_id,
                                 grace_s=PREFILL_GRACE_S)
            except UpstreamFailed as exc:
                failed = True
                p_result["failed"] = exc
                tlog.warning("gateway.prefill_failed", phase="prefill", error=str(exc), reached=exc.reached)
                if not ex.committed:
                    d_scope.cancel()
            except Exception as exc:  # this task is the gateway's: a bug must cost this request, never the gateway
                p_result["crashed"] = exc
                tlog.exception("gateway.prefill_crashed", phase="prefill", error=repr(exc))
                if not ex.committed:
                    d_scope.cancel()
            finally:
                self.router.finished(up, self.clock(), failed=failed)
                slot.release()
                p_done.set()

        assert self._tasks is not None, "requests are served only inside run()"
        slot.hold()
        self._tasks.start_soon(prefill)
        d_result: list[int | HttpError] = []
        try:
            with d_scope:
                d_result.append(await self._decode(ex, target, d_raw, hdrs, route.decode, tlog, route.prefill.instance_id))
        finally:  # also when the client left or the deadline passed (this task is cancelled then)
            if not p_done.is_set():
                if ex.decoded:
                    p_scope.deadline = min(p_scope.deadline, anyio.current_time() + PREFILL_GRACE_S)
                else:
                    p_scope.cancel()  # D will not load this KV: P's copy would never be claimed
            if not ex.decoded:
                self._cancel_soon(route.transfer_id, _given_up(d_result, p_result))
        if not ex.decoded:  # else P's request ends on its own, in the background
            await p_done.wait()  # cancelled, or it cancelled D's request: it ends at once
            if "crashed" in p_result and not ex.committed:
                raise HttpError(500, "the gateway failed on this request; its log says why.")
        if d_result and isinstance(d_result[0], HttpError):
            raise d_result[0]
        if ex.committed:
            return None
        failed = p_result.get("failed")
        if isinstance(failed, UpstreamFailed):
            if not failed.reached:
                return failed
            raise HttpError(502, f"{failed}; the request was not answered.")
        status, ctype, body = p_result["reply"]
        # P answered first with an error, and D's request was cancelled for it: pass P's on.
        await self._reply(ex, status, [("Content-Type", ctype)], body)
        return None

    async def _decode(
        self, ex: _Exchange, target: str, raw: bytes, hdrs: list[tuple[str, str]], first: Upstream,
        tlog: structlog.typing.FilteringBoundLogger,
        prefill: str | None = None,
    ) -> int | HttpError:
        """D's request, tried on another decode instance while nothing has gone to the
        client; D's body names only the transfer and P, so it goes unchanged and the broker
        hands P's staged KV to the new claim. Returns the status sent to the client, or
        what to send when no instance answered: 503 if none could be reached."""
        tried: list[str] = []
        up: Upstream | None = first
        last = ""
        reached = False
        while up is not None and len(tried) < self.config.decode_attempts:
            tried.append(up.instance_id)
            self.router.started(up)
            failed = False  # passed over only for its own failure: never for a cancelled request, nor a 4xx
            try:
                async with self._upstreams.request(up, "POST", target, raw, hdrs) as reply:
                    if reply.status >= 500:
                        failed = reached = True
                        last = f"decode instance {up.instance_id} answered {reply.status}: {(await reply.body())[:200]!r}"
                    else:
                        ex.decoded = reply.status < 300
                        await self._relay(ex, reply)
                        # The request's one line at info: the route and the answer.
                        tlog.info("gateway.decoded", phase="decode", prefill=prefill, decode=up.instance_id,
                                  path=target, status=reply.status, attempt=len(tried))
                        return reply.status
            except UpstreamFailed as exc:  # unreachable, not HTTP, or its answer cut short
                failed = True
                if ex.committed:
                    tlog.warning("gateway.decode_broke", phase="decode", error=str(exc))
                    return HttpError(502, str(exc))  # the stream ends early; the client sees it
                last = str(exc)
                reached = reached or exc.reached
            finally:
                self.router.finished(up, self.clock(), failed=failed)
            tlog.warning("gateway.decode_retry", phase="decode", error=last, attempt=len(tried))
            self.events["decode_retries"] += 1
            up = self.router.pick("decode", self.clock(), exclude=tried)
        if not reached:
            return HttpError(503, f"no decode instance could be reached ({last}).", RETRY_AFTER)
        return HttpError(502, f"no decode instance answered ({last}).")

    @property
    def _upstreams(self) -> UpstreamPool:
        assert self._pool is not None, "requests are served only inside run()"
        return self._pool

    def _cancel_soon(self, transfer_id: str, reason: str) -> None:
        """Tell the broker, beside the client's answer, that the request was given up."""
        if self._tasks is not None:
            self.events["transfers_cancelled"] += 1
            self._tasks.start_soon(self._cancel, transfer_id, reason)

    async def _cancel(self, transfer_id: str, reason: str) -> None:
        cfg = self.config
        with structlog.contextvars.bound_contextvars(transfer_id=transfer_id, role="gateway"):
            try:
                got = await cancel_transfer(cfg.broker, transfer_id, reason, cfg.connect_timeout_s,
                                            cfg.curve_server_key, cfg.curve_client_secret, ctx=self._zmq)
            except Exception as exc:  # the transfer's own deadlines end it then; the gateway serves on
                log.warning("gateway.cancel_failed", phase="cancel", error=_broker_error(exc), check=_broker_check(exc),
                            exc_info=not isinstance(exc, _BROKER_TROUBLE))
            else:
                log.info("gateway.cancelled", phase="cancel", reason=reason, ended=got.ended, left=got.left)

    async def _relay(self, ex: _Exchange, reply: UpstreamReply) -> None:
        ctype = reply.content_type
        if reply.header("content-length") is not None or not ctype.startswith("text/event-stream"):
            await self._reply(ex, reply.status, [("Content-Type", ctype)], await reply.body())
            return
        # A stream: pass each chunk on as it comes, chunked.
        ex.committed = True
        self.answers[reply.status] += 1
        await ex.conn.start_stream(reply.status, [("Content-Type", ctype), ("Cache-Control", "no-cache")])
        async for chunk in reply.chunks():
            await ex.conn.send_chunk(chunk)
        await ex.conn.end_stream()


def _given_up(d_result: list[int | HttpError], p_result: dict[str, Any]) -> str:
    """Why a request no decode instance answered was given up, for the peers' logs."""
    if d_result and isinstance(d_result[0], HttpError):
        return d_result[0].message
    if d_result:
        return f"the decode instance answered {d_result[0]}"
    if "failed" in p_result:
        return str(p_result["failed"])
    if "reply" in p_result and p_result["reply"][0] >= 300:
        return f"the prefill instance answered {p_result['reply'][0]}"
    return "the client left, or --request-timeout passed"


# What a question to the broker meets when the broker (or what answers at its address) fails: a
# timeout, a refusal (RuntimeError), the network or the process's file descriptors (OSError,
# zmq.ZMQError), another protocol or release (RemoteProtocolError). Anything else is a bug here.
_BROKER_TROUBLE = (TimeoutError, RuntimeError, OSError, zmq.ZMQError, RemoteProtocolError)


def _broker_error(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return str(exc) or "timed out"
    if isinstance(exc, RuntimeError) and str(exc):
        return str(exc)  # the broker's own sentence
    return f"{type(exc).__name__}: {exc}"


def _broker_check(exc: BaseException) -> str:
    """What to change when a question to the broker failed with `exc`, in one sentence."""
    if isinstance(exc, TimeoutError):
        return "start the broker, or point --broker at the address it binds, and let the gateway reach it."
    if isinstance(exc, RemoteProtocolError):
        return "point --broker at a kvbroker broker of this release: what answers there speaks another protocol."
    if isinstance(exc, (zmq.ZMQError, OSError)) and exc.errno in (errno.EMFILE, errno.ENFILE):
        return "raise the gateway's open-file limit (ulimit -n): it has run out of file descriptors."
    if isinstance(exc, (zmq.ZMQError, OSError)):
        return "check --broker's address and this host's network and resources (the error says which)."
    if isinstance(exc, RuntimeError):
        return "see the broker's log for why it refused the gateway's question."
    return "report this gateway bug with the traceback logged here."


def _event_loop() -> str:
    """The event loop serving: asyncio's loop by its package (asyncio, uvloop), or trio."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # not in asyncio
        return "trio"
    return type(loop).__module__.split(".")[0]


def serve(config: GatewayConfig, backend: str = "asyncio") -> None:
    """Run the gateway in the foreground until SIGINT or SIGTERM; on asyncio, uvloop's
    event loop (a quarter of the gateway's time per request went to asyncio's own)."""
    options = {"use_uvloop": sys.platform != "win32"} if backend == "asyncio" else {}
    run_until_signalled(lambda: Gateway(config).run, "gateway.stopping", backend, options)
