"""kvtool's own import graph has no cycle: module-level, function-level and TYPE_CHECKING imports alike.

A cycle kept importable only by a deferred or TYPE_CHECKING import is still a cycle: the modules
in it cannot be understood, tested or moved into another process one at a time.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "kvtool"


def module_name(path: Path) -> str:
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = name.split(".") if is_package else name.split(".")[:-1]
                    anchor = anchor[: len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                # `from pkg import mod` imports the module pkg.mod; `from mod import name` imports mod.
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            for t in targets:
                if t in modules and t != name:
                    graph[name].add(t)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
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
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_the_checker_finds_a_cycle():
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_kvtool_has_no_import_cycle():
    graph = import_graph()
    assert "kvtool.engine.engine" in graph and graph["kvtool.engine.engine"], "the graph was not built"
    assert find_cycles(graph) == []


LEAVES = [
    "kvtool.engine.errors",
    "kvtool.engine.params",
    "kvtool.engine.core.request",
    "kvtool.engine.core.messages",
    "kvtool.engine.outputs",
    "kvtool.engine.connectors.config",
]


@pytest.mark.parametrize("leaf", LEAVES)
def test_value_types_import_no_connector_or_model_code(leaf):
    """Settings, params, errors, messages and Request reach no connector, model or runner module."""
    graph = import_graph()
    seen, todo = set(), [leaf]
    while todo:
        m = todo.pop()
        for t in graph[m]:
            if t not in seen:
                seen.add(t)
                todo.append(t)
    allowed = set(LEAVES) | {"kvtool.engine.connectors.names", "kvtool.engine.events.config", "kvtool.engine.config.sizes",
                              "kvtool.engine.config.json_document"}
    assert seen <= allowed, sorted(seen - allowed)


# The tensor-parallel process code; only the executor modules start or talk to rank processes.
TP_PROCESS_MODULES = {"kvtool.engine.executor.multiprocess", "kvtool.engine.executor.rank_process"}
EXECUTOR_MODULES = {"kvtool.engine.executor.executor"} | TP_PROCESS_MODULES


def test_only_the_executor_modules_import_the_tensor_parallel_process_code():
    graph = import_graph()
    importers = sorted(m for m, targets in graph.items() if targets & TP_PROCESS_MODULES and m not in EXECUTOR_MODULES)
    assert importers == []


def test_the_engine_has_no_tensor_parallel_branch():
    """The engine drives one Executor whatever the tensor-parallel size: no `tp_` name in it."""
    source = (PACKAGE / "engine" / "engine.py").read_text()
    assert "tp_" not in source
