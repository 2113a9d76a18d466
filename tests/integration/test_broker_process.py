"""A real `kvbroker serve` process on loopback, driven by real client processes and sockets."""

from __future__ import annotations

import json
import random
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest
import structlog.testing
import zmq

from protocols.channel import curve_client_keys
from protocols.codec import HEADER, Codec, encode
from protocols.errors import BrokerUnavailable
from protocols.messages import (
    Abort,
    Done,
    Error,
    Expect,
    Go,
    Heartbeat,
    Layout,
    Offer,
    Prepare,
    Ready,
    Register,
    Registered,
    Status,
    StatusRequest,
)
from tests.support import ROOT, BrokerProcess, env, wait_until
from workers.client import BrokerClient, ClientConfig, NullHandler

pytestmark = pytest.mark.slow

PEER = Path(__file__).with_name("handshake_peer.py")


@pytest.fixture
def broker(tmp_path: Path):
    b = BrokerProcess(tmp_path, "--heartbeat", "0.2", "--peer-lease", "5")
    b.start()
    yield b
    assert b.stop() == 0, b.log_path.read_text()


def spawn_peer(endpoint: str, role: str, instance: str, *args: str) -> subprocess.Popen[str]:
    cmd = [sys.executable, str(PEER), "--broker", endpoint, "--role", role, "--instance", instance, *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env(), cwd=ROOT)


def finish(proc: subprocess.Popen[str]) -> dict:
    out, err = proc.communicate(timeout=90)
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


async def cli(*args: str) -> subprocess.CompletedProcess[str]:
    """`python -m broker.cli ARGS` from an async test, without blocking its event loop."""
    with anyio.fail_after(30):
        done = await anyio.run_process([sys.executable, "-m", "broker.cli", *args], check=False, env=env(), cwd=ROOT)
    return subprocess.CompletedProcess(done.args, done.returncode, done.stdout.decode(), done.stderr.decode())


def structure(status: dict) -> dict:
    """Status without the fields that move with the clock or count rejected frames."""
    peers = [{k: v for k, v in p.items() if k != "lease_left_s"} for p in status["peers"]]
    transfers = [{k: v for k, v in t.items() if k != "lease_left_s"} for t in status["transfers"]]
    return {"peers": peers, "pools": status["pools"], "transfers": transfers}


def test_serve_and_status(broker: BrokerProcess) -> None:
    st = broker.status()
    assert st["type"] == "status" and st["peers"] == [] and st["transfers"] == []
    table = subprocess.run(
        [sys.executable, "-m", "broker.cli", "status", "--broker", broker.endpoint],
        capture_output=True, text=True, env=env(), cwd=ROOT, timeout=30,
    )
    assert table.returncode == 0 and "peers (0)" in table.stdout and "transfers in flight (0)" in table.stdout


def test_cancel_from_the_command_line(broker: BrokerProcess) -> None:
    """`kvbroker cancel` for a proxy of one's own: the broker answers what it ended; a dead
    broker is named."""
    out = subprocess.run(
        [sys.executable, "-m", "broker.cli", "cancel", "req-7f3a", "--broker", broker.endpoint, "--reason", "client left"],
        capture_output=True, text=True, env=env(), cwd=ROOT, timeout=30,
    )
    assert out.returncode == 0 and out.stdout.strip() == "req-7f3a: ended 0, already moving 0", out.stderr
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = subprocess.run(
        [sys.executable, "-m", "broker.cli", "cancel", "x", "--broker", f"tcp://127.0.0.1:{port}", "--timeout", "0.5"],
        capture_output=True, text=True, env=env(), cwd=ROOT, timeout=30,
    )
    assert out.returncode != 0 and "did not answer" in out.stderr


