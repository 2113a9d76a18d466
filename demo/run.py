"""`make demo`: P/D disaggregation on real vLLM servers on the CPU, with a decode server killed and the broker restarted.

It makes a tiny random-weight model on the spot, starts `kvbroker serve`, one prefill
and two decode vLLM OpenAI servers (KVBrokerConnector) and `kvbroker gateway` in front
of them, all on 127.0.0.1. It asks the prefill server each distinct prompt once without
kv_transfer_params (the plain run), then sends a stream of requests through the
gateway, every prompt several times. Mid-stream it kills decode-1 with SIGKILL, and
later kills the broker with SIGKILL and starts it again on the same address. Nothing
retries around a failed request: the summary counts it, and the exit status is
non-zero if any request failed or any answer differs from the plain run's token ids.

Every process it starts is stopped by its PID at the end, also on an error or Ctrl-C;
their logs stay in a temp directory (printed at the start and the end).

    python -m demo [--requests 72] [--rate 3] [--distinct 12]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anyio
import httpx
import msgspec

from broker.status import fetch_status

from .daemons import Broker, Gateway, child_env, wait_for
from .servers import (
    HEALTH_TIMEOUT_S,
    ROOT,
    STOP_TIMEOUT_S,
    ServerError,
    ServerProcess,
    completion,
    kv_transfer_config,
    wait_all_healthy,
)
from .stream import Answer, make_prompts, prompt_lengths, send, stream_order, token_ids_of
from .summary import Summary, compare, count_events, counter_total, problems, prometheus_value, render

PREFILL, DECODES, VICTIM = "prefill-0", ("decode-0", "decode-1"), "decode-1"
# Six vLLM processes share the host's cores: a server's worker can go without CPU for
# a few seconds, so the peers get a longer lease than the default 5 s.
PEER_LEASE_S = 10.0
MODEL_TIMEOUT_S = 300.0
# Each server's KV cache: 64 Ki tokens of the tiny model (1 KiB a token in float32), far
# more than the stream needs, and little memory on a shared host.
KV_CACHE_BYTES = 64 << 20
# The servers compute in float32. In bfloat16 one of the twelve prompts, whose greedy
# choice between two tokens is nearly a tie under the random weights, decoded
# differently on D in about half the runs (its KV moved bit for bit; D computes the
# prompt's last token against the cached KV where the plain run computed it in the
# prefill pass, with other kernels and rounding), with the connector's scatter as well
# as with its receive straight into the blocks.
DTYPE_ARGS = ("--dtype", "float32")


class Demo:
    def __init__(self, args: argparse.Namespace, logdir: Path) -> None:
        self.args, self.logdir = args, logdir
        self.t0 = time.monotonic()
        self.phases: list[tuple[str, float]] = []
        self.broker = Broker(logdir, "--peer-lease", f"{PEER_LEASE_S:g}")
        self.servers: list[ServerProcess] = []
        self.gateway: Gateway | None = None
        self.model_maker: subprocess.Popen[bytes] | None = None
        self.counters: list[dict[str, int]] = []  # the broker's, per lifetime
        self.fault_error: BaseException | None = None
        # Set by `stop`; the faults thread makes no fault after it, and holds `lock` while
        # it makes one, so that no process it starts is left behind.
        self.stopping = threading.Event()
        self.lock = threading.Lock()

    def note(self, what: str) -> None:
        t = time.monotonic() - self.t0
        self.phases.append((what, t))
        print(f"[{t:6.1f} s] {what}", file=sys.stderr, flush=True)

    # --- the cluster ---

    def make_model(self) -> Path:
        model_dir = self.logdir / "tiny-llama"
        with open(self.logdir / "tiny-llama.log", "wb") as log:
            self.model_maker = subprocess.Popen(
                [sys.executable, "-m", "demo.tiny_model", str(model_dir)], stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, env=child_env(), cwd=ROOT, start_new_session=True,
            )
        try:
            rc = self.model_maker.wait(timeout=MODEL_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"making the tiny model took over {MODEL_TIMEOUT_S:g} s; see {log.name}") from None
        if rc != 0:
            raise RuntimeError(f"making the tiny model failed (status {rc}); see {log.name}")
        return model_dir

    def start(self) -> None:
        endpoint = self.broker.start()
        self.note(f"broker serving at {endpoint}")
        model_dir = self.make_model()
        self.note(f"tiny random-weight Llama made in {model_dir}")
        specs = {PREFILL: kv_transfer_config(endpoint, "kv_producer", PREFILL)}
        specs |= {d: kv_transfer_config(endpoint, "kv_consumer", d) for d in DECODES}
        self.servers = [ServerProcess(model_dir, self.logdir, name, ktc, kv_cache_bytes=KV_CACHE_BYTES,
                                      extra_args=DTYPE_ARGS)
                        for name, ktc in specs.items()]
        for s in self.servers:
            s.start()
        self.note(f"starting vLLM servers {', '.join(specs)} (a minute or more: each imports vLLM in three processes)")
        wait_all_healthy(self.servers, HEALTH_TIMEOUT_S)
        self.note("servers healthy: " + ", ".join(f"{s.name} :{s.port}" for s in self.servers))
        urls = {s.name: f"http://127.0.0.1:{s.port}" for s in self.servers}
        self.gateway = Gateway(self.logdir, endpoint, {PREFILL: urls[PREFILL]}, {d: urls[d] for d in DECODES})
        self.gateway.start()
        self.note(f"gateway serving at {self.gateway.wait_healthy()}")

    def server(self, name: str) -> ServerProcess:
        return next(s for s in self.servers if s.name == name)

    def stop(self) -> None:
        """Every process this demo started, by PID: the gateway, the servers, the broker."""
        self.stopping.set()
        with self.lock:
            self._stop()

    def _stop(self) -> None:
        if self.model_maker is not None and self.model_maker.poll() is None:
            self.model_maker.kill()
            self.model_maker.wait(timeout=10)
        if self.gateway is not None:
            self.gateway.stop()
        for s in self.servers:  # all at once: each takes a few seconds to shut down
            s.terminate()
        # One deadline for all: a server still starting ignores SIGTERM, and each would
        # otherwise get its own before the SIGKILL.
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for s in self.servers:
            s.wait_stopped(max(1.0, deadline - time.monotonic()))
        self.broker.stop()

    # --- the broker's counters ---

    def broker_status(self) -> dict[str, Any]:
        """`kvbroker status --json`'s answer, through its client function."""
        return msgspec.to_builtins(anyio.run(fetch_status, self.broker.endpoint, 5.0))

    # --- the run ---

    def plain_run(self, prompts: list[list[int]]) -> dict[int, list[int]]:
        """Each distinct prompt once, straight to the prefill server without
        kv_transfer_params: the token ids every answer of the stream must equal."""
        p = self.server(PREFILL).server
        assert p is not None
        with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
            bodies = list(pool.map(lambda q: completion(p, q, self.args.max_tokens), prompts))
        ref = {i: token_ids_of(b) for i, b in enumerate(bodies)}
        missing = [i for i, ids in ref.items() if ids is None or len(ids) != self.args.max_tokens]
        if missing:
            raise RuntimeError(f"the plain run gave no {self.args.max_tokens} token ids for prompts {missing}")
        return ref  # type: ignore[return-value]

    def faults(self, start: float, stream_s: float) -> None:
        """On their schedule: SIGKILL the victim decode server; later SIGKILL the broker
        and start it again on the same address. The stream goes on at its pace meanwhile."""
        try:
            if self.stopping.wait(max(0.0, start + self.args.kill_decode_at * stream_s - time.monotonic())):
                return
            with self.lock:
                if self.stopping.is_set():
                    return
                victim = self.server(VICTIM)
                assert victim.proc is not None
                os.killpg(victim.proc.pid, signal.SIGKILL)  # the server and its engine core
                self.note(f"SIGKILL {VICTIM} (pid {victim.proc.pid} and its engine core)")
            if self.stopping.wait(max(0.0, start + self.args.restart_broker_at * stream_s - time.monotonic())):
                return
            with self.lock:
                if self.stopping.is_set():
                    return
                # Read just before the kill: the next broker counts from zero.
                self.counters.append(self.broker_status()["counters"])
                self.broker.kill(signal.SIGKILL)
                self.note("SIGKILL broker")
                self.broker.start()
                self.note(f"broker started again at {self.broker.endpoint}")
        except BaseException as exc:  # noqa: BLE001 (the main thread reports it)
            self.fault_error = exc

    def stream(self, prompts: list[list[int]]) -> list[Answer]:
        a = self.args
        assert self.gateway is not None
        order = stream_order(a.requests, len(prompts), a.seed)
        stream_s = a.requests / a.rate
        self.note(f"stream: {a.requests} requests at {a.rate:g}/s through the gateway ({stream_s:.0f} s)")
        futures: list[Future[Answer]] = []
        pause = threading.Event()
        start = time.monotonic()
        faults = threading.Thread(target=self.faults, args=(start, stream_s), name="demo-faults", daemon=True)
        limits = httpx.Limits(max_connections=a.requests, max_keepalive_connections=a.requests)
        client = httpx.Client(timeout=a.request_timeout, limits=limits)
        # Not a `with`: on Ctrl-C the demo stops the servers at once rather than wait for
        # the requests in flight, which then end with them.
        pool = ThreadPoolExecutor(max_workers=a.requests, thread_name_prefix="demo-request")
        try:
            faults.start()
            for i, k in enumerate(order):
                pause.wait(max(0.0, start + i / a.rate - time.monotonic()))
                futures.append(pool.submit(send, client, self.gateway.url, i, k, prompts[k], a.max_tokens, start))
                if (i + 1) % 10 == 0:
                    done = [f.result() for f in futures if f.done()]
                    print(f"           sent {i + 1}/{a.requests}, answered {len(done)}, "
                          f"failed {sum(not x.ok for x in done)}", file=sys.stderr, flush=True)
            answers = [f.result() for f in futures]
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
        client.close()
        faults.join(timeout=60)
        if self.fault_error is not None:
            raise RuntimeError(f"the faults could not be made: {self.fault_error}") from self.fault_error
        self.note(f"stream answered: {sum(x.ok for x in answers)} of {len(answers)} ok")
        return answers

    def settle(self, timeout: float = 10.0) -> dict[str, Any]:
        """The broker's status once it holds no transfer (or after `timeout` s)."""
        last: dict[str, Any] = {}

        def idle() -> bool:
            nonlocal last
            last = self.broker_status()
            return not last["transfers"]

        try:
            wait_for(idle, timeout, "the broker finishing its transfers", interval=0.5)
        except TimeoutError:
            pass
        return last

    def run(self) -> int:
        a = self.args
        self.start()
        prompts = make_prompts(prompt_lengths(a.distinct), salt=a.seed)
        reference = self.plain_run(prompts)
        self.note(f"plain run: {len(prompts)} prompts straight to {PREFILL}, no kv_transfer_params")
        answers = self.stream(prompts)
        final = self.settle()
        self.counters.append(final["counters"])
        assert self.gateway is not None
        gateway_retries = prometheus_value(self.gateway.metrics(), "kvbroker_gateway_decode_retries")
        decode_logs = [line for d in DECODES for line in self.server(d).log_path.read_text(errors="replace").splitlines()]
        summary = Summary(
            requests=len(answers), distinct=len(prompts), rate=a.rate,
            comparison=compare(answers, reference),
            completed=[int(c.get("completed", 0)) for c in self.counters],
            retried=counter_total(self.counters, "retried"),
            claims_moved=counter_total(self.counters, "claims_moved"),
            gateway_retries=gateway_retries,
            loaded=count_events(decode_logs, "transfer.loaded"),
            load_failed=count_events(decode_logs, "transfer.load_failed"),
            in_flight_at_end=len(final["transfers"]),
            wall_s=time.monotonic() - self.t0,
            phases=self.phases, logdir=str(self.logdir),
        )
        print("\n" + render(summary), flush=True)
        bad = problems(summary)
        if bad:
            print("FAILED: " + "; ".join(bad), file=sys.stderr)
            return 1
        return 0


