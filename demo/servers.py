"""Real vLLM OpenAI API servers on the CPU, for the demo and the end-to-end tests.

Each server is `python -m vllm.entrypoints.openai.api_server` in a child process,
bound to 127.0.0.1 on a free port, serving the tiny model as "tiny", with an
optional kv-transfer-config for KVBrokerConnector:

    ktc = kv_transfer_config(broker_endpoint, "kv_consumer", "decode-0")
    with api_server(model_dir, tmp_path, "decode-0", ktc) as d:
        body = completion(d, prompt_ids, max_tokens=16, kv_transfer_params={...})
        body["choices"][0]["token_ids"]

    # Several at once: each takes about a minute to become healthy, so they start together.
    with api_servers(model_dir, tmp_path, {"plain": None, "prefill-0": p_ktc}) as servers:
        servers["plain"].base_url

A server's stdout and stderr go to `<log_dir>/<name>.log` (the connector's JSON
lines included: vLLM's engine core inherits them). A server is stopped by its PID:
SIGTERM, then SIGKILL after a deadline.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

SERVED_MODEL = "tiny"
HEALTH_TIMEOUT_S = 240.0
STOP_TIMEOUT_S = 30.0
PORT_RETRIES = 2
ROOT = Path(__file__).resolve().parents[1]

# The environment of every vLLM engine on the CPU, here and in the tests' engine runner.
BASE_ENV = {
    # GiB of KV cache per engine: ample for the tiny model, and three or four servers fit in memory.
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
    # vLLM's CPU backend otherwise pins each engine, every thread of it (the connector's
    # too), to the cores it would pick alone: the same for all engines on one host. On a
    # 2-core host a decode engine then went 15 s without CPU while the others computed,
    # missed its heartbeats, and the broker evicted it.
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
}

# Every vLLM engine here starts in its own session, which Linux's scheduler (with
# autogroups, the default) weighs as one against every other session, however many
# threads it holds. Each engine holds about 40 (gloo's, vLLM's) that wake together, and a
# decode engine waiting for KV steps without pause; on a 2-core host the broker, a
# session of its own, then got no CPU at all for 23 to 77 s at a time in 4 of 15 runs of the
# hetero-TP test (its peers took it for dead). So each engine lowers its session's
# weight (nice 10) and its own: when the broker or the gateway has work, it runs.
YIELD_CPU = ("/bin/sh", "-c", '{ echo 10 > /proc/self/autogroup; } 2>/dev/null; '
             'if command -v nice >/dev/null; then exec nice -n 10 "$0" "$@"; fi; exec "$0" "$@"')


def yielding(cmd: Sequence[str]) -> list[str]:
    """`cmd` run with its session's and its own CPU weight lowered (see YIELD_CPU)."""
    return [*YIELD_CPU, *cmd]


# Block size a multiple of 32 (the CPU backend's rule).
SERVER_ARGS = (
    "--skip-tokenizer-init",
    "--enforce-eager",
    "--max-model-len", "256",
    "--dtype", "bfloat16",
    "--block-size", "32",
    "--gpu-memory-utilization", "0.3",
    "--seed", "0",
    # usage.prompt_tokens_details.cached_tokens: how much of a prompt D did not compute.
    "--enable-prompt-tokens-details",
)


class ServerError(RuntimeError):
    """A server exited or did not become healthy in time."""


def kv_transfer_config(
    broker: str,
    role: str,
    instance_id: str,
    *,
    policy: str | None = "recompute",
    **extra: Any,
) -> dict[str, Any]:
    """A kv-transfer-config for KVBrokerConnector. `policy` is the consumer's
    kv_load_failure_policy (left out for a producer and when None); `extra` adds to
    or overrides kv_connector_extra_config."""
    config: dict[str, Any] = {
        "kv_connector": "KVBrokerConnector",
        "kv_connector_module_path": "connector",
        "kv_role": role,
        "kv_connector_extra_config": {
            "broker": broker,
            "instance_id": instance_id,
            "pool_bytes": 64 << 20,
            "staging_bytes": 64 << 20,
            "tcp_host": "127.0.0.1",
            # Several servers importing vLLM at once on two cores: registration can be slow.
            "register_timeout_s": 60,
            **extra,
        },
    }
    if policy is not None and role == "kv_consumer":
        config["kv_load_failure_policy"] = policy
    return config


@dataclass(frozen=True)
class ApiServer:
    """A started, healthy server."""

    name: str
    port: int
    pid: int
    log_path: Path
    role: str | None  # "kv_producer", "kv_consumer", or None without a connector
    instance_id: str | None
    startup_s: float

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def http_status(port: int, path: str, timeout: float = 2.0) -> int | None:
    """The status of GET 127.0.0.1:port/path, or None without an HTTP answer (nothing
    listens yet, or another program took the port). The standard library's client:
    polled twice a second per server while they start, httpx's per-call setup (an SSL
    context each time) took CPU from the servers on a small host."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        return conn.getresponse().status
    except (OSError, http.client.HTTPException):
        return None
    finally:
        conn.close()


_handed_out: set[int] = set()
_handed_out_lock = threading.Lock()


def free_port() -> int:
    """A port free on 127.0.0.1 now, and never handed out before by this process. The
    kernel may give a port again once the socket that found it is closed, and vLLM binds
    with SO_REUSEADDR long before it listens: two servers started together were once
    given one port, and the one that listened first answered both servers' requests."""
    with _handed_out_lock:
        while True:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            if port not in _handed_out:
                _handed_out.add(port)
                return port


