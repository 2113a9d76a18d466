"""Tiny random-weight checkpoints, made on the spot, for the demo and the end-to-end tests:
a Llama, and a Gemma-3 text model whose sliding-window and full-attention layers give
vLLM two KV cache groups.

Nothing is downloaded: the checkpoint is built locally from a seed. Greedy decoding of
a random model is deterministic, which is all the demo and the tests need: they
compare token ids between engines.

    python -m demo.tiny_model DIR            (the Llama)
    python -m demo.tiny_model DIR gemma3     (the Gemma-3)
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

# Kept small so an engine starts in seconds on a CPU. head_dim = 128 / 4 = 32,
# the smallest head size the CPU attention backend accepts.
TINY_LLAMA = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
    "max_position_embeddings": 512,
}
SEED = 1234
_MARKER = ".tiny-llama-complete"


def make_tiny_llama(dir: str | os.PathLike[str], seed: int = SEED) -> Path:
    """Write a deterministic random bf16 Llama to `dir` and return `dir`.

    Idempotent: an existing complete checkpoint in `dir` is reused.
    """

    def build() -> object:
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(**TINY_LLAMA, **_TOKENS, dtype="bfloat16", tie_word_embeddings=False))

    return _write(Path(dir), _MARKER, TINY_LLAMA, build, seed)


_TOKENS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}


def _write(out: Path, marker_name: str, shape: dict[str, object], build: Callable[[], object], seed: int) -> Path:
    """Build the model under `seed` (the global RNG is left as it was), save it in bf16
    to `out` with a generation config, then the marker that makes it complete."""
    marker = out / marker_name
    if marker.exists():
        return out

    import torch

    out.mkdir(parents=True, exist_ok=True)
    rng_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(seed)
        model = build().to(torch.bfloat16)  # type: ignore[attr-defined]
    finally:
        torch.random.set_rng_state(rng_state)
    model.eval()
    model.save_pretrained(out, safe_serialization=True)
    # A generation config that does not stop early; requests pass ignore_eos
    # anyway, this only keeps vLLM from looking elsewhere.
    (out / "generation_config.json").write_text(json.dumps(_TOKENS))
    marker.write_text(json.dumps({"seed": seed, **shape}))
    return out


# Gemma-3's interleaving at the smallest size that still has both kinds twice: layers 0 and
# 2 slide over 64 tokens, 1 and 3 attend to all (sliding_window_pattern 2). head_dim 32
# is the CPU attention backend's smallest.
TINY_GEMMA3 = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "query_pre_attn_scalar": 32,
    "vocab_size": 512,
    "max_position_embeddings": 512,
    "sliding_window": 64,
    "layer_types": ["sliding_attention", "full_attention"] * 2,
}
_GEMMA3_MARKER = ".tiny-gemma3-complete"


def make_tiny_gemma3(dir: str | os.PathLike[str], seed: int = SEED) -> Path:
    """Write a deterministic random bf16 Gemma-3 text model to `dir` and return `dir`.

    Idempotent: an existing complete checkpoint in `dir` is reused.
    """

    def build() -> object:
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        return Gemma3ForCausalLM(Gemma3TextConfig(**TINY_GEMMA3, **_TOKENS, dtype="bfloat16"))

    return _write(Path(dir), _GEMMA3_MARKER, TINY_GEMMA3, build, seed)


if __name__ == "__main__":
    import sys

    where = sys.argv[1] if len(sys.argv) > 1 else "tiny-llama"
    print(make_tiny_gemma3(where) if sys.argv[2:] == ["gemma3"] else make_tiny_llama(where))
