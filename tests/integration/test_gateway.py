"""`gateway.proxy` on real sockets: a real `kvbroker serve` process, peers registered with
it by real broker clients, and HTTP upstreams on loopback that answer as the test says.

The upstreams stand in for vLLM servers only where a fault must be timed (an instance
that answers 503, breaks off, refuses the prompt); tests/e2e/test_openai_servers.py runs
the gateway in front of real vLLM servers.
"""

from __future__ import annotations

import errno
import itertools
import json
import signal
import socket
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import h11
import httpx
import msgspec
import pytest
import structlog
import zmq
from anyio.abc import SocketStream

from gateway import proxy, sockets
from gateway.http import HttpConn
from gateway.proxy import Gateway, GatewayConfig
from gateway.routes import Upstream
from protocols.ask import STATUS_MAX_FRAME, fetch_status
from protocols.channel import curve_client_keys
from protocols.codec import Codec
from protocols.messages import Abort, Error, Register
from tests.support import ROOT, BrokerProcess, env
from workers.client import BrokerClient, ClientConfig, NullHandler

pytestmark = [pytest.mark.slow, pytest.mark.anyio]


@dataclass
class Seen:
    body: dict[str, Any]
    path: str = ""
    gone: anyio.Event = field(default_factory=anyio.Event)  # the gateway closed the connection


# behaviour(seen) -> (status, chunks); chunks may be an async iterator for a stream; None: close at once;
# bytes: sent as they are (an answer cut short, or not HTTP), then the connection closes.
Behaviour = Callable[[Seen], Awaitable[tuple[int, Any] | bytes | None]]


class FakeServer:
    """An HTTP server on 127.0.0.1 that records each request and answers per `behaviour`."""

    def __init__(self, behaviour: Behaviour) -> None:
        self.behaviour = behaviour
        self.seen: list[Seen] = []
        self.arrived = anyio.Event()
        self.port = 0
        self.connections = 0
        self.ended = 0  # connections this server has closed
        self.close_after_answer = False  # as a server whose keep-alive ran out while the connection was idle

    async def run(self, *, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1", local_port=0)
        self.port = listener.extra(anyio.abc.SocketAttribute.local_port)
        async with listener, anyio.create_task_group() as tg:
            task_status.started()
            await listener.serve(self._one, task_group=tg)

    async def _one(self, stream: SocketStream) -> None:
        """Requests one after another on a kept-alive connection, as vLLM's server takes them."""
        conn = h11.Connection(h11.SERVER)
        self.connections += 1
        try:
            async with stream:
                while await self._request(conn, stream) and not self.close_after_answer:
                    conn.start_next_cycle()
        finally:
            self.ended += 1

    async def _request(self, conn: h11.Connection, stream: SocketStream) -> bool:
        """Serve one request; False when the connection ends."""
        body, path = b"", ""
        while True:
            ev = conn.next_event()
            if isinstance(ev, h11.Request):
                path = ev.target.decode()
            if ev is h11.NEED_DATA:
                try:
                    conn.receive_data(await stream.receive())
                except (anyio.EndOfStream, anyio.BrokenResourceError):
                    return False  # closed while idle, or before sending the whole request
            elif isinstance(ev, h11.Data):
                body += ev.data
            elif isinstance(ev, h11.EndOfMessage):
                break
            elif isinstance(ev, h11.ConnectionClosed):
                return False
        seen = Seen(msgspec.json.decode(body) if body else {}, path)
        self.seen.append(seen)
        self.arrived.set()
        last = b""  # the answer's last bytes, sent once `watch` is gone: after them the gateway may send its next request
        try:
            async with anyio.create_task_group() as tg:

                async def watch() -> None:  # EOF from the gateway: it cancelled this request
                    try:
                        await stream.receive()
                    except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError):
                        pass
                    seen.gone.set()
                    tg.cancel_scope.cancel()

                tg.start_soon(watch)
                answer = await self.behaviour(seen)
                if isinstance(answer, bytes):
                    await stream.send(answer)
                    answer = None
                if answer is not None:
                    status, chunks = answer
                    if isinstance(chunks, bytes):
                        head = [("Content-Type", "application/json"), ("Content-Length", str(len(chunks)))]
                        last = conn.send(h11.Response(status_code=status, headers=head)) + conn.send(h11.Data(data=chunks))
                    else:
                        head = [("Content-Type", "text/event-stream"), ("Transfer-Encoding", "chunked")]
                        await stream.send(conn.send(h11.Response(status_code=status, headers=head)))
                        async for c in chunks:
                            await stream.send(conn.send(h11.Data(data=c)))
                    last += conn.send(h11.EndOfMessage())
                tg.cancel_scope.cancel()
            if seen.gone.is_set() or not last:
                return False  # cancelled, or told to close without answering
            await stream.send(last)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            return False
        return True


def answer(status: int, obj: Any) -> Behaviour:
    async def behave(seen: Seen) -> tuple[int, bytes]:
        return status, msgspec.json.encode(obj)

    return behave


def completion(seen: Seen) -> dict[str, Any]:
    """What a vLLM server answers, tagged with who answered and what it was told."""
    return {"object": "text_completion", "max_tokens": seen.body.get("max_tokens"),
            "kv_transfer_params": seen.body.get("kv_transfer_params")}


async def echo(seen: Seen) -> tuple[int, bytes]:
    return 200, msgspec.json.encode(completion(seen))


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens here once the socket closes


@dataclass
class Cluster:
    gateway: Gateway
    servers: dict[str, FakeServer]
    http: httpx.AsyncClient

    async def post(self, body: Any, path: str = "/v1/completions", **kw: Any) -> httpx.Response:
        with anyio.fail_after(20):
            return await self.http.post(path, json=body, **kw)


@pytest.fixture
def broker(tmp_path: Path):
    b = BrokerProcess(tmp_path, "--heartbeat", "0.2", "--peer-lease", "3")
    b.start()
    yield b
    assert b.stop() == 0, b.log_path.read_text()


