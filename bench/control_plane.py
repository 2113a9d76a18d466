"""Control-plane benchmark: handshakes per second through one broker, and the latency it adds.

Baseline, measured in the same run on the same cores: a raw pyzmq ROUTER echo server
(recv_multipart/send_multipart, nothing else). A handshake moves 6 messages through the
broker (Offer, Prepare, Ready, Go, Done, Release: 3 in, 3 out), so the echo's equivalent
is one echo round trip per message pair: echo_msgs_per_s / 3 handshakes per second.

The broker (or echo server) runs as its own process pinned to one core (--no-pin-server
lets it float); the driver that plays both the prefill and the decode peer is unpinned
unless --pin-driver. The driver sleeps between offers with select on the sockets'
notification fds: zmq's own poll takes whole milliseconds and would spin.

    python bench/control_plane.py [--transfers 50000] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import select
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import zmq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from broker.core import Broker, Send  # noqa: E402
from broker.ledger import BrokerConfig  # noqa: E402
from protocols.codec import Codec  # noqa: E402
from protocols.messages import Done, Go, Offer, Prepare, Ready, Register, Registered, Release  # noqa: E402

# The two peers the driver plays, registered the same way with the core alone (`core_us`).
PREFILL = Register(role="prefill", instance_id="bench-p", compat_hash="bench")
DECODE = Register(role="decode", instance_id="bench-d", pool_capacity=1 << 40, compat_hash="bench")

ECHO = """
import sys, zmq
ctx = zmq.Context(); s = ctx.socket(zmq.ROUTER); s.setsockopt(zmq.SNDHWM, 0); s.setsockopt(zmq.RCVHWM, 0)
port = s.bind_to_random_port("tcp://127.0.0.1"); print(f"tcp://127.0.0.1:{port}", flush=True)
recv, send = s.recv_multipart, s.send_multipart
while True:
    send(recv())
