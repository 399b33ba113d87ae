"""The layering rules: the engine never prints, commands never reach into engine internals."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[3] / "kvtool"

# What commands, the server and workloads may import from the engine: its public surface.
PUBLIC_ENGINE_MODULES = {
    "kvtool.engine.engine",
    "kvtool.engine.params",
    "kvtool.engine.errors",
    "kvtool.engine.outputs",
    "kvtool.engine.models.model_dir",
    "kvtool.engine.presets.catalog",
    "kvtool.engine.presets.default_model",
    "kvtool.engine.kv.identity",
    # vLLM's number and JSON rules (sizes, bounds), leaves that hold no engine state.
    "kvtool.engine.config.sizes",
    "kvtool.engine.config.json_document",
    "kvtool.engine.connectors.config",
    "kvtool.engine.connectors.registry",
    "kvtool.engine.connectors.lmcache.keys",
    "kvtool.engine.connectors.lmcache.identity_digest",
    "kvtool.engine.connectors.lmcache.stores.lm_client",
    "kvtool.engine.connectors.lmcache.stores.protocol",
    "kvtool.engine.connectors.lmcache.probe",
    "kvtool.engine.connectors.offloading.connector",
    "kvtool.engine.connectors.offloading.disk.tier_identity",
    "kvtool.engine.connectors.offloading.disk.tier_report",
}
# The transformers baseline builds the engine's own dummy weights to compare like with like.
EXTRA_FOR_WORKLOADS = {"kvtool.engine.models"}


def _modules(folder: str):
    for path in sorted((PACKAGE / folder).rglob("*.py")):
        yield path, ast.parse(path.read_text(), filename=str(path))


def _imported(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            yield node.module
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names)


def test_engine_and_server_never_print():
    offenders = []
    for folder in ("engine", "server"):
        for path, tree in _modules(folder):
            for node in ast.walk(tree):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print":
                    offenders.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert offenders == []


def test_commands_server_and_workloads_use_the_public_engine_only():
    offenders = []
    for folder in ("commands", "server", "workloads"):
        allowed = PUBLIC_ENGINE_MODULES | (EXTRA_FOR_WORKLOADS if folder == "workloads" else set())
        for path, tree in _modules(folder):
            for module in _imported(tree):
                if module.startswith("kvtool.engine") and module != "kvtool.engine" and module not in allowed:
                    offenders.append(f"{path.relative_to(PACKAGE)} imports {module}")
    assert offenders == []


def test_models_know_nothing_of_connectors_or_flags():
    for path, tree in _modules("engine/models"):
        for module in _imported(tree):
            assert not module.startswith(("kvtool.engine.connectors", "kvtool.commands", "kvtool.engine.core.scheduler")), (
                f"{path.name} imports {module}"
            )
