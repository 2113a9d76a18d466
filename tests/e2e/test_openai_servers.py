"""KVBrokerConnector behind real vLLM OpenAI API servers on the CPU.

A broker and three `vllm.entrypoints.openai.api_server` processes, shared by the module
(each takes about a minute to become healthy):

    plain      no connector: the reference outputs
    prefill-0  kv_producer; it sends the KV of transfers whose id starts with "corrupt-"
               negated (`tests.e2e.fault_connectors.NegatingConnector`)
    decode-0   kv_consumer, kv_load_failure_policy "recompute"

Each request goes out as README's "What the proxy sends" describes: the same prompt,
at the same time, to prefill-0 with max_tokens 1 and to decode-0 with the full request,
both carrying one transfer_id in `kv_transfer_params` over HTTP. With "recompute", a D
that got no KV still answers the plain server's tokens, so the tests also check that D
loaded it: its connector's `transfer.loaded` lines, P's `transfer.sent` bytes, D's
usage.prompt_tokens_details.cached_tokens, and a corrupted transfer changing D's tokens.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import httpx
import pytest

from demo import summary
from demo.servers import ApiServer, api_servers, completion, kv_transfer_config
from tests.support import NEGATING, ROOT, BrokerProcess, env, wait_until

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(find_spec("vllm") is None, reason="vLLM is not installed"),
]

BLOCK = 32
MAX_TOKENS = 16
T0 = time.monotonic()


def make_prompts(lengths: list[int], salt: int) -> list[list[int]]:
    """Deterministic prompts with distinct first blocks (token ids 3..511)."""
    return [[3 + (salt * 131 + i * 37 + j * 13 + (j * j) % 7) % 509 for j in range(n)] for i, n in enumerate(lengths)]


def log_events(server: ApiServer, event: str) -> list[dict[str, Any]]:
    """The connector's JSON log lines with this event name in a server's log."""
    return summary.log_events(server.log_text().splitlines(), event)


# Events about a whole process, not one transfer, that explain a transfer's fate.
PROCESS_EVENTS = ("peer.evicted", "peer.registered", "broker.lost", "broker.reregistered", "broker.stalled")


def timeline(cluster: dict[str, Any], tids: list[str]) -> str:
    """The JSON log lines of the broker and the servers about `tids`, and the peers'
    comings and goings, in time order: what a failed assertion prints."""
    rows = []
    for path in sorted(Path(cluster["root"]).glob("*.log")):
        for line in path.read_text(errors="replace").splitlines():
            start = line.find("{")
            if start < 0 or not (any(t in line for t in tids) or any(f'"{e}"' in line for e in PROCESS_EVENTS)):
                continue
            try:
                rec = json.loads(line[start:])
            except ValueError:
                continue
            rows.append((rec.get("timestamp", ""), path.stem, rec.get("transfer_id") or rec.get("peer", ""),
                         rec.get("event"), rec.get("stalled_s") or rec.get("reason") or ""))
    return "\n".join(" ".join(map(str, row)) for row in sorted(rows))


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("openai-servers")
    # Nine vLLM processes share two cores here: a server's worker can go without CPU for
    # a few seconds, so the peers get a longer lease than the default 5 s.
    broker = BrokerProcess(root, "--peer-lease", "10")
    endpoint = broker.start()
    specs = {
        "plain": None,
        "prefill-0": {**kv_transfer_config(endpoint, "kv_producer", "prefill-0"), **NEGATING},
        "decode-0": kv_transfer_config(endpoint, "kv_consumer", "decode-0"),
        # Behind the gateway only, and killed by the last test.
        "decode-1": kv_transfer_config(endpoint, "kv_consumer", "decode-1"),
    }
    t0 = time.monotonic()
    try:
        with api_servers(tiny_model_dir, root, specs) as servers:
            print(
                f"\n[openai-servers] {len(servers)} servers healthy in {time.monotonic() - t0:.1f} s "
                f"({', '.join(f'{s.name} {s.startup_s} s' for s in servers.values())})"
            )
            yield {**servers, "broker": broker, "root": root}
    finally:
        broker.stop()
        print(f"\n[openai-servers] module wall time {time.monotonic() - T0:.1f} s (logs in {root})")


def run_pd(cluster: dict[str, Any], prompts: list[list[int]], tids: list[str]) -> dict[str, list[dict[str, Any]]]:
    """Every prompt to prefill-0 and decode-0 at once, as a proxy does, and to the plain
    server; all requests in flight together. Returns the bodies by server."""
    p, d, plain = cluster["prefill-0"], cluster["decode-0"], cluster["plain"]
    with ThreadPoolExecutor(max_workers=3 * len(prompts)) as pool:
        futures: dict[str, list[Any]] = {"prefill-0": [], "decode-0": [], "plain": []}
        for prompt, tid in zip(prompts, tids):
            futures["prefill-0"].append(
                pool.submit(completion, p, prompt, 1, {"transfer_id": tid, "decode_instance_id": d.instance_id})
            )
            futures["decode-0"].append(
                pool.submit(completion, d, prompt, MAX_TOKENS, {"transfer_id": tid, "prefill_instance_id": p.instance_id})
            )
            futures["plain"].append(pool.submit(completion, plain, prompt, MAX_TOKENS))
        return {name: [f.result() for f in fs] for name, fs in futures.items()}


def token_ids(body: dict[str, Any]) -> list[int]:
    return body["choices"][0]["token_ids"]


def cached_tokens(body: dict[str, Any]) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_decode_server_loads_kv_from_prefill_server_and_matches_plain(cluster: dict[str, Any]) -> None:
    lengths = [100, 150, 200, 129]
    prompts = make_prompts(lengths, salt=61)
    tids = [f"oai-{i}" for i in range(len(prompts))]
    t0 = time.monotonic()
    bodies = run_pd(cluster, prompts, tids)
    took = time.monotonic() - t0

    ref = [token_ids(b) for b in bodies["plain"]]
    assert all(len(r) == MAX_TOKENS for r in ref), ref
    assert [token_ids(b) for b in bodies["decode-0"]] == ref, timeline(cluster, tids)
    assert [token_ids(b)[0] for b in bodies["prefill-0"]] == [r[0] for r in ref]
    # vLLM's server hands kv_transfer_params to the connector and its answer back to the proxy.
    assert [b["kv_transfer_params"] for b in bodies["prefill-0"]] == [
        {"transfer_id": t, "prefill_instance_id": "prefill-0"} for t in tids
    ]

    d, p = cluster["decode-0"], cluster["prefill-0"]
    loaded = {r["transfer_id"]: r for r in log_events(d, "transfer.loaded")}
    assert set(tids) <= set(loaded), timeline(cluster, tids)
    assert [(loaded[t]["blocks"], loaded[t]["skipped_blocks"]) for t in tids] == [(-(-n // BLOCK), 0) for n in lengths]
    assert not [r for r in log_events(d, "transfer.load_failed") if r["transfer_id"] in tids], timeline(cluster, tids)
    # D computed none of the prompts itself: vLLM counts the whole loaded prompt as
    # cached (it recomputes only the last token), where the plain server counts none.
    assert [cached_tokens(b) for b in bodies["decode-0"]] == lengths, timeline(cluster, tids)
    assert [cached_tokens(b) for b in bodies["plain"]] == [0] * len(lengths)
    def sent() -> dict[str, int]:
        out: dict[str, int] = {}
        for r in log_events(p, "transfer.sent"):
            out[r["transfer_id"]] = out.get(r["transfer_id"], 0) + r["nbytes"]
        return out

    # P writes its line once its send's end is seen, which may come after D answered.
    wait_until(lambda: set(tids) <= set(sent()), 10, "P's transfer.sent lines")
    assert [sent().get(t) for t in tids] == [loaded[t]["nbytes"] for t in tids]
    print(f"\n[openai-servers] {len(prompts)} prompts P->D over HTTP in {took:.2f} s; cached_tokens {lengths}")


def test_corrupted_transfer_changes_decode_output(cluster: dict[str, Any]) -> None:
    """Negative control: D decodes from the KV it received (P's sends negated change its tokens)."""
    prompts = make_prompts([96, 150], salt=71)
    tids = ["corrupt-oai-0", "corrupt-oai-1"]
    bodies = run_pd(cluster, prompts, tids)
    injected = {r["transfer_id"] for r in log_events(cluster["prefill-0"], "transfer.fault_injected")}
    assert set(tids) <= injected, timeline(cluster, tids)
    loaded = {r["transfer_id"] for r in log_events(cluster["decode-0"], "transfer.loaded")}
    assert set(tids) <= loaded, timeline(cluster, tids)
    ref = [token_ids(b) for b in bodies["plain"]]
    got = [token_ids(b) for b in bodies["decode-0"]]
    assert all(a != b for a, b in zip(got, ref)), (got, ref)


def test_a_request_given_up_before_decode_had_it_frees_the_prefill_servers_kv_at_once(cluster: dict[str, Any]) -> None:
    """The proxy sent the prompt to prefill-0, naming decode-0, then gave the request up
    before decode-0 had it (its client left, decode-0 refused it). P's KV is staged and
    granted to decode-0, which holds no request for it and would keep the Prepare, and its
    room, until its load_timeout_s (30 s). `kvbroker cancel` (what the gateway sends
    itself) frees P's copy and decode-0's room at once."""
    p, d, broker = cluster["prefill-0"], cluster["decode-0"], cluster["broker"]
    (prompt,) = make_prompts([150], salt=97)
    tid = "given-up-1"
    completion(p, prompt, 1, {"transfer_id": tid, "decode_instance_id": d.instance_id})

    def granted() -> list[dict[str, Any]]:
        return [t for t in broker.status()["transfers"] if t["transfer_id"] == tid and t["state"] == "preparing"]

    wait_until(granted, 20, "P's Offer to be granted to decode-0")
    out = subprocess.run(
        [sys.executable, "-m", "broker.cli", "cancel", tid, "--broker", broker.endpoint, "--reason", "the client left"],
        capture_output=True, text=True, env=env(), cwd=ROOT, timeout=30,
    )
    assert out.returncode == 0 and out.stdout.strip() == f"{tid}: ended 1, already moving 0", out.stdout + out.stderr
    freed = wait_until(lambda: [r for r in log_events(p, "transfer.aborted") if r["transfer_id"] == tid], 10,
                       "prefill-0 to free the staged copy")
    assert freed[0]["reason"] == "the request was cancelled (the client left)", timeline(cluster, [tid])
    status = broker.status()
    assert [t for t in status["transfers"] if t["transfer_id"] == tid] == []
    assert [pool["reserved"] for pool in status["pools"] if pool["peer_id"].startswith("decode-0")] == [0]


@pytest.fixture(scope="module")
def gateway(cluster: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """`kvbroker gateway` as a real process in front of prefill-0 and decode-0."""
    root: Path = cluster["root"]
    port_file, log_path = root / "gateway.port", root / "gateway.log"
    p, d = cluster["prefill-0"], cluster["decode-0"]
    cmd = [
        sys.executable, "-m", "broker.cli", "gateway", "--broker", cluster["broker"].endpoint,
        "--port", "0", "--port-file", str(port_file), "--log-format", "json",
        "--prefill", f"prefill-0={p.base_url}", "--decode", f"decode-0={d.base_url}",
        "--decode", f"decode-1={cluster['decode-1'].base_url}",
    ]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env(), cwd=ROOT)
    try:
        def healthy() -> str:
            assert proc.poll() is None, log_path.read_text()
            if not port_file.exists():
                return ""
            url = f"http://127.0.0.1:{port_file.read_text().strip()}"
            try:  # both instances registered, as the gateway sees the broker
                r = httpx.get(f"{url}/health", timeout=5)
                return url if r.status_code == 200 and r.json().get("status") == "ok" else ""
            except httpx.HTTPError:
                return ""

        yield {"url": wait_until(healthy, 60, "the gateway to see both instances registered"), "log": log_path}
    finally:
        proc.terminate()
        assert proc.wait(timeout=15) == 0, log_path.read_text()


DECODES = ("decode-0", "decode-1")


def gateway_transfers(log: Path) -> dict[str, dict[str, Any]]:
    """The gateway's `gateway.decoded` lines by transfer_id."""
    out = {}
    for line in log.read_text().splitlines():
        if '"gateway.decoded"' in line:
            rec = json.loads(line)
            out[rec["transfer_id"]] = rec
    return out


def new_transfers(log: Path, before: set[str], n: int) -> dict[str, dict[str, Any]]:
    """The gateway's `gateway.decoded` lines not in `before`, once there are `n` of them:
    the gateway writes a request's line after relaying D's answer, so a client can hold
    the answer a moment before the line is there."""
    def seen() -> dict[str, dict[str, Any]]:
        fresh = {t: rec for t, rec in gateway_transfers(log).items() if t not in before}
        return fresh if len(fresh) >= n else {}

    return wait_until(seen, 10, f"{n} new gateway.decoded lines")


def wait_for_an_idle_view(gateway: dict[str, Any]) -> None:
    """Until the gateway's router sees no transfer on either decode instance. It ranks them
    by the broker's count of their transfers as well as by its own requests, and a status
    taken while an earlier test's transfer was in flight counts that transfer until the
    next one (a second later): a test of where requests go waits for a fresh, idle view."""
    def idle() -> bool:
        text = httpx.get(f"{gateway['url']}/metrics", timeout=5).text
        return all(f'kvbroker_gateway_{gauge}{{instance="{d}",role="decode"}} 0.0' in text
                   for gauge in ("broker_transfers", "in_flight") for d in DECODES)

    wait_until(idle, 30, "the gateway to see no transfer in flight on either decode instance")


def test_a_client_of_the_gateway_gets_the_decode_servers_answer_from_the_prefill_servers_kv(
    cluster: dict[str, Any], gateway: dict[str, Any]
) -> None:
    lengths = [120, 70, 180]
    wait_for_an_idle_view(gateway)  # the requests are to go to both decode instances
    prompts = make_prompts(lengths, salt=83)
    before = set(gateway_transfers(gateway["log"]))

    def ask(prompt: list[int]) -> dict[str, Any]:
        # A client's plain request: no kv_transfer_params, no instance names.
        body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        r = httpx.post(f"{gateway['url']}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    with ThreadPoolExecutor(max_workers=2 * len(prompts)) as pool:
        via = list(pool.map(ask, prompts))
        plain = list(pool.map(lambda q: completion(cluster["plain"], q, MAX_TOKENS), prompts))
    tids = sorted(new_transfers(gateway["log"], before, len(prompts)))
    assert len(tids) == len(prompts), timeline(cluster, tids)
    assert [token_ids(b) for b in via] == [token_ids(b) for b in plain], timeline(cluster, tids)
    # D computed none of them: every prompt's KV came from P, under the gateway's transfer ids.
    assert sorted(cached_tokens(b) for b in via) == sorted(lengths), timeline(cluster, tids)
    loaded = {r["transfer_id"] for d in DECODES for r in log_events(cluster[d], "transfer.loaded")}
    assert set(tids) <= loaded, timeline(cluster, tids)
    # The requests went to both decode instances (equals take turns).
    assert {gateway_transfers(gateway["log"])[t]["decode"] for t in tids} == set(DECODES)
    # One transfer's trace joins the gateway's hops with the broker's and the servers'.
    out = subprocess.run(
        [sys.executable, "-m", "broker.cli", "trace", tids[0], str(gateway["log"]), str(cluster["broker"].log_path),
         *(str(cluster[n].log_path) for n in ("prefill-0", *DECODES))],
        check=False, capture_output=True, text=True, env=env(), cwd=ROOT, timeout=60,
    )
    for step in ("transfer.offered", "transfer.loaded", "gateway.decoded"):
        assert step in out.stdout, out.stdout + out.stderr


def test_a_streamed_answer_through_the_gateway_matches_the_plain_servers(
    cluster: dict[str, Any], gateway: dict[str, Any]
) -> None:
    (prompt,) = make_prompts([140], salt=89)
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "stream": True, "stream_options": {"include_usage": True}}
    tokens: list[int] = []
    usage: dict[str, Any] = {}
    with httpx.stream("POST", f"{gateway['url']}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: "):])
            for choice in event.get("choices") or []:
                tokens += choice.get("token_ids") or []
            usage = event.get("usage") or usage
    assert tokens == token_ids(completion(cluster["plain"], prompt, MAX_TOKENS))
    assert usage["prompt_tokens_details"]["cached_tokens"] == len(prompt)  # loaded, not computed


