"""The end-to-end harness, proven on vLLM's own ExampleConnector.

Three engine processes run side by side: a plain engine (the reference), a
producer (kv_producer) and a consumer (kv_consumer). The two connector engines
run vLLM's ExampleConnector, which passes KV through files, wrapped by
engine_runner.TracingExampleConnector so every connector hook is recorded.

What this pins down about vLLM (and what a real connector can rely on):
- a consumer that loads the producer's KV decodes exactly what the plain
  engine decodes, and it really uses that KV (corrupting it changes the output);
- the CPU KV cache layout handed to register_kv_caches;
- the order of the hooks within a step.
"""

from __future__ import annotations

import json
import threading
import time
from importlib.util import find_spec
from pathlib import Path

import pytest
from engine_runner import EngineProcess

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(find_spec("vllm") is None, reason="vLLM is not installed"),
]

BLOCK = 32
MAX_TOKENS = 8
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]


def make_prompts(lengths: list[int], salt: int) -> list[list[int]]:
    """Deterministic prompts with distinct first blocks (ids 3..511)."""
    return [
        [3 + (salt * 131 + i * 37 + j * 13 + (j * j) % 7) % 509 for j in range(n)]
        for i, n in enumerate(lengths)
    ]


def example_connector_load_len(n: int) -> int:
    """Tokens ExampleConnector loads for an n-token prompt.

    It loads only whole blocks of the first n - 1 tokens (the last prompt
    token is always computed by the consumer). It stores under a key of the
    first (n - 1) // B * B tokens but looks up (n - 2) // B * B, so a prompt of
    length 1 mod B never matches and is recomputed.
    """
    store = (n - 1) // BLOCK * BLOCK
    lookup = (n - 2) // BLOCK * BLOCK
    return lookup if store == lookup else 0


def _connector_config(role: str, storage: Path, trace: Path) -> dict:
    return {
        "kv_connector": "TracingExampleConnector",
        "kv_connector_module_path": "engine_runner",
        "kv_role": role,
        "kv_connector_extra_config": {
            "shared_storage_path": str(storage),
            "trace_path": str(trace),
        },
    }