def _interrupted(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=72)
    parser.add_argument("--rate", type=float, default=3.0, help="requests sent per second")
    parser.add_argument("--distinct", type=int, default=12, help="distinct prompts; the other requests repeat them")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kill-decode-at", type=float, default=0.2, help="fraction of the stream's time")
    parser.add_argument("--restart-broker-at", type=float, default=0.65, help="fraction of the stream's time")
    parser.add_argument("--request-timeout", type=float, default=120.0, help="seconds one request may take")
    args = parser.parse_args(argv)
    if not 0 <= args.kill_decode_at <= args.restart_broker_at <= 1:
        parser.error("need 0 <= --kill-decode-at <= --restart-broker-at <= 1.")
    if args.requests < 1 or args.rate <= 0 or not 1 <= args.distinct <= args.requests:
        parser.error("need --requests >= 1, --rate > 0 and 1 <= --distinct <= --requests.")
    logdir = Path(tempfile.mkdtemp(prefix="kvbroker-demo-"))
    print(f"kvbroker demo on real vLLM servers; logs in {logdir}", file=sys.stderr, flush=True)
    signal.signal(signal.SIGTERM, _interrupted)
    demo = Demo(args, logdir)
    try:
        return demo.run()
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except (RuntimeError, ServerError, TimeoutError, OSError) as exc:
        print(f"demo failed: {exc}", file=sys.stderr)
        return 1
    finally:
        # Stopping goes on to the end (each wait in it has a deadline): a second Ctrl-C
        # would leave servers behind.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        print("stopping every process the demo started ...", file=sys.stderr, flush=True)
        demo.stop()
        print(f"stopped; logs in {logdir}", file=sys.stderr, flush=True)