def test_status_names_a_dead_broker() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = subprocess.run(
        [sys.executable, "-m", "broker.cli", "status", "--broker", f"tcp://127.0.0.1:{port}", "--timeout", "0.5"],
        capture_output=True, text=True, env=env(), cwd=ROOT, timeout=30,
    )
    assert out.returncode != 0 and "did not answer" in out.stderr


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_offer_to_release_between_client_processes(broker: BrokerProcess, backend: str) -> None:
    # The decode pool holds 4 transfers at a time: the rest wait for credit.
    d = spawn_peer(broker.endpoint, "decode", "d0", "--count", "200", "--pool", str(4 << 20), "--backend", backend)
    assert json.loads(d.stdout.readline())["registered"]
    p = spawn_peer(broker.endpoint, "prefill", "p0", "--count", "200", "--nbytes", str(1 << 20), "--backend", backend)
    pres, dres = finish(p), finish(d)
    assert pres["released"] == 200 and pres["aborted"] == 0 and pres["go"] == 200
    assert dres["done"] == 200
    st = broker.status()
    assert st["transfers"] == [] and st["counters"]["completed"] == 200
    log = broker.log_path.read_text().splitlines()
    done = [json.loads(line) for line in log if '"transfer.done"' in line]
    assert len(done) == 200 and all(e["transfer_id"].startswith("p0-") and e["role"] == "broker" for e in done)


def garbage_frames(rng: random.Random, codec: Codec) -> list[list[bytes]]:
    valid = codec.encode(Offer(transfer_id="x", nbytes=10, layout=Layout(num_layers=2)))
    kinds = [
        lambda: [rng.randbytes(rng.randrange(0, 64))],
        lambda: [valid[: rng.randrange(0, len(valid))]],
        lambda: [bytes(b ^ (1 << rng.randrange(8)) if rng.random() < 0.1 else b for b in valid)],
        lambda: [HEADER + msgspec.msgpack.encode({"type": "nonsense", "a": 1})],
        lambda: [HEADER + msgspec.msgpack.encode({"type": "offer", "transfer_id": 5, "nbytes": "many"})],
        lambda: [HEADER + msgspec.msgpack.encode({"type": "offer", "transfer_id": "y", "nbytes": -1})],
        lambda: [bytes([HEADER[0], 99]) + valid[2:]],
        lambda: [valid, valid],
        lambda: [b""],
        # Well-formed but not allowed: unregistered sender, unknown transfers.
        lambda: [encode(Ready(transfer_id="nope", nbytes=1))],
        lambda: [encode(Done(transfer_id="keep", nbytes=1))],
        lambda: [encode(Abort(transfer_id="keep", reason="x"))],
    ]
    return [rng.choice(kinds)() for _ in range(10_000)]


def test_garbage_leaves_broker_serving_and_state_unchanged(tmp_path: Path) -> None:
    broker = BrokerProcess(tmp_path, "--peer-lease", "120", "--heartbeat", "30")
    broker.start()
    ctx = zmq.Context()
    try:
        codec = Codec()
        member = ctx.socket(zmq.DEALER)
        member.setsockopt(zmq.LINGER, 0)
        member.connect(broker.endpoint)
        member.send(codec.encode(Register(role="decode", instance_id="d0", pool_capacity=1000, compat_hash="h")))
        assert member.poll(5000) and type(codec.decode(member.recv())).__name__ == "Registered"
        member.send(codec.encode(Expect(transfer_id="keep")))
        before = wait_until(lambda: (s := broker.status())["transfers"] and s, 10, "the expected transfer")

        rng = random.Random(7)
        senders = [ctx.socket(zmq.DEALER) for _ in range(4)]
        for s in senders:
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, 0)
            s.connect(broker.endpoint)
        frames = garbage_frames(rng, codec)
        for i, msg in enumerate(frames):
            senders[i % len(senders)].send_multipart(msg)
        # An oversized frame: zmq drops that connection before the broker sees it.
        senders[0].send(b"\x00" * (2 << 20))
        # The registered peer misbehaves too: illegal transitions, refused without effect.
        member.send(codec.encode(Ready(transfer_id="keep", nbytes=1)))
        member.send(codec.encode(Offer(transfer_id="keep", nbytes=5)))
        member.send(codec.encode(Done(transfer_id="keep", nbytes=1)))

        def rejected_all() -> dict | None:
            # Every garbage message and the member's three illegal ones, each refused once.
            s = broker.status()
            c = s["counters"]
            assert c["bad_frames"] + c["errors"] <= len(frames) + 3
            return s if c["bad_frames"] + c["errors"] == len(frames) + 3 else None

        after = wait_until(rejected_all, 60, "the broker to reject every garbage message")
        assert structure(after) == structure(before)
        # Raw TCP junk, not even ZMTP (libzmq may read some of it as legacy frames: more garbage).
        host, port = broker.endpoint.removeprefix("tcp://").rsplit(":", 1)
        for _ in range(20):
            with socket.create_connection((host, int(port)), timeout=5) as raw:
                raw.sendall(rng.randbytes(rng.randrange(1, 4096)))
        after = broker.status()
        assert broker.proc is not None and broker.proc.poll() is None
        assert structure(after) == structure(before)
        log = broker.log_path.read_text()
        assert '"frame.rejected"' in log and "Traceback" not in log
    finally:
        ctx.destroy(linger=0)
        assert broker.stop() == 0


