"""An LMCache server for the `lmcache` arm: the URL the user gave, or one started for the run.

Without `--lmcache-url`, LMCache's own reference server (`python -m lmcache.v1.server HOST PORT`)
is started from the peer environment (`kvtool.peer.peer_python()`, built by scripts/peer-env) on
127.0.0.1 and a free port, and stopped by its PID when the run ends. Its output goes to a log
file that a failure to start quotes.
"""

from __future__ import annotations

import contextlib
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from kvtool.engine.connectors.lmcache.stores.lm_client import LMClient
from kvtool.engine.connectors.lmcache.stores.protocol import parse_lm_url
from kvtool.engine.errors import ConfigError, PeerError
from kvtool.peer.env import peer_env, peer_python
from kvtool.workloads.local_process import HOST, free_port, stop_by_pid

START_TIMEOUT_S = 120.0


@contextlib.contextmanager
def lmcache_server(url: str | None) -> Iterator[str]:
    """Yields an lm:// URL: `url` itself (checked), or that of a server started for the block.

    Raises ConfigError for a malformed URL or a missing peer environment, PeerError when the
    started server exits or does not answer HEALTH within START_TIMEOUT_S.
    """
    if url is not None:
        parse_lm_url(url)
        yield url
        return
    python = peer_python()
    if not python.exists():
        raise ConfigError(
            f"the lmcache arm needs --lmcache-url lm://HOST:PORT, or the LMCache peer environment "
            f"({python} does not exist; build it with scripts/peer-env)"
        )
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="kvtool-lmcache-") as tmp:
        log_path = Path(tmp) / "server.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [str(python), "-m", "lmcache.v1.server", HOST, str(port)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=peer_env(),
            )
        try:
            _wait_healthy(proc, port, log_path)
            yield f"lm://{HOST}:{port}"
        finally:
            stop_by_pid(proc)


def _wait_healthy(proc: subprocess.Popen, port: int, log_path: Path) -> None:
    probe = LMClient(HOST, port, connections=1, timeout_s=2.0, backoff_s=0)  # it polls
    deadline = time.monotonic() + START_TIMEOUT_S
    try:
        while not probe.health():
            if proc.poll() is not None:
                tail = log_path.read_text(errors="replace")[-2000:]
                raise PeerError(f"the LMCache server exited with status {proc.returncode}: {tail.strip()}")
            if time.monotonic() > deadline:
                raise PeerError(f"the LMCache server did not answer HEALTH within {START_TIMEOUT_S:.0f} s")
            time.sleep(0.1)
    finally:
        probe.close()