def listens(pid: int, port: int) -> bool | None:
    """Whether process `pid` holds the socket that listens on TCP `port` (Linux's /proc);
    None where /proc cannot tell (another system, or the process is gone)."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
        held = set()
        for fd in fds:
            with contextlib.suppress(OSError):  # an fd closed while listed
                held.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
        tables = [Path(f"/proc/net/{t}").read_text() for t in ("tcp", "tcp6")]
    except OSError:
        return None
    for table in tables:
        for line in table.splitlines()[1:]:
            fields = line.split()  # sl, local address:port (hex), remote, state, ..., inode
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port and f"socket:[{fields[9]}]" in held:
                return True
    return False


class ServerProcess:
    """One api_server child process: `start` launches it, `wait_healthy` waits for
    GET /health, `stop` ends it."""

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        log_dir: str | os.PathLike[str],
        name: str,
        kv_transfer_config: dict[str, Any] | None = None,
        *,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        kv_cache_bytes: int | None = None,
    ) -> None:
        self.model_dir = str(model_dir)
        self.name = name
        self.log_path = Path(log_dir) / f"{name}.log"
        self.kv_transfer_config = kv_transfer_config
        self.extra_args = list(extra_args)
        self.env = dict(env or {})
        # KV cache space in bytes, instead of BASE_ENV's whole GiB (which vLLM takes first).
        self.kv_cache_bytes = kv_cache_bytes
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0
        self.server: ApiServer | None = None
        self.port_retries = 0
        self._log_offset = 0

    @property
    def role(self) -> str | None:
        return (self.kv_transfer_config or {}).get("kv_role")

    @property
    def instance_id(self) -> str | None:
        return ((self.kv_transfer_config or {}).get("kv_connector_extra_config") or {}).get("instance_id")

    def command(self) -> list[str]:
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model_dir,
            "--served-model-name", SERVED_MODEL,
            "--host", "127.0.0.1",
            "--port", str(self.port),
            *SERVER_ARGS,
        ]
        if self.kv_transfer_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(self.kv_transfer_config)]
        if self.kv_cache_bytes is not None:
            cmd += ["--kv-cache-memory-bytes", str(self.kv_cache_bytes)]
        return cmd + self.extra_args

    def start(self) -> None:
        env = dict(os.environ)
        # BASE_ENV's VLLM_CPU_OMP_THREADS_BIND=nobind: by default vLLM's CPU backend pins
        # every server's worker process, all its threads (the connector's included), to
        # core 0. Several servers on one small host then share one core, and a prefill
        # worker went without CPU for over 5 s while a decode server waited for its KV:
        # the broker evicted it and every transfer failed.
        env.update(BASE_ENV)
        # The server's engine core runs in its own process, as in production.
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        env["PYTHONUNBUFFERED"] = "1"
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
        env.update(self.env)
        if self.kv_cache_bytes is not None:
            env.pop("VLLM_CPU_KVCACHE_SPACE", None)
        self.port = free_port()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        self.started_at = time.monotonic()
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                yielding(self.command()),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=str(ROOT),
                # Its own process group, led by its PID: the engine core it forks is
                # found there if the server is killed before it could end it.
                start_new_session=True,
            )

    def healthy(self) -> bool:
        """Whether GET /health answers 200; raises ServerError if the process exited."""
        assert self.proc is not None, "not started"
        rc = self.proc.poll()
        if rc is not None:
            if self._port_taken() and self.port_retries < PORT_RETRIES:
                # The free port was taken before vLLM bound it (another server's
                # internal sockets, started at the same time): start again on another.
                self.port_retries += 1
                self.start()
                return False
            raise ServerError(f"{self.name}: exited with {rc} before it was healthy{self.log_tail()}")
        if http_status(self.port, "/health") != 200:
            return False
        if listens(self.proc.pid, self.port) is False:
            # Another program answers on this server's port (it listened first), so this
            # server never will: its requests would go to that program.
            if self.port_retries >= PORT_RETRIES:
                raise ServerError(f"{self.name}: another program answered on each of the {PORT_RETRIES + 1} ports "
                                  f"it was given (the last {self.port}): stop what takes ports on 127.0.0.1."
                                  f"{self.log_tail()}")
            self.port_retries += 1
            self.stop()
            self.start()
            return False
        return True

    def ready(self) -> ApiServer:
        assert self.proc is not None
        self.server = ApiServer(
            name=self.name,
            port=self.port,
            pid=self.proc.pid,
            log_path=self.log_path,
            role=self.role,
            instance_id=self.instance_id,
            startup_s=round(time.monotonic() - self.started_at, 1),
        )
        return self.server

    def wait_healthy(self, timeout: float = HEALTH_TIMEOUT_S) -> ApiServer:
        wait_all_healthy([self], timeout)
        assert self.server is not None
        return self.server

    def terminate(self) -> None:
        """SIGTERM to the server's PID (vLLM then shuts its engine core down)."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGTERM)

    def wait_stopped(self, timeout: float = STOP_TIMEOUT_S) -> int | None:
        """Wait up to `timeout` s for the server to exit, then SIGKILL it; returns its
        exit status. What is left of its process group after that (an engine core of
        about 3 GB whose server was killed) gets the same deadline, then SIGKILL."""
        if self.proc is None:
            return None
        pid, deadline = self.proc.pid, time.monotonic() + timeout
        try:
            self.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            self.proc.wait()
        pause = threading.Event()
        while _group_alive(pid) and time.monotonic() < deadline:
            pause.wait(0.1)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
        return self.proc.returncode

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> int | None:
        """SIGTERM, then `wait_stopped`."""
        self.terminate()
        return self.wait_stopped(timeout)

    def _port_taken(self) -> bool:
        if not self.log_path.exists():
            return False
        with open(self.log_path, "rb") as f:
            f.seek(self._log_offset)
            return b"address already in use" in f.read().lower()

    def log_tail(self, n: int = 6000) -> str:
        if not self.log_path.exists():
            return ""
        data = self.log_path.read_bytes()[-n:].decode(errors="replace")
        return f"\n--- {self.name} log tail ({self.log_path}) ---\n{data}"