"""


def cpus() -> tuple[set[int], set[int]]:
    avail = sorted(os.sched_getaffinity(0))
    if len(avail) < 2:
        return set(avail), set(avail)
    return {avail[0]}, {avail[1]}


def start_server(cmd: list[str], core: set[int], endpoint_from: str, tmp: Path) -> tuple[subprocess.Popen[bytes], str]:
    # The project first, then whatever the caller set (its dependencies may live there).
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=open(tmp / "server.log", "wb"), env=env, preexec_fn=lambda: os.sched_setaffinity(0, core)
    )
    if endpoint_from == "stdout":
        assert proc.stdout is not None
        return proc, proc.stdout.readline().decode().strip()
    port_file = Path(endpoint_from)
    deadline = time.monotonic() + 30
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"broker did not start: {(tmp / 'server.log').read_text()}")
        time.sleep(0.02)
    return proc, port_file.read_text().strip()


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    proc.wait(timeout=10)


def wait_readable(socks: list[zmq.Socket], timeout_s: float) -> None:
    """Sleep until one of `socks` may have a message queued, or `timeout_s` has passed.

    Not `zmq.Poller`/`Socket.poll`: they take whole milliseconds and truncate a float, so
    every wait under 1 ms (all of them at 2,000 offers/s) becomes a busy loop that keeps a
    core of this 2-core setup running and delays the server's threads by whole scheduler
    slices. `select` on the notification fds sleeps to the microsecond. Those fds are
    edge-triggered: `zmq.EVENTS` is read first, and the caller drains every socket (recv
    until `zmq.Again`) before calling again. May return early for nothing.
    """
    if any(s.getsockopt(zmq.EVENTS) & zmq.POLLIN for s in socks):
        return
    select.select([s.getsockopt(zmq.FD) for s in socks], [], [], timeout_s)


def next_offer_in(rate: float | None, sent: int, n: int, elapsed: float) -> float:
    """Seconds until the next offer is due: how long to wait for replies at most."""
    if rate is None or sent >= n:
        return 1.0
    return max(0.0, sent / rate - elapsed)


def dealer(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.SNDHWM, 0)
    s.setsockopt(zmq.RCVHWM, 0)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    return s


class Driver:
    """Plays one prefill and one decode peer on two DEALER sockets, in one loop."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.codec = Codec()
        self.p = dealer(self.ctx, endpoint)
        self.d = dealer(self.ctx, endpoint)
        for sock, reg in (
            (self.p, PREFILL),
            (self.d, DECODE),
        ):
            sock.send(self.codec.encode(reg))
            assert sock.poll(10_000), "broker did not answer Register"
            assert isinstance(self.codec.decode(sock.recv()), Registered)

    def run(self, n: int, window: int, rate: float | None = None) -> tuple[float, list[float]]:
        """Run n handshakes with at most `window` in flight (or offered at `rate` per second).

        Returns elapsed seconds and per-handshake latency (Offer sent to Release received).
        """
        enc, dec = self.codec.encode, self.codec.decode
        psend, dsend, precv, drecv = self.p.send, self.d.send, self.p.recv, self.d.recv
        socks = [self.p, self.d]
        started: dict[str, float] = {}
        lat: list[float] = []
        sent = done = 0
        t0 = time.perf_counter()
        clock = time.perf_counter
        while done < n:
            now = clock()
            if rate is None:
                while sent < n and sent - done < window:
                    tid = f"t{sent}"
                    started[tid] = clock()
                    psend(enc(Offer(transfer_id=tid, nbytes=4096)))
                    sent += 1
            else:
                due = min(n, int((now - t0) * rate) + 1)
                while sent < due:
                    tid = f"t{sent}"
                    started[tid] = clock()
                    psend(enc(Offer(transfer_id=tid, nbytes=4096)))
                    sent += 1
            wait_readable(socks, next_offer_in(rate, sent, n, clock() - t0))
            for recv in (drecv, precv):
                while True:
                    try:
                        raw = recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    msg = dec(raw)
                    if isinstance(msg, Prepare):
                        dsend(enc(Ready(transfer_id=msg.transfer_id, nbytes=msg.nbytes)))
                    elif isinstance(msg, Go):
                        dsend(enc(Done(transfer_id=msg.transfer_id, nbytes=msg.nbytes)))
                    elif isinstance(msg, Release):
                        lat.append(clock() - started.pop(msg.transfer_id))
                        done += 1
                    else:
                        raise SystemExit(f"unexpected message from the broker: {msg}")
        return clock() - t0, lat

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def core_us(n: int, rounds: int = 5, *, notes: bool = False) -> dict[str, float]:
    """The broker's decisions alone, in this process (no sockets, no codec): microseconds
    per message of each kind of a handshake, the best of `rounds` runs of `n` transfers
    all in flight (Offers, then Readys, then Dones). Where the daemon's time goes when the
    table's rate moves: the core, or the loop and the sockets around it. `notes`: with
    each transfer's info notes, as a daemon logging at info makes them."""
    core = Broker(BrokerConfig(note_transfers=notes))
    core.handle(0.0, b"p", PREFILL)
    core.handle(0.0, b"d", DECODE)
    best = {"offer": math.inf, "ready": math.inf, "done": math.inf}
    for r in range(rounds):
        tids = [f"c{r}-{i}" for i in range(n)]
        batches = {"offer": (b"p", [Offer(transfer_id=t, nbytes=4096) for t in tids]),
                   "ready": (b"d", [Ready(transfer_id=t, nbytes=4096) for t in tids]),
                   "done": (b"d", [Done(transfer_id=t, nbytes=4096) for t in tids])}
        for kind, (identity, msgs) in batches.items():
            t0 = time.perf_counter()
            for msg in msgs:
                out = core.handle(1.0, identity, msg)
            best[kind] = min(best[kind], (time.perf_counter() - t0) / n * 1e6)
            assert any(isinstance(e, Send) for e in out), f"the core refused the {kind}s: {out}"
    return {kind: round(us, 2) for kind, us in best.items()}