def test_a_burst_is_answered_whole_and_in_order(broker: BrokerProcess) -> None:
    # The broker sends a burst's replies a few at a time, after handling them: every one
    # must still go out, in the order of the messages they answer, a bad frame's Error too.
    ctx = zmq.Context()
    try:
        codec = Codec()
        peer = ctx.socket(zmq.DEALER)
        peer.setsockopt(zmq.LINGER, 0)
        peer.setsockopt(zmq.SNDHWM, 0)
        peer.connect(broker.endpoint)
        peer.send(codec.encode(Register(role="decode", instance_id="d0", pool_capacity=1000, compat_hash="h")))
        assert peer.poll(5000) and isinstance(codec.decode(peer.recv()), Registered)
        n = 1000  # several of the broker's bursts, each several send batches
        for seq in range(n):
            peer.send(codec.encode(Heartbeat(seq=seq)))
        peer.send(b"not a message")
        peer.send(codec.encode(Heartbeat(seq=n)))
        got: list[object] = []
        deadline = time.monotonic() + 30
        while len(got) < n + 2 and peer.poll(max(deadline - time.monotonic(), 0) * 1000):
            got.append(codec.decode(peer.recv()))
        assert [m.seq for m in got[:n]] == list(range(n))  # type: ignore[attr-defined]
        assert isinstance(got[n], Error) and got[n + 1] == Heartbeat(seq=n)
    finally:
        ctx.destroy(linger=0)


@pytest.mark.anyio
async def test_clients_register_again_after_broker_restart(tmp_path: Path, anyio_backend: str) -> None:
    # A peer lease of a few seconds: on a loaded host a one-second lease evicted a live
    # client between its heartbeats, which is not what this test is about.
    broker = BrokerProcess(tmp_path, "--heartbeat", "0.2", "--peer-lease", "5")
    broker.start()

    class Prefill(NullHandler):
        def __init__(self) -> None:
            self.go = anyio.Event()

        async def on_go(self, msg: object) -> None:
            self.go.set()

    class Decode(NullHandler):
        async def on_prepare(self, msg: Prepare) -> None:
            await d.ready(msg.transfer_id, msg.nbytes)

    handler = Prefill()
    cfg = ClientConfig(broker=broker.endpoint, register_timeout_s=5)
    p = BrokerClient(cfg, Register(role="prefill", instance_id="p0", compat_hash="h"), handler)
    d = BrokerClient(cfg, Register(role="decode", instance_id="d0", pool_capacity=1 << 20, compat_hash="h"), Decode())
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(p.run)
            # No decode peer yet: the offer waits unrouted, and dies with the broker.
            await p.offer("t-survives", 1000)
            broker.stop()
            broker.start()
            assert broker.endpoint == cfg.broker
            with anyio.fail_after(20):
                while p.registrations < 2:
                    await anyio.sleep(0.02)
                # The client re-sent its staged offer; a decode peer arriving now gets it.
                await tg.start(d.run)
                await handler.go.wait()
            peers = {x["peer_id"] for x in broker.status()["peers"]}
            assert peers == {"p0:0", "d0:0"}
            tg.cancel_scope.cancel()
    finally:
        broker.stop()


