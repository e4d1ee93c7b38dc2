"""Imports flow one way: config -> core -> model -> engine -> bench/sim -> entrypoints, with no cycles.

Every module's imports are read with ast, those inside functions too (a lazy import is still a dependency);
only `if TYPE_CHECKING:` blocks are left out, since they never run.
"""
import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "paceline"

# a module may import its own layer and those before it; bench and sim share one (sim reads bench's workloads and
# reports through bench's measurement library; bench never imports sim, which the cycle check holds)
LAYERS = {"config": 0, "request": 0, "sampling": 0, "spec_config": 0, "core": 1, "model": 2, "engine": 3, "bench": 4,
          "sim": 4, "parallel": 3, "entrypoints": 5}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> int | None:
    parts = module.split(".")
    # the package root re-exports LLM from entrypoints: only the top layer may import it
    return LAYERS.get(parts[1]) if len(parts) > 1 else LAYERS["entrypoints"]


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """The paceline modules `path` imports, each resolved to a module of the package (a package's __init__ when a
    name is not a submodule)."""
    out: set[str] = set()

    def resolve(name: str) -> None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name:
            out.add(name)

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("paceline"):
                    resolve(alias.name)
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("paceline") and not node.level:
            for alias in node.names:  # `from paceline.bench import plots` imports the module paceline.bench.plots
                full = f"{node.module}.{alias.name}"
                resolve(full if full in modules else node.module)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return out


def import_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    modules = set(files)
    return {m: imports_of(p, modules) - {m} for m, p in files.items()}


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    bad = []
    for m, deps in graph.items():
        for d in deps:
            lm, ld = layer(m), layer(d)
            if lm is not None and ld is not None and ld > lm:
                bad.append(f"{m} imports {d}")
    return sorted(bad)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return found


def test_every_module_belongs_to_a_layer():
    assert not [m for m in import_graph() if layer(m) is None]


def test_no_upward_import():
    assert upward_imports(import_graph()) == []


def test_no_circular_import():
    assert cycles(import_graph()) == []


@pytest.mark.parametrize("source,target,expect", [
    ("paceline.core.scheduler", "paceline.sim.cost_model", "upward"),
    ("paceline.bench.cli", "paceline.bench.compare", "cycle"),
])
def test_the_checks_catch_what_they_should(source, target, expect):
    graph = import_graph()
    graph[source] = graph[source] | {target}
    if expect == "upward":
        assert f"{source} imports {target}" in upward_imports(graph)
    else:
        graph[target] = graph[target] | {source}
        assert sorted([source, target]) in [c for c in cycles(graph) if source in c and len(c) == 2] or any(
            source in c and target in c for c in cycles(graph))


def test_imports_inside_functions_count_and_type_checking_ones_do_not(tmp_path):
    src = tmp_path / "m.py"
    src.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from paceline.core import scheduler\n"
                   "def f():\n    from paceline.bench import plots\n")
    assert imports_of(src, {"paceline.core.scheduler", "paceline.bench", "paceline.bench.plots"}) == {
        "paceline.bench.plots"}
