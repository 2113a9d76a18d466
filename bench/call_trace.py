"""Where a request's time goes inside the worker processes: a timeline of function calls.

`bench/connector_path.py` times a request end to end, and the JSON logs give the broker's
legs (`kvbroker trace`). Between those lines, the time is spent in the workers' threads:
the engine's (saves, get_finished), the broker client's loop (the handlers of Prepare and
Go, the posts), the poller that sees the ops end; and in the broker, whose handling of
each message (side B) tells its own time from the hops' wake-ups around it. This wraps
chosen functions of the connector's and the broker's modules in every Python process of
a run and records each call's entry and exit: `time.monotonic()` (one clock for the
processes of a host), the thread, its CPU time (`time.thread_time()`: what of the span
the thread ran, the rest it waited, for the GIL among others) and the transfer it
concerns, if an argument names one.

    python bench/call_trace.py run DIR -- bench/connector_path.py --transport nccl --tokens 512
    python bench/call_trace.py legs DIR       # each event's median time from P's bind
    python bench/call_trace.py show DIR 5     # every event of the 6th request, in order

`run` puts a `sitecustomize` first on the processes' `PYTHONPATH` (it shadows any other
for the run), so each process, the benchmark's spawned P and D included, installs the
wrappers as the modules are imported, and writes `DIR/PID.json` when it exits. The
wrappers cost a few microseconds a call: compare legs with each other, not with the
benchmark's own table.
"""

from __future__ import annotations

import argparse
import atexit
import functools
import importlib.abc
import importlib.util
import inspect
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

ENV = "KVBROKER_CALL_TRACE"

# module -> class -> methods. A name missing from the code is reported, not skipped.
TARGETS: dict[str, dict[str, list[str]]] = {
    "connector.worker": {"ConnectorWorker": [
        "bind", "save_kv_layer", "wait_for_save", "start_load_kv", "get_finished", "on_prepare", "on_go", "spawn"]},
    "connector.producer": {"ProducerSide": ["_offer_all", "_offer", "_receive_seen", "_sent_on_receive",
                                            "_go_on_receive", "on_go"]},
    "connector.consumer": {"ConsumerSide": [
        "on_prepare", "get_finished", "_await_landing", "_collect", "_scatter", "_landed_in_place", "_received",
        "_receive", "_finish"]},
    "connector.nccl_link": {"NcclLink": ["send", "post_recv", "wait", "_carried", "_turn", "_post", "_postable_now",
                                         "_post_blocks", "ticket_at", "send_on_receive", "posts_first",
                                         "watch_receive"]},
    "workers.client": {"BrokerClient": ["_dispatch", "send"]},
    "broker.core": {"Broker": ["handle"]},
    "workers.gpu_staging": {"StepLayers": ["gathered", "follow"]},
    "workers.transports.tcp": {"TcpSender": ["_send", "_checkout"]},
    "workers.transports.tcp_receiver": {"TcpReceiver": ["expect", "_read_header", "_receive"]},
    "workers.transports.cuda_ipc": {
        "IpcCommunicator": ["post_blocks", "send_blocks", "_posted", "_publish_layers", "_wait_room", "_descriptor",
                            "_layers_of", "_send_stream", "send_ready", "next_receive_takes_blocks",
                            "next_block_receive"],
        "_BlockSend": ["launch"], "_BlockCopier": ["__call__"]},
    "workers.transports.cuda_driver": {"CudaDriver": ["make_current", "wait_value", "write_value", "copy"]},
    "workers.transports.ipc_mailbox": {"Mailbox": ["post", "take", "consume"]},
}

Event = tuple[float, str, str, "str | None", float]  # when, thread, "E:"/"X:"/"R:" + name, transfer, CPU


# -- in each traced process -----------------------------------------------------------------


class _Recorder:
    def __init__(self, out: Path) -> None:
        self.out = out
        self.events: list[Event] = []

    def note(self, kind: str, name: str, transfer: str | None) -> None:
        self.events.append((time.monotonic(), threading.current_thread().name, kind + name, transfer,
                            time.thread_time()))

    def dump(self) -> None:
        if self.events:
            path = self.out / f"{os.getpid()}.json"
            path.write_text(json.dumps({"argv": sys.argv, "events": self.events}))