def test_refuses_incompatible_peer(broker: BrokerProcess) -> None:
    ctx = zmq.Context()
    try:
        codec = Codec()
        a, b = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
        for s in (a, b):
            s.setsockopt(zmq.LINGER, 0)
            s.connect(broker.endpoint)
        a.send(codec.encode(Register(role="prefill", instance_id="p", compat_hash="1", compat={"dtype": "bfloat16"})))
        assert a.poll(5000) and type(codec.decode(a.recv())).__name__ == "Registered"
        b.send(codec.encode(Register(role="decode", instance_id="d", pool_capacity=10, compat_hash="2", compat={"dtype": "float16"})))
        assert b.poll(5000)
        err = codec.decode(b.recv())
        assert type(err).__name__ == "Error" and err.code == "refused"  # type: ignore[attr-defined]
        assert "dtype: float16 vs bfloat16" in err.detail  # type: ignore[attr-defined]
    finally:
        ctx.destroy(linger=0)


def test_metrics_and_trace(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    broker = BrokerProcess(tmp_path, "--metrics-port", str(port))
    broker.start()
    try:
        _transfers(broker, 3)

        import urllib.request

        def scraped() -> str | None:
            body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            return body if "kvbroker_completed_total 3.0" in body else None

        body = wait_until(scraped, 10, "metrics to show 3 completed transfers")
        assert "kvbroker_peers" in body and "kvbroker_transfers_in_flight" in body
        for phase in ("handshake", "data", "total"):
            assert f'kvbroker_transfer_seconds_count{{phase="{phase}"}} 3.0' in body, body
            assert f'kvbroker_transfer_seconds_bucket{{le="+Inf",phase="{phase}"}} 3.0' in body, body

        assert _traced(broker, "p0-1") == ["transfer.offered", "transfer.done"]
        missing = subprocess.run(
            [sys.executable, "-m", "broker.cli", "trace", "nope", str(broker.log_path)],
            capture_output=True, text=True, env=env(), cwd=ROOT, timeout=30,
        )
        assert missing.returncode != 0 and "no log line carries transfer_id nope" in missing.stderr
        phases = subprocess.run(
            [sys.executable, "-m", "broker.cli", "phases", str(broker.log_path), "--prefix", "p0-"],
            capture_output=True, text=True, env=env(), cwd=ROOT, timeout=30,
        )
        assert phases.returncode == 0, phases.stderr
        rows = [line.split() for line in phases.stdout.splitlines()[1:]]
        assert [r[:3] for r in rows] == [["transfer.offered", "transfer.done", "3"], ["first", "event", "last"]]
        assert rows[1][3] == "3" and float(rows[0][3]) >= 0
    finally:
        assert broker.stop() == 0


def test_debug_level_traces_each_message_step_of_a_transfer(tmp_path: Path) -> None:
    """At debug level the broker also notes when it sent a transfer's Prepare (credit
    granted) and relayed its Go, so a trace shows the broker's own hops; at info level
    (above) it writes only the Offer and the Done."""
    broker = BrokerProcess(tmp_path, "--log-level", "debug")
    broker.start()
    try:
        _transfers(broker, 2)
        assert _traced(broker, "p0-1") == ["transfer.offered", "transfer.prepared", "transfer.go", "transfer.done"]
    finally:
        assert broker.stop() == 0


def _transfers(broker: BrokerProcess, count: int) -> None:
    """`count` transfers from a prefill peer p0 to a decode peer d0, through `broker`."""
    d = spawn_peer(broker.endpoint, "decode", "d0", "--count", str(count))
    assert json.loads(d.stdout.readline())["registered"]  # type: ignore[union-attr]
    p = spawn_peer(broker.endpoint, "prefill", "p0", "--count", str(count))
    assert finish(p)["released"] == count and finish(d)["done"] == count


def _traced(broker: BrokerProcess, transfer_id: str) -> list[str]:
    """The events `kvbroker trace` shows for `transfer_id` in the broker's log."""
    out = subprocess.run(
        [sys.executable, "-m", "broker.cli", "trace", transfer_id, str(broker.log_path)],
        capture_output=True, text=True, env=env(), cwd=ROOT, timeout=30,
    )
    assert out.returncode == 0, out.stderr
    return [line.split()[2] for line in out.stdout.splitlines()]


def _keygen(out: Path, *name: str) -> None:
    made = subprocess.run(
        [sys.executable, "-m", "broker.cli", "keygen", "--out", str(out), *(("--name", name[0]) if name else ())],
        capture_output=True, text=True, env=env(), cwd=ROOT, timeout=30,
    )
    assert made.returncode == 0, made.stderr


@pytest.mark.anyio
async def test_curve_clients_admits_listed_keys_only(tmp_path: Path, anyio_backend: str) -> None:
    """With --curve-clients only peers whose public key is listed get in; another peer,
    though it knows the broker's key, is refused at the handshake, and the broker says why."""
    keys, listed = tmp_path / "keys", tmp_path / "clients"
    _keygen(keys)
    _keygen(keys, "p0")
    _keygen(keys, "stranger")
    listed.mkdir()
    (listed / "p0.key").write_bytes((keys / "p0.key").read_bytes())
    server = (keys / "broker.key").read_text().strip()
    broker = BrokerProcess(
        tmp_path, "--curve-secret-file", str(keys / "broker.key_secret"), "--curve-clients", str(listed)
    )
    broker.start()
    try:
        reg = Register(role="prefill", instance_id="p0", compat_hash="h")
        p0 = BrokerClient(
            ClientConfig(broker=broker.endpoint, curve=curve_client_keys(server, (keys / "p0.key_secret").read_bytes())),
            reg,
        )
        stranger_keys = curve_client_keys(server, (keys / "stranger.key_secret").read_bytes())
        stranger = BrokerClient(ClientConfig(broker=broker.endpoint, curve=stranger_keys, register_timeout_s=1),
                                Register(role="prefill", instance_id="s0", compat_hash="h"))
        async with anyio.create_task_group() as tg:
            assert (await tg.start(p0.run)).peer_id == "p0:0"
            with pytest.raises(BrokerUnavailable, match="did not answer"):
                await stranger.run()
            tg.cancel_scope.cancel()
        refused = [json.loads(line) for line in broker.log_path.read_text().splitlines() if "peer.refused_key" in line]
        assert refused and refused[0]["client_key"] == (keys / "stranger.key").read_text().strip()
        out = await cli("status", "--broker", broker.endpoint, "--json", "--curve-server-key", server,
                        "--curve-client-secret-file", str(keys / "p0.key_secret"))
        assert out.returncode == 0, out.stderr
    finally:
        assert broker.stop() == 0
    no_secret = await cli("serve", "--bind", "tcp://127.0.0.1:0", "--curve-clients", str(listed))
    assert no_secret.returncode == 2 and "--curve-clients needs --curve-secret-file" in no_secret.stderr


@pytest.mark.anyio
async def test_curve_broker_serves_keyed_clients_only(tmp_path: Path, anyio_backend: str) -> None:
    keygen = await cli("keygen", "--out", str(tmp_path))
    assert keygen.returncode == 0, keygen.stderr
    assert oct((tmp_path / "broker.key_secret").stat().st_mode & 0o777) == "0o600"
    public = (tmp_path / "broker.key").read_text().strip()
    broker = BrokerProcess(tmp_path, "--curve-secret-file", str(tmp_path / "broker.key_secret"))
    broker.start()
    try:
        reg = Register(role="prefill", instance_id="p0", compat_hash="h")
        keyed = BrokerClient(ClientConfig(broker=broker.endpoint, curve=curve_client_keys(public)), reg)
        plain = BrokerClient(ClientConfig(broker=broker.endpoint, register_timeout_s=1), reg)
        async with anyio.create_task_group() as tg:
            registered = await tg.start(keyed.run)
            assert registered.peer_id == "p0:0"
            with pytest.raises(BrokerUnavailable, match="did not answer"):
                await plain.run()
            tg.cancel_scope.cancel()
        out = await cli("status", "--broker", broker.endpoint, "--json", "--curve-server-key", public)
        assert out.returncode == 0 and json.loads(out.stdout)["peers"][0]["peer_id"] == "p0:0", out.stderr
    finally:
        broker.stop()


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_broker_stopped_past_every_lease_keeps_the_peers_that_kept_heartbeating(tmp_path: Path, backend: str) -> None:
    """The broker process stops for twice its peer lease (a starved host, a stopped VM)
    while a prefill and a decode peer go on heartbeating into its queue. On waking it
    logs how long it was away and evicts neither: the transfer it held goes on."""
    broker = BrokerProcess(tmp_path, "--peer-lease", "1", "--heartbeat", "0.2", "--backend", backend)
    broker.start()
    ctx = zmq.Context()
    codec = Codec()

    def until(sock: zmq.Socket, kind: type) -> Any:
        """The next message of `kind` on `sock`, skipping heartbeat echoes."""
        def got() -> Any:
            while sock.poll(0):
                msg = codec.decode(sock.recv())
                if isinstance(msg, kind):
                    return msg
            return None
        return wait_until(got, 10, f"a {kind.__name__}")

    try:
        p, d, q = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
        for sock in (p, d, q):
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(broker.endpoint)
        for sock, reg in (
            (d, Register(role="decode", instance_id="d0", pool_capacity=1000, compat_hash="h")),
            (p, Register(role="prefill", instance_id="p0", compat_hash="h")),
        ):
            sock.send(codec.encode(reg))
            until(sock, Registered)
        p.send(codec.encode(Offer(transfer_id="t1", nbytes=100, decode="d0")))
        until(d, Prepare)
        pace = threading.Event()
        with broker.paused():
            away_until = time.monotonic() + 2.0
            while time.monotonic() < away_until:  # the peers' heartbeats, every 0.1 s while it is away
                for sock in (p, d):
                    sock.send(codec.encode(Heartbeat()))
                pace.wait(0.1)
        # Asked on a socket of its own, so the answer comes within the peers' lease.
        q.send(codec.encode(StatusRequest()))
        status = until(q, Status)
        assert status.counters["stalls"] >= 1  # found before it answered anything
        d.send(codec.encode(Ready(transfer_id="t1", nbytes=100)))
        assert until(p, Go).transfer_id == "t1"
        assert sorted(x.peer_id for x in status.peers) == ["d0:0", "p0:0"]
        assert status.counters["evicted"] == 0
        stalled = [json.loads(line) for line in broker.log_path.read_text().splitlines() if '"broker.stalled"' in line]
        assert stalled[0]["stalled_s"] >= 1.5, stalled
        assert "start them under nice or give the broker a core of its own" in stalled[0]["reason"]  # what to do
    finally:
        ctx.destroy(linger=0)
        assert broker.stop() == 0


def test_the_stall_watch_names_where_the_loop_is_stuck() -> None:
    """A loop thread stuck in a blocking call: the watch logs its stack, once per stall."""
    from broker.daemon import STALL_S, _StallWatch

    def a_blocking_call(logs: list[dict[str, Any]]) -> None:
        wait_until(lambda: [e for e in logs if e["event"] == "broker.stuck"], 10 * STALL_S, "the watch to report")

    with structlog.testing.capture_logs() as logs:
        due = time.monotonic()
        watch = _StallWatch(time.monotonic, lambda: due, "tcp://127.0.0.1:0")  # watching this thread
        watch.start()
        try:
            a_blocking_call(logs)
        finally:
            watch.stop()
            watch.join(10)
    [stuck] = [e for e in logs if e["event"] == "broker.stuck"]
    assert "a_blocking_call" in stuck["where"] and stuck["since_s"] > STALL_S
