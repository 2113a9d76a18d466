"""Gateway benchmark: requests per second and the latency the gateway adds, in front of
fast fake upstreams, beside a plain FastAPI + httpx proxy measured in the same run.

The peer is vLLM's toy proxy design, written here (bench/toy_proxy.py): one FastAPI app
under uvicorn that sends the request to P (max_tokens 1, kv_transfer_params), waits for
P's answer, then streams D's answer back, through one pooled httpx.AsyncClient; uvicorn's
access log off. `kvbroker gateway` runs as the real
command, with its default logging (JSON lines to a file), in front of the same upstreams,
with a real `kvbroker serve` beside it at which P and D are registered (by broker
clients in a process of their own), so the gateway routes as in production.

The upstreams (P and D, one process) answer every request at once (or after
--upstream-ms) with a fixed completion, on kept-alive connections. `direct` rows send the
requests straight to D: the floor the load generator and the upstreams allow.

Each of C clients (1, 16, 64) keeps one connection and sends its next request as soon as
its answer is whole; the answers counted are those that come within --seconds, which
start --warmup after every client had its first answer; rounds (--rounds) interleave
the systems so drift on a shared host hits each alike. Added latency is a system's
quantile minus direct's at the same C. Every process floats over the cores by default:
on a host shared with other work, a proxy pinned to one core waits for that core while
another is free (at 1 client that tripled the gateway's p50 on a loaded 2-core VM);
--pin gives the system under test a core of its own, for a quiet host.
`CPU us/req` is the CPU time the proxy process spent per request (for direct, the
upstreams'), read from /proc: on a shared host it moves less than the rates do.

    python bench/gateway.py [--seconds 5] [--rounds 2] [--clients 1,16,64] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

COMPLETION = json.dumps({
    "id": "cmpl-bench", "object": "text_completion", "created": 0, "model": "m",
    "choices": [{"index": 0, "text": " the answer", "logprobs": None, "finish_reason": "length"}],
    "usage": {"prompt_tokens": 8, "total_tokens": 16, "completion_tokens": 8}, "kv_transfer_params": None,
}).encode()
REQUEST = json.dumps({"model": "m", "prompt": "The quick brown fox jumps over the lazy dog", "max_tokens": 8}).encode()


# --- the fake upstreams ----------------------------------------------------------------


class FakeUpstream(asyncio.Protocol):
    """HTTP/1.1 with keep-alive, just enough of it: every request gets the same completion."""

    answer = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
              % (len(COMPLETION), COMPLETION))
    delay_s = 0.0

    def connection_made(self, transport: Any) -> None:
        self.transport, self.buf = transport, b""

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while (end := self.buf.find(b"\r\n\r\n")) >= 0:
            need = end + 4 + _content_length(self.buf[:end])
            if len(self.buf) < need:
                return
            self.buf = self.buf[need:]
            if self.delay_s:
                asyncio.get_running_loop().call_later(self.delay_s, self._answer)
            else:
                self._answer()

    def _answer(self) -> None:
        if not self.transport.is_closing():
            self.transport.write(self.answer)


def _content_length(head: bytes) -> int:
    head = head.lower()
    i = head.find(b"\r\ncontent-length:")
    if i < 0:
        return 0
    j = head.find(b"\r\n", i + 2)
    return int(head[i + 17:j if j >= 0 else None])


def serve_upstreams(port_file: str, delay_ms: float) -> None:
    FakeUpstream.delay_s = delay_ms / 1000

    async def main() -> None:
        loop = asyncio.get_running_loop()
        servers = [await loop.create_server(FakeUpstream, "127.0.0.1", 0, backlog=1024) for _ in ("p", "d")]
        ports = [s.sockets[0].getsockname()[1] for s in servers]
        _write(port_file, " ".join(map(str, ports)))
        await asyncio.Event().wait()

    _run(main())


def register_peers(ready_file: str, broker: str) -> None:
    """Stand in for P's and D's connectors at the broker: register p0 and d0, stay."""
    import anyio

    from protocols.messages import Register
    from workers.client import BrokerClient, ClientConfig

    async def main() -> None:
        cfg = ClientConfig(broker=broker, register_timeout_s=30)
        async with anyio.create_task_group() as tg:
            for name, role in (("p0", "prefill"), ("d0", "decode")):
                reg = Register(role=role, instance_id=name, compat_hash="bench", pool_capacity=0 if role == "prefill" else 1 << 30)
                await tg.start(BrokerClient(cfg, reg).run)
            _write(ready_file, "registered")

    anyio.run(main)


# --- the load ----------------------------------------------------------------------------


class Conn(asyncio.Protocol):
    """One client's kept-alive connection: `ask()` sends the request and waits for the whole answer."""

    def __init__(self, request: bytes) -> None:
        self.request, self.buf, self.waiter = request, b"", None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        status = _whole_answer(self.buf)
        if status is not None and self.waiter is not None and not self.waiter.done():
            self.buf = b""
            self.waiter.set_result(status)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError("the server closed the connection"))

    async def ask(self) -> int:
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(self.request)
        return await self.waiter


