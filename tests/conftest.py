"""Shared fixtures: small model directories and engines that are checked for leaks after each test."""

import os
import sys
from pathlib import Path

# Small matrices on a shared 2-core machine: one intra-op thread each is much faster than
# threads that spin against each other (and against the servers the tests start).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)

REPO = Path(__file__).resolve().parent.parent


def kvtool_cmd() -> list[str]:
    """The kvtool CLI of this checkout, as a subprocess command."""
    return [sys.executable, "-m", "kvtool.cli"]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    from kvtool.engine.presets import create_model_dir

    d = tmp_path_factory.mktemp("models") / "tiny"
    create_model_dir(d, preset="tiny", seed=0)
    return d


@pytest.fixture
def make_engine(tiny_model_dir):
    """Factory for engines on the tiny model; each is closed and checked for leaked blocks."""
    from kvtool.engine.engine import LLMEngine
    from kvtool.engine.params import EngineParams

    engines = []

    def factory(**overrides):
        params = {"model": str(tiny_model_dir), "device": "cpu", "kv_cache_memory": 64 << 20}
        params.update(overrides)
        engine = LLMEngine(EngineParams(**params))
        engines.append(engine)
        return engine

    yield factory
    for engine in engines:
        if not engine.has_unfinished_requests():
            engine.check_integrity()
            assert engine.scheduler.pool.num_free_blocks == engine.num_blocks
        engine.close()


@pytest.fixture
def cli_env(tmp_path):
    """Environment for CLI subprocesses: this checkout importable, the user cache kept."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    return env


@pytest.fixture
def run_kvtool(capsys):
    """Run the kvtool CLI in this process: returns (exit code, stdout, stderr)."""
    from kvtool.cli import main

    def run(args: list[str]) -> tuple[int, str, str]:
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_info:
            main([str(a) for a in args])
        out = capsys.readouterr()
        code = exit_info.value.code
        return (0 if code is None else int(code)), out.out, out.err

    return run
