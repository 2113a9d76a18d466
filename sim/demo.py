"""`make demo`: a broker, one prefill and two decode workers as real processes; one decode dies.

It starts ``kvbroker serve`` on a free loopback port, two simulated decode workers and
one simulated prefill worker running a few hundred prompts (many repeated), kills one
decode worker with SIGKILL once a third of the transfers are done, and waits for the
rest. The staged transfers the dead worker held are re-delivered to the other one
from P's staged copies. Every byte is checked on the decode side against the content
recomputed from the prompt's seed. The exit status is non-zero if any transfer was
corrupt, lost without being counted, or if the broker still holds credit at the end.

Every process it starts is ended by its PID in a ``finally``; logs (JSON lines, one
file per process, ready for ``kvbroker trace ID <files>``) stay in a temp directory.

    python -m sim.demo [--prompts 300] [--distinct 40] [--kill-at 0.33]
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20


class Child:
    """One child process: JSON lines from its stdout go to a shared queue; stderr goes to a log file."""

    def __init__(self, name: str, cmd: list[str], logdir: Path, events: queue.Queue[tuple[str, dict[str, Any]]]) -> None:
        self.name = name
        self.log_path = logdir / f"{name}.log"
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=log)
        self.lines: list[dict[str, Any]] = []
        self._reader = threading.Thread(target=self._read, args=(events,), name=f"demo-read-{name}", daemon=True)
        self._reader.start()

    def _read(self, events: queue.Queue[tuple[str, dict[str, Any]]]) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            try:
                line = json.loads(raw)
            except ValueError:
                continue
            if isinstance(line, dict):
                self.lines.append(line)
                events.put((self.name, line))
        events.put((self.name, {"event": "exited"}))

    def last(self, event: str) -> dict[str, Any] | None:
        return next((line for line in reversed(self.lines) if line.get("event") == event), None)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig: signal.Signals) -> None:
        if self.alive():
            os.kill(self.proc.pid, sig)

    def end(self, grace_s: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after `grace_s`; reap the process either way."""
        if self.alive():
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
        self.proc.wait(5)
        self._reader.join(5)


class Bar:
    """A plain-text progress bar on stderr: redrawn in place on a terminal, every 10% otherwise."""

    def __init__(self, total: int, width: int = 40) -> None:
        self.total, self.width = total, width
        self.tty = sys.stderr.isatty()
        self.shown = -1

    def update(self, done: int, note: str = "") -> None:
        filled = self.width * done // max(self.total, 1)
        text = f"[{'#' * filled}{'-' * (self.width - filled)}] {done}/{self.total} {note}".rstrip()
        if self.tty:
            sys.stderr.write("\r" + text.ljust(self.width + 40))
        elif note or done * 10 // max(self.total, 1) > self.shown or done == self.total:
            self.shown = done * 10 // max(self.total, 1)
            sys.stderr.write(text + "\n")
        sys.stderr.flush()

    def finish(self) -> None:
        if self.tty:
            sys.stderr.write("\n")


def wait_for(events: queue.Queue[tuple[str, dict[str, Any]]], want: set[str], deadline: float, what: str) -> None:
    """Consume events until each child in `want` has said ready (or fail naming `what`)."""
    pending = set(want)
    while pending:
        left = deadline - time.monotonic()
        if left <= 0:
            raise RuntimeError(f"timed out waiting for {what}: {', '.join(sorted(pending))} not ready")
        try:
            name, line = events.get(timeout=left)
        except queue.Empty:
            continue
        if line.get("event") == "ready":
            pending.discard(name)
        elif line.get("event") in ("exited", "error") and name in pending:
            raise RuntimeError(f"{name} failed to start: {line.get('error', 'exited')}; see its log")