def _transfer_of(at: int | None, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """The transfer a call concerns: its `transfer_id` (or `tid`) argument (at `at`), or a
    message's or a load's `transfer_id`, with its kind."""
    tid = kwargs.get("transfer_id", args[at] if at is not None and at < len(args) else None)
    if isinstance(tid, str):
        return tid
    for arg in args[1:]:
        tid = getattr(arg, "transfer_id", None)
        if isinstance(tid, str):
            return f"{tid} {type(arg).__name__}"
    return None


def _wrap(rec: _Recorder, name: str, fn: Any) -> Any:
    params = list(inspect.signature(fn).parameters)
    at = next((params.index(n) for n in ("transfer_id", "tid") if n in params), None)
    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def traced_async(*args: Any, **kwargs: Any) -> Any:
            tid = _transfer_of(at, args, kwargs)
            rec.note("E:", name, tid)
            try:
                return await fn(*args, **kwargs)
            finally:
                rec.note("X:", name, tid)
        return traced_async

    @functools.wraps(fn)
    def traced(*args: Any, **kwargs: Any) -> Any:
        tid = _transfer_of(at, args, kwargs)
        rec.note("E:", name, tid)
        try:
            result = fn(*args, **kwargs)
        finally:
            rec.note("X:", name, tid)
        if name == "ConnectorWorker.get_finished" and result and result[1]:  # what it reported
            rec.note("R:", name, ",".join(sorted(result[1])))
        return result
    return traced


def _patch(rec: _Recorder, module: Any) -> None:
    for cls_name, methods in TARGETS[module.__name__].items():
        cls = getattr(module, cls_name, None)
        for method in methods:
            fn = None if cls is None else cls.__dict__.get(method)
            if fn is None:
                print(f"call_trace: {module.__name__}.{cls_name}.{method} is gone; update TARGETS", file=sys.stderr)
                continue
            setattr(cls, method, _wrap(rec, f"{cls_name}.{method}", fn))


class _Finder(importlib.abc.MetaPathFinder):
    """Patches a target module right after it is executed, wherever it is imported from."""

    def __init__(self, rec: _Recorder) -> None:
        self.rec = rec

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in TARGETS:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            execute(module)
            _patch(self.rec, module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install() -> None:
    """Called by the run's `sitecustomize` in each process."""
    rec = _Recorder(Path(os.environ[ENV]))
    sys.meta_path.insert(0, _Finder(rec))
    atexit.register(rec.dump)


# -- the run and its reports ----------------------------------------------------------------


def run(out: Path, command: list[str]) -> int:
    out.mkdir(parents=True, exist_ok=True)
    site = out / "site"
    site.mkdir(exist_ok=True)
    bench = Path(__file__).resolve().parent
    (site / "sitecustomize.py").write_text(
        f"import sys\nsys.path.insert(0, {str(bench)!r})\nimport call_trace\ncall_trace.install()\n")
    env = dict(os.environ, **{ENV: str(out.resolve())})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH", "")) if p)
    return subprocess.run([sys.executable, *command], env=env, check=False).returncode


def _load(out: Path) -> dict[str, list[Event]]:
    """Each side's events: the process that saved is P, the one that got finished loads D,
    the one that handled messages the broker (B; none when it did not exit cleanly)."""
    sides: dict[str, list[Event]] = {"P": [], "D": [], "B": []}
    for path in sorted(out.glob("*.json")):
        events = [tuple(e) for e in json.loads(path.read_text())["events"]]
        names = {e[2] for e in events}
        if "E:ConnectorWorker.save_kv_layer" in names:
            sides["P"] = events  # type: ignore[assignment]
        elif "R:ConnectorWorker.get_finished" in names:
            sides["D"] = events  # type: ignore[assignment]
        elif "E:Broker.handle" in names:
            sides["B"] = events  # type: ignore[assignment]
    if not sides["P"] or not sides["D"]:
        raise SystemExit(f"{out}: no P and D traces (a process saved, another reported loads)")
    return sides


def _requests(sides: dict[str, list[Event]]) -> list[list[tuple[float, str, Event]]]:
    """Per request (each P bind), every event of each side until the next bind, with its
    time from the bind (ms) and the side that recorded it."""
    binds = [e[0] for e in sides["P"] if e[2] == "E:ConnectorWorker.bind"]
    merged = sorted(((e[0], side, e) for side, events in sides.items() for e in events), key=lambda x: x[0])
    out = []
    for i, t0 in enumerate(binds):
        t1 = binds[i + 1] if i + 1 < len(binds) else float("inf")
        # D binds every engine step: only P's bind opens a request.
        out.append([((t - t0) * 1e3, side, e) for t, side, e in merged
                    if t0 - 2e-3 <= t < t1 and not (side == "D" and e[2].endswith("ConnectorWorker.bind"))])
    return out


def legs(out: Path, skip: int) -> None:
    """Each event's median time from P's bind, over the requests after the first `skip`
    (repeated events keyed by their count in the request), and when D reported each
    request against its last landing."""
    requests = _requests(_load(out))[skip:]
    at: dict[str, list[float]] = defaultdict(list)
    landing_to_report = []
    for request in requests:
        seen: Counter[str] = Counter()
        landed, reported = None, None
        for ms, side, (_, thread, name, tid, _cpu) in request:
            kind = tid.split(" ")[-1] if tid and " " in tid else ""
            key = f"{side} {thread[:16]:16} {name} {kind}".rstrip()
            seen[key] += 1
            at[f"{key} #{seen[key]}"].append(ms)
            if side == "D" and name in ("X:ConsumerSide._landed_in_place", "X:ConsumerSide._received"):
                landed = ms
            if side == "D" and name.startswith("R:") and reported is None:
                reported = ms
        if landed is not None and reported is not None:
            landing_to_report.append(reported - landed)
    n = len(requests)
    last: dict[str, int] = {}  # a repeated event (a save per layer, an engine step) shows its first two and last
    for key in at:
        base, count = key.rsplit(" #", 1)
        last[base] = max(last.get(base, 0), int(count))
    for ms, key in sorted((statistics.median(v), k) for k, v in at.items() if len(v) >= n // 2):
        base, count = key.rsplit(" #", 1)
        if int(count) in (1, 2, last[base]):
            print(f"{ms:9.3f}  {key}")
    if landing_to_report:
        print(f"D: last landing to reported, median {statistics.median(landing_to_report):.3f} ms "
              f"(min {min(landing_to_report):.3f}, max {max(landing_to_report):.3f})")


def show(out: Path, index: int, lo: float, hi: float) -> None:
    """Every event of one request, in order, with each thread's CPU time (ms) at it."""
    for ms, side, (_, thread, name, tid, cpu) in _requests(_load(out))[index]:
        if lo <= ms <= hi:
            print(f"{ms:9.3f}  {side} {thread[:16]:16} {name} {tid or ''}  cpu {cpu * 1e3:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    r = sub.add_parser("run", help="run a command with every process traced into DIR")
    r.add_argument("dir", type=Path)
    r.add_argument("command", nargs=argparse.REMAINDER, help="after --: the script and its arguments")
    lg = sub.add_parser("legs", help="each event's median time from P's bind")
    lg.add_argument("dir", type=Path)
    lg.add_argument("--skip", type=int, default=3, help="warm-up requests left out (default 3)")
    sh = sub.add_parser("show", help="one request's events in order")
    sh.add_argument("dir", type=Path)
    sh.add_argument("index", type=int)
    sh.add_argument("--from", dest="lo", type=float, default=-1e9, help="ms from P's bind")
    sh.add_argument("--to", dest="hi", type=float, default=1e9)
    args = ap.parse_args()
    if args.what == "run":
        command = args.command[1:] if args.command[:1] == ["--"] else args.command
        if not command:
            ap.error("run needs a command after --")
        sys.exit(run(args.dir, command))
    if args.what == "legs":
        legs(args.dir, args.skip)
    else:
        show(args.dir, args.index, args.lo, args.hi)


if __name__ == "__main__":
    main()
