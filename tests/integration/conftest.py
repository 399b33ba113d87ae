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
