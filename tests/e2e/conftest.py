"""Fixtures for the end-to-end tests that run real vLLM engines on the CPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from demo.tiny_model import make_tiny_llama

# engine_runner.py sits next to this file and is imported by name, here and inside
# the engine processes.
_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A deterministic random bf16 Llama checkpoint, built once per session."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