@asynccontextmanager
async def cluster(
    broker: BrokerProcess | str | None, behaviours: dict[str, Behaviour], *, registered: tuple[str, ...] | None = None,
    dead: tuple[str, ...] = (), request_timeout_s: float = 20.0, max_upstream_connections: int = 1024, **config: Any,
) -> AsyncIterator[Cluster]:
    """Upstreams named p*/d* (prefill/decode), each registered at the broker under its name
    (or only those in `registered`); names in `dead` get a port nobody listens on. `broker`
    may instead be an address where no broker runs (a fake one; None: a port nobody listens
    on): nothing registers then, and every instance given takes requests. `config`: more of
    the gateway's."""
    real = isinstance(broker, BrokerProcess)
    endpoint = broker.endpoint if isinstance(broker, BrokerProcess) else (broker or f"tcp://127.0.0.1:{closed_port()}")
    servers = {name: FakeServer(b) for name, b in behaviours.items()}
    cfg = ClientConfig(broker=endpoint, register_timeout_s=10)
    async with anyio.create_task_group() as tg:
        for s in servers.values():
            await tg.start(s.run)
        names = registered if registered is not None else tuple(behaviours) + dead
        for name in names if real else ():  # nothing registers at a fake broker
            role = "prefill" if name.startswith("p") else "decode"
            reg = Register(role=role, instance_id=name, compat_hash="h", pool_capacity=0 if role == "prefill" else 1 << 20)
            await tg.start(BrokerClient(cfg, reg, NullHandler()).run)
        ports = {n: s.port for n, s in servers.items()} | {n: closed_port() for n in dead}
        ups = [Upstream(instance_id=n, role="prefill" if n.startswith("p") else "decode", host="127.0.0.1", port=port)
               for n, port in ports.items()]
        gw = Gateway(GatewayConfig(upstreams=ups, broker=endpoint, port=0, poll_s=0.1,
                                   request_timeout_s=request_timeout_s, connect_timeout_s=2,
                                   max_upstream_connections=max_upstream_connections, **config))
        port = await tg.start(gw.run)
        with anyio.fail_after(10):  # the first status reached the router
            while real and gw.router.view is None:
                await anyio.sleep(0.02)
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
            yield Cluster(gw, servers, http)
        tg.cancel_scope.cancel()


async def never(seen: Seen) -> None:
    await anyio.sleep_forever()


async def test_a_request_goes_to_prefill_for_one_token_and_to_decode_for_the_answer(broker: BrokerProcess) -> None:
    async with cluster(broker, {"p0": echo, "d0": echo}) as c:
        r = await c.post({"model": "m", "prompt": [1, 2, 3], "max_tokens": 9, "stream": False, "min_tokens": 2})
        assert r.status_code == 200, r.text
        (p,), (d,) = c.servers["p0"].seen, c.servers["d0"].seen
        tid = p.body["kv_transfer_params"]["transfer_id"]
        assert p.body["max_tokens"] == 1 and p.body["stream"] is False and "min_tokens" not in p.body
        assert p.body["kv_transfer_params"] == {"transfer_id": tid, "decode_instance_id": "d0"}
        assert d.body["kv_transfer_params"] == {"transfer_id": tid, "prefill_instance_id": "p0"}
        assert d.body["max_tokens"] == 9 and d.body["min_tokens"] == 2 and d.body["prompt"] == [1, 2, 3]
        # The client's answer is D's.
        assert r.json() == completion(d)
        # A second request is a new transfer.
        r2 = await c.post({"model": "m", "prompt": [1, 2, 3], "max_tokens": 9})
        assert r2.status_code == 200
        assert c.servers["d0"].seen[1].body["kv_transfer_params"]["transfer_id"] not in ("", tid)
        # A chat request the same way, on its own path; P gets one token by either name.
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 9}
        r3 = await c.post(chat, path="/v1/chat/completions")
        assert r3.status_code == 200, r3.text
        p3, d3 = c.servers["p0"].seen[2], c.servers["d0"].seen[2]
        assert p3.path == d3.path == "/v1/chat/completions" and p.path == d.path == "/v1/completions"
        assert p3.body["max_tokens"] == 1 and p3.body["max_completion_tokens"] == 1
        assert d3.body["messages"] == chat["messages"] and d3.body["max_completion_tokens"] == 9
        assert p3.body["kv_transfer_params"]["transfer_id"] == d3.body["kv_transfer_params"]["transfer_id"]
        # One after another, the three requests took the same kept-alive connection to each side.
        assert c.servers["p0"].connections == 1 and c.servers["d0"].connections == 1


async def test_a_kept_alive_connection_its_server_closed_is_not_used_again(broker: BrokerProcess) -> None:
    async with cluster(broker, {"p0": echo, "d0": echo}) as c:
        d0 = c.servers["d0"]
        d0.close_after_answer = True
        for n in (1, 2, 3):
            assert (await c.post({"prompt": [n]})).status_code == 200
            with anyio.fail_after(10):  # d0 closed its side of the idle connection
                while d0.ended < n:
                    await anyio.sleep(0.01)
        # Each request found the last connection closed and opened a new one: no failure, no retry.
        assert d0.connections == 3 and len(d0.seen) == 3 and c.gateway.events["decode_retries"] == 0
        assert c.servers["p0"].connections == 1


async def test_a_streamed_answer_reaches_the_client_as_decode_sends_it(broker: BrokerProcess) -> None:
    first_read = anyio.Event()

    async def stream(seen: Seen) -> tuple[int, Any]:
        async def chunks() -> AsyncIterator[bytes]:
            yield b"data: one\n\n"
            with anyio.fail_after(10):
                await first_read.wait()  # the client has the first chunk while D still holds the rest
            yield b"data: two\n\n"
            yield b"data: [DONE]\n\n"

        return 200, chunks()

    async with cluster(broker, {"p0": echo, "d0": stream}) as c:
        got = []
        with anyio.fail_after(20):
            async with c.http.stream("POST", "/v1/completions", json={"prompt": [1], "stream": True}) as r:
                assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
                async for chunk in r.aiter_raw():
                    got.append(chunk)
                    first_read.set()
        assert b"".join(got) == b"data: one\n\ndata: two\n\ndata: [DONE]\n\n"
        assert c.servers["p0"].seen[0].body["stream"] is False


