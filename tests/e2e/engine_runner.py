"""Run one vLLM engine in a child process and drive it over JSON lines.

Server (the child):

    PYTHONPATH=. python tests/e2e/engine_runner.py '<config JSON>'
    PYTHONPATH=. python tests/e2e/engine_runner.py @config.json

Config keys (all but "model" optional):

    model                  checkpoint directory
    kv_transfer_config     dict for vllm.config.KVTransferConfig, or null
    enable_prefix_caching  bool (default: vLLM's default)
    block_size             32;  max_model_len 256;  seed 0;  dtype "bfloat16"
    max_num_seqs           engine default unless given
    multiprocessing        false (VLLM_ENABLE_V1_MULTIPROCESSING=0, in-process)
    engine_kwargs          extra keyword arguments for vllm.LLM

Protocol: one JSON object per line on stdin, one per line on stdout. Only
protocol lines go to stdout; everything the engine prints goes to stderr.

    -> {"id": 7, "prompts": [[1, 2, ...], ...], "max_tokens": 8,
        "kv_transfer_params": [{...} | null, ...] | null,
        "request_ids": [...] (optional), "ignore_eos": true (default)}
    <- {"id": 7, "outputs": [[...], ...], "finish_reasons": [...],
        "kv_transfer_params": [...], "num_cached_tokens": [...],
        "request_ids": [...], "elapsed_s": 0.12}
    -> {"id": 8, "cmd": "ping" | "info" | "trace" | "shutdown"}
    <- {"id": 8, "ok": true, ...}
    any failure: {"id": ..., "error": "...", "traceback": "..."}

The first line the child writes is {"event": "ready", ...} (with the startup
time and the engine's resolved config) or {"event": "fatal", ...}.

Several generate messages may be in flight: the child keeps stepping the
engine while it reads new lines, and answers each message when all of its
prompts are finished (answers may come out of order; match them by "id").
It also keeps stepping while the scheduler still has work of its own
(finished requests whose blocks a connector holds, requests waiting for
remote KV), as vLLM's engine-core busy loop would.

Client (the parent): `EngineProcess` starts the child, sends messages and
waits for answers; it imports neither torch nor vLLM.

Tracing: `kv_connector: "TracingExampleConnector"` with
`kv_connector_module_path: "engine_runner"` (this file's directory is put on
the child's path) runs vLLM's ExampleConnector and records every connector
hook, with process, thread and tensor shapes, as JSON lines in
`kv_connector_extra_config["trace_path"]`; `{"cmd": "trace"}` returns them.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from demo.servers import BASE_ENV, yielding

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
DEFAULTS: dict[str, Any] = {
    "kv_transfer_config": None,
    "enable_prefix_caching": None,
    "block_size": 32,
    "max_model_len": 256,
    "seed": 0,
    "dtype": "bfloat16",
    "max_num_seqs": None,
    "multiprocessing": False,
    "engine_kwargs": {},
}


# --------------------------------------------------------------------------
# Client side
# --------------------------------------------------------------------------


class EngineError(RuntimeError):
    """The engine process reported an error or died."""


class EngineProcess:
    """One engine child process, driven from the parent over JSON lines."""

    def __init__(
        self,
        config: dict[str, Any],
        *,
        name: str = "engine",
        log_path: str | os.PathLike[str] | None = None,
        env: dict[str, str] | None = None,
        python: str = sys.executable,
    ) -> None:
        self.config = config
        self.name = name
        self.log_path = Path(log_path) if log_path else None
        self.env = env or {}
        self.python = python
        self.proc: subprocess.Popen[bytes] | None = None
        self.ready: dict[str, Any] | None = None
        self.start_wall_s: float | None = None
        self._next_id = 0
        self._lock = threading.Lock()
        self._answers: dict[Any, dict[str, Any]] = {}
        self._cond = threading.Condition(self._lock)
        self._events: queue.Queue[dict[str, Any]] = queue.Queue()
        self._eof = False
        self._log_file = None

    # -- lifecycle ---------------------------------------------------------

    def start(self, timeout: float = 180.0) -> dict[str, Any]:
        """Start the child and wait for its ready line; returns it."""
        env = dict(os.environ)
        env.update(BASE_ENV)
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = (
            "1" if self.config.get("multiprocessing") else "0"
        )
        env.update(self.env)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(HERE), str(ROOT), env.get("PYTHONPATH", "")) if p
        )
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log_file = open(self.log_path, "wb")  # noqa: SIM115 (lives with the child)
        t0 = time.monotonic()
        self.proc = subprocess.Popen(
            yielding([self.python, str(HERE / "engine_runner.py"), json.dumps(self.config)]),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log_file if self._log_file else subprocess.DEVNULL,
            env=env,
            cwd=str(HERE),
            # Its own process group: vLLM's engine-core and worker processes (when the
            # engine runs multiprocess) are ended with it, never left behind.
            start_new_session=True,
        )
        threading.Thread(
            target=self._read_loop, name=f"{self.name}-reader", daemon=True
        ).start()
        try:
            event = self._events.get(timeout=timeout)
        except queue.Empty:
            self.kill()
            raise EngineError(f"{self.name}: not ready in {timeout}s{self._log_tail()}")
        if event.get("event") != "ready":
            self.kill()
            raise EngineError(
                f"{self.name}: failed to start: {event.get('error')}\n"
                f"{event.get('traceback', '')}{self._log_tail()}"
            )
        self.start_wall_s = time.monotonic() - t0
        self.ready = event
        return event

    def close(self, timeout: float = 30.0) -> None:
        """Ask the child to exit; kill it if it does not."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            with contextlib.suppress(EngineError, OSError):
                self.request({"cmd": "shutdown"}, timeout=timeout)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._end_group()
        self._close_files()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._end_group()
        self._close_files()

    def _end_group(self) -> None:
        """End what the child started in its process group (vLLM's engine-core/workers)."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)

    def _close_files(self) -> None:
        if self.proc is not None and self.proc.stdin and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    # -- messages ----------------------------------------------------------

    def submit(self, msg: dict[str, Any]) -> Any:
        """Send one message without waiting; returns its id."""
        assert self.proc is not None and self.proc.stdin is not None, "not started"
        msg = dict(msg)
        with self._lock:
            if "id" not in msg:
                self._next_id += 1
                msg["id"] = f"{self.name}-{self._next_id}"
        line = (json.dumps(msg) + "\n").encode()
        try:
            self.proc.stdin.write(line)
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError) as e:
            raise EngineError(f"{self.name}: process is gone ({e}){self._log_tail()}")
        return msg["id"]

    def result(self, msg_id: Any, timeout: float = 120.0) -> dict[str, Any]:
        """Wait for the answer to `msg_id`; raise EngineError on an error."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while msg_id not in self._answers:
                left = deadline - time.monotonic()
                if self._eof:
                    raise EngineError(
                        f"{self.name}: exited (rc={self.proc.poll() if self.proc else None})"
                        f" before answering {msg_id}{self._log_tail()}"
                    )
                if left <= 0:
                    raise EngineError(
                        f"{self.name}: no answer to {msg_id} in {timeout}s"
                    )
                self._cond.wait(min(left, 1.0))
            answer = self._answers.pop(msg_id)
        if "error" in answer:
            raise EngineError(
                f"{self.name}: {answer['error']}\n{answer.get('traceback', '')}"
            )
        return answer

    def request(self, msg: dict[str, Any], timeout: float = 120.0) -> dict[str, Any]:
        return self.result(self.submit(msg), timeout=timeout)

    def generate(
        self,
        prompts: list[list[int]],
        max_tokens: int,
        kv_transfer_params: list[dict[str, Any] | None] | None = None,
        timeout: float = 120.0,
    ) -> dict[str, Any]:
        return self.request(
            {
                "prompts": prompts,
                "max_tokens": max_tokens,
                "kv_transfer_params": kv_transfer_params,
            },
            timeout=timeout,
        )

    def trace(self) -> list[dict[str, Any]]:
        return self.request({"cmd": "trace"})["trace"]

    # -- internals ---------------------------------------------------------

    def _read_loop(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for raw in self.proc.stdout:
            try:
                msg = json.loads(raw)
            except ValueError:
                continue  # not ours; the child keeps stdout clean, but be lenient
            if "event" in msg:
                self._events.put(msg)
                continue
            with self._cond:
                self._answers[msg.get("id")] = msg
                self._cond.notify_all()
        with self._cond:
            self._eof = True
            self._cond.notify_all()
        self._events.put({"event": "eof", "error": "process exited"})

    def _log_tail(self, n: int = 4000) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        data = self.log_path.read_bytes()[-n:].decode(errors="replace")
        return f"\n--- {self.name} log tail ({self.log_path}) ---\n{data}"


# --------------------------------------------------------------------------
# Tracing connector (runs in the engine; built lazily so the client stays light)
# --------------------------------------------------------------------------


def _shape_info(t: Any) -> dict[str, Any]:
    return {
        "shape": list(t.shape),
        "stride": list(t.stride()),
        "dtype": str(t.dtype).removeprefix("torch."),
        "device": str(t.device),
        "contiguous": bool(t.is_contiguous()),
        "data_ptr": int(t.data_ptr()),
        "storage_nbytes": int(t.untyped_storage().nbytes()),
    }


def _build_tracing_connector() -> type:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
        ExampleConnector,
    )

    class TracingExampleConnector(ExampleConnector):
        """vLLM's ExampleConnector, recording each hook call as a JSON line."""

        def __init__(self, vllm_config, role, kv_cache_config):
            super().__init__(vllm_config, role, kv_cache_config)
            self._trace_path = self._kv_transfer_config.get_from_extra_config(
                "trace_path", None
            )
            self._saves_seen: set[str] = set()
            self._emit(
                "__init__",
                kv_role=self._kv_transfer_config.kv_role,
                block_size=self._block_size,
                kv_cache_groups=(
                    len(kv_cache_config.kv_cache_groups) if kv_cache_config else None
                ),
                num_blocks=getattr(kv_cache_config, "num_blocks", None),
                prefix_caching=vllm_config.cache_config.enable_prefix_caching,
            )

        def _emit(self, hook: str, **fields: Any) -> None:
            if not self._trace_path:
                return
            rec = {
                "hook": hook,
                "role": "scheduler"
                if self._role == KVConnectorRole.SCHEDULER
                else "worker",
                "pid": os.getpid(),
                "thread": threading.current_thread().name,
                "t": time.time(),
                **fields,
            }
            with open(self._trace_path, "a") as f:
                f.write(json.dumps(rec, default=str) + "\n")

        # scheduler side
        def get_num_new_matched_tokens(self, request, num_computed_tokens):
            ret = super().get_num_new_matched_tokens(request, num_computed_tokens)
            self._emit(
                "get_num_new_matched_tokens",
                req_id=request.request_id,
                num_prompt_tokens=request.num_prompt_tokens,
                num_computed_tokens=num_computed_tokens,
                kv_transfer_params=request.kv_transfer_params,
                ret=list(ret),
            )
            return ret

        def update_state_after_alloc(self, request, blocks, num_external_tokens):
            self._emit(
                "update_state_after_alloc",
                req_id=request.request_id,
                block_ids=[list(g) for g in blocks.get_block_ids()],
                num_external_tokens=num_external_tokens,
            )
            return super().update_state_after_alloc(
                request, blocks, num_external_tokens
            )

        def build_connector_meta(self, scheduler_output):
            meta = super().build_connector_meta(scheduler_output)
            so = scheduler_output
            self._emit(
                "build_connector_meta",
                new_reqs=[
                    {
                        "req_id": r.req_id,
                        "block_ids": [list(g) for g in r.block_ids],
                        "num_computed_tokens": r.num_computed_tokens,
                        "num_prompt_tokens": len(r.prompt_token_ids or []),
                    }
                    for r in so.scheduled_new_reqs
                ],
                cached_req_ids=list(so.scheduled_cached_reqs.req_ids),
                num_scheduled_tokens=dict(so.num_scheduled_tokens),
                finished_req_ids=sorted(so.finished_req_ids),
                meta=[
                    {"is_store": r.is_store, "num_tokens": int(r.slot_mapping.numel())}
                    for r in meta.requests
                ],
            )
            return meta

        def update_connector_output(self, connector_output):
            self._emit(
                "update_connector_output",
                finished_sending=sorted(connector_output.finished_sending or ()),
                finished_recving=sorted(connector_output.finished_recving or ()),
                invalid_block_ids=sorted(connector_output.invalid_block_ids),
            )
            return super().update_connector_output(connector_output)

        def request_finished(self, request, block_ids):
            ret = super().request_finished(request, block_ids)
            self._emit(
                "request_finished",
                req_id=request.request_id,
                block_ids=list(block_ids),
                status=str(request.status),
                num_computed_tokens=request.num_computed_tokens,
                ret=list(ret),
            )
            return ret

        # worker side
        def register_kv_caches(self, kv_caches):
            import torch

            ptrs = {n: t.untyped_storage().data_ptr() for n, t in kv_caches.items()}
            self._emit(
                "register_kv_caches",
                layers={n: _shape_info(t) for n, t in kv_caches.items()},
                shared_storage=len(set(ptrs.values())) < len(ptrs),
                torch_version=torch.__version__,
            )
            return super().register_kv_caches(kv_caches)

        def bind_connector_metadata(self, connector_metadata):
            self._emit(
                "bind_connector_metadata",
                meta=[
                    {"is_store": r.is_store, "num_tokens": int(r.slot_mapping.numel())}
                    for r in connector_metadata.requests
                ],
            )
            return super().bind_connector_metadata(connector_metadata)

        def clear_connector_metadata(self):
            self._emit("clear_connector_metadata")
            return super().clear_connector_metadata()

        def start_load_kv(self, forward_context, **kwargs):
            am = forward_context.attn_metadata
            self._emit(
                "start_load_kv",
                attn_metadata=type(am).__name__,
                attn_metadata_layers=sorted(am) if isinstance(am, dict) else None,
                loads=[
                    int(r.slot_mapping.numel())
                    for r in self._get_connector_metadata().requests
                    if not r.is_store
                ],
            )
            return super().start_load_kv(forward_context, **kwargs)

        def wait_for_layer_load(self, layer_name):
            self._emit("wait_for_layer_load", layer=layer_name)
            return super().wait_for_layer_load(layer_name)

        def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
            self._emit(
                "save_kv_layer",
                layer=layer_name,
                kv_layer=_shape_info(kv_layer),
                attn_metadata=type(attn_metadata).__name__,
                slot_mapping_len=(
                    int(attn_metadata.slot_mapping.numel())
                    if hasattr(attn_metadata, "slot_mapping")
                    else None
                ),
            )
            return super().save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

        def wait_for_save(self):
            self._emit("wait_for_save")
            return super().wait_for_save()

        def get_finished(self, finished_req_ids):
            ret = super().get_finished(finished_req_ids)
            self._emit(
                "get_finished",
                finished_req_ids=sorted(finished_req_ids),
                ret=[sorted(x) if x else x for x in ret],
            )
            return ret

        def get_block_ids_with_load_errors(self):
            ret = super().get_block_ids_with_load_errors()
            self._emit("get_block_ids_with_load_errors", ret=sorted(ret))
            return ret

    return TracingExampleConnector


