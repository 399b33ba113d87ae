"""A `vllm-router` process for tests: on loopback, in front of given workers, stopped by its PID.

The router is the `vllm-router` package's own launcher (a Rust load balancer from the vLLM
project), installed with the test extras. It is ready once GET /health answers 200, which it
does after every worker answered its own /health.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import httpx
import pytest

from tests.support.peer_server import free_port

HOST = "127.0.0.1"


def router_binary() -> str:
    """The vllm-router launcher of this interpreter's environment, or a test failure saying how to get it."""
    beside = Path(sys.executable).with_name("vllm-router")
    found = str(beside) if beside.exists() else shutil.which("vllm-router")
    if found is None:
        pytest.fail("vllm-router is not installed: pip install -e '.[test]'", pytrace=False)
    return found


class RouterProcess:
    """One `vllm-router --worker-urls ... --policy POLICY` process."""

    def __init__(self, worker_urls: Sequence[str], policy: str, extra: Sequence[str] = (),
                 startup_timeout_s: float = 120.0) -> None:
        self.port = free_port()
        self.args = [
            router_binary(), "--host", HOST, "--port", str(self.port), "--worker-urls", *worker_urls,
            "--policy", policy, "--prometheus-host", HOST, "--prometheus-port", str(free_port()),
            "--log-level", "debug", *extra,
        ]
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen | None = None
        self._log = Path(tempfile.mkstemp(prefix="vllm-router-", suffix=".log")[1])

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def logs(self) -> str:
        return self._log.read_text(errors="replace") if self._log.exists() else ""

    def __enter__(self) -> RouterProcess:
        with open(self._log, "wb") as log:
            self.proc = subprocess.Popen(self.args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm-router exited ({self.proc.returncode}):\n{self.logs()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError(f"vllm-router was not ready within {self.startup_timeout_s:.0f} s:\n{self.logs()[-3000:]}")
            time.sleep(0.2)

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.unlink(missing_ok=True)