def wait_all_healthy(procs: Sequence[ServerProcess], timeout: float = HEALTH_TIMEOUT_S) -> dict[str, ApiServer]:
    """Poll every server's /health until all answer 200; fail at the first one that exits
    or when `timeout` s have passed."""
    deadline = time.monotonic() + timeout
    pending = [p for p in procs if p.server is None]
    pause = threading.Event()
    while True:
        for p in list(pending):
            if p.healthy():
                p.ready()
                pending.remove(p)
        if not pending:
            break
        if time.monotonic() > deadline:
            tails = "".join(p.log_tail(3000) for p in pending)
            raise ServerError(f"not healthy after {timeout} s: {[p.name for p in pending]}{tails}")
        pause.wait(0.5)
    return {p.name: p.server for p in procs if p.server is not None}


@contextlib.contextmanager
def api_servers(
    model_dir: str | os.PathLike[str],
    log_dir: str | os.PathLike[str],
    specs: Mapping[str, dict[str, Any] | None],
    *,
    timeout: float = HEALTH_TIMEOUT_S,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> Iterator[dict[str, ApiServer]]:
    """Start one server per `specs` entry (name -> kv-transfer-config or None) all at
    once, wait until every one is healthy, yield them by name, and stop them all."""
    procs = [
        ServerProcess(model_dir, log_dir, name, ktc, extra_args=extra_args, env=env)
        for name, ktc in specs.items()
    ]
    try:
        for p in procs:
            p.start()
        yield wait_all_healthy(procs, timeout)
    finally:
        # All at once: each takes a few seconds to shut down.
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait_stopped()


@contextlib.contextmanager
def api_server(
    model_dir: str | os.PathLike[str],
    log_dir: str | os.PathLike[str],
    name: str,
    kv_transfer_config: dict[str, Any] | None = None,
    **kwargs: Any,
) -> Iterator[ApiServer]:
    """One server; see `api_servers`."""
    with api_servers(model_dir, log_dir, {name: kv_transfer_config}, **kwargs) as servers:
        yield servers[name]


def post_json(server: ApiServer, path: str, body: dict[str, Any], timeout: float = 120.0) -> dict[str, Any]:
    """POST `body` to the server; the parsed answer, or a ServerError with the status
    and body when it is not 200."""
    r = httpx.post(server.base_url + path, json=body, timeout=timeout)
    if r.status_code != 200:
        raise ServerError(f"{server.name} {path}: HTTP {r.status_code}: {r.text}")
    return r.json()


def completion_body(prompt: list[int], max_tokens: int, **fields: Any) -> dict[str, Any]:
    """A /v1/completions body for one prompt of token ids, greedy, ignoring EOS, asking
    for the generated token ids (choices[0]["token_ids"]); `fields` add to or override it."""
    return {
        "model": SERVED_MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        **fields,
    }


def completion(
    server: ApiServer,
    prompt: list[int],
    max_tokens: int,
    kv_transfer_params: dict[str, Any] | None = None,
    timeout: float = 120.0,
    **fields: Any,
) -> dict[str, Any]:
    """POST /v1/completions (`completion_body`) to the server; the parsed answer."""
    body = completion_body(prompt, max_tokens, **fields)
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    return post_json(server, "/v1/completions", body, timeout=timeout)
