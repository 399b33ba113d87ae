"""The real LMCache server and client for tests, run from the peer environment.

`PeerServer.start()` runs `PEER_PYTHON -m lmcache.v1.server 127.0.0.1 PORT` (LMCache's own
reference server, unmodified) and returns once a HEALTH request answers 200. It is stopped by
PID. `run_lmcache_client` drives LMCache's own `LMCServerConnector` through
`kvtool/peer/lmcache_client.py`. Nothing here skips: a missing peer environment is a failure
that says how to build it.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from kvtool.engine.connectors.lmcache.stores.lm_client import LMClient
from kvtool.peer.env import is_peer_ready, peer_env, peer_python, peer_script
from kvtool.workloads.local_process import HOST, free_port, stop_by_pid
START_TIMEOUT_S = 90.0  # importing torch on a busy 2-core machine can take a while

# A killed server closes its connections first, and the TIME_WAIT / FIN_WAIT2 entries they
# leave hold its port for a minute: LMCache's listener (no SO_REUSEADDR) cannot bind it again.
# Linux lets a new listener in only if the old one had SO_REUSEADDR too, so a server meant to
# be restarted on its port runs the unmodified server module with SO_REUSEADDR set on the
# sockets it binds, from its first launch on.
_SERVER_WITH_REUSEADDR = """
import runpy, socket, sys

class _ReuseAddrSocket(socket.socket):
    def bind(self, address):
        self.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        super().bind(address)

socket.socket = _ReuseAddrSocket
sys.argv[0] = "lmcache.v1.server"
runpy.run_module("lmcache.v1.server", run_name="__main__", alter_sys=True)
"""


def require_peer_python() -> Path:
    """The peer interpreter, or a test failure telling how to build it."""
    python = peer_python()
    if not is_peer_ready():
        pytest.fail(
            f"the LMCache peer environment is missing or incomplete ({python}); "
            "build it with scripts/peer-env (a few minutes, once)",
            pytrace=False,
        )
    return python


class PeerServer:
    """A running `lmcache.v1.server`; unpacks as `(host, port, pid)`."""

    def __init__(self, port: int, log_path: Path, restartable: bool = False):
        self.host = HOST
        self.port = port
        self.log_path = log_path
        self.restartable = restartable
        self.proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None, "server is not running"
        return self.proc.pid

    def __iter__(self):
        return iter((self.host, self.port, self.pid))

    @classmethod
    def start(cls, log_dir: Path, restartable: bool = False) -> PeerServer:
        """Start a server on a free port and wait until HEALTH answers 200.

        A plain server is exactly `PEER_PYTHON -m lmcache.v1.server 127.0.0.1 PORT`; a
        `restartable` one also sets SO_REUSEADDR (see above) so that `restart()` can work.
        """
        server = cls(free_port(), log_dir / "lmcache-server.log", restartable)
        server.launch()
        return server

    def launch(self) -> None:
        """Start the server process and wait until HEALTH answers 200 (fails the test otherwise)."""
        python = require_peer_python()
        entry = ["-c", _SERVER_WITH_REUSEADDR] if self.restartable else ["-m", "lmcache.v1.server"]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [str(python), *entry, self.host, str(self.port)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=peer_env(),
            )
        probe = LMClient(self.host, self.port, connections=1, timeout_s=2.0, backoff_s=0)  # it polls
        deadline = time.monotonic() + START_TIMEOUT_S
        try:
            while not probe.health():
                if self.proc.poll() is not None:
                    pytest.fail(f"lmcache.v1.server exited with {self.proc.returncode}:\n{self.log_tail()}")
                if time.monotonic() > deadline:
                    self.stop()
                    tail = self.log_tail()
                    pytest.fail(f"lmcache.v1.server did not answer HEALTH in {START_TIMEOUT_S} s:\n{tail}")
                time.sleep(0.05)
        finally:
            probe.close()

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Kill the server by PID and wait for it. Idempotent."""
        if self.proc is not None:
            stop_by_pid(self.proc, sig)
            self.proc = None

    def restart(self) -> None:
        """Kill the server hard (as a crash would) and start a new one on the same port: it is empty."""
        assert self.restartable, "only a server started with restartable=True can rebind its port"
        self.stop(signal.SIGKILL)
        self.launch()

    def log_tail(self, num_bytes: int = 4000) -> str:
        data = self.log_path.read_bytes() if self.log_path.exists() else b""
        return data[-num_bytes:].decode(errors="replace")


def run_lmcache_client(*args: str) -> subprocess.Popen:
    """Start `kvtool/peer/lmcache_client.py ARGS...` in the peer interpreter (see `finish_client`)."""
    python = require_peer_python()
    return subprocess.Popen(
        [str(python), str(peer_script("lmcache_client.py")), *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=peer_env(),
        text=True,
    )


def finish_client(proc: subprocess.Popen, timeout_s: float = 120.0) -> dict:
    """Wait for a `run_lmcache_client` process; its JSON answer, or a failure with its stderr."""
    out, err = proc.communicate(timeout=timeout_s)
    if proc.returncode != 0:
        pytest.fail(f"lmcache_client.py exited with {proc.returncode}:\n{err[-4000:]}")
    return json.loads(out)