def start_broker(logdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    port_file = logdir / "broker.endpoint"
    cmd = [
        sys.executable, "-m", "broker.cli", "serve", "--bind", "tcp://127.0.0.1:0", "--port-file", str(port_file),
        "--log-format", "json", "--heartbeat", "0.2", "--peer-lease", "1.0", "--transfer-lease", "20",
        "--credit-timeout", "10",
    ]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    with open(logdir / "broker.log", "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while not port_file.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"the broker exited with status {proc.returncode}; see {logdir / 'broker.log'}")
        if time.monotonic() > deadline:
            raise RuntimeError("the broker did not bind within 30 s")
        threading.Event().wait(0.02)
    return proc, port_file.read_text().strip()


def broker_status(endpoint: str) -> Any:
    import anyio

    from broker.status import fetch_status

    return anyio.run(fetch_status, endpoint, 5.0)


def run(args: argparse.Namespace) -> int:
    logdir = Path(tempfile.mkdtemp(prefix="kvbroker-demo-"))
    events: queue.Queue[tuple[str, dict[str, Any]]] = queue.Queue(maxsize=100_000)
    children: list[Child] = []
    broker: subprocess.Popen[bytes] | None = None
    py = [sys.executable, "-m"]
    t_start = time.monotonic()
    try:
        broker, endpoint = start_broker(logdir)
        for name in ("d1", "d2"):
            children.append(
                Child(name, py + ["sim.decode", "--broker", endpoint, "--instance", name, "--pool-mib", str(args.pool_mib)], logdir, events)
            )
        wait_for(events, {"d1", "d2"}, time.monotonic() + 60, "the decode workers")
        prefill = Child(
            "p1",
            py + ["sim.prefill", "--broker", endpoint, "--instance", "p1", "--prompts", str(args.prompts),
                  "--distinct", str(args.distinct), "--seed", str(args.seed)],
            logdir,
            events,
        )
        children.append(prefill)
        d1, d2 = children[0], children[1]
        print(f"kvbroker demo: broker {endpoint}, decode d1 + d2, prefill p1, {args.prompts} prompts; logs in {logdir}", file=sys.stderr)
        bar = Bar(args.prompts)
        kill_at = max(1, int(args.prompts * args.kill_at))
        killed_at: int | None = None
        deadline = time.monotonic() + args.timeout
        summary: dict[str, Any] | None = None
        while summary is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"the prefill worker did not finish within {args.timeout:g} s")
            try:
                name, line = events.get(timeout=left)
            except queue.Empty:
                continue
            if name != "p1":
                continue
            kind = line.get("event")
            if kind == "progress":
                done = int(line["resolved"])
                note = ""
                if killed_at is None and done >= kill_at:
                    d1.signal(signal.SIGKILL)
                    killed_at = done
                    note = "<- SIGKILL d1"
                bar.update(done, note)
            elif kind == "summary":
                summary = line
            elif kind in ("error", "exited"):
                raise RuntimeError(f"the prefill worker stopped: {line.get('error', 'exited')}; see {prefill.log_path}")
        bar.finish()
        prefill.proc.wait(30)
        status = broker_status(endpoint)
        d2.end()
        return report(args, summary, d1, d2, status, killed_at, time.monotonic() - t_start, logdir)
    finally:
        for child in reversed(children):
            child.end()
        if broker is not None and broker.poll() is None:
            broker.send_signal(signal.SIGTERM)
            try:
                broker.wait(5)
            except subprocess.TimeoutExpired:
                broker.kill()
                broker.wait(5)


def report(
    args: argparse.Namespace,
    p: dict[str, Any],
    d1: Child,
    d2: Child,
    status: Any,
    killed_at: int | None,
    wall_s: float,
    logdir: Path,
) -> int:
    verified = {c.name: sum(1 for line in c.lines if line.get("event") == "transfer" and line.get("outcome") == "done") for c in (d1, d2)}
    corrupt = sum(1 for c in (d1, d2) for line in c.lines if line.get("event") == "transfer" and line.get("outcome") == "corrupt")
    d2_summary = d2.last("summary") or {}
    pool = d2_summary.get("pool", {})
    held_credit = [f"{pi.peer_id} reserved {pi.reserved}" for pi in status.pools if pi.reserved or pi.free != pi.capacity]
    in_flight = len(status.transfers)
    rows = [
        ("transfers", f"{p['prompts']}"),
        ("completed", f"{p['released']}"),
        ("bytes", f"{p['bytes_released'] / MiB:.1f} MiB"),
        ("transfer time", f"{p['transfer_s']:.2f} s"),
        ("throughput", f"{p['gbps']:.3f} GB/s end to end (prefill, verify and d1's eviction included)"),
        ("TCP send rate", f"{p['send_gbps']:.3f} GB/s per stream, while sending"),
        ("prefills", f"{p['prefills']} (one per prompt, never re-run)"),
        ("retries", f"{p['retries']} (re-delivered from staged copies after d1 died)"),
        ("failures", f"{p['failures']}"),
        ("corrupt", f"{corrupt}"),
        ("lost", f"{p['lost']}"),
        ("verified on D", f"{sum(verified.values())} (d1 {verified['d1']} before SIGKILL at {killed_at}, d2 {verified['d2']})"),
        ("d2 pool at end", f"{pool.get('free', '?')} of {pool.get('capacity', '?')} B free, peak {pool.get('peak_reserved', '?')} B"),
        ("broker at end", f"{in_flight} transfers in flight, {'credit held: ' + ', '.join(held_credit) if held_credit else 'all credit returned'}"),
        ("wall time", f"{wall_s:.1f} s"),
    ]
    width = max(len(k) for k, _ in rows)
    print("\nkvbroker demo summary")
    print("-" * (width + 50))
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    print(f"\nlogs: {logdir}  (kvbroker trace TRANSFER_ID {logdir}/*.log)")
    problems = []
    if corrupt:
        problems.append(f"{corrupt} corrupt transfers")
    if p["lost"]:
        problems.append(f"{p['lost']} transfers lost without a Release or Abort")
    if in_flight or held_credit:
        problems.append("the broker still holds transfers or credit")
    if pool and pool.get("free") != pool.get("capacity"):
        problems.append("d2's pool did not end full")
    if problems:
        print("FAILED: " + "; ".join(problems), file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sim.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=300)
    parser.add_argument("--distinct", type=int, default=40, help="distinct prompts; the rest are repeats")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pool-mib", type=float, default=16, help="each decode worker's receive pool")
    parser.add_argument("--kill-at", type=float, default=0.33, help="fraction of transfers done when d1 is killed")
    parser.add_argument("--timeout", type=float, default=100.0, help="give up after this many seconds")
    args = parser.parse_args(argv)
    try:
        return run(args)
    except (RuntimeError, OSError) as exc:
        print(f"demo failed: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