@pytest.fixture(scope="module")
def engines(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("harness")
    storage = root / "kv-store"
    storage.mkdir()
    model = str(tiny_model_dir)
    procs = {
        "plain": EngineProcess(
            {"model": model, "enable_prefix_caching": True},
            name="plain",
            log_path=root / "plain.log",
        ),
        "producer": EngineProcess(
            {
                "model": model,
                "kv_transfer_config": _connector_config(
                    "kv_producer", storage, root / "producer.trace.jsonl"
                ),
            },
            name="producer",
            log_path=root / "producer.log",
        ),
        "consumer": EngineProcess(
            {
                "model": model,
                "kv_transfer_config": _connector_config(
                    "kv_consumer", storage, root / "consumer.trace.jsonl"
                ),
            },
            name="consumer",
            log_path=root / "consumer.log",
        ),
    }
    errors: dict[str, BaseException] = {}

    def start(name: str, proc: EngineProcess) -> None:
        try:
            proc.start(timeout=300)
        except BaseException as e:  # noqa: BLE001 (re-raised in the test's thread)
            errors[name] = e

    t0 = time.monotonic()
    threads = [
        threading.Thread(target=start, args=item, daemon=True) for item in procs.items()
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    all_started_s = time.monotonic() - t0
    try:
        if errors:
            raise RuntimeError(f"engines failed to start: {errors}")
        startup = {
            n: {"startup_s": p.ready["startup_s"], "wall_s": round(p.start_wall_s, 1)}
            for n, p in procs.items()
        }
        print(
            f"\n[harness] engines started concurrently in {all_started_s:.1f}s: {startup}"
        )
        yield {**procs, "storage": storage, "root": root}
    finally:
        for p in procs.values():
            p.close()


def _steps(trace: list[dict]) -> list[list[str]]:
    """Worker hooks grouped by step, from bind_connector_metadata on."""
    steps: list[list[str]] = []
    for rec in trace:
        if rec["role"] != "worker" or rec["hook"] in ("__init__", "register_kv_caches"):
            continue
        if rec["hook"] == "bind_connector_metadata":
            steps.append([])
        if steps:
            steps[-1].append(rec["hook"])
    return steps


def test_plain_engine_is_deterministic(engines):
    plain: EngineProcess = engines["plain"]
    prompts = make_prompts([70, 40, 100, 64, 65], salt=1)
    first = plain.generate(prompts, MAX_TOKENS)
    second = plain.generate(prompts, MAX_TOKENS)  # prefix-cache hits this time
    assert first["outputs"] == second["outputs"]
    assert all(len(o) == MAX_TOKENS for o in first["outputs"])
    assert first["finish_reasons"] == ["length"] * len(prompts)
    assert first["num_cached_tokens"] == [0] * len(prompts)
    # Prefix caching works on the CPU: full blocks of the prompt, never the last token.
    assert second["num_cached_tokens"] == [
        (n - 1) // BLOCK * BLOCK for n in map(len, prompts)
    ]
    # Outputs depend on the prompt (the random model is not degenerate).
    assert len({tuple(o) for o in first["outputs"]}) == len(prompts)

    one = make_prompts([100], salt=2)
    t0 = time.monotonic()
    r = plain.generate(one, 16)
    round_trip = time.monotonic() - t0
    print(
        f"\n[harness] plain: 1 prompt x 100 tok -> 16 tok: engine {r['elapsed_s']:.3f}s,"
        f" round trip {round_trip:.3f}s; 5 prompts -> {MAX_TOKENS} tok: engine"
        f" {first['elapsed_s']:.3f}s (cold) / {second['elapsed_s']:.3f}s (prefix-cached)"
    )


def test_register_kv_caches_cpu_layout(engines):
    for name in ("producer", "consumer"):
        trace = engines[name].trace()
        (reg,) = [r for r in trace if r["hook"] == "register_kv_caches"]
        (init,) = [
            r for r in trace if r["hook"] == "__init__" and r["role"] == "worker"
        ]
        layers = reg["layers"]
        assert sorted(layers) == LAYERS
        for info in layers.values():
            # CPU_ATTN: [num_blocks, num_kv_heads, block_size, 2 * head_size]
            assert info["shape"] == [init["num_blocks"], 2, BLOCK, 64]
            assert info["dtype"] == "bfloat16" and info["device"] == "cpu"
            assert info["contiguous"]
        # All layers are views of one allocation (layer-major), not separate tensors.
        assert reg["shared_storage"]
        print(
            f"\n[harness] {name} register_kv_caches: "
            + json.dumps(
                {
                    k: {x: v[x] for x in ("shape", "stride", "dtype")}
                    for k, v in layers.items()
                }
            )
        )


def test_pd_example_connector_matches_plain(engines):
    plain, producer, consumer = (
        engines["plain"],
        engines["producer"],
        engines["consumer"],
    )
    lengths = [70, 40, 100, 64, 65, 20]
    prompts = make_prompts(lengths, salt=3)
    params = [{"transfer_id": f"t-{i}"} for i in range(len(prompts))]

    # The reference and the prefill run at the same time, in different processes.
    ref_id = plain.submit({"prompts": prompts, "max_tokens": MAX_TOKENS})
    t0 = time.monotonic()
    p = producer.generate(prompts, 1, kv_transfer_params=params)
    t_prefill = time.monotonic() - t0
    ref = plain.result(ref_id)
    t0 = time.monotonic()
    d = consumer.generate(prompts, MAX_TOKENS, kv_transfer_params=params)
    t_decode = time.monotonic() - t0

    assert [o[0] for o in p["outputs"]] == [o[0] for o in ref["outputs"]]
    assert d["outputs"] == ref["outputs"]
    expected = [example_connector_load_len(n) for n in lengths]
    # The consumer's "cached" tokens are exactly the externally loaded ones.
    assert d["num_cached_tokens"] == expected

    trace = consumer.trace()
    matched = {
        r["kv_transfer_params"]["transfer_id"]: r
        for r in trace
        if r["hook"] == "get_num_new_matched_tokens" and r["kv_transfer_params"]
    }
    for i, n in enumerate(lengths):
        rec = matched[f"t-{i}"]
        # kv_transfer_params from SamplingParams.extra_args reach the scheduler
        # side; the request id there is ours plus a random suffix.
        assert rec["req_id"].startswith(f"{d['request_ids'][i]}-")
        assert rec["num_prompt_tokens"] == n
        assert rec["ret"] == [expected[i], False]

    # Hook order in the consumer's loading step: a sync load starts before the
    # forward, then each layer waits and saves, then the step's bookkeeping.
    load_steps = [
        s
        for s in _steps(trace)
        if "start_load_kv" in s and s.index("start_load_kv") == 1
    ]
    assert load_steps, _steps(trace)
    assert load_steps[0] == [
        "bind_connector_metadata",
        "start_load_kv",
        "wait_for_layer_load",
        "save_kv_layer",
        "wait_for_layer_load",
        "save_kv_layer",
        "wait_for_save",
        "get_finished",
        "get_block_ids_with_load_errors",
        "clear_connector_metadata",
    ]
    # With no sync load in the step (the producer), start_load_kv runs after
    # the forward instead.
    p_steps = _steps(producer.trace())
    assert p_steps[0] == [
        "bind_connector_metadata",
        "wait_for_layer_load",
        "save_kv_layer",
        "wait_for_layer_load",
        "save_kv_layer",
        "start_load_kv",
        "wait_for_save",
        "get_finished",
        "get_block_ids_with_load_errors",
        "clear_connector_metadata",
    ]
    print(
        f"\n[harness] P/D {len(prompts)} prompts: prefill (max_tokens=1) {t_prefill:.3f}s"
        f" round trip (engine {p['elapsed_s']:.3f}s), decode {MAX_TOKENS} tok"
        f" {t_decode:.3f}s round trip (engine {d['elapsed_s']:.3f}s); loaded tokens {expected}"
    )


def test_consumer_really_uses_transferred_kv(engines):
    import safetensors.torch
    import torch

    plain, producer, consumer = (
        engines["plain"],
        engines["producer"],
        engines["consumer"],
    )
    storage: Path = engines["storage"]
    prompts = make_prompts([96, 80], salt=4)
    ref = plain.generate(prompts, MAX_TOKENS)

    before = set(storage.iterdir())
    producer.generate(prompts, 1)
    new = set(storage.iterdir()) - before
    assert len(new) == len(prompts)
    gen = torch.Generator().manual_seed(0)
    for folder in new:
        files = sorted(folder.glob("*.safetensors"))
        assert [f.stem for f in files] == LAYERS
        for f in files:
            kv = safetensors.torch.load_file(str(f))["kv_cache"]
            noise = torch.randn(kv.shape, generator=gen).to(kv.dtype)
            safetensors.torch.save_file({"kv_cache": noise}, str(f))

    d = consumer.generate(prompts, MAX_TOKENS)
    assert d["num_cached_tokens"] == [64, 64]
    assert all(a != b for a, b in zip(d["outputs"], ref["outputs"])), (d, ref)


def test_engines_are_fed_concurrently(engines):
    shared = make_prompts([50, 90], salt=5)
    other = make_prompts([50, 90], salt=6)
    # The consumer must not race the producer for the same prompts here: the
    # ExampleConnector would see a half-written entry.
    ids = {
        "plain": engines["plain"].submit({"prompts": shared, "max_tokens": 4}),
        "consumer": engines["consumer"].submit({"prompts": shared, "max_tokens": 4}),
        "producer": engines["producer"].submit({"prompts": other, "max_tokens": 4}),
    }
    outs = {n: engines[n].result(i)["outputs"] for n, i in ids.items()}
    assert outs["plain"] == outs["consumer"]
    assert [len(o) for o in outs["producer"]] == [4, 4]
    # Several messages may be in flight in one engine; answers match by id.
    a = engines["plain"].submit({"prompts": shared[:1], "max_tokens": 2})
    b = engines["plain"].submit({"prompts": shared[1:], "max_tokens": 2})
    assert engines["plain"].result(b)["outputs"] == [outs["plain"][1][:2]]
    assert engines["plain"].result(a)["outputs"] == [outs["plain"][0][:2]]
    assert engines["plain"].request({"cmd": "info"})["in_flight"] == 0


def test_errors_come_back_as_json(engines):
    from engine_runner import EngineError

    plain: EngineProcess = engines["plain"]
    with pytest.raises(EngineError, match="prompts must be"):
        plain.request({"prompts": [[]], "max_tokens": 2})
    with pytest.raises(EngineError, match="unknown cmd"):
        plain.request({"cmd": "nope"})
    # A prompt longer than max_model_len is refused by vLLM, not a crash.
    with pytest.raises(EngineError):
        plain.generate([[5] * 300], 2)
    assert plain.request({"cmd": "ping"})["ok"]
