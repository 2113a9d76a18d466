"""KVBrokerConnector behind the P/D routers people already run: real vLLM servers on the CPU.

One broker and two `vllm.entrypoints.openai.api_server` processes, shared by the module:

    prefill-r  kv_producer; a request without kv_transfer_params is a plain vLLM run,
               which gives the reference answers (no third server on a 2-core host)
    decode-r   kv_consumer, kv_load_failure_policy "recompute", load_timeout_s 15

In front of them, a proxy written here (a real HTTP server on loopback) that follows
each protocol exactly:

    sequential  (NixlConnector's: vLLM's toy proxy, llm-d's nixlv2 sidecar, vllm-router,
                Dynamo) P first with max_tokens 1 and
                {"do_remote_decode": true, "remote_*": null}; then the full request to D
                with P's returned kv_transfer_params, unchanged.
    concurrent  (Mooncake's) a transfer_id of the proxy's own, P
                {"do_remote_decode": true, "transfer_id"} and D {"do_remote_prefill":
                true, "transfer_id", "remote_engine_id"}, both at once.

A D that recomputed would still answer right (policy "recompute"), so every test also
checks the broker's count of completed transfers (one per request) and D's
usage.prompt_tokens_details.cached_tokens (the whole prompt, i.e. loaded, not computed).
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import httpx
import pytest
from demo import summary
from demo.servers import SERVED_MODEL, ApiServer, api_servers, completion, kv_transfer_config

from tests.support import BrokerProcess, wait_until

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(find_spec("vllm") is None, reason="vLLM is not installed"),
]

MAX_TOKENS = 12
LOAD_TIMEOUT_S = 15.0
T0 = time.monotonic()

# Exactly what vLLM's toy_proxy_server.py (and the routers that copied it) send P.
NIXL_PREFILL_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def make_prompts(lengths: list[int], salt: int) -> list[list[int]]:
    """Deterministic prompts with distinct first blocks (token ids 3..511)."""
    return [[3 + (salt * 131 + i * 37 + j * 13 + (j * j) % 7) % 509 for j in range(n)] for i, n in enumerate(lengths)]


def post(url: str, body: dict[str, Any], timeout: float = 120.0) -> httpx.Response:
    return httpx.post(url + "/v1/completions", json=body, timeout=timeout)


class RouterProxy:
    """A P/D router on 127.0.0.1 speaking one protocol; records what it sent and got."""

    def __init__(self, prefill: ApiServer, decode: ApiServer, protocol: str) -> None:
        self.prefill, self.decode, self.protocol = prefill, decode, protocol
        self.exchanges: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                status, answer = proxy.route(body)
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)

    def route(self, body: dict[str, Any]) -> tuple[int, Any]:
        p_body = {**body, "max_tokens": 1, "stream": False}
        p_body.pop("stream_options", None)
        if self.protocol == "sequential":
            p_body["kv_transfer_params"] = dict(NIXL_PREFILL_PARAMS)
            p = post(self.prefill.base_url, p_body)
            if p.status_code != 200:
                return p.status_code, p.json()
            forwarded = p.json().get("kv_transfer_params")
            d = post(self.decode.base_url, {**body, "kv_transfer_params": forwarded})
            exchange = {"p_params": p_body["kv_transfer_params"], "p_answer": forwarded, "d_params": forwarded}
        else:
            tid = f"mc-{uuid.uuid4().hex}"
            p_body["kv_transfer_params"] = {"do_remote_decode": True, "transfer_id": tid}
            d_params = {"do_remote_prefill": True, "transfer_id": tid, "remote_engine_id": self.prefill.instance_id,
                        "remote_bootstrap_addr": self.prefill.base_url}
            with ThreadPoolExecutor(max_workers=2) as pool:
                pf = pool.submit(post, self.prefill.base_url, p_body)
                df = pool.submit(post, self.decode.base_url, {**body, "kv_transfer_params": d_params})
                p, d = pf.result(), df.result()
            exchange = {"p_params": p_body["kv_transfer_params"], "p_answer": p.json().get("kv_transfer_params"),
                        "d_params": d_params}
        with self._lock:
            self.exchanges.append({**exchange, "prompt": body["prompt"], "d_status": d.status_code})
        return d.status_code, d.json()


def log_events(server: ApiServer, event: str) -> list[dict[str, Any]]:
    """The connector's JSON log lines with this event name in a server's log."""
    return summary.log_events(server.log_text().splitlines(), event)


def ask(url: str, prompt: list[int], **fields: Any) -> dict[str, Any]:
    """A client's plain request (what a router receives)."""
    body = {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, **fields}
    r = post(url, body)
    assert r.status_code == 200, r.text
    return r.json()


