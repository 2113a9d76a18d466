"""Heterogeneous TP end to end: real vLLM engines on the CPU, a prefill instance and a
decode instance of different tensor-parallel sizes, a real broker, TCP between them.

The tiny Llama has 4 attention heads and 2 KV heads: at TP 2 each rank holds one KV
head. P TP 1 -> D TP 2 sends each D rank its head from P's one rank; P TP 2 -> D TP 1
joins both P ranks' heads in D's one rank. Either way D's greedy outputs must equal a
plain engine's, and the broker must count each lane's transfer completed (so D really
loaded the KV rather than computing it).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest
from engine_runner import EngineProcess

from tests.support import BrokerProcess, wait_until

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(find_spec("vllm") is None, reason="vLLM is not installed"),
]

MAX_TOKENS = 8
BLOCK = 32


def make_prompts(lengths: list[int], salt: int) -> list[list[int]]:
    return [[3 + (salt * 131 + i * 37 + j * 13 + (j * j) % 7) % 509 for j in range(n)] for i, n in enumerate(lengths)]


def connector_config(broker: str, role: str, instance: str) -> dict[str, Any]:
    return {
        "kv_connector": "KVBrokerConnector",
        "kv_connector_module_path": "connector",
        "kv_role": role,
        "kv_load_failure_policy": "fail",
        "kv_connector_extra_config": {
            "broker": broker, "instance_id": instance, "pool_bytes": 32 << 20, "staging_bytes": 32 << 20,
            "load_timeout_s": 240.0, "register_timeout_s": 120,
        },
    }


def engine(model: Path, root: Path, name: str, tp: int, ktc: dict[str, Any] | None) -> EngineProcess:
    kwargs = {"tensor_parallel_size": tp, "distributed_executor_backend": "mp"} if tp > 1 else {}
    return EngineProcess({"model": str(model), "enable_prefix_caching": True, "kv_transfer_config": ktc,
                          "engine_kwargs": kwargs}, name=name, log_path=root / f"{name}.log",
                         env={"OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def base(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("hetero-e2e")
    # Long leases: three engines, one of them TP 2 (three processes), share two cores on
    # CI, and a starved engine's heartbeats come late, and its steps (a D engine stepped
    # 26 s after its KV was in, past a 30 s transfer lease); so does a starved broker's
    # answer, and a peer that hears nothing from it for a whole peer lease registers
    # again (P did, mid-transfer, under a 30 s lease): the speed is not what is tested.
    broker = BrokerProcess(root, "--peer-lease", "90", "--heartbeat", "1", "--transfer-lease", "300")
    broker.start()
    plain = engine(tiny_model_dir, root, "plain", 1, None)
    try:
        plain.start(timeout=420)
        yield {"broker": broker, "plain": plain, "root": root, "model": tiny_model_dir}
    finally:
        plain.close()
        broker.stop()


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 2), (2, 1)])
def test_hetero_tp_outputs_match_a_plain_engine_and_d_loaded(base: dict[str, Any], p_tp: int, d_tp: int) -> None:
    broker: BrokerProcess = base["broker"]
    p_name, d_name = f"p-tp{p_tp}", f"d-tp{d_tp}"
    p = engine(base["model"], base["root"], p_name, p_tp, connector_config(broker.endpoint, "kv_producer", p_name))
    d = engine(base["model"], base["root"], d_name, d_tp, connector_config(broker.endpoint, "kv_consumer", d_name))
    try:
        # One after the other: starting (imports, weights, warm-up) is when engines need
        # the CPU most, and a TP 2 engine's three processes beside another engine's
        # starved the broker on two cores.
        p.start(timeout=420)
        d.start(timeout=420)
        lengths = [33, 70, 100, 64, 129]
        prompts = make_prompts(lengths, salt=p_tp * 10 + d_tp)
        tids = [f"h{p_tp}{d_tp}-{i}" for i in range(len(prompts))]
        counters = broker.status()["counters"]
        before, aborted_before = counters["completed"], counters["aborted"]
        ref = base["plain"].generate(prompts, MAX_TOKENS)
        t0 = time.monotonic()
        p_id = p.submit({"prompts": prompts, "max_tokens": 1,
                         "kv_transfer_params": [{"transfer_id": t, "decode_instance_id": d_name} for t in tids]})
        d_id = d.submit({"prompts": prompts, "max_tokens": MAX_TOKENS,
                         "kv_transfer_params": [{"transfer_id": t, "prefill_instance_id": p_name} for t in tids]})
        d_out, p_out = d.result(d_id), p.result(p_id)
        took = time.monotonic() - t0
        assert d_out["outputs"] == ref["outputs"]
        assert [o[0] for o in p_out["outputs"]] == [o[0] for o in ref["outputs"]]
        assert d_out["num_cached_tokens"] == lengths  # the whole prompt came from P
        lanes = 2  # 1 -> 2: one lane into each D rank; 2 -> 1: one from each P rank
        wait_until(lambda: broker.status()["counters"]["completed"] - before == lanes * len(prompts), 20,
                   "every lane counted completed at the broker")
        assert broker.status()["counters"]["aborted"] == aborted_before
        print(f"\n[hetero-e2e] P TP {p_tp} -> D TP {d_tp}: {len(prompts)} prompts in {took:.2f} s")
    finally:
        d.close()
        p.close()
