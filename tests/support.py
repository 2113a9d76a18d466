"""Helpers shared by tests that start real processes: a broker on loopback, condition waits."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

ROOT = Path(__file__).resolve().parent.parent
# A producer's kv-transfer-config keys that make it send the KV of transfers named corrupt-*
# negated: the end-to-end negative controls (tests/e2e/fault_connectors.py).
NEGATING = {"kv_connector": "NegatingConnector", "kv_connector_module_path": "tests.e2e.fault_connectors"}
# ... that make it fail the sends of transfers named refuse-*: P ends them itself.
REFUSING = {"kv_connector": "RefusingConnector", "kv_connector_module_path": "tests.e2e.fault_connectors"}


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = os.pathsep.join([str(ROOT), e.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    e.setdefault("PYTHONUNBUFFERED", "1")
    return e


def wait_until(predicate: Callable[[], T], timeout: float, what: str, interval: float = 0.01) -> T:
    """Poll `predicate` until it returns something truthy; fail naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        pause.wait(interval)


def engine_step_pause(seconds: float = 0.005) -> None:
    """The gap between two steps of an idle engine loop, which keeps stepping."""
    threading.Event().wait(seconds)


class BrokerProcess:
    """`kvbroker serve` as a real child process on 127.0.0.1, stopped by its PID."""

    def __init__(self, tmp: Path, *args: str, bind: str = "tcp://127.0.0.1:0") -> None:
        self.tmp = tmp
        self.args = list(args)
        self.bind = bind
        self.endpoint = ""
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def log_path(self) -> Path:
        return self.tmp / f"broker-{self.starts}.log"

    def start(self) -> str:
        self.starts += 1
        port_file = self.tmp / f"broker-{self.starts}.endpoint"
        cmd = [sys.executable, "-m", "broker.cli", "serve", "--bind", self.bind, "--port-file", str(port_file)]
        cmd += ["--log-format", "json", *self.args]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env(), cwd=ROOT)

        def bound() -> str:
            assert self.proc is not None and self.proc.poll() is None, self.log_path.read_text()
            return port_file.read_text() if port_file.exists() else ""

        self.endpoint = wait_until(bound, 20, "the broker to bind")
        # A restart must come back on the same address, so pin the port we got.
        self.bind = self.endpoint
        return self.endpoint

    def stop(self) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.terminate()
        rc = self.proc.wait(timeout=10)
        self.proc = None
        return rc

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Stop the broker (SIGSTOP to its PID) for the block, as a starved or swapped-out
        host would, and let it go on after."""
        assert self.proc is not None and self.proc.poll() is None
        os.kill(self.proc.pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(self.proc.pid, signal.SIGCONT)

    def answers(self) -> bool:
        """Whether the broker answers a status request within a few seconds."""
        try:
            self.status()
        except AssertionError:
            return False
        return True

    def status(self) -> dict:
        out = subprocess.run(
            [sys.executable, "-m", "broker.cli", "status", "--broker", self.endpoint, "--json", "--timeout", "5"],
            capture_output=True,
            env=env(),
            cwd=ROOT,
            timeout=30,
        )
        assert out.returncode == 0, out.stderr.decode()
        return json.loads(out.stdout)