def __getattr__(name: str) -> Any:
    # vLLM's factory does getattr(import_module(path), kv_connector).
    if name == "TracingExampleConnector":
        cls = _build_tracing_connector()
        globals()[name] = cls
        return cls
    raise AttributeError(name)


# --------------------------------------------------------------------------
# Server side
# --------------------------------------------------------------------------


class _Server:
    def __init__(self, config: dict[str, Any], out) -> None:
        self.config = {**DEFAULTS, **config}
        self.out = out
        self.llm = None
        self.engine = None
        # message id -> {"rids": [...], "done": {rid: RequestOutput}, "t0": float}
        self.groups: dict[Any, dict[str, Any]] = {}
        self.rid_to_group: dict[str, Any] = {}
        self.n_msgs = 0
        self.buf = b""
        self.stdin_open = True
        self.stop = False

    def send(self, obj: dict[str, Any]) -> None:
        self.out.write(json.dumps(obj, default=str) + "\n")
        self.out.flush()

    def start(self) -> None:
        t0 = time.monotonic()
        from vllm import LLM
        from vllm.config import KVTransferConfig

        t_import = time.monotonic() - t0
        cfg = self.config
        kwargs: dict[str, Any] = {
            "model": cfg["model"],
            "skip_tokenizer_init": True,
            "enforce_eager": True,
            "max_model_len": cfg["max_model_len"],
            "dtype": cfg["dtype"],
            "seed": cfg["seed"],
            "block_size": cfg["block_size"],
        }
        if cfg["kv_transfer_config"] is not None:
            kwargs["kv_transfer_config"] = KVTransferConfig(**cfg["kv_transfer_config"])
        if cfg["enable_prefix_caching"] is not None:
            kwargs["enable_prefix_caching"] = cfg["enable_prefix_caching"]
        if cfg["max_num_seqs"] is not None:
            kwargs["max_num_seqs"] = cfg["max_num_seqs"]
        kwargs.update(cfg["engine_kwargs"])
        self.llm = LLM(**kwargs)
        self.engine = self.llm.llm_engine
        vc = self.engine.vllm_config
        import vllm

        self.send(
            {
                "event": "ready",
                "pid": os.getpid(),
                "startup_s": round(time.monotonic() - t0, 3),
                "import_s": round(t_import, 3),
                "vllm_version": vllm.__version__,
                "enable_prefix_caching": vc.cache_config.enable_prefix_caching,
                "block_size": vc.cache_config.block_size,
                "num_gpu_blocks": vc.cache_config.num_gpu_blocks,
                "max_num_batched_tokens": vc.scheduler_config.max_num_batched_tokens,
                "chunked_prefill": vc.scheduler_config.enable_chunked_prefill,
                "kv_transfer_config": (
                    None
                    if vc.kv_transfer_config is None
                    or vc.kv_transfer_config.kv_connector is None
                    else {
                        "kv_connector": vc.kv_transfer_config.kv_connector,
                        "kv_role": vc.kv_transfer_config.kv_role,
                        "kv_load_failure_policy": vc.kv_transfer_config.kv_load_failure_policy,
                        "engine_id": vc.kv_transfer_config.engine_id,
                    }
                ),
                "disable_hybrid_kv_cache_manager": vc.scheduler_config.disable_hybrid_kv_cache_manager,
            }
        )

    # -- stdin -------------------------------------------------------------

    def read_lines(self, timeout: float | None) -> list[str]:
        """Lines available on stdin, waiting up to `timeout` seconds (None:
        forever) for the first one."""
        lines: list[str] = []
        while self.stdin_open:
            r, _, _ = select.select([0], [], [], 0 if lines else timeout)
            if not r:
                break
            chunk = os.read(0, 1 << 20)
            if not chunk:
                self.stdin_open = False
                break
            self.buf += chunk
            while b"\n" in self.buf:
                line, self.buf = self.buf.split(b"\n", 1)
                if line.strip():
                    lines.append(line.decode())
        return lines

    def engine_has_work(self) -> bool:
        """Whether the in-process scheduler still wants steps although none
        of our requests is unfinished (finished requests whose blocks a
        connector still holds, requests waiting for remote KV, ...)."""
        try:
            core = self.engine.engine_core.engine_core  # InprocClient -> EngineCore
        except AttributeError:
            return False  # engine core in another process: it steps itself
        return bool(core.scheduler.has_requests())

    # -- messages ----------------------------------------------------------

    def handle(self, line: str) -> None:
        msg_id = None
        try:
            msg = json.loads(line)
            if not isinstance(msg, dict):
                raise TypeError("message must be a JSON object")
            self.n_msgs += 1
            msg_id = msg.get("id", self.n_msgs)
            cmd = msg.get("cmd", "generate")
            if cmd == "generate":
                self.add_generate(msg_id, msg)
            elif cmd == "ping":
                self.send({"id": msg_id, "ok": True, "pid": os.getpid()})
            elif cmd == "info":
                self.send(
                    {
                        "id": msg_id,
                        "ok": True,
                        "in_flight": len(self.rid_to_group),
                        "engine_has_work": self.engine_has_work(),
                    }
                )
            elif cmd == "trace":
                self.send({"id": msg_id, "ok": True, "trace": self.read_trace()})
            elif cmd == "shutdown":
                self.send({"id": msg_id, "ok": True})
                self.stop = True
            else:
                raise ValueError(f"unknown cmd {cmd!r}")
        except Exception as e:  # noqa: BLE001 (every failure goes back as JSON)
            self.send(
                {
                    "id": msg_id,
                    "error": f"{type(e).__name__}: {e}",
                    "traceback": traceback.format_exc(),
                }
            )

    def read_trace(self) -> list[dict[str, Any]]:
        ktc = self.config.get("kv_transfer_config") or {}
        path = (ktc.get("kv_connector_extra_config") or {}).get("trace_path")
        if not path or not os.path.exists(path):
            return []
        with open(path) as f:
            return [json.loads(x) for x in f if x.strip()]

    def add_generate(self, msg_id: Any, msg: dict[str, Any]) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if msg_id in self.groups:
            raise ValueError(f"duplicate message id {msg_id!r}")
        prompts = msg["prompts"]
        if not isinstance(prompts, list) or not all(
            isinstance(p, list) and p and all(isinstance(t, int) for t in p)
            for p in prompts
        ):
            raise ValueError("prompts must be a list of non-empty lists of token ids")
        max_tokens = int(msg["max_tokens"])
        ktp = msg.get("kv_transfer_params")
        if ktp is None:
            ktp = [None] * len(prompts)
        if not isinstance(ktp, list) or len(ktp) != len(prompts):
            raise ValueError("kv_transfer_params must be null or one entry per prompt")
        rids = msg.get("request_ids") or [f"{msg_id}-{i}" for i in range(len(prompts))]
        rids = [str(r) for r in rids]
        if len(rids) != len(prompts) or any(r in self.rid_to_group for r in rids):
            raise ValueError("request_ids must be unique, one per prompt")
        added: list[str] = []
        try:
            for rid, ids, params in zip(rids, prompts, ktp):
                extra = {"kv_transfer_params": params} if params is not None else None
                sp = SamplingParams(
                    temperature=0.0,
                    max_tokens=max_tokens,
                    ignore_eos=bool(msg.get("ignore_eos", True)),
                    detokenize=False,
                    extra_args=extra,
                )
                self.engine.add_request(rid, TokensPrompt(prompt_token_ids=ids), sp)
                added.append(rid)
                self.rid_to_group[rid] = msg_id
        except Exception:
            if added:
                self.engine.abort_request(added)
            for rid in added:
                self.rid_to_group.pop(rid, None)
            raise
        self.groups[msg_id] = {"rids": rids, "done": {}, "t0": time.monotonic()}

    def on_output(self, out: Any) -> None:
        if not out.finished:
            return
        msg_id = self.rid_to_group.pop(out.request_id, None)
        if msg_id is None:
            return
        group = self.groups[msg_id]
        group["done"][out.request_id] = out
        if len(group["done"]) < len(group["rids"]):
            return
        del self.groups[msg_id]
        outs = [group["done"][r] for r in group["rids"]]
        self.send(
            {
                "id": msg_id,
                "outputs": [list(o.outputs[0].token_ids) for o in outs],
                "finish_reasons": [o.outputs[0].finish_reason for o in outs],
                "kv_transfer_params": [o.kv_transfer_params for o in outs],
                "num_cached_tokens": [o.num_cached_tokens for o in outs],
                "request_ids": group["rids"],
                "elapsed_s": round(time.monotonic() - group["t0"], 4),
            }
        )

    def fail_all(self, err: dict[str, Any]) -> None:
        for msg_id in list(self.groups):
            self.send({"id": msg_id, **err})
        self.groups.clear()
        self.rid_to_group.clear()

    def run(self) -> int:
        while not self.stop:
            ours = bool(self.rid_to_group)
            background = not ours and self.engine_has_work()
            if not ours and not background and not self.stdin_open:
                break
            # Block on stdin only when idle; poll while our requests run; nap
            # briefly while only the engine's own bookkeeping wants steps.
            timeout = 0.0 if ours else (0.005 if background else None)
            for line in self.read_lines(timeout):
                self.handle(line)
            if self.stop:
                break
            if self.rid_to_group or background:
                try:
                    for out in self.engine.step():
                        self.on_output(out)
                except Exception as e:  # noqa: BLE001 (reported, then exit)
                    err = {
                        "error": f"engine step failed: {type(e).__name__}: {e}",
                        "traceback": traceback.format_exc(),
                    }
                    print(err["traceback"], file=sys.stderr, flush=True)
                    self.fail_all(err)
                    self.send({"event": "fatal", **err})
                    return 1
        return 0