def token_ids(body: dict[str, Any]) -> list[int]:
    return body["choices"][0]["token_ids"]


def cached_tokens(body: dict[str, Any]) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("router-protocols")
    broker = BrokerProcess(root, "--peer-lease", "10")
    endpoint = broker.start()
    specs = {
        "prefill-r": kv_transfer_config(endpoint, "kv_producer", "prefill-r"),
        "decode-r": kv_transfer_config(endpoint, "kv_consumer", "decode-r", load_timeout_s=LOAD_TIMEOUT_S),
    }
    t0 = time.monotonic()
    try:
        with api_servers(tiny_model_dir, root, specs) as servers:
            print(f"\n[router-protocols] servers healthy in {time.monotonic() - t0:.1f} s")
            yield {**servers, "broker": broker, "root": root}
    finally:
        broker.stop()
        print(f"\n[router-protocols] module wall time {time.monotonic() - T0:.1f} s (logs in {root})")


def reference(cluster: dict[str, Any], prompts: list[list[int]]) -> list[list[int]]:
    """The plain answers: the prefill server without kv_transfer_params is a plain vLLM server."""
    return [token_ids(ask(cluster["prefill-r"].base_url, q)) for q in prompts]


def completed(cluster: dict[str, Any]) -> int:
    return int(cluster["broker"].status()["counters"]["completed"])


def run_behind(cluster: dict[str, Any], protocol: str, prompts: list[list[int]]) -> tuple[list[dict[str, Any]], RouterProxy, int]:
    """Every prompt through a proxy of `protocol`, several in flight at once; (answers, proxy, completed transfers)."""
    proxy = RouterProxy(cluster["prefill-r"], cluster["decode-r"], protocol)
    before = completed(cluster)
    try:
        with ThreadPoolExecutor(max_workers=4) as pool:
            answers = list(pool.map(lambda q: ask(proxy.url, q), prompts))
        # D answered after its load's Done went out; the broker counts it as it arrives.
        moved = wait_until(lambda: (n := completed(cluster) - before) >= len(prompts) and n, 15,
                           "the broker to count the transfers")
    finally:
        proxy.close()
    return answers, proxy, moved


