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
    from kvtool.engine.presets.catalog import create_model_dir

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
            assert engine.scheduler.pool.num_free_blocks == engine.scheduler.pool.num_usable_blocks
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


# -- real LMCache servers from the peer environment --


@pytest.fixture(scope="session")
def lmcache_server(tmp_path_factory):
    """LMCache's own `lmcache.v1.server` on 127.0.0.1 and a free port, shared by the session.

    Yields a `PeerServer`, which unpacks as `(host, port, pid)`. Tests use keys of their own.
    Fails (never skips) when the peer environment is missing: build it with `scripts/peer-env`.
    """
    from tests.support.peer_server import PeerServer

    server = PeerServer.start(tmp_path_factory.mktemp("lmcache-server"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def restartable_lmcache_server(tmp_path):
    """A server of the test's own that `stop()`, `launch()` and `restart()` may kill and start
    again on the same port (the shared one must stay up). A restarted server is empty.
    """
    from tests.support.peer_server import PeerServer

    server = PeerServer.start(tmp_path, restartable=True)
    try:
        yield server
    finally:
        server.stop()


# -- real redis-server processes (Debian's redis-server on PATH; scripts/install --test adds it) --


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """One `redis-server` on 127.0.0.1 and a free port, shared by the session (a `RedisServer`)."""
    from kvtool.workloads.redis_server import RedisServer, free_port

    server = RedisServer(free_port(), tmp_path_factory.mktemp("redis")).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory):
    """A three-master Redis Cluster on loopback, shared by the session (tests that kill a node
    use `own_redis_cluster`)."""
    from kvtool.workloads.redis_server import RedisClusterProcesses

    cluster = RedisClusterProcesses(tmp_path_factory.mktemp("redis-cluster")).start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def own_redis_server(tmp_path):
    """A `redis-server` of the test's own, which it may stop or restart empty."""
    from kvtool.workloads.redis_server import RedisServer, free_port

    server = RedisServer(free_port(), tmp_path / "redis").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def own_redis_cluster(tmp_path):
    """A three-master Redis Cluster of the test's own, whose masters it may kill."""
    from kvtool.workloads.redis_server import RedisClusterProcesses

    cluster = RedisClusterProcesses(tmp_path / "cluster").start()
    try:
        yield cluster
    finally:
        cluster.stop()


# -- marks by what a test needs: `-m "not slow"` skips the process-heavy ones, `-m "not peer"`
# the ones that need the real LMCache peer environment; CUDA tests carry `cuda` themselves. --

PEER_FIXTURES = {"lmcache_server", "restartable_lmcache_server"}
PROCESS_FIXTURES = PEER_FIXTURES | {"cli_env", "redis_server", "redis_cluster", "own_redis_server",
                                    "own_redis_cluster", "server", "failing_server"}


def pytest_collection_modifyitems(items):
    for item in items:
        used = set(getattr(item, "fixturenames", ()))
        if used & PEER_FIXTURES:
            item.add_marker(pytest.mark.peer)
        if used & PROCESS_FIXTURES:
            item.add_marker(pytest.mark.slow)
