"""The communicator backends behind one interface: what a backend without block writes
says about itself, and the transport modules importing one another in one direction only
(no cycle, and none hidden in a function body)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from workers.transports.communicator import Communicator

TRANSPORTS = Path(__file__).resolve().parents[2] / "workers" / "transports"


class _Bytes(Communicator):
    """A backend that moves byte ranges only."""

    backend = "bytes"


def test_a_backend_without_block_writes_says_so_and_refuses_them() -> None:
    comm = _Bytes(peer="d0:0", rank=0, device=torch.device("cpu"), nonce="n", cache=None, mem_bytes=0)
    assert not comm.writes_into_blocks and not comm.takes_blocks(object(), 4)  # type: ignore[arg-type]
    assert comm.send_ready() and not comm.next_receive_takes_blocks()
    with pytest.raises(NotImplementedError, match="the bytes backend does not write into blocks"):
        comm.post_blocks(object(), [1, 2])  # type: ignore[arg-type]
    assert comm.idle() and not comm.closed


def _sibling_imports(path: Path) -> tuple[set[str], list[str]]:
    """The transport modules `path` imports, and those it imports inside a function."""
    tree = ast.parse(path.read_text())
    names = {p.stem for p in TRANSPORTS.glob("*.py")}
    found: set[str] = set()
    local: list[str] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            targets: list[str] = []
            if isinstance(child, ast.ImportFrom):
                module = child.module or ""
                if child.level == 1:
                    targets = [module] if module else [a.name for a in child.names]
                elif module.startswith("workers.transports"):
                    rest = module.removeprefix("workers.transports").lstrip(".")
                    targets = [rest.split(".")[0]] if rest else [a.name for a in child.names]
            elif isinstance(child, ast.Import):
                targets = [a.name.split(".")[2] for a in child.names if a.name.startswith("workers.transports.")]
            mine = [t for t in targets if t in names]
            found.update(mine)
            if inner:
                local.extend(mine)
            visit(child, inner)

    visit(tree, False)
    return found, local


def test_the_transport_modules_import_one_another_in_one_direction() -> None:
    graph = {}
    for path in sorted(TRANSPORTS.glob("*.py")):
        found, local = _sibling_imports(path)
        assert not local, f"{path.name} imports {local} inside a function"
        graph[path.stem] = found
    assert graph["nccl_comm"] >= {"communicator", "cuda_ipc", "nccl_setup"}
    done: set[str] = set()

    def walk(node: str, trail: list[str]) -> None:
        assert node not in trail, f"import cycle: {' -> '.join([*trail, node])}"
        if node in done:
            return
        for nxt in graph.get(node, ()):
            walk(nxt, [*trail, node])
        done.add(node)

    for node in graph:
        walk(node, [])
