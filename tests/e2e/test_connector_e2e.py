"""KVBrokerConnector end to end: real vLLM engines on the CPU, a real broker, TCP between them.

Every engine is its own process (`engine_runner.EngineProcess`); the engines are
shared by the whole module because each takes 10-25 s to start:

    plain      no connector: the reference outputs
    p-main     producer (prefill, max_tokens=1); it sends the KV of transfers whose id
               starts with "corrupt-" negated (`fault_connectors.NegatingConnector`)
    p-victim   producer that test (d) kills with SIGKILL
    d-main     consumer, kv_load_failure_policy "recompute"
    d-fail     consumer, kv_load_failure_policy "fail"; named only by "KVBrokerConnector"
               (the plugin entry point), engine core in its own process like `vllm serve`

Prefix caching is on everywhere. The broker runs with a short peer lease
(``--peer-lease 3 --heartbeat 0.5``) so a killed producer is evicted within seconds; not
shorter, or an engine starved for a moment on a 2-core machine loses its transfers.
Like a proxy, each test sends a prompt to a producer (max_tokens=1) and to a consumer
at the same time, both with ``kv_transfer_params={"transfer_id": ...}``; the
producer's copy also names the consumer (``decode_instance_id``), except in the test of
a proxy that names none.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest
from engine_runner import EngineProcess

from tests.support import NEGATING, BrokerProcess, wait_until

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(find_spec("vllm") is None, reason="vLLM is not installed"),
]

BLOCK = 32
MAX_TOKENS = 8
LOAD_TIMEOUT_S = 20.0
T0 = time.monotonic()


def make_prompts(lengths: list[int], salt: int) -> list[list[int]]:
    """Deterministic prompts with distinct first blocks (token ids 3..511)."""
    return [[3 + (salt * 131 + i * 37 + j * 13 + (j * j) % 7) % 509 for j in range(n)] for i, n in enumerate(lengths)]


def connector_config(broker: str, role: str, instance: str, **extra: Any) -> dict[str, Any]:
    policy = extra.pop("policy", "recompute")
    # By name alone, the connector comes from the vllm.general_plugins entry point.
    by_name = extra.pop("by_name", False)
    return {
        "kv_connector": "KVBrokerConnector",
        **({} if by_name else {"kv_connector_module_path": "connector"}),
        "kv_role": role,
        "kv_load_failure_policy": policy,
        "kv_connector_extra_config": {
            "broker": broker,
            "instance_id": instance,
            "pool_bytes": 64 << 20,
            "staging_bytes": 64 << 20,
            "load_timeout_s": LOAD_TIMEOUT_S,
            "register_timeout_s": 60,
            **extra,
        },
    }


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("connector-e2e")
    # At debug the broker also logs each Prepare it sends and Go it relays: a failed test's timeline shows them.
    broker = BrokerProcess(root, "--peer-lease", "3", "--heartbeat", "0.5", "--log-level", "debug")
    endpoint = broker.start()
    model = str(tiny_model_dir)
    specs: dict[str, dict[str, Any] | None] = {
        "plain": None,
        "p-main": {**connector_config(endpoint, "kv_producer", "p-main"), **NEGATING},
        "p-victim": connector_config(endpoint, "kv_producer", "p-victim"),
        "d-main": connector_config(endpoint, "kv_consumer", "d-main"),
        "d-fail": connector_config(endpoint, "kv_consumer", "d-fail", policy="fail", by_name=True),
    }
    # d-fail runs its engine core in a separate process, as `vllm serve` does.
    procs = {
        name: EngineProcess(
            {
                "model": model,
                "enable_prefix_caching": True,
                "kv_transfer_config": ktc,
                "multiprocessing": name == "d-fail",
            },
            name=name,
            log_path=root / f"{name}.log",
        )
        for name, ktc in specs.items()
    }
    errors: dict[str, BaseException] = {}

    def start(name: str, proc: EngineProcess) -> None:
        try:
            proc.start(timeout=300)
        except BaseException as e:  # noqa: BLE001 (re-raised below)
            errors[name] = e

    t0 = time.monotonic()
    threads = [threading.Thread(target=start, args=item, daemon=True) for item in procs.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        if errors:
            raise RuntimeError(f"engines failed to start: {errors}")
        print(f"\n[connector-e2e] {len(procs)} engines and a broker up in {time.monotonic() - t0:.1f} s")
        yield {**procs, "broker": broker, "root": root}
    finally:
        for p in procs.values():
            p.close()
        broker.stop()
        print(f"\n[connector-e2e] module wall time {time.monotonic() - T0:.1f} s (logs in {root})")


# Events about a whole process, not one transfer, that explain a transfer's fate.
PROCESS_EVENTS = (
    "peer.evicted", "peer.registered", "broker.lost", "broker.reregistered", "broker.forgot_us", "broker.stalled",
    "broker.stuck",
)


def timeline(cluster: dict[str, Any], tids: set[str]) -> str:
    """Every JSON log line of the module's engines and broker about `tids`, and each
    peer's and broker's comings and goings from the first of them on, in time order:
    what a failed assertion about a transfer's fate prints, to show where it went."""
    rows = []
    for path in sorted(Path(cluster["root"]).glob("*.log")):
        for line in path.read_text(errors="replace").splitlines():
            if line.startswith("{") and (any(t in line for t in tids) or any(f'"{e}"' in line for e in PROCESS_EVENTS)):
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                rows.append((rec.get("timestamp", ""), path.stem, rec.get("transfer_id") or rec.get("peer", ""),
                             rec.get("event"), rec.get("reason") or rec.get("error") or rec.get("detail")
                             or rec.get("where") or rec.get("stalled_s") or rec.get("silent_s") or ""))
    rows.sort()
    first = next((i for i, row in enumerate(rows) if row[2] in tids), len(rows))
    return "\n".join(" ".join(map(str, row)) for row in rows[first:])


