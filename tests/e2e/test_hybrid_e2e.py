"""A hybrid model end to end: real vLLM engines on the CPU running a tiny Gemma-3 (layers
0 and 2 slide over 64 tokens, 1 and 3 attend to all) with two KV cache groups, a real
broker, TCP between P and D.

Prompts of 100 to 200 tokens reach past the window, so D's sliding-window group holds
null blocks for the prompt's first blocks and P sends that group only the blocks its
window still holds. D's greedy outputs must equal a plain engine's, D must count the
whole prompt as loaded, and the broker must count each transfer completed.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest
from engine_runner import EngineProcess

from demo.summary import log_events
from demo.tiny_model import make_tiny_gemma3
from tests.support import REFUSING, BrokerProcess, wait_until

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(find_spec("vllm") is None, reason="vLLM is not installed"),
]

MAX_TOKENS = 8
LENGTHS = [100, 129, 150, 200, 64]


def make_prompts(lengths: list[int], salt: int) -> list[list[int]]:
    return [[3 + (salt * 131 + i * 37 + j * 13 + (j * j) % 7) % 509 for j in range(n)] for i, n in enumerate(lengths)]


def connector_config(broker: str, role: str, instance: str, **extra: Any) -> dict[str, Any]:
    return {
        "kv_connector": "KVBrokerConnector",
        "kv_connector_module_path": "connector",
        "kv_role": role,
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {
            "broker": broker, "instance_id": instance, "pool_bytes": 32 << 20, "staging_bytes": 32 << 20,
            "load_timeout_s": 240.0, "register_timeout_s": 120, **extra,
        },
    }


def engine(model: Path, root: Path, name: str, ktc: dict[str, Any] | None) -> EngineProcess:
    return EngineProcess({"model": str(model), "enable_prefix_caching": True, "kv_transfer_config": ktc},
                         name=name, log_path=root / f"{name}.log", env={"OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def gemma(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3"))


@pytest.fixture(scope="module")
def cluster(gemma: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("hybrid-e2e")
    broker = BrokerProcess(root, "--peer-lease", "30", "--heartbeat", "1", "--transfer-lease", "300")
    broker.start()
    plain = engine(gemma, root, "plain", None)
    # P fails its sends of the transfers named refuse-* (a fault the test injects), so D's loads fail.
    p = engine(gemma, root, "p-gemma", {**connector_config(broker.endpoint, "kv_producer", "p-gemma"), **REFUSING})
    d = engine(gemma, root, "d-gemma", connector_config(broker.endpoint, "kv_consumer", "d-gemma"))
    try:
        for proc in (plain, p, d):  # one at a time: each takes both cores while it starts
            proc.start(timeout=420)
        yield {"broker": broker, "plain": plain, "p": p, "d": d, "root": root}
    finally:
        for proc in (d, p, plain):
            proc.close()
        broker.stop()


def test_hybrid_gemma3_outputs_match_a_plain_engine_and_d_loaded(cluster: dict[str, Any]) -> None:
    broker: BrokerProcess = cluster["broker"]
    p, d = cluster["p"], cluster["d"]
    for proc in (p, d):  # vLLM kept its hybrid manager: two KV cache groups, each moved
        assert proc.ready["disable_hybrid_kv_cache_manager"] is False
    prompts = make_prompts(LENGTHS, salt=7)
    tids = [f"hy-{i}" for i in range(len(prompts))]
    ref = cluster["plain"].generate(prompts, MAX_TOKENS)
    before = broker.status()["counters"]
    t0 = time.monotonic()
    p_id = p.submit({"prompts": prompts, "max_tokens": 1,
                     "kv_transfer_params": [{"transfer_id": t, "decode_instance_id": "d-gemma"} for t in tids]})
    d_id = d.submit({"prompts": prompts, "max_tokens": MAX_TOKENS,
                     "kv_transfer_params": [{"transfer_id": t, "prefill_instance_id": "p-gemma"} for t in tids]})
    d_out, p_out = d.result(d_id, timeout=300), p.result(p_id, timeout=300)
    took = time.monotonic() - t0
    assert d_out["outputs"] == ref["outputs"]
    assert [o[0] for o in p_out["outputs"]] == [o[0] for o in ref["outputs"]]
    assert d_out["num_cached_tokens"] == LENGTHS  # the whole prompt came from P
    wait_until(lambda: broker.status()["counters"]["completed"] - before["completed"] == len(prompts), 20,
               "every transfer counted completed at the broker")
    assert broker.status()["counters"]["aborted"] == before["aborted"]
    # The window group sent only its blocks inside the window: a 64-token prompt's 2 blocks
    # of all 4 layers (the window reaches back to token 0), a 100-token prompt's 4 blocks of
    # the full layers and 4 - (100 - 64 + 1) // 32 = 3 of the window's, a 200-token prompt's
    # 7 and 7 - (200 - 64 + 1) // 32 = 3.
    log = (cluster["root"] / "d-gemma.log").read_text().splitlines()
    loaded = {e["transfer_id"]: e for e in log_events(log, "transfer.loaded")}
    assert set(tids) <= set(loaded)
    cell = 2 * 32 * 2 * 32 * 2  # one layer of one block: K and V, 32 tokens, 2 KV heads of 32 bf16
    assert loaded["hy-4"]["nbytes"] == 2 * 4 * cell
    assert loaded["hy-0"]["nbytes"] == (2 * 4 + 2 * 3) * cell
    assert loaded["hy-3"]["nbytes"] == (2 * 7 + 2 * 3) * cell
    print(f"\n[hybrid-e2e] {len(prompts)} prompts in {took:.2f} s; bytes per transfer "
          f"{json.dumps({t: e['nbytes'] for t, e in sorted(loaded.items())})}")


def test_hybrid_gemma3_d_loads_only_past_its_prefix_hit_in_every_group(cluster: dict[str, Any]) -> None:
    """The first test's 200-token prompt, 40 tokens longer: D's prefix cache holds its first
    6 blocks in the full group and, in the window group, the 2 blocks the window of token
    192 needs (5 and 6 of the first prompt's 7 blocks were loaded from P). So D loads
    blocks 6 and 7 of both groups (8 cells) and writes nothing it holds."""
    broker: BrokerProcess = cluster["broker"]
    p, d = cluster["p"], cluster["d"]
    base = make_prompts(LENGTHS, salt=7)[3]
    prompt = base + [3 + (j * 29) % 509 for j in range(40)]
    ref = cluster["plain"].generate([prompt], MAX_TOKENS)
    before = broker.status()["counters"]["completed"]
    p_id = p.submit({"prompts": [prompt], "max_tokens": 1,
                     "kv_transfer_params": [{"transfer_id": "hy-ext", "decode_instance_id": "d-gemma"}]})
    d_id = d.submit({"prompts": [prompt], "max_tokens": MAX_TOKENS,
                     "kv_transfer_params": [{"transfer_id": "hy-ext", "prefill_instance_id": "p-gemma"}]})
    d_out, _ = d.result(d_id, timeout=300), p.result(p_id, timeout=300)
    assert d_out["outputs"] == ref["outputs"]
    assert d_out["num_cached_tokens"] == [len(prompt)]
    wait_until(lambda: broker.status()["counters"]["completed"] - before == 1, 20, "the transfer completed")
    log = (cluster["root"] / "d-gemma.log").read_text().splitlines()
    (loaded,) = [e for e in log_events(log, "transfer.loaded") if e["transfer_id"] == "hy-ext"]
    assert loaded["skipped_blocks"] == 6
    assert loaded["nbytes"] == 2 * 4 * (2 * 32 * 2 * 32 * 2)


def test_hybrid_gemma3_failed_loads_are_recomputed_and_the_engine_goes_on(cluster: dict[str, Any]) -> None:
    """P cannot send these transfers (their payload fails on P), so D's loads fail at once.
    vLLM takes no block ids from several KV cache groups (it stops the engine on them), so
    D reports the requests instead; under kv_load_failure_policy "recompute" D computes them locally, gives the
    plain engine's outputs, and serves the next transfer as before."""
    broker: BrokerProcess = cluster["broker"]
    p, d = cluster["p"], cluster["d"]
    prompts = make_prompts([120, 90], salt=11)
    tids = ["refuse-0", "refuse-1"]
    ref = cluster["plain"].generate(prompts, MAX_TOKENS)
    aborted = broker.status()["counters"]["aborted"]
    p_id = p.submit({"prompts": prompts, "max_tokens": 1,
                     "kv_transfer_params": [{"transfer_id": t, "decode_instance_id": "d-gemma"} for t in tids]})
    d_id = d.submit({"prompts": prompts, "max_tokens": MAX_TOKENS,
                     "kv_transfer_params": [{"transfer_id": t, "prefill_instance_id": "p-gemma"} for t in tids]})
    d_out, _ = d.result(d_id, timeout=300), p.result(p_id, timeout=300)
    assert d_out["outputs"] == ref["outputs"]
    assert d_out["num_cached_tokens"] == [0, 0]  # computed here: nothing was loaded
    wait_until(lambda: broker.status()["counters"]["aborted"] - aborted == len(tids), 20, "the aborts at the broker")
    log = (cluster["root"] / "d-gemma.log").read_text().splitlines()
    assert {e["transfer_id"] for e in log_events(log, "transfer.load_failed")} >= set(tids)
    # The engine goes on: the next transfer loads.
    again = make_prompts([110], salt=12)
    before = broker.status()["counters"]["completed"]
    p_id = p.submit({"prompts": again, "max_tokens": 1,
                     "kv_transfer_params": [{"transfer_id": "hy-after", "decode_instance_id": "d-gemma"}]})
    d_id = d.submit({"prompts": again, "max_tokens": MAX_TOKENS,
                     "kv_transfer_params": [{"transfer_id": "hy-after", "prefill_instance_id": "p-gemma"}]})
    d_out, _ = d.result(d_id, timeout=300), p.result(p_id, timeout=300)
    assert d_out["outputs"] == cluster["plain"].generate(again, MAX_TOKENS)["outputs"]
    assert d_out["num_cached_tokens"] == [110]
    wait_until(lambda: broker.status()["counters"]["completed"] - before == 1, 20, "the transfer completed")