async def test_a_decode_instance_that_fails_is_replaced_with_the_same_transfer(broker: BrokerProcess) -> None:
    async def broken(seen: Seen) -> None:
        return None  # closes the connection without answering, as a dying server would

    async with cluster(broker, {"p0": echo, "d0": broken, "d1": echo}) as c:
        # d0 and d1 are alike to the router; make d0 the first pick.
        c.gateway.router.pick("decode", c.gateway.clock(), exclude=["d0"])
        r = await c.post({"prompt": [5, 6], "max_tokens": 4})
        assert r.status_code == 200, r.text
        (p,), (d0,), (d1,) = c.servers["p0"].seen, c.servers["d0"].seen, c.servers["d1"].seen
        tid = p.body["kv_transfer_params"]["transfer_id"]
        assert d0.body["kv_transfer_params"]["transfer_id"] == tid == d1.body["kv_transfer_params"]["transfer_id"]
        assert r.json() == completion(d1)
        # d0 failed: the next request goes to d1 while d0 is down.
        await c.post({"prompt": [5, 6], "max_tokens": 4})
        assert len(c.servers["d0"].seen) == 1 and len(c.servers["d1"].seen) == 2
        # /metrics says so.
        text = (await c.http.get("/metrics")).text
        for sample in ('kvbroker_gateway_answers_total{status="200"} 2.0', "kvbroker_gateway_decode_retries_total 1.0",
                       'kvbroker_gateway_instance_usable{instance="d0",role="decode"} 0.0',
                       'kvbroker_gateway_instance_usable{instance="d1",role="decode"} 1.0',
                       'kvbroker_gateway_in_flight{instance="d1",role="decode"} 0.0'):
            assert sample in text, text


async def test_a_decode_5xx_is_retried_and_a_decode_4xx_is_the_clients(broker: BrokerProcess) -> None:
    async with cluster(broker, {"p0": echo, "d0": answer(503, {"error": "overloaded"}), "d1": answer(400, {"error": "bad"})}) as c:
        c.gateway.router.pick("decode", c.gateway.clock(), exclude=["d0"])
        r = await c.post({"prompt": [1], "max_tokens": 4})
        # d0's 503 was retried on d1, whose 400 is the client's to see.
        assert r.status_code == 400 and r.json() == {"error": "bad"}
        assert len(c.servers["d0"].seen) == 1 and len(c.servers["d1"].seen) == 1


class Aborts(NullHandler):
    """A peer's handler that keeps the Aborts the broker sends it."""

    def __init__(self) -> None:
        self.got: list[Abort] = []
        self.came = anyio.Event()

    async def on_abort(self, msg: Abort) -> None:
        self.got.append(msg)
        self.came.set()


async def test_a_request_no_decode_instance_took_frees_prefills_staged_kv_at_once(broker: BrokerProcess) -> None:
    """P staged and offered the prompt's KV, naming d0; d0 refused the request. Without a
    word from the gateway, P's copy would wait for d0's load deadline; the gateway's
    Cancel ends it now, whichever of Offer and Cancel reaches the broker first."""
    aborts, offered = Aborts(), anyio.Event()
    p0 = BrokerClient(ClientConfig(broker=broker.endpoint, register_timeout_s=10),
                      Register(role="prefill", instance_id="p0", compat_hash="h"), aborts)

    async def stage_then_answer(seen: Seen) -> tuple[int, bytes]:
        kv = seen.body["kv_transfer_params"]
        await p0.offer(kv["transfer_id"], 4096, decode=kv["decode_instance_id"])
        offered.set()
        return await echo(seen)

    async def refuse_once_offered(seen: Seen) -> tuple[int, bytes]:
        with anyio.fail_after(10):
            await offered.wait()
        return 400, msgspec.json.encode({"error": "bad"})

    async with anyio.create_task_group() as tg:
        await tg.start(p0.run)
        async with cluster(broker, {"p0": stage_then_answer, "d0": refuse_once_offered}, registered=("d0",)) as c:
            r = await c.post({"prompt": [1], "max_tokens": 4})
            assert r.status_code == 400 and r.json() == {"error": "bad"}
            tid = c.servers["p0"].seen[0].body["kv_transfer_params"]["transfer_id"]
            with anyio.fail_after(10):  # well inside the 30 s that d0's load deadline would take
                await aborts.came.wait()
            assert [m.transfer_id for m in aborts.got] == [tid]
            assert aborts.got[0].reason == "the request was cancelled (the decode instance answered 400)"
            status = await fetch_status(broker.endpoint)
            assert status.transfers == [] and all(pool.reserved == 0 for pool in status.pools)
            assert c.gateway.events["transfers_cancelled"] == 1
        tg.cancel_scope.cancel()


async def test_an_unreachable_prefill_instance_sends_the_request_to_another_pair(broker: BrokerProcess) -> None:
    async with cluster(broker, {"p1": echo, "d0": never, "d1": echo}, dead=("p0",)) as c:
        router = c.gateway.router
        router.pick("prefill", c.gateway.clock(), exclude=["p0"])  # p0 first
        router.pick("decode", c.gateway.clock(), exclude=["d0"])  # d0 first
        r = await c.post({"prompt": [1], "max_tokens": 4})
        assert r.status_code == 200, r.text
        (p1,), (d1,) = c.servers["p1"].seen, c.servers["d1"].seen
        # A new pair, under a new transfer_id.
        assert p1.body["kv_transfer_params"]["transfer_id"] == d1.body["kv_transfer_params"]["transfer_id"]
        assert d1.body["kv_transfer_params"]["prefill_instance_id"] == "p1"
        assert r.json() == completion(d1)
        # D's request for the dead P's transfer was cancelled, whether or not it had arrived.
        for d0 in c.servers["d0"].seen:
            assert d0.body["kv_transfer_params"]["transfer_id"] != d1.body["kv_transfer_params"]["transfer_id"]
            with anyio.fail_after(10):
                await d0.gone.wait()


async def test_a_prompt_prefill_refuses_ends_the_decode_request_with_prefills_answer(broker: BrokerProcess) -> None:
    refusal = {"error": {"message": "prompt too long", "code": 400}}
    async with cluster(broker, {"p0": answer(400, refusal), "d0": never}) as c:
        r = await c.post({"prompt": [1], "max_tokens": 4})
        # At once, not after D's wait: D's request was cancelled (if it had arrived at all).
        assert r.status_code == 400 and r.json() == refusal
        for d0 in c.servers["d0"].seen:
            with anyio.fail_after(10):
                await d0.gone.wait()


async def test_only_instances_registered_at_the_broker_get_requests(broker: BrokerProcess) -> None:
    async with cluster(broker, {"p0": echo, "d0": echo, "d1": echo}, registered=("p0", "d1")) as c:
        for _ in range(3):
            assert (await c.post({"prompt": [1]})).status_code == 200
        assert len(c.servers["d0"].seen) == 0 and len(c.servers["d1"].seen) == 3
        health = await c.http.get("/health")
        assert health.status_code == 200 and health.json() == {"status": "ok"}
        assert "kvbroker_gateway_degraded 0.0" in (await c.http.get("/metrics")).text


