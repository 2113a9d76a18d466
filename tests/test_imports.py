"""What each part imports: the broker runs where neither torch nor vLLM is installed, and
the GPU tests run on GPU hosts that have torch but no vLLM. A fresh interpreter in which
those packages cannot be imported loads the modules, so an import added on the way shows
here, on the CPU, rather than on the first host without them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import ROOT, env


def _modules(folder: str) -> list[str]:
    return sorted(f"{folder.replace('/', '.')}.{p.stem}" for p in (ROOT / folder).glob("*.py") if p.stem != "__init__")


def _import_without(missing: list[str], modules: list[str]) -> subprocess.CompletedProcess[str]:
    code = (f"import sys\nfor name in {missing!r}:\n    sys.modules[name] = None  # import fails, as if not installed\n"
            f"import importlib\nfor m in {modules!r}:\n    importlib.import_module(m)\n")
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env(), capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("folder", ["broker", "protocols"])
def test_the_broker_imports_without_torch_or_vllm(folder: str) -> None:
    modules = _modules(folder)
    assert modules, f"no modules under {folder}"
    done = _import_without(["torch", "vllm"], modules)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_gpu_tests_import_without_vllm() -> None:
    modules = _modules("tests/gpu")
    assert "tests.gpu.test_connector_nccl" in modules
    done = _import_without(["vllm"], modules)
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_blocked_package_does_fail_the_import() -> None:
    """The check itself: importing the connector's vLLM half without vLLM fails."""
    done = _import_without(["vllm"], ["connector.connector"])
    assert done.returncode != 0 and "vllm" in done.stderr
