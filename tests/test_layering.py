"""The package's import graph stays one-way: no folder imports a folder that imports it back (through
any chain), no file cycle, and the layers named in docs/design.md never import upward. Imports
inside functions count too: a lazy import is still a dependency."""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "loopline"

# Each layer may import only layers to its right (and the top-level modules: config, errors, ...).
LAYERS = ["entrypoints", "distributed", "runtime", "engine", "worker", "core", "kv", "attention", "models"]


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _graph() -> tuple[dict[str, set[str]], dict[str, Path]]:
    files = {_module(p): p for p in PACKAGE.rglob("*.py")}
    edges: dict[str, set[str]] = defaultdict(set)
    for mod, path in files.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            edges[mod].update(n for n in names if n in files and n != mod)
    return edges, files


def _folder(mod: str, files: dict[str, Path]) -> str:
    """``loopline.engine.llm_engine`` -> ``engine``; top-level modules (``loopline.config``) are their own."""
    parts = mod.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and files[mod].name == "__init__.py") else mod


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in list(edges):
        if v not in index:
            visit(v)
    return out


@pytest.fixture(scope="module")
def graph():
    return _graph()


def test_no_file_imports_itself_back(graph):
    edges, _ = graph
    assert _cycles(edges) == []


def test_no_folder_imports_itself_back(graph):
    edges, files = graph
    folders: dict[str, set[str]] = defaultdict(set)
    for a, targets in edges.items():
        for b in targets:
            if _folder(a, files) != _folder(b, files) and _folder(a, files) != "loopline":
                folders[_folder(a, files)].add(_folder(b, files))
    folders = {a: bs - {"loopline"} for a, bs in folders.items()}  # the package face: lazy re-exports only
    assert _cycles(folders) == []


def test_layers_import_only_downward(graph):
    edges, files = graph
    upward = sorted((a, b) for a, targets in edges.items() for b in targets
                    if _folder(a, files) in LAYERS and _folder(b, files) in LAYERS
                    and LAYERS.index(_folder(b, files)) < LAYERS.index(_folder(a, files)))
    assert upward == []


def test_the_checks_see_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