async def test_with_no_decode_instance_registered_requests_go_to_the_ones_given(broker: BrokerProcess) -> None:
    """d0 is not (yet, or again) registered: the request goes to it as usual, with its
    transfer, rather than a 503; /health stays 200 and says why the gateway is degraded."""
    async with cluster(broker, {"p0": echo, "d0": echo}, registered=("p0",)) as c:
        r = await c.post({"prompt": [1]})
        assert r.status_code == 200, r.text
        (p,), (d,) = c.servers["p0"].seen, c.servers["d0"].seen
        assert d.body["kv_transfer_params"] == {"transfer_id": p.body["kv_transfer_params"]["transfer_id"],
                                                "prefill_instance_id": "p0"}
        health = await c.http.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "degraded"
        assert "no decode instance is registered at the broker (given: d0)" in health.json()["reason"]
        assert "kvbroker_gateway_degraded 1.0" in (await c.http.get("/metrics")).text


async def test_with_no_prefill_instance_reachable_a_decode_instance_serves_the_request_alone(broker: BrokerProcess) -> None:
    async with cluster(broker, {"d0": echo}, dead=("p0", "p1")) as c:
        r = await c.post({"prompt": [1], "max_tokens": 4})
        assert r.status_code == 200, r.text
        # The last D request is the plain one: no transfer, the whole request.
        assert c.servers["d0"].seen[-1].body == {"prompt": [1], "max_tokens": 4}
        assert r.json() == completion(c.servers["d0"].seen[-1])
        assert c.gateway.events["decode_alone"] == 1 and c.gateway.events["prefill_retries"] == 2


async def test_with_no_upstream_reachable_the_answer_is_503_with_retry_after(broker: BrokerProcess) -> None:
    async with cluster(broker, {}, dead=("p0", "d0", "d1")) as c:
        for r in (await c.post({"prompt": [1]}), await c.http.get("/v1/models")):
            assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
            assert "could be reached" in r.json()["error"]["message"] or "cannot connect" in r.json()["error"]["message"]


async def test_bad_requests_get_a_sentence_and_the_connection_serves_on(broker: BrokerProcess) -> None:
    async with cluster(broker, {"p0": echo, "d0": echo}) as c:
        cases = [
            (await c.http.post("/v1/completions", content=b"{not json"), 400, "not JSON"),
            (await c.http.post("/v1/completions", content=b"[1, 2]"), 400, "JSON object"),
            (await c.post({"prompt": [1], "kv_transfer_params": {"transfer_id": "x"}}), 400, "sets kv_transfer_params"),
            (await c.http.get("/v1/completions"), 405, "takes POST"),
            (await c.post({}, path="/v1/embeddings"), 404, "not served here"),
        ]
        for r, status, words in cases:
            assert r.status_code == status and words in r.json()["error"]["message"], r.text
        assert c.servers["p0"].seen == [] and c.servers["d0"].seen == []
        c.gateway.config.max_body_bytes = 1000
        r = await c.http.post("/v1/completions", content=b"x" * 5000)
        assert r.status_code == 413 and "--max-body-bytes" in r.json()["error"]["message"]
        # Not HTTP at all: a 400 on that connection, and the gateway serves on.
        port = c.gateway.port
        assert port is not None
        upgrade = b"POST /v1/completions HTTP/1.1\r\nConnection: Upgrade\r\nUpgrade: h2c\r\nContent-Length: 2\r\n\r\n{}"
        for junk in (b"\x00\xff GARBAGE\r\n\r\n", b"GET / HTTP/1.1\r\n" + b"X: " + b"y" * 20000 + b"\r\n\r\n", upgrade):
            async with await anyio.connect_tcp("127.0.0.1", port) as raw:
                await raw.send(junk)
                with anyio.fail_after(10):
                    head = await raw.receive()
            assert head.startswith((b"HTTP/1.1 400", b"HTTP/1.1 431")), head[:80]
        assert (await c.post({"prompt": [1]})).status_code == 200  # still serving


async def _answers(raw: SocketStream, n: int) -> list[tuple[bytes, bytes]]:
    """The next `n` answers on a raw connection, each as (head, body); the gateway gives
    every whole answer a Content-Length."""
    buf, got = b"", []
    with anyio.fail_after(10):
        while len(got) < n:
            end = buf.find(b"\r\n\r\n")
            if end >= 0:
                head = buf[:end]
                length = next((int(line.split(b":")[1]) for line in head.lower().split(b"\r\n")
                               if line.startswith(b"content-length:")), 0)
                if len(buf) >= end + 4 + length:
                    got.append((head, buf[end + 4:end + 4 + length]))
                    buf = buf[end + 4 + length:]
                    continue
            buf += await raw.receive()
    return got


async def test_pipelined_requests_are_answered_in_order_and_a_client_that_expects_100_continue_gets_it(
        broker: BrokerProcess) -> None:
    async with cluster(broker, {"p0": echo, "d0": echo}) as c:
        port = c.gateway.port
        assert port is not None
        body = msgspec.json.encode({"prompt": [7], "max_tokens": 4})
        post = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
        async with await anyio.connect_tcp("127.0.0.1", port) as raw:
            # Three requests in one write: each answered in turn on the same connection.
            await raw.send(post + b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n" + post)
            (h1, b1), (h2, b2), (h3, b3) = await _answers(raw, 3)
            assert h1.startswith(b"HTTP/1.1 200") and h2.startswith(b"HTTP/1.1 200") and h3.startswith(b"HTTP/1.1 200")
            d = c.servers["d0"].seen
            assert len(d) == 2 and msgspec.json.decode(b1) == completion(d[0]) and msgspec.json.decode(b3) == completion(d[1])
            assert msgspec.json.decode(b2) == {"status": "ok"}
            # A client that waits for 100 Continue before it sends the body.
            await raw.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                           b"Content-Length: %d\r\n\r\n" % len(body))
            with anyio.fail_after(10):
                assert await raw.receive() == b"HTTP/1.1 100 Continue\r\n\r\n"
            await raw.send(body)
            ((head, answer),) = await _answers(raw, 1)
            assert head.startswith(b"HTTP/1.1 200") and msgspec.json.decode(answer) == completion(c.servers["d0"].seen[2])


