"""A Gemma-3-like hybrid engine as the connector's worker half sees it, for the tests:
one sliding-window group and one full-attention group, with stand-ins for vLLM's specs
(the windows are given, so only the fields `CacheSpec.from_vllm` reads matter)."""

from __future__ import annotations

from dataclasses import dataclass

from connector.config import EngineInfo


@dataclass(frozen=True)
class Spec:
    block_size: int
    num_kv_heads: int
    head_size: int
    use_mla: bool = False


@dataclass(frozen=True)
class SlidingWindowSpec(Spec):
    sliding_window: int = 0


def hybrid_info(layer_groups: dict[str, int], *, block_size: int, heads: int, head_size: int, window: int,
                backend: str, world_size: int = 1) -> EngineInfo:
    """The engine: group 0 slides over `window` tokens, group 1 attends to all."""
    sliding = SlidingWindowSpec(block_size, heads, head_size, sliding_window=window)
    return EngineInfo(model="tiny-gemma", spec=sliding, block_size=block_size, backend=backend, kv_heads=heads,
                      world_size=world_size, layer_groups=layer_groups, windows=(window, 0),
                      group_specs=(sliding, Spec(block_size, heads, head_size)))