def _main(argv: list[str]) -> int:
    # Keep stdout for the protocol only: vLLM logs (and any print) go to stderr.
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        if len(argv) != 2:
            raise SystemExit("usage: engine_runner.py '<config JSON>' | @config.json")
        raw = argv[1]
        if raw.startswith("@"):
            raw = Path(raw[1:]).read_text()
        config = json.loads(raw)
        os.environ.setdefault(
            "VLLM_ENABLE_V1_MULTIPROCESSING",
            "1" if config.get("multiprocessing") else "0",
        )
        for k, v in BASE_ENV.items():
            os.environ.setdefault(k, v)
        if str(HERE) not in sys.path:
            sys.path.insert(0, str(HERE))
        server = _Server(config, proto)
        server.start()
    except BaseException as e:  # noqa: BLE001 (reported as the first line)
        proto.write(
            json.dumps(
                {
                    "event": "fatal",
                    "error": f"{type(e).__name__}: {e}",
                    "traceback": traceback.format_exc(),
                }
            )
            + "\n"
        )
        proto.flush()
        return 1
    rc = server.run()
    proto.flush()
    # Skip interpreter teardown races in engine threads; the answer is out.
    sys.stderr.flush()
    os._exit(rc)


if __name__ == "__main__":
    sys.exit(_main(sys.argv))