def echo_run(endpoint: str, n: int, window: int, rate: float | None = None, hops: int = 1) -> tuple[float, list[float]]:
    """n round trips (of `hops` sequential echoes each) through the raw echo server."""
    ctx = zmq.Context()
    s = dealer(ctx, endpoint)
    payload = b"x" * 40
    started: dict[int, float] = {}
    remaining: dict[int, int] = {}
    lat: list[float] = []
    sent = done = 0
    clock = time.perf_counter
    t0 = clock()
    while done < n:
        if rate is None:
            while sent < n and sent - done < window:
                started[sent], remaining[sent] = clock(), hops
                s.send_multipart([sent.to_bytes(4, "little"), payload])
                sent += 1
        else:
            due = min(n, int((clock() - t0) * rate) + 1)
            while sent < due:
                started[sent], remaining[sent] = clock(), hops
                s.send_multipart([sent.to_bytes(4, "little"), payload])
                sent += 1
        wait_readable([s], next_offer_in(rate, sent, n, clock() - t0))
        while True:
            try:
                key_b, body = s.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            key = int.from_bytes(key_b, "little")
            remaining[key] -= 1
            if remaining[key]:
                s.send_multipart([key_b, body])
            else:
                lat.append(clock() - started.pop(key))
                done += 1
    elapsed = clock() - t0
    ctx.destroy(linger=0)
    return elapsed, lat


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--transfers", type=int, default=50_000)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--rate", type=float, default=2000.0, help="offered handshakes/s for the latency run")
    ap.add_argument("--latency-seconds", type=float, default=5.0)
    ap.add_argument("--backend", default="asyncio", choices=["asyncio", "trio"])
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument(
        "--broker-log-level", default="warning",
        help="info logs two JSON lines per transfer (to a file in a temporary folder)",
    )
    ap.add_argument(
        "--no-pin-server", dest="pin_server", action="store_false",
        help="let the server's main and zmq I/O threads run on any core (it still uses about one)",
    )
    ap.add_argument(
        "--pin-driver", action="store_true",
        help="pin the driver to the other core too (its zmq I/O thread then shares that core: tick-long stalls)",
    )
    args = ap.parse_args()

    server_core, driver_core = cpus()
    if not args.pin_server:
        server_core = set(os.sched_getaffinity(0))
    if args.pin_driver:
        os.sched_setaffinity(0, driver_core)
    else:
        driver_core = set(os.sched_getaffinity(0))
    n_lat = int(args.rate * args.latency_seconds)
    rows = []
    with tempfile.TemporaryDirectory() as tmpd:
        tmp = Path(tmpd)
        echo, ep = start_server([sys.executable, "-c", ECHO], server_core, "stdout", tmp)
        try:
            echo_run(ep, 5000, args.window)  # warm up
            e_el, _ = echo_run(ep, args.transfers * 3, args.window)
            e_lel, e_lat = echo_run(ep, n_lat, 1, rate=args.rate, hops=3)
        finally:
            stop(echo)
        port_file = tmp / "endpoint"
        broker, bep = start_server(
            [sys.executable, "-m", "broker.cli", "serve", "--bind", "tcp://127.0.0.1:0", "--port-file", str(port_file),
             "--log-format", "json", "--log-level", args.broker_log_level, "--backend", args.backend, "--max-transfers", "1000000",
             "--transfer-lease", "600", "--peer-lease", "600", "--heartbeat", "60"],
            server_core, str(port_file), tmp,
        )
        try:
            drv = Driver(bep)
            drv.run(5000, args.window)  # warm up
            b_el, _ = drv.run(args.transfers, args.window)
            b_lel, b_lat = drv.run(n_lat, 1, rate=args.rate)
            drv.close()
        finally:
            stop(broker)

    core = core_us(20_000, notes=args.broker_log_level.lower() in ("debug", "info"))
    echo_hs = args.transfers * 3 / e_el / 3
    broker_hs = args.transfers / b_el
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "backend": args.backend,
        "cores": {"server": sorted(server_core), "driver": sorted(driver_core)},
        "transfers": args.transfers,
        "window": args.window,
        "broker_handshakes_per_s": round(broker_hs),
        "echo_msg_pairs_per_s": round(args.transfers * 3 / e_el),
        "echo_equivalent_handshakes_per_s": round(echo_hs),
        "throughput_ratio_to_echo": round(broker_hs / echo_hs, 3),
        "latency_rate_per_s": args.rate,
        "broker_handshake_p50_ms": round(pct(b_lat, 0.50), 3),
        "broker_handshake_p99_ms": round(pct(b_lat, 0.99), 3),
        "echo_3hop_p50_ms": round(pct(e_lat, 0.50), 3),
        "echo_3hop_p99_ms": round(pct(e_lat, 0.99), 3),
        "broker_added_p50_ms": round(pct(b_lat, 0.50) - pct(e_lat, 0.50), 3),
        "broker_added_p99_ms": round(pct(b_lat, 0.99) - pct(e_lat, 0.99), 3),
        "latency_mean_ms": round(statistics.fmean(b_lat) * 1e3, 3),
        "core_us_per_message": core,
        "core_us_per_handshake": round(sum(core.values()), 2),
    }
    rows = [
        ("handshakes/s (window %d)" % args.window, f"{broker_hs:,.0f}", f"{echo_hs:,.0f}", f"{broker_hs / echo_hs:.2f}x"),
        (f"p50 ms at {args.rate:g}/s", f"{pct(b_lat, .5):.3f}", f"{pct(e_lat, .5):.3f}", f"+{pct(b_lat, .5) - pct(e_lat, .5):.3f}"),
        (f"p99 ms at {args.rate:g}/s", f"{pct(b_lat, .99):.3f}", f"{pct(e_lat, .99):.3f}", f"+{pct(b_lat, .99) - pct(e_lat, .99):.3f}"),
    ]
    head = ("metric", "broker", "raw echo", "ratio / added")
    widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(4)]
    print(f"control plane, broker on core {sorted(server_core)}, driver on {sorted(driver_core)}, backend {args.backend}")
    for r in [head] + rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))
    print(f"the core alone, in this process, us per message: offer {core['offer']}, ready {core['ready']}, "
          f"done {core['done']} ({sum(core.values()):.2f} a handshake)")
    print("targets: >= 20,000 handshakes/s; p99 <= 1 ms at 2,000/s")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