async def test_an_http_1_0_client_gets_a_stream_unchunked_to_the_connections_end(broker: BrokerProcess) -> None:
    async def stream(seen: Seen) -> tuple[int, Any]:
        async def chunks() -> AsyncIterator[bytes]:
            yield b"data: one\n\n"
            yield b"data: [DONE]\n\n"

        return 200, chunks()

    async with cluster(broker, {"p0": echo, "d0": stream}) as c:
        port = c.gateway.port
        assert port is not None
        body = msgspec.json.encode({"prompt": [1], "stream": True})
        async with await anyio.connect_tcp("127.0.0.1", port) as raw:
            await raw.send(b"POST /v1/completions HTTP/1.0\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            got = b""
            with anyio.fail_after(10):
                try:
                    while True:
                        got += await raw.receive()
                except anyio.EndOfStream:
                    pass
        head, _, rest = got.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200") and b"connection: close" in head.lower()
        assert b"transfer-encoding" not in head.lower() and rest == b"data: one\n\ndata: [DONE]\n\n"


async def test_requests_over_the_upstream_connection_limit_wait_and_never_lock_each_other_out(
        broker: BrokerProcess) -> None:
    """Two upstream connections at most, and each D answers only once P has seen its
    transfer, as a real D waits for P's KV. Three requests at once: if two D requests held
    both connections, their P requests could never start and every request would run to
    its deadline. A routed request holds P's and D's together, so one is routed at a
    time, the others wait for it, and all three are answered. (D's answers are also held
    until the test has seen the other two wait.)"""
    release = anyio.Event()

    async def after_prefill(seen: Seen) -> tuple[int, bytes]:
        tid = seen.body["kv_transfer_params"]["transfer_id"]
        with anyio.fail_after(20):
            while not any(s.body["kv_transfer_params"]["transfer_id"] == tid for s in c.servers["p0"].seen):
                await anyio.sleep(0.01)
            await release.wait()
        return await echo(seen)

    async with cluster(broker, {"p0": echo, "d0": after_prefill}, max_upstream_connections=2,
                       request_timeout_s=8) as c:
        got: list[httpx.Response] = []
        routes, slots = c.gateway._routes, c.gateway._upstreams.pool.slots
        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(lambda: _append(got, c.post({"prompt": [1]})))
            with anyio.fail_after(10):  # one routed (its P answered, its D held), the others waiting for it
                while len(routes.waiting) < 2 or not c.servers["p0"].seen:
                    await anyio.sleep(0.01)
            assert routes.busy == 1 and len(c.servers["p0"].seen) == 1
            release.set()
        assert [r.status_code for r in got] == [200, 200, 200], [r.text for r in got]
        with anyio.fail_after(10):  # the last P may end after its D answered the client
            while slots.busy or routes.busy:
                await anyio.sleep(0.01)
        assert len(c.servers["p0"].seen) == len(c.servers["d0"].seen) == 3
        assert not slots.waiting and not routes.waiting


async def test_a_request_past_its_deadline_gets_504_and_its_upstream_requests_end(broker: BrokerProcess) -> None:
    async with cluster(broker, {"p0": never, "d0": never}, request_timeout_s=2) as c:
        got: list[httpx.Response] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: _append(got, c.post({"prompt": [1]})))
            with anyio.fail_after(10):
                await c.servers["p0"].arrived.wait()
                await c.servers["d0"].arrived.wait()
        assert got[0].status_code == 504 and "--request-timeout" in got[0].json()["error"]["message"]
        with anyio.fail_after(10):
            await c.servers["p0"].seen[0].gone.wait()
            await c.servers["d0"].seen[0].gone.wait()


async def _append(into: list[Any], value: Awaitable[Any]) -> None:
    into.append(await value)


async def test_a_silent_broker_leaves_every_configured_instance_in_use(broker: BrokerProcess) -> None:
    async with cluster(broker, {"p0": echo, "d0": echo, "d1": echo}, registered=("p0", "d0")) as c:
        assert (await c.post({"prompt": [1]})).status_code == 200
        assert len(c.servers["d0"].seen) == 1 and c.servers["d1"].seen == []  # the registered one
        broker.stop()
        with anyio.fail_after(20):  # the last status goes stale
            while c.gateway.router.fresh_view(c.gateway.clock()) is not None:
                await anyio.sleep(0.05)
        # Without the broker's view the connectors' own deadlines decide; every instance takes turns.
        for _ in range(2):
            assert (await c.post({"prompt": [1]})).status_code == 200
        assert len(c.servers["d1"].seen) == 1


async def test_a_client_that_hangs_up_ends_both_upstream_requests(broker: BrokerProcess) -> None:
    async with cluster(broker, {"p0": never, "d0": never}) as c:
        port = c.gateway.port
        assert port is not None
        body = msgspec.json.encode({"prompt": [1], "max_tokens": 4})
        async with await anyio.connect_tcp("127.0.0.1", port) as raw:
            await raw.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            with anyio.fail_after(10):
                await c.servers["p0"].arrived.wait()
                await c.servers["d0"].arrived.wait()
        # Well inside the 20 s request deadline: the gateway saw the client leave.
        with anyio.fail_after(10):
            await c.servers["p0"].seen[0].gone.wait()
            await c.servers["d0"].seen[0].gone.wait()
        assert c.gateway.router.in_flight(c.gateway.router.upstreams[0]) == 0
        with anyio.fail_after(10):  # and the broker is told, once the request's task has unwound
            while c.gateway.events["transfers_cancelled"] < 1:
                await anyio.sleep(0.01)
        assert (await c.post({"prompt": [1]}, path="/v1/embeddings")).status_code == 404  # still serving


async def test_a_gateway_reads_a_curve_brokers_registry_only_with_a_listed_key(tmp_path: Path) -> None:
    keys, listed = tmp_path / "keys", tmp_path / "clients"
    listed.mkdir()
    for name in ("broker", "p0", "d0", "gw", "stranger"):
        with anyio.fail_after(30):
            made = await anyio.run_process([sys.executable, "-m", "broker.cli", "keygen", "--out", str(keys), "--name", name],
                                           env=env(), cwd=ROOT, check=False)
        assert made.returncode == 0, made.stderr.decode()
        if name in ("p0", "d0", "gw"):
            (listed / f"{name}.key").write_bytes((keys / f"{name}.key").read_bytes())
    server = (keys / "broker.key").read_text().strip()
    broker = BrokerProcess(tmp_path, "--curve-secret-file", str(keys / "broker.key_secret"), "--curve-clients", str(listed))
    broker.start()
    ups = [Upstream("p0", "prefill", "127.0.0.1", closed_port()), Upstream("d0", "decode", "127.0.0.1", closed_port())]

    def gateway(key: str) -> Gateway:
        return Gateway(GatewayConfig(upstreams=ups, broker=broker.endpoint, port=0, poll_s=0.1, curve_server_key=server,
                                     curve_client_secret=(keys / f"{key}.key_secret").read_bytes()))

    try:
        async with anyio.create_task_group() as tg:
            for name, role in (("p0", "prefill"), ("d0", "decode")):
                cfg = ClientConfig(broker=broker.endpoint, curve=curve_client_keys(server, (keys / f"{name}.key_secret").read_bytes()))
                reg = Register(role=role, instance_id=name, compat_hash="h", pool_capacity=0 if role == "prefill" else 1 << 20)
                await tg.start(BrokerClient(cfg, reg, NullHandler()).run)
            listed_gw, stranger_gw = gateway("gw"), gateway("stranger")
            await tg.start(listed_gw.run)
            await tg.start(stranger_gw.run)
            with anyio.fail_after(20):
                while listed_gw.router.view is None or stranger_gw.broker_ok is not False:
                    await anyio.sleep(0.05)
            assert listed_gw.router.view.registered == {"prefill": {"p0"}, "decode": {"d0"}}
            assert stranger_gw.router.view is None  # refused at the handshake: it learns nothing
            tg.cancel_scope.cancel()
    finally:
        assert broker.stop() == 0, broker.log_path.read_text()


