"""The simulated paged KV cache, and KV content that both sides derive from a seed.

A real prefill computes KV from the prompt; here the "prompt" is a seed, and its KV is
pseudo-random bits drawn from that seed, layer by layer. Identical prompts have the
same seed, hence the same length and the same bytes, which is exactly the case that
corrupted output in the seed connector. The decode side recomputes the expected bytes
from the seed alone (it is embedded in the transfer id, see `transfer_id`), so a
check there proves the bytes went from P's cache to D's cache intact, whatever P did
to its blocks after saving.
"""

from __future__ import annotations

import hashlib
import re
from collections import deque
from dataclasses import dataclass

import torch

from protocols.messages import Layout
from workers.layout import (
    CacheSpec,
    LayerLayout,
    detect_layout,
    gather_layer_into_staging,
    scatter_layers_from_staging,
    staging_view,
    wire_layout,
)

__all__ = ["CacheFull", "CacheGeometry", "PagedCache", "content", "seed_of", "transfer_id"]

_SEED_RE = re.compile(r"-s(\d{1,12})$")


@dataclass(frozen=True)
class CacheGeometry:
    """The shape of a simulated model's KV cache; P and D must agree on all of it."""

    num_layers: int = 4
    num_blocks: int = 256
    block_size: int = 16
    num_kv_heads: int = 2
    head_size: int = 64
    dtype: torch.dtype = torch.bfloat16
    layout: str = "kv_first"

    @property
    def block_elems(self) -> int:
        """Elements of one block of one layer, K and V."""
        return 2 * self.block_size * self.num_kv_heads * self.head_size

    @property
    def block_nbytes(self) -> int:
        return self.block_elems * self.dtype.itemsize

    def transfer_nbytes(self, num_blocks: int) -> int:
        """Bytes of a staged transfer of `num_blocks` blocks (all layers)."""
        return num_blocks * self.num_layers * self.block_nbytes

    def compat(self) -> dict[str, str]:
        """The fields behind the compatibility hash, named so a refusal can say what differs."""
        return {
            "model": "sim",
            "dtype": str(self.dtype).removeprefix("torch."),
            "layout": self.layout,
            "num_layers": str(self.num_layers),
            "block_size": str(self.block_size),
            "num_kv_heads": str(self.num_kv_heads),
            "head_size": str(self.head_size),
        }

    def compat_hash(self) -> str:
        text = ";".join(f"{k}={v}" for k, v in sorted(self.compat().items()))
        return hashlib.sha256(text.encode()).hexdigest()[:32]


class CacheFull(Exception):
    """Not enough free blocks for a request."""


def transfer_id(instance: str, run: str, index: int, seed: int) -> str:
    """A unique transfer id that carries the prompt's seed, so D can recompute its content."""
    return f"{instance}-{run}-{index}-s{seed}"


def seed_of(tid: str) -> int | None:
    """The seed embedded by `transfer_id`, or None if `tid` carries none."""
    m = _SEED_RE.search(tid)
    return int(m.group(1)) if m else None


def content(geometry: CacheGeometry, seed: int, layer: int, num_blocks: int) -> torch.Tensor:
    """The KV of `num_blocks` blocks of `layer` for the prompt `seed`: [n, 2, bs, H, D] int16 bits.

    Bits, not values: every pattern (NaNs included) must survive the trip unchanged.
    """
    g = torch.Generator().manual_seed(seed * 1031 + layer)
    bits = torch.randint(-(1 << 15), 1 << 15, (num_blocks * geometry.block_elems,), generator=g, dtype=torch.int16)
    return bits.view(num_blocks, 2, geometry.block_size, geometry.num_kv_heads, geometry.head_size)


class PagedCache:
    """One ``[2, num_blocks, block_size, H, D]`` tensor per layer (vLLM's kv_first) and a free list.

    Blocks are handed out FIFO from the free list, so freed blocks are soon reused,
    as in vLLM.
    """

    def __init__(self, geometry: CacheGeometry) -> None:
        if geometry.layout != "kv_first":
            raise ValueError(f"the simulated cache supports the kv_first layout only, not {geometry.layout!r}")
        g = geometry
        self.geometry = g
        self.layers = [
            torch.zeros(2, g.num_blocks, g.block_size, g.num_kv_heads, g.head_size, dtype=g.dtype)
            for _ in range(g.num_layers)
        ]
        spec = CacheSpec(block_size=g.block_size, num_kv_heads=g.num_kv_heads, head_size=g.head_size)
        self.layer_layout: LayerLayout = detect_layout(self.layers[0], spec, hint="kv_first")
        self._free: deque[int] = deque(range(g.num_blocks), maxlen=g.num_blocks)

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise CacheFull(f"{n} blocks needed, {len(self._free)} of {self.geometry.num_blocks} free")
        return [self._free.popleft() for _ in range(n)]

    def free(self, block_ids: list[int]) -> None:
        self._free.extend(block_ids)

    def wire_layout(self, num_blocks: int) -> Layout:
        return wire_layout(self.layer_layout, self.geometry.num_layers, num_blocks)

    def fill(self, seed: int, block_ids: list[int]) -> None:
        """The "prefill": write the prompt's KV into its blocks, every layer."""
        idx = torch.tensor(block_ids)
        for layer, cache in enumerate(self.layers):
            kv = content(self.geometry, seed, layer, len(block_ids)).view(self.geometry.dtype)
            cache[:, idx] = kv.transpose(0, 1)

    def overwrite(self, block_ids: list[int]) -> None:
        """Reuse freed blocks at once, as vLLM does for the next request: the old KV is gone."""
        idx = torch.tensor(block_ids)
        for cache in self.layers:
            cache.view(torch.int16)[:, idx] = 0x7FC1  # a NaN pattern no seed's content is all made of

    def stage(self, block_ids: list[int], out: torch.Tensor) -> None:
        """Gather the blocks into block-major staging `out`; the copy is complete on return."""
        g = self.geometry
        staging = staging_view(out, len(block_ids), g.num_layers, self.layer_layout.block_nbytes)
        for layer, cache in enumerate(self.layers):
            gather_layer_into_staging(staging, layer, cache, self.layer_layout, block_ids)

    def load(self, block_ids: list[int], src: torch.Tensor) -> None:
        """Scatter block-major staged bytes `src` into the blocks (the inverse of `stage`)."""
        g = self.geometry
        staging = staging_view(src, len(block_ids), g.num_layers, self.layer_layout.block_nbytes)
        scatter_layers_from_staging(staging, [(cache, self.layer_layout) for cache in self.layers], block_ids)

    def verify(self, seed: int, block_ids: list[int]) -> int:
        """Compare the blocks with the prompt's content; return the number of wrong layers (0: exact)."""
        idx = torch.tensor(block_ids)
        wrong = 0
        for layer, cache in enumerate(self.layers):
            expected = content(self.geometry, seed, layer, len(block_ids))
            actual = cache.view(torch.int16)[:, idx].transpose(0, 1)
            wrong += not torch.equal(actual, expected)
        return wrong