def log_events(cluster: dict[str, Any], name: str, event: str) -> list[dict[str, Any]]:
    """The JSON log lines with this event name of one process: an engine, or "broker-N" (its Nth start)."""
    out = []
    for line in Path(cluster["root"], f"{name}.log").read_text(errors="replace").splitlines():
        if line.startswith("{") and f'"{event}"' in line:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("event") == event:
                out.append(rec)
    return out


def submit_pd(
    cluster: dict[str, Any],
    prompts: list[list[int]],
    tids: list[str],
    producer: str = "p-main",
    consumer: str = "d-main",
    max_tokens: int = MAX_TOKENS,
    name_consumer: bool = True,
) -> tuple[Any, Any]:
    """Send the prompts to a producer and a consumer at once, as a proxy does; returns both message ids."""
    named = {"decode_instance_id": consumer} if name_consumer else {}
    p_params = [{"transfer_id": t, **named} for t in tids]
    p_id = cluster[producer].submit({"prompts": prompts, "max_tokens": 1, "kv_transfer_params": p_params})
    d_id = cluster[consumer].submit(
        {"prompts": prompts, "max_tokens": max_tokens, "kv_transfer_params": [{"transfer_id": t} for t in tids]}
    )
    return p_id, d_id


def test_outputs_match_plain_engine_and_consumer_loaded(cluster: dict[str, Any]) -> None:
    lengths = [33, 70, 100, 200, 5, 64, 31, 129]
    prompts = make_prompts(lengths, salt=11)
    tids = [f"a-{i}" for i in range(len(prompts))]
    ref_id = cluster["plain"].submit({"prompts": prompts, "max_tokens": MAX_TOKENS})
    t0 = time.monotonic()
    p_id, d_id = submit_pd(cluster, prompts, tids)
    d = cluster["d-main"].result(d_id)
    took = time.monotonic() - t0
    p = cluster["p-main"].result(p_id)
    ref = cluster["plain"].result(ref_id)
    assert d["outputs"] == ref["outputs"]
    assert [o[0] for o in p["outputs"]] == [o[0] for o in ref["outputs"]]
    assert [x["transfer_id"] for x in p["kv_transfer_params"]] == tids
    loaded = {r["transfer_id"]: r for r in log_events(cluster, "d-main", "transfer.loaded")}
    assert set(tids) <= set(loaded), sorted(loaded)
    assert [loaded[t]["blocks"] for t in tids] == [-(-n // BLOCK) for n in lengths]
    # how long each load, once in, waited for the engine's get_finished: a time, never missing
    assert all(loaded[t]["since_received_ms"] >= 0 for t in tids), [loaded[t] for t in tids]
    assert not [r for r in log_events(cluster, "d-main", "transfer.load_failed") if r["transfer_id"] in tids]
    # vLLM counts the whole loaded prompt as cached (it still recomputes the last token).
    assert d["num_cached_tokens"] == lengths
    print(
        f"\n[connector-e2e] (a) {len(prompts)} prompts P->D in {took:.2f} s; num_cached_tokens {d['num_cached_tokens']}"
    )

    # A request without a transfer_id on the consumer runs as a plain request.
    plain_on_d = cluster["d-main"].generate(make_prompts([45], salt=12), MAX_TOKENS)
    assert plain_on_d["outputs"] == cluster["plain"].generate(make_prompts([45], salt=12), MAX_TOKENS)["outputs"]


def test_repeated_prompt_with_prefix_caching_and_requests_in_flight(cluster: dict[str, Any]) -> None:
    """The seed's scenario: one prompt 20 times among others, many requests in flight at once."""
    hot = make_prompts([100], salt=21)[0]
    others = make_prompts([40, 70, 130, 33, 90], salt=22)
    prompts: list[list[int]] = []
    for i in range(20):
        prompts.append(hot)
        prompts.append(others[i % len(others)] if i % 2 else make_prompts([50 + i], salt=100 + i)[0])
    tids = [f"b-{i}" for i in range(len(prompts))]
    ref_id = cluster["plain"].submit({"prompts": prompts, "max_tokens": MAX_TOKENS})
    t0 = time.monotonic()
    pending = []
    for start in range(0, len(prompts), 8):  # five messages of 8 requests, all in flight together
        pending.append(submit_pd(cluster, prompts[start : start + 8], tids[start : start + 8]))
    outputs: list[list[int]] = []
    for p_id, d_id in pending:
        outputs += cluster["d-main"].result(d_id)["outputs"]
        cluster["p-main"].result(p_id)
    took = time.monotonic() - t0
    ref = cluster["plain"].result(ref_id)["outputs"]
    assert outputs == ref
    assert len({tuple(o) for o in outputs[0::2]}) == 1  # the hot prompt always decodes the same
    loaded = {r["transfer_id"]: r for r in log_events(cluster, "d-main", "transfer.loaded")}
    assert set(tids) <= set(loaded)

    # Now D holds the hot prompt in its prefix cache: later copies move only the blocks
    # after D's hit, and D's cached blocks (shared by these requests) stay intact.
    again = [f"b-again-{i}" for i in range(4)]
    pending = [submit_pd(cluster, [hot, hot], again[:2]), submit_pd(cluster, [hot, hot], again[2:])]
    for p_id, d_id in pending:
        assert cluster["d-main"].result(d_id)["outputs"] == [ref[0], ref[0]]
        cluster["p-main"].result(p_id)
    loaded = {r["transfer_id"]: r for r in log_events(cluster, "d-main", "transfer.loaded")}
    hit = (len(hot) - 1) // BLOCK
    assert [(loaded[t]["skipped_blocks"], loaded[t]["blocks"]) for t in again] == [
        (hit, -(-len(hot) // BLOCK) - hit)
    ] * 4
    print(f"\n[connector-e2e] (b) {len(prompts)} requests, 8 per message, 5 messages in flight: {took:.2f} s")


def test_corrupted_transfer_changes_outputs(cluster: dict[str, Any]) -> None:
    """Negative control: D really uses the transferred KV (P's sends negated change the tokens)."""
    prompts = make_prompts([96, 150], salt=31)
    tids = ["corrupt-0", "corrupt-1"]
    ref = cluster["plain"].generate(prompts, MAX_TOKENS)
    p_id, d_id = submit_pd(cluster, prompts, tids)
    d = cluster["d-main"].result(d_id)
    cluster["p-main"].result(p_id)
    injected = {r["transfer_id"] for r in log_events(cluster, "p-main", "transfer.fault_injected")}
    assert set(tids) <= injected
    loaded = {r["transfer_id"] for r in log_events(cluster, "d-main", "transfer.loaded")}
    assert set(tids) <= loaded, timeline(cluster, set(tids))
    assert all(a != b for a, b in zip(d["outputs"], ref["outputs"])), (d["outputs"], ref["outputs"])


def test_a_proxy_that_names_no_consumer_still_gets_each_load_where_its_request_is(cluster: dict[str, Any]) -> None:
    """Two consumers are registered and the producer's requests name neither: the broker
    must route each transfer to the consumer whose request claims it, not guess by free
    room. d-fail fails a request whose load fails, so a wrong guess shows as an error."""
    prompts = make_prompts([70, 140, 40, 100], salt=41)
    tids = [f"unnamed-{i}" for i in range(len(prompts))]
    ref = cluster["plain"].generate(prompts, MAX_TOKENS)
    p_id, d_id = submit_pd(cluster, prompts, tids, consumer="d-fail", name_consumer=False)
    d = cluster["d-fail"].result(d_id)
    cluster["p-main"].result(p_id)
    assert d["outputs"] == ref["outputs"], timeline(cluster, set(tids))
    loaded = {r["transfer_id"] for r in log_events(cluster, "d-fail", "transfer.loaded")}
    assert set(tids) <= loaded, timeline(cluster, set(tids))
    assert not {r["transfer_id"] for r in log_events(cluster, "d-main", "transfer.ready")} & set(tids)


def test_a_broker_restart_loses_no_request(cluster: dict[str, Any]) -> None:
    """The broker is killed (SIGKILL) and started again on its address, once between
    requests and once with requests just sent. Every engine registers again by itself;
    requests sent after it load their KV as before, and those caught by the restart end
    with the plain engine's tokens (loaded, or recomputed on d-main's policy) well
    within the load deadline, never hanging."""
    broker: BrokerProcess = cluster["broker"]
    instances = {"p-main", "p-victim", "d-main", "d-fail"}

    def all_registered() -> bool:
        return instances <= {p["instance_id"] for p in broker.status()["peers"]}

    broker.kill()
    broker.start()
    wait_until(all_registered, 30, "every engine to register with the restarted broker")
    prompts = make_prompts([50, 90, 130], salt=51)
    ref = cluster["plain"].generate(prompts, MAX_TOKENS)
    tids = [f"restart-after-{i}" for i in range(len(prompts))]
    p_id, d_id = submit_pd(cluster, prompts, tids)
    assert cluster["d-main"].result(d_id)["outputs"] == ref["outputs"]
    cluster["p-main"].result(p_id)
    loaded = {r["transfer_id"] for r in log_events(cluster, "d-main", "transfer.loaded")}
    assert set(tids) <= loaded, timeline(cluster, set(tids))

    prompts = make_prompts([70, 110, 40, 150], salt=52)
    ref = cluster["plain"].generate(prompts, MAX_TOKENS)
    tids = [f"restart-during-{i}" for i in range(len(prompts))]
    t0 = time.monotonic()
    p_id, d_id = submit_pd(cluster, prompts, tids)
    broker.kill()
    broker.start()
    d = cluster["d-main"].result(d_id, timeout=LOAD_TIMEOUT_S + 30)
    took = time.monotonic() - t0
    cluster["p-main"].result(p_id)
    assert d["outputs"] == ref["outputs"], timeline(cluster, set(tids))
    assert took < LOAD_TIMEOUT_S, f"{took:.1f} s; the transfers' timeline:\n" + timeline(cluster, set(tids))
    ended = {r["transfer_id"] for event in ("transfer.loaded", "transfer.load_failed")
             for r in log_events(cluster, "d-main", event)}
    assert set(tids) <= ended, timeline(cluster, set(tids))
    wait_until(all_registered, 30, "every engine to stay registered")
    loaded = {r["transfer_id"] for r in log_events(cluster, "d-main", "transfer.loaded")} & set(tids)
    print(f"\n[connector-e2e] (e) broker restarted under {len(tids)} requests: done in {took:.2f} s, {len(loaded)} loaded")


def test_killed_producer_fails_or_recomputes_within_lease(cluster: dict[str, Any]) -> None:
    """P staged and offered, then died before D's request arrived: no hang, the policy applies."""
    victim: EngineProcess = cluster["p-victim"]
    prompts = make_prompts([80, 80], salt=41)
    ref = cluster["plain"].generate(prompts, MAX_TOKENS)
    params = [
        {"transfer_id": "victim-rec", "decode_instance_id": "d-main"},
        {"transfer_id": "victim-fail", "decode_instance_id": "d-fail"},
    ]
    victim.generate(prompts, 1, kv_transfer_params=params)  # staged and offered
    # The Offers are handed to ZMQ when generate returns, not yet on the wire: kill P only
    # once the broker holds both, or the test is of an Offer that never left (D then
    # waits its whole load deadline, as it must for a transfer nobody offered).
    broker: BrokerProcess = cluster["broker"]
    wait_until(
        lambda: {"victim-rec", "victim-fail"} <= {t["transfer_id"] for t in broker.status()["transfers"]},
        20, "the broker to hold the victim's Offers",
    )
    victim.kill()  # SIGKILL: no goodbye, heartbeats stop
    t0, killed_at = time.monotonic(), datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    rec_id = cluster["d-main"].submit(
        {"prompts": prompts[:1], "max_tokens": MAX_TOKENS, "kv_transfer_params": [{"transfer_id": "victim-rec"}]}
    )
    fail_id = cluster["d-fail"].submit(
        {"prompts": prompts[1:], "max_tokens": MAX_TOKENS, "kv_transfer_params": [{"transfer_id": "victim-fail"}]}
    )
    rec = cluster["d-main"].result(rec_id, timeout=LOAD_TIMEOUT_S + 30)
    rec_s = time.monotonic() - t0
    fail = cluster["d-fail"].result(fail_id, timeout=LOAD_TIMEOUT_S + 30)
    fail_s = time.monotonic() - t0
    # Resolved by the broker's 3 s peer lease, well before D's own 20 s load deadline; but
    # only a broker that runs can end a lease: if the host stopped it meanwhile (it logs
    # `broker.stalled`), the loads must still end, by D's deadline, and never hang.
    # Once the broker answers it runs again, and it logs a stall before it answers anything.
    wait_until(broker.answers, 60, "the broker to answer")
    stalls = log_events(cluster, broker.log_path.stem, "broker.stalled")
    away = sum(e["stalled_s"] for e in stalls if e["timestamp"] > killed_at)
    bound = 10 if away < 5 else LOAD_TIMEOUT_S + 10
    assert rec_s < bound and fail_s < bound, (
        f"recompute after {rec_s:.1f} s, fail after {fail_s:.1f} s (the broker was away {away:.1f} s); "
        "the transfers' timeline:\n" + timeline(cluster, {"victim-rec", "victim-fail"})
    )
    assert rec["outputs"] == ref["outputs"][:1]  # "recompute": computed locally, same tokens
    assert rec["finish_reasons"] == ["length"]
    assert fail["finish_reasons"] != ["length"] and len(fail["outputs"][0]) < MAX_TOKENS, fail  # "fail": an error
    failed = {r["transfer_id"] for n in ("d-main", "d-fail") for r in log_events(cluster, n, "transfer.load_failed")}
    assert {"victim-rec", "victim-fail"} <= failed
    print(
        f"\n[connector-e2e] (d) producer killed: recompute done in {rec_s:.2f} s, fail reported in {fail_s:.2f} s "
        f"(finish_reason {fail['finish_reasons'][0]!r})"
        + (f"; the broker did not run for {away:.1f} s of it" if away else "")
    )
    # The consumers stay healthy: a normal transfer still works afterwards.
    prompts2 = make_prompts([60], salt=42)
    p_id, d_id = submit_pd(cluster, prompts2, ["after-kill"])
    assert cluster["d-main"].result(d_id)["outputs"] == cluster["plain"].generate(prompts2, MAX_TOKENS)["outputs"]
    cluster["p-main"].result(p_id)
