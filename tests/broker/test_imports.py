"""Imports point one way: no module of the broker, the gateway or the wire imports one
that imports it back (not even inside a function or for type checking only), and the
gateway uses nothing of the broker. Each service module imports on its own."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import ROOT, env

PACKAGES = ("broker", "gateway", "protocols")


def modules() -> dict[str, Path]:
    return {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
            for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Every project module `name` imports anywhere in its file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        found |= {t for t in targets if t in known and t != name}
    return found


def test_no_import_cycle_among_the_broker_the_gateway_and_the_wire() -> None:
    known = modules()
    graph = {name: imported(name, path, known) for name, path in known.items()}
    assert graph["gateway.proxy"] and graph["broker.daemon"]  # the walk finds imports at all
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt):] + [node, nxt] if nxt in path else [node, nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt, [*path, node])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [])


def test_the_gateway_imports_nothing_of_the_broker() -> None:
    known = modules()
    for name, path in known.items():
        if name.startswith("gateway"):
            assert not {m for m in imported(name, path, known) if m.startswith("broker")}, name


@pytest.mark.parametrize("module", ["broker.daemon", "broker.metrics", "broker.cli", "gateway.proxy", "gateway.metrics"])
def test_each_service_module_imports_fresh(module: str) -> None:
    got = subprocess.run([sys.executable, "-c", f"import {module}"], env=env(), cwd=ROOT,
                         capture_output=True, timeout=120)
    assert got.returncode == 0, got.stderr.decode()
