"""Fixtures for integration tests against real peers."""

from __future__ import annotations

import pytest

from tests.peer_server import PeerServer


@pytest.fixture(scope="session")
def lmcache_server(tmp_path_factory):
    """LMCache's own `lmcache.v1.server` on 127.0.0.1 and a free port, shared by the session.

    Yields a `PeerServer`, which unpacks as `(host, port, pid)`. Tests use keys of their own.
    Fails (never skips) when the peer environment is missing: build it with `scripts/peer-env`.
    """
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