def test_a_decode_server_killed_behind_the_gateway_loses_no_request_and_costs_no_second_prefill(
    cluster: dict[str, Any], gateway: dict[str, Any]
) -> None:
    """decode-1 dies (SIGKILL to the process group this test started) while the broker
    still holds its registration: the gateway's request to it is refused, goes to decode-0
    under the same transfer_id, and decode-0 loads the KV P staged once."""
    wait_for_an_idle_view(gateway)  # else both requests may go to decode-0 at once
    os.killpg(cluster["decode-1"].pid, signal.SIGKILL)
    prompts = make_prompts([110, 90], salt=97)
    before = set(gateway_transfers(gateway["log"]))

    def ask(prompt: list[int]) -> dict[str, Any]:
        r = httpx.post(f"{gateway['url']}/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True})
        assert r.status_code == 200, r.text
        return r.json()

    with ThreadPoolExecutor(max_workers=2) as pool:  # two at once: the router gives one to each decode instance
        via = list(pool.map(ask, prompts))
    done = new_transfers(gateway["log"], before, 2)
    tids = list(done)
    assert len(tids) == 2 and {done[t]["decode"] for t in tids} == {"decode-0"}
    retried = [t for t in tids if done[t]["attempt"] == 2]
    assert len(retried) == 1, timeline(cluster, tids)
    assert [token_ids(b) for b in via] == [token_ids(completion(cluster["plain"], q, MAX_TOKENS)) for q in prompts]
    assert [cached_tokens(b) for b in via] == [len(q) for q in prompts], timeline(cluster, tids)
    # P offered each prompt's KV once: the retry cost no second prefill.
    offered = [r["transfer_id"] for r in log_events(cluster["prefill-0"], "transfer.offered")]
    assert [offered.count(t) for t in tids] == [1, 1], timeline(cluster, tids)