def _whole_answer(buf: bytes) -> int | None:
    """The status of the response in `buf` once it is whole, else None."""
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        return None
    head = buf[:end].lower()
    if b"transfer-encoding: chunked" in head:
        if not buf.endswith(b"\r\n0\r\n\r\n"):
            return None
    elif len(buf) < end + 4 + _content_length(head):
        return None
    return int(buf[9:12])


@dataclass
class Sample:
    system: str
    clients: int
    seconds: float = 0.0
    latencies_s: list[float] = field(default_factory=list)
    errors: int = 0
    answered: int = 0  # warm-up included
    cpu_s: float = 0.0  # the process measured (the proxy; for direct, the upstreams), warm-up included


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of a process, all its threads: from /proc, whoever else runs."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def load(port: int, pid: int, clients: int, seconds: float, warmup_s: float, into: Sample) -> None:
    """C clients back to back; the window opens `warmup_s` after every client had an
    answer, and counts the answers that come within it, whenever their request left."""
    loop = asyncio.get_running_loop()
    request = (b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1:%d\r\ncontent-type: application/json\r\n"
               b"content-length: %d\r\n\r\n%s" % (port, len(REQUEST), REQUEST))
    conns = [(await loop.create_connection(lambda: Conn(request), "127.0.0.1", port))[1] for _ in range(clients)]
    cpu0 = cpu_seconds(pid)
    warm, window = asyncio.Event(), [float("inf"), float("inf")]
    waiting = [clients]
    done: list[tuple[float, float, int]] = []

    async def client(conn: Conn) -> None:
        first = True
        while time.perf_counter() < window[1]:
            t0 = time.perf_counter()
            status = await asyncio.wait_for(conn.ask(), 60)
            done.append((t0, time.perf_counter(), status))
            if first:
                first, waiting[0] = False, waiting[0] - 1
                if not waiting[0]:
                    warm.set()
                await warm.wait()

    async def timer() -> None:
        await warm.wait()
        window[0] = time.perf_counter() + warmup_s
        window[1] = window[0] + seconds

    await asyncio.gather(timer(), *(client(c) for c in conns))
    into.cpu_s += cpu_seconds(pid) - cpu0
    into.answered += len(done)
    into.seconds += seconds
    for t0, t1, status in done:
        if window[0] <= t1 <= window[1]:
            into.latencies_s.append(t1 - t0)
            into.errors += status != 200
    for c in conns:
        c.transport.close()


# --- the processes -----------------------------------------------------------------------


def _write(path: str, text: str) -> None:
    Path(f"{path}.tmp").write_text(text)
    os.replace(f"{path}.tmp", path)