def check_loaded(cluster: dict[str, Any], prompts: list[list[int]], answers: list[dict[str, Any]], moved: int,
                 tids: list[str]) -> None:
    assert [token_ids(a) for a in answers] == reference(cluster, prompts)
    assert moved == len(prompts)  # one completed transfer per request: a D that recomputes fails here
    loaded = {r["transfer_id"]: r for r in log_events(cluster["decode-r"], "transfer.loaded")}
    assert set(tids) <= set(loaded)
    # A prompt D saw before is partly in its prefix cache: only the blocks after that hit move.
    for q, t in zip(prompts, tids):
        assert loaded[t]["blocks"] + loaded[t]["skipped_blocks"] == -(-len(q) // 32), loaded[t]


def test_sequential_protocol_moves_every_prompt_once_and_answers_as_a_plain_server(cluster: dict[str, Any]) -> None:
    hot = make_prompts([150], salt=5)[0]
    prompts = [*make_prompts([100, 64, 200, 129], salt=3), hot, hot, hot]  # a repeated prompt, in flight together
    answers, proxy, moved = run_behind(cluster, "sequential", prompts)
    # What P returned, and the router forwarded to D unchanged.
    got = {x["p_answer"]["transfer_id"]: x["p_answer"] for x in proxy.exchanges}
    assert len(got) == len(prompts)
    for tid, g in got.items():
        assert g == {
            "do_remote_prefill": True, "do_remote_decode": False, "transfer_id": tid,
            "prefill_instance_id": "prefill-r", "remote_engine_id": "prefill-r",
            "remote_request_id": g["remote_request_id"], "remote_block_ids": [], "remote_host": "", "remote_port": 0,
            "tp_size": 1,
            # vLLM adds P's prefix-cache hit, which D then reports as its cached_tokens.
            "remote_prefill_cached_tokens": g["remote_prefill_cached_tokens"],
        }
    # The answers come back in the order asked; the exchanges in the order they ended.
    by_prompt = {tuple(q): [] for q in prompts}
    for x in proxy.exchanges:
        by_prompt[tuple(x["prompt"])].append(x["p_answer"]["transfer_id"])
    tids = [by_prompt[tuple(q)].pop() for q in prompts]
    check_loaded(cluster, prompts, answers, moved, tids)
    assert sorted(cached_tokens(a) for a in answers) == sorted(got[t]["remote_prefill_cached_tokens"] for t in tids)


def test_concurrent_protocol_moves_every_prompt_once_and_answers_as_a_plain_server(cluster: dict[str, Any]) -> None:
    hot = make_prompts([170], salt=9)[0]
    prompts = [*make_prompts([96, 140, 33], salt=7), hot, hot]
    answers, proxy, moved = run_behind(cluster, "concurrent", prompts)
    by_prompt = {tuple(q): [] for q in prompts}
    for x in proxy.exchanges:
        by_prompt[tuple(x["prompt"])].append(x["d_params"]["transfer_id"])
    check_loaded(cluster, prompts, answers, moved, [by_prompt[tuple(q)].pop() for q in prompts])
    # D computed none of the prompts itself (vLLM counts a loaded prompt as cached).
    assert [cached_tokens(a) for a in answers] == [len(q) for q in prompts]
    # P answered Mooncake's request under the router's id.
    assert [x["p_answer"]["transfer_id"] for x in proxy.exchanges] == [x["p_params"]["transfer_id"] for x in proxy.exchanges]


def test_decode_params_without_a_usable_or_known_id_recompute_within_the_deadline(cluster: dict[str, Any]) -> None:
    d = cluster["decode-r"]
    prompts = make_prompts([90, 120, 70], salt=11)
    ref = reference(cluster, prompts)
    cases = [
        {"do_remote_prefill": True, "remote_engine_id": "prefill-r"},  # a router that dropped the id
        {"do_remote_prefill": True, "transfer_id": 12345, "remote_engine_id": "prefill-r"},
        {"do_remote_prefill": True, "transfer_id": "never-offered-1", "remote_engine_id": "prefill-r"},
    ]
    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=3) as pool:
        answers = list(pool.map(lambda a: ask(d.base_url, a[0], kv_transfer_params=a[1]), zip(prompts, cases)))
    took = time.monotonic() - t0
    assert [token_ids(a) for a in answers] == ref  # recomputed (policy "recompute")
    assert took < LOAD_TIMEOUT_S + 30
    failed = {r["reason"] for r in log_events(d, "transfer.load_failed")}
    assert any(r.startswith("do_remote_prefill came without a usable transfer_id") for r in failed), failed
    assert f"no Prepare within the load deadline of {LOAD_TIMEOUT_S:g} s" in failed, failed


MALFORMED: list[Any] = [
    {"do_remote_decode": True, "remote_block_ids": list(range(100_000)), "remote_host": "h" * 100_000,
     "unknown_key": {"nested": [1, 2, 3]}, "tp_size": "many"},
    {"transfer_id": "x" * 100_000},
    {"transfer_id": ["t"], "do_remote_prefill": "yes", "remote_engine_id": 7},
    {"do_remote_prefill": True, "transfer_id": "t" * 129, "remote_engine_id": "e" * 100_000, "grant": "g" * 100_000},
    {"do_remote_decode": 1, "do_remote_prefill": None, "remote_port": -1, "k" * 1000: "v"},
]


def test_malformed_kv_transfer_params_get_a_4xx_or_a_plain_answer_and_the_servers_live_on(cluster: dict[str, Any]) -> None:
    p, d = cluster["prefill-r"], cluster["decode-r"]
    (prompt,) = make_prompts([80], salt=13)
    (ref,) = reference(cluster, [prompt])
    body = {"model": SERVED_MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    statuses = []
    for server in (p, d):
        for params in ("a string", [1, 2], 5, *MALFORMED):
            r = post(server.base_url, {**body, "kv_transfer_params": params}, timeout=LOAD_TIMEOUT_S + 60)
            statuses.append((server.name, r.status_code))
            assert r.status_code < 500, (server.name, params if len(str(params)) < 200 else "...", r.text[:500])
            if r.status_code == 200:
                assert token_ids(r.json()) == ref
                answer = r.json().get("kv_transfer_params")
                # P returns only values it made itself, never the client's.
                assert answer is None or len(json.dumps(answer)) < 1024, server.name
            else:
                assert 400 <= r.status_code < 500
    assert {s for _, s in statuses} <= {200, 400, 422}, statuses
    assert sum(s == 200 for _, s in statuses) >= 2 * len(MALFORMED)
    # Both engines are alive and P/D still works.
    for server in (p, d):
        assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200
    answers, proxy, moved = run_behind(cluster, "sequential", [prompt])
    check_loaded(cluster, [prompt], answers, moved, [proxy.exchanges[0]["p_answer"]["transfer_id"]])