async def test_a_broker_killed_and_restarted_under_a_stream_of_requests_fails_none(broker: BrokerProcess) -> None:
    """SIGKILL the broker under a steady stream of requests, restart it on the same
    address, and let p0, then d0, register again: every request is answered 200, and
    every one went to P and D as a transfer (with kv_transfer_params), before, during
    and after the gap. The peers register again only once the gateway has seen the
    restarted broker list no one, so each state of the gap is certain to be met."""
    servers = {"p0": FakeServer(echo), "d0": FakeServer(echo)}
    cfg = ClientConfig(broker=broker.endpoint, register_timeout_s=10)

    def peer(name: str) -> BrokerClient:
        role = "prefill" if name.startswith("p") else "decode"
        return BrokerClient(cfg, Register(role=role, instance_id=name, compat_hash="h",
                                          pool_capacity=0 if role == "prefill" else 1 << 20), NullHandler())

    codes: Counter[int] = Counter()
    in_phase: Counter[str] = Counter()
    phase = "registered"

    async def client(http: httpx.AsyncClient, stop: anyio.Event) -> None:
        while not stop.is_set():
            with anyio.fail_after(20):
                r = await http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 3})
            codes[r.status_code] += 1
            if r.status_code == 200:
                in_phase[phase] += 1

    async def served_in(name: str, n: int = 10) -> None:
        nonlocal phase
        phase = name
        with anyio.fail_after(30):
            while in_phase[name] < n:
                await anyio.sleep(0.02)

    async def until(what: Callable[[], bool]) -> None:
        with anyio.fail_after(30):
            while not what():
                await anyio.sleep(0.02)

    async with anyio.create_task_group() as tg:
        for s in servers.values():
            await tg.start(s.run)
        ups = [Upstream("p0", "prefill", "127.0.0.1", servers["p0"].port), Upstream("d0", "decode", "127.0.0.1", servers["d0"].port)]
        gw = Gateway(GatewayConfig(upstreams=ups, broker=broker.endpoint, port=0, poll_s=0.1, connect_timeout_s=2))
        port = await tg.start(gw.run)
        registered = gw.router.registered
        first_peers = anyio.CancelScope()

        async def register_both(*, task_status: Any = anyio.TASK_STATUS_IGNORED) -> None:
            with first_peers:
                async with anyio.create_task_group() as peers:
                    for name in ("p0", "d0"):
                        await peers.start(peer(name).run)
                    task_status.started()

        await tg.start(register_both)
        await until(lambda: gw.router.degraded(gw.clock()) is None and gw.broker_ok is True)
        stop = anyio.Event()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as http, \
                anyio.create_task_group() as clients:
            for _ in range(4):
                clients.start_soon(client, http, stop)
            await served_in("registered")
            broker.kill()  # SIGKILL: no goodbye, no state kept
            first_peers.cancel()  # its peers register again below, once the gap has been seen
            await until(lambda: gw.broker_ok is False)
            await served_in("broker unreachable")
            broker.start()  # the same address
            await until(lambda: gw.broker_ok is True and gw.router.fresh_view(gw.clock()) is not None
                        and not registered("prefill", gw.clock()) and not registered("decode", gw.clock()))
            await served_in("restarted, no one registered")
            await tg.start(peer("p0").run)
            await until(lambda: registered("prefill", gw.clock()) == {"p0"} and not registered("decode", gw.clock()))
            await served_in("prefill registered, decode not yet")
            await tg.start(peer("d0").run)
            await until(lambda: gw.router.degraded(gw.clock()) is None)
            await served_in("registered again")
            stop.set()
        tg.cancel_scope.cancel()
    assert set(codes) == {200}, codes
    assert len(in_phase) == 5
    # Every request went to both sides as a transfer, none plain to one.
    tids = {side: [s.body["kv_transfer_params"]["transfer_id"] for s in servers[side].seen] for side in servers}
    assert sorted(tids["p0"]) == sorted(tids["d0"]) and len(set(tids["d0"])) == len(tids["d0"]) == codes[200]
    assert gw.answers == Counter({200: codes[200]})


async def test_the_gateway_command_serves_on_uvloop_and_logs_one_line_per_request(broker: BrokerProcess, tmp_path: Path) -> None:
    servers = {"p0": FakeServer(echo), "d0": FakeServer(echo)}
    port_file, log_path = tmp_path / "gateway.port", tmp_path / "gateway.log"
    async with anyio.create_task_group() as tg:
        for server in servers.values():
            await tg.start(server.run)
        cmd = [sys.executable, "-m", "broker.cli", "gateway", "--broker", broker.endpoint, "--port", "0",
               "--port-file", str(port_file), "--prefill", f"p0=http://127.0.0.1:{servers['p0'].port}",
               "--decode", f"d0=http://127.0.0.1:{servers['d0'].port}", "--log-format", "json", "--log-level", "info"]
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env(), cwd=ROOT)
        try:
            with anyio.fail_after(30):
                while not port_file.exists():
                    assert proc.poll() is None, log_path.read_text()
                    await anyio.sleep(0.05)
            port = int(port_file.read_text())
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=20) as http:
                for _ in range(3):
                    r = await http.post("/v1/completions", json={"model": "m", "prompt": [1, 2], "max_tokens": 4})
                    assert r.status_code == 200, r.text
                    assert r.json() == completion(servers["d0"].seen[-1])
        finally:
            proc.send_signal(signal.SIGTERM)
            with anyio.fail_after(20):
                while proc.poll() is None:
                    await anyio.sleep(0.05)
        tg.cancel_scope.cancel()
    assert proc.returncode == 0, log_path.read_text()
    lines = [json.loads(line) for line in log_path.read_text().splitlines() if line.startswith("{")]
    (serving,) = [e for e in lines if e["event"] == "gateway.serving"]
    assert serving["event_loop"] == ("asyncio" if sys.platform == "win32" else "uvloop")
    # One line at info per request, naming its transfer, both instances and the answer.
    per_request = [e for e in lines if "transfer_id" in e]
    assert [e["event"] for e in per_request] == ["gateway.decoded"] * 3, per_request
    tids = [e["transfer_id"] for e in per_request]
    assert tids == [s.body["kv_transfer_params"]["transfer_id"] for s in servers["d0"].seen]
    assert all(e["prefill"] == "p0" and e["decode"] == "d0" and e["status"] == 200 for e in per_request)