def _run(coro: Any) -> None:
    try:
        import uvloop

        uvloop.run(coro)
    except ImportError:
        asyncio.run(coro)


def _cores(pin: bool) -> tuple[set[int] | None, set[int] | None]:
    """(the system under test's core, everyone else's), or (None, None) to float."""
    avail = sorted(os.sched_getaffinity(0))
    if not pin or len(avail) < 2:
        return None, None
    return {avail[-1]}, set(avail[:-1])


def start(cmd: list[str], port_file: Path, log: Path, core: set[int] | None) -> tuple[subprocess.Popen[bytes], str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(log, "wb"), env=env, cwd=ROOT,
                            preexec_fn=(lambda: os.sched_setaffinity(0, core)) if core else None)
    deadline = time.monotonic() + 60
    while not port_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"{cmd[2:4]} did not start: {log.read_text()[-2000:]}")
        time.sleep(0.05)
    return proc, port_file.read_text().strip()


def host_speed_us() -> float:
    """How fast Python runs on this host now (best of 5), to read the rows' times against."""
    import timeit

    return min(timeit.repeat("sum(range(1000))", number=2000, repeat=5)) / 2000 * 1e6


def quantile(xs: list[float], q: float) -> float:
    if len(xs) < 2:
        return xs[0] if xs else float("nan")
    return statistics.quantiles(xs, n=1000, method="inclusive")[int(q * 1000) - 1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=5.0, help="measured seconds per system, client count and round")
    ap.add_argument("--warmup", type=float, default=1.0, help="seconds between every client's first answer and the window")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--clients", default="1,16,64")
    ap.add_argument("--upstream-ms", type=float, default=0.0, help="how long the fake upstreams take to answer")
    ap.add_argument("--gateway-log-level", default="info")
    ap.add_argument("--pin", action="store_true", help="give the system under test a core of its own (a quiet host)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--upstreams", metavar="PORT_FILE", help=argparse.SUPPRESS)
    ap.add_argument("--peers", nargs=2, metavar=("READY_FILE", "BROKER"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.upstreams:
        return serve_upstreams(args.upstreams, args.upstream_ms)
    if args.peers:
        return register_peers(*args.peers)

    sut_core, rest = _cores(args.pin)
    if rest:
        os.sched_setaffinity(0, rest)
    py, me = sys.executable, str(Path(__file__).resolve())
    clients = [int(c) for c in args.clients.split(",")]
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        procs = []
        try:
            up, ports = start([py, me, "--upstreams", str(tmp / "up.port"), "--upstream-ms", str(args.upstream_ms)],
                              tmp / "up.port", tmp / "up.log", None)
            procs.append(up)
            p_url, d_url = (f"http://127.0.0.1:{p}" for p in ports.split())
            broker, endpoint = start([py, "-m", "broker.cli", "serve", "--bind", "tcp://127.0.0.1:0", "--port-file",
                                      str(tmp / "broker.ep"), "--log-format", "json"], tmp / "broker.ep", tmp / "broker.log", None)
            procs.append(broker)
            peers, _ = start([py, me, "--peers", str(tmp / "peers.ready"), endpoint], tmp / "peers.ready", tmp / "peers.log", None)
            procs.append(peers)
            gw, gw_port = start([py, "-m", "broker.cli", "gateway", "--broker", endpoint, "--port", "0", "--port-file",
                                 str(tmp / "gw.port"), "--prefill", f"p0={p_url}", "--decode", f"d0={d_url}",
                                 "--log-format", "json", "--log-level", args.gateway_log_level],
                                tmp / "gw.port", tmp / "gateway.log", sut_core)
            procs.append(gw)
            toy, toy_port = start([py, str(ROOT / "bench" / "toy_proxy.py"), str(tmp / "toy.port"), p_url, d_url],
                                  tmp / "toy.port", tmp / "toy.log", sut_core)
            procs.append(toy)
            systems = {"direct": (int(d_url.rsplit(":", 1)[1]), up.pid), "gateway": (int(gw_port), gw.pid),
                       "toy proxy": (int(toy_port), toy.pid)}
            samples = {(s, c): Sample(s, c) for c in clients for s in systems}

            async def measure() -> None:
                for r in range(args.rounds):
                    for c in clients:
                        for name, (port, pid) in systems.items():
                            await load(port, pid, c, args.seconds, args.warmup, samples[(name, c)])
                            s = samples[(name, c)]
                            print(f"round {r + 1}/{args.rounds}: {name:9} x{c:<3} {s.answered} answered, {s.errors} errors",
                                  file=sys.stderr, flush=True)

            _run(measure())
        finally:
            for p in procs:
                p.terminate()
                p.wait(timeout=10)
    report(samples, clients, args)


def report(samples: dict[tuple[str, int], Sample], clients: list[int], args: argparse.Namespace) -> None:
    rows = []
    for (name, c), s in samples.items():
        lat = s.latencies_s
        rows.append({"system": name, "clients": c, "requests": len(lat), "errors": s.errors,
                     "rps": round(len(lat) / s.seconds, 1), "cpu_us_per_request": round(s.cpu_s / max(1, s.answered) * 1e6),
                     "p50_ms": round(quantile(lat, 0.5) * 1e3, 3), "p99_ms": round(quantile(lat, 0.99) * 1e3, 3)})
    by = {(r["system"], r["clients"]): r for r in rows}
    for r in rows:
        base = by[("direct", r["clients"])]
        r["added_p50_ms"] = round(r["p50_ms"] - base["p50_ms"], 3)
        r["added_p99_ms"] = round(r["p99_ms"] - base["p99_ms"], 3)
    # None where the toy proxy answered nothing within the window (no ratio to give).
    ratios = {c: round(by[("gateway", c)]["rps"] / by[("toy proxy", c)]["rps"], 2) if by[("toy proxy", c)]["rps"] else None
              for c in clients}
    head = ("system", "clients", "req/s", "p50 ms", "p99 ms", "added p50", "added p99", "CPU us/req", "errors", "req/s vs toy")
    table = [head]
    for r in sorted(rows, key=lambda r: (r["clients"], ["direct", "gateway", "toy proxy"].index(r["system"]))):
        ratio = ratios[r["clients"]]
        vs = ("-" if ratio is None else f"{ratio:.2f}x") if r["system"] == "gateway" else ""
        table.append((r["system"], str(r["clients"]), f"{r['rps']:.0f}", f"{r['p50_ms']:.3f}", f"{r['p99_ms']:.3f}",
                      "" if r["system"] == "direct" else f"{r['added_p50_ms']:+.3f}",
                      "" if r["system"] == "direct" else f"{r['added_p99_ms']:+.3f}", str(r["cpu_us_per_request"]),
                      str(r["errors"]), vs))
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    for i, row in enumerate(table):
        print("  ".join(cell.rjust(w) if j else cell.ljust(w) for j, (cell, w) in enumerate(zip(row, widths))))
        if i == 0:
            print("  ".join("-" * w for w in widths))
    print(f"\ntargets: gateway >= 2x the toy proxy's req/s at 64 clients (got {ratios.get(64, '-')}x); "
          f"<= 1 ms added p50 at 1 client (got {by[('gateway', 1)]['added_p50_ms'] if 1 in clients else '-'} ms)")
    print(f"host speed: sum(range(1000)) took {host_speed_us():.1f} us here (about 10 us on an idle recent x86 core)")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: v for k, v in vars(args).items() if k != "json"} | {"cpus": os.cpu_count()},
                                         "host_sum_range_1000_us": round(host_speed_us(), 1),
                                         "rows": rows, "gateway_rps_over_toy_proxy": ratios}, indent=1, default=str))


if __name__ == "__main__":
    main()
