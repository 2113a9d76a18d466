"""`kvbroker serve` and `kvbroker gateway` as child processes on 127.0.0.1, stopped by PID.

Each runs in its own process group (a Ctrl-C at the terminal reaches only the demo, which
then stops them in order), with its output in `<log_dir>/<name>.log`.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import httpx

from .servers import ROOT

T = TypeVar("T")


def wait_for(predicate: Callable[[], T], timeout: float, what: str, interval: float = 0.05) -> T:
    """Poll `predicate` until it returns something truthy; TimeoutError naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} did not happen within {timeout:g} s")
        pause.wait(interval)


def child_env() -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env


class Daemon:
    """One `python -m broker.cli ARGS` process."""

    def __init__(self, name: str, args: list[str], log_dir: Path) -> None:
        self.name, self.args, self.log_dir = name, args, log_dir
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"{self.name}.log"

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "broker.cli", *self.args], stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, env=child_env(), cwd=ROOT, start_new_session=True,
            )

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"{self.name} exited with status {self.proc.returncode}; see {self.log_path}")

    def kill(self, sig: signal.Signals = signal.SIGKILL) -> None:
        """Send `sig` to its PID and reap it."""
        if self.alive():
            assert self.proc is not None
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, sig)
            self.proc.wait(timeout=10)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after `timeout` s."""
        if not self.alive():
            return
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)


class Broker:
    """`kvbroker serve` on a free loopback port; `restart` comes back on the same address."""

    def __init__(self, log_dir: Path, *serve_args: str) -> None:
        self.log_dir, self.serve_args = log_dir, list(serve_args)
        self.bind = "tcp://127.0.0.1:0"
        self.endpoint = ""
        self.lifetimes: list[Daemon] = []

    @property
    def current(self) -> Daemon | None:
        return self.lifetimes[-1] if self.lifetimes else None

    def start(self, timeout: float = 30.0) -> str:
        n = len(self.lifetimes) + 1
        port_file = self.log_dir / f"broker-{n}.endpoint"
        d = Daemon(f"broker-{n}", ["serve", "--bind", self.bind, "--port-file", str(port_file),
                                   "--log-format", "json", *self.serve_args], self.log_dir)
        self.lifetimes.append(d)
        d.start()

        def bound() -> str:
            d.check_alive()
            return port_file.read_text().strip() if port_file.exists() else ""

        self.endpoint = wait_for(bound, timeout, f"{d.name} binding its address")
        self.bind = self.endpoint  # a restart comes back here
        return self.endpoint

    def kill(self, sig: signal.Signals = signal.SIGKILL) -> None:
        if self.current is not None:
            self.current.kill(sig)

    def stop(self) -> None:
        for d in self.lifetimes:
            d.stop()


class Gateway(Daemon):
    """`kvbroker gateway` on a free loopback port in front of the named instances."""

    def __init__(self, log_dir: Path, broker: str, prefills: dict[str, str], decodes: dict[str, str]) -> None:
        self.port_file = log_dir / "gateway.port"
        args = ["gateway", "--broker", broker, "--port", "0", "--port-file", str(self.port_file), "--log-format", "json"]
        args += [a for name, url in prefills.items() for a in ("--prefill", f"{name}={url}")]
        args += [a for name, url in decodes.items() for a in ("--decode", f"{name}={url}")]
        super().__init__("gateway", args, log_dir)
        self.url = ""

    def wait_healthy(self, timeout: float = 60.0) -> str:
        """Wait until GET /health says "ok": every instance registered, as the gateway sees
        the broker (it answers 200 with "degraded" while it serves without that)."""

        def healthy() -> str:
            self.check_alive()
            if not self.port_file.exists():
                return ""
            port = int(self.port_file.read_text().strip())
            return f"http://127.0.0.1:{port}" if gateway_health(port) == "ok" else ""

        self.url = wait_for(healthy, timeout, "the gateway seeing every instance registered", interval=0.2)
        return self.url

    def metrics(self) -> str:
        """Its /metrics text ("" if it does not answer)."""
        try:
            r = httpx.get(f"{self.url}/metrics", timeout=5)
        except httpx.HTTPError:
            return ""
        return r.text if r.status_code == 200 else ""


def gateway_health(port: int) -> str | None:
    """The `status` of the gateway's GET /health ("ok" or "degraded"), or None without a
    JSON answer."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2.0)
    try:
        conn.request("GET", "/health")
        body = json.loads(conn.getresponse().read())
        return body.get("status") if isinstance(body, dict) else None
    except (OSError, http.client.HTTPException, ValueError):
        return None
    finally:
        conn.close()