# --- faults the gateway must outlive: its broker's, its upstreams', its clients' -----------------


async def until(what: Callable[[], object], timeout: float = 10) -> None:
    with anyio.fail_after(timeout):
        while not what():
            await anyio.sleep(0.01)


def post_bytes(body: bytes) -> bytes:
    return b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)


class WatchedConn(HttpConn):
    """The gateway's side of a client connection, kept in `made` for a test to look at;
    `body_came` is set once body bytes of a request were parsed."""

    made: list[WatchedConn] = []

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.body_came = anyio.Event()
        self.made.append(self)

    def on_body(self, body: bytes) -> None:
        super().on_body(body)
        self.body_came.set()


@pytest.fixture
def client_conns(monkeypatch: pytest.MonkeyPatch) -> list[WatchedConn]:
    """The gateway's client connections, as it makes them."""
    monkeypatch.setattr(WatchedConn, "made", [])
    monkeypatch.setattr(proxy, "HttpConn", WatchedConn)
    return WatchedConn.made


class FakeBroker:
    """A ROUTER socket where the broker would be, answering every question with `replies`
    in turn (frames no broker of this release sends); a thread, for either event loop."""

    def __init__(self, replies: list[bytes]) -> None:
        self.replies = itertools.cycle(replies)
        self.asked: list[str] = []  # the questions' message types, in order
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.RCVTIMEO, 20)  # how soon it sees `_stop`
        self.endpoint = f"tcp://127.0.0.1:{self._sock.bind_to_random_port('tcp://127.0.0.1')}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> FakeBroker:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        self._sock.close(linger=0)
        self._ctx.term()

    def _serve(self) -> None:
        codec = Codec(STATUS_MAX_FRAME)
        while not self._stop.is_set():
            try:
                frames = self._sock.recv_multipart()
            except zmq.Again:
                continue
            self.asked.append(type(codec.decode(frames[-1])).__name__)
            self._sock.send_multipart([frames[0], next(self.replies)])


async def test_whatever_answers_at_the_brokers_address_the_gateway_serves_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """Another service, or a broker of another release, at --broker; then a gateway out of
    file descriptors (a ZMQError, not an OSError): its status polls and Cancels fail, each
    cause logged once with what to change, and requests are still served."""
    other_release = bytearray(Codec().encode(Error(code="x", detail="y")))
    other_release[1] += 1  # the protocol version
    with FakeBroker([b"\x00 not kvbroker", bytes(other_release)]) as fake, \
            structlog.testing.capture_logs() as logs:
        async with cluster(fake.endpoint, {"p0": echo, "d0": answer(400, {"error": "bad"})}) as c:
            await until(lambda: fake.asked.count("StatusRequest") >= 4)  # polled on after each refused answer
            assert c.gateway.broker_ok is False
            assert (await c.post({"prompt": [1]})).status_code == 400  # D refused it: a Cancel goes out
            await until(lambda: [e for e in logs if e["event"] == "gateway.cancel_failed"])
            assert "Cancel" in fake.asked

            async def out_of_fds(*args: Any, **kw: Any) -> Any:
                raise zmq.ZMQError(errno.EMFILE)

            polls = len(fake.asked)
            monkeypatch.setattr(proxy, "fetch_status", out_of_fds)
            monkeypatch.setattr(proxy, "cancel_transfer", out_of_fds)
            await until(lambda: len([e for e in logs if e["event"] == "gateway.broker_silent"]) == 2)
            assert (await c.post({"prompt": [1]})).status_code == 400
            await until(lambda: len([e for e in logs if e["event"] == "gateway.cancel_failed"]) == 2)
            assert (await c.http.get("/health")).status_code == 200
            assert len(fake.asked) == polls  # every question since met the ZMQError
    silent = [e for e in logs if e["event"] == "gateway.broker_silent"]
    cancels = [e for e in logs if e["event"] == "gateway.cancel_failed"]
    for events in (silent, cancels):
        assert "--broker at a kvbroker broker of this release" in events[0]["check"], events
        assert "open-file limit" in events[1]["check"] and "Too many open files" in events[1]["error"], events
    assert len(silent) == 2  # one line per cause, not one per poll


async def test_a_header_that_never_ends_gets_431_once_past_the_head_limit() -> None:
    """A header's name or value with no end: httptools keeps it whole until it ends, so the
    limit holds only if the gateway counts what it feeds; else it keeps (and copies) it all."""
    async with cluster(None, {"p0": echo, "d0": echo}) as c:
        port = c.gateway.port
        assert port is not None
        for start in (b"X-Big: ", b"X-"):
            async with await anyio.connect_tcp("127.0.0.1", port) as raw:
                await raw.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + start)
                got = b""
                with anyio.fail_after(5):
                    async with anyio.create_task_group() as tg:

                        async def flood() -> None:
                            for _ in range(256):  # 16 MiB at most
                                await raw.send(b"a" * (64 << 10))

                        tg.start_soon(flood)
                        while b"\r\n\r\n" not in got:
                            got += await raw.receive()
                        tg.cancel_scope.cancel()
            assert got.startswith(b"HTTP/1.1 431") and b"send shorter ones" in got, got[:200]
        assert (await c.post({"prompt": [1]})).status_code == 200


