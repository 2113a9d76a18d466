"""What the simulated workers share: JSON lines on stdout, cache geometry options, error text.

stdout carries only machine-readable JSON lines (one object each: ``ready``,
``progress``, ``transfer``, ``stalled``, ``summary``, ``error``) for an orchestrator
such as `sim.demo`; logs go to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import IO, Any

import torch

from sim.kv import CacheGeometry

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def emit(out: IO[str] | None, line: dict[str, Any]) -> None:
    """Write one JSON line and flush it, so a reader sees it at once (even before a SIGKILL)."""
    if out is None:
        return
    out.write(json.dumps(line, separators=(",", ":")) + "\n")
    out.flush()


def add_geometry_args(p: argparse.ArgumentParser) -> None:
    d = CacheGeometry()
    g = p.add_argument_group("KV cache geometry (P and D must agree)")
    g.add_argument("--layers", type=int, default=d.num_layers)
    g.add_argument("--blocks", type=int, default=d.num_blocks, help="blocks in the paged cache")
    g.add_argument("--block-size", type=int, default=d.block_size)
    g.add_argument("--kv-heads", type=int, default=d.num_kv_heads)
    g.add_argument("--head-dim", type=int, default=d.head_size)
    g.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")


def geometry_from_args(a: argparse.Namespace) -> CacheGeometry:
    return CacheGeometry(
        num_layers=a.layers,
        num_blocks=a.blocks,
        block_size=a.block_size,
        num_kv_heads=a.kv_heads,
        head_size=a.head_dim,
        dtype=DTYPES[a.dtype],
    )


def describe_error(exc: BaseException) -> str:
    """The first real error inside (possibly nested) exception groups, as one line."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}"