async def test_requests_pipelined_behind_an_unanswered_one_wait_in_the_socket(client_conns: list[WatchedConn]) -> None:
    """While a whole request waits its turn the gateway reads no further: a client that
    pipelines without end is pushed back by TCP instead of filling the gateway's memory."""
    async with cluster(None, {"p0": echo, "d0": never}) as c:
        port = c.gateway.port
        assert port is not None
        one = post_bytes(msgspec.json.encode({"prompt": "x" * (256 << 10)}))
        stream = memoryview(one * 8)  # sent over and over: requests back to back
        with socket.create_connection(("127.0.0.1", port)) as client:
            client.sendall(post_bytes(b'{"prompt": [1]}'))
            with anyio.fail_after(10):
                await c.servers["d0"].arrived.wait()  # the first request waits on D from here on
            client.setblocking(False)
            sent = 0
            with anyio.fail_after(20):
                while sent < 64 << 20:
                    try:
                        sent += client.send(stream[sent % len(stream):])
                    except BlockingIOError:
                        with anyio.move_on_after(0.5):  # the gateway still reads, or has stopped
                            await anyio.wait_writable(client)
                            continue
                        break
        assert sent < 32 << 20, f"the gateway read {sent} bytes of pipelined requests"
        assert len(client_conns[0].ready) <= 1


async def test_a_prefill_request_left_hanging_after_decode_answered_holds_neither_the_client_nor_its_slot(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """D answered in full while P's request hangs: the client's next request on the same
    connection is answered at once, and P's request ends after the grace, with its routing
    slot, without P being taken for failed."""
    monkeypatch.setattr(proxy, "PREFILL_GRACE_S", 0.3)
    async with cluster(None, {"p0": never, "d0": echo}) as c:
        port = c.gateway.port
        assert port is not None
        async with await anyio.connect_tcp("127.0.0.1", port) as raw:
            for n in (1, 2):
                await raw.send(post_bytes(msgspec.json.encode({"prompt": [n]})))
                with anyio.fail_after(3):  # not after --request-timeout (20 s)
                    ((head, body),) = await _answers(raw, 1)
                assert head.startswith(b"HTTP/1.1 200")
                assert msgspec.json.decode(body) == completion(c.servers["d0"].seen[-1])
        for seen in c.servers["p0"].seen:
            with anyio.fail_after(5):
                await seen.gone.wait()
        await until(lambda: c.gateway._routes.busy == 0 and c.gateway._upstreams.pool.slots.busy == 0)
        assert c.gateway.router.usable("prefill", c.gateway.clock()) == {"p0"}


async def test_an_answer_cut_short_to_a_client_that_stopped_reading_frees_its_connection(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The deadline passes while D's large answer goes to a client that reads none of it:
    the connection, and what is still buffered for it, go then, not when the client reads."""
    accepted: list[tuple[socket.socket, int]] = []
    wrap = sockets.wrap

    async def recording(sock: socket.socket) -> sockets.Stream:
        accepted.append((sock, sock.getsockname()[1]))
        return await wrap(sock)

    monkeypatch.setattr(sockets, "wrap", recording)

    async def large(seen: Seen) -> tuple[int, bytes]:
        return 200, msgspec.json.encode({"text": "x" * (16 << 20)})  # past the kernel's buffers

    async with cluster(None, {"p0": echo, "d0": large}, request_timeout_s=2) as c:
        with socket.socket() as client:
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            client.connect(("127.0.0.1", c.gateway.port))
            client.sendall(post_bytes(b'{"prompt": [1]}'))
            await until(lambda: [s for s, port in accepted if port == c.gateway.port])
            (gateway_side,) = [s for s, port in accepted if port == c.gateway.port]
            await until(lambda: c.servers["d0"].seen)
            await until(lambda: gateway_side.fileno() == -1)  # closed past the deadline, not once the client reads


async def test_only_an_instances_own_failure_passes_it_over() -> None:
    """A client that hangs up, or a prompt P refuses, fails neither instance; a D whose
    answer breaks off mid-body is passed over."""

    async def prefill(seen: Seen) -> tuple[int, bytes] | None:
        if seen.body["prompt"] == [1]:
            return await never(seen)
        if seen.body["prompt"] == [2]:
            return 400, b'{"error": "prompt too long"}'
        return await echo(seen)

    async def decode(seen: Seen) -> tuple[int, bytes] | bytes | None:
        if seen.body["prompt"] == [3]:
            return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"cut"
        return await never(seen)

    async with cluster(None, {"p0": prefill, "d0": decode}) as c:
        gw, (p0, d0) = c.gateway, (c.servers["p0"], c.servers["d0"])

        async def cancelled(*requests: Seen) -> None:  # the gateway ended them, and the router was told
            for seen in requests:
                with anyio.fail_after(10):
                    await seen.gone.wait()
            await until(lambda: not any(gw.router.in_flight(u) for u in gw.router.upstreams))

        def usable() -> tuple[set[str], set[str]]:
            return gw.router.usable("prefill", gw.clock()), gw.router.usable("decode", gw.clock())

        async with await anyio.connect_tcp("127.0.0.1", gw.port) as raw:
            await raw.send(post_bytes(b'{"prompt": [1]}'))
            await until(lambda: p0.seen and d0.seen)
        await cancelled(p0.seen[0], d0.seen[0])
        assert usable() == ({"p0"}, {"d0"})  # the client left: no one failed
        r = await c.post({"prompt": [2]})
        assert r.status_code == 400
        await until(lambda: len(d0.seen) == 2)
        await cancelled(d0.seen[1])
        assert usable() == ({"p0"}, {"d0"})  # P refused the prompt: D's request was cancelled, not failed
        r = await c.post({"prompt": [3]})
        assert r.status_code == 502 and "mid-answer" in r.json()["error"]["message"], r.text
        assert usable() == ({"p0"}, set())


async def test_a_client_that_expects_100_continue_gets_it_once_however_its_body_comes(
        client_conns: list[WatchedConn]) -> None:
    async with cluster(None, {"p0": echo, "d0": echo}) as c:
        port = c.gateway.port
        assert port is not None
        body = msgspec.json.encode({"prompt": [7], "max_tokens": 4})
        async with await anyio.connect_tcp("127.0.0.1", port) as raw:
            await raw.send(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                           b"Content-Length: %d\r\n\r\n" % len(body))
            with anyio.fail_after(10):
                assert await raw.receive() == b"HTTP/1.1 100 Continue\r\n\r\n"
            await raw.send(body[:5])
            with anyio.fail_after(10):
                await client_conns[0].body_came.wait()  # parsed on its own, before the rest comes
            await raw.send(body[5:])
            ((head, got),) = await _answers(raw, 1)
        assert head.startswith(b"HTTP/1.1 200"), head
        assert msgspec.json.decode(got) == completion(c.servers["d0"].seen[0])
