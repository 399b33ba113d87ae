"""A `kvtool serve` subprocess for tests: started on a free loopback port, stopped by its PID.

    with ServerProcess(["--model", str(model_dir)]) as server:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused")

The server is started with `--port 0`: the kernel picks a free port, and the server names it in
its ready line on stderr, so there is no race for a port between tests running at once. The
server is ready once that line is out and GET /health answers 200. Its stdout and stderr go to
a log file whose text `logs()` returns, and which a failure to start quotes.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[2]
READY_LINE = re.compile(r"kvtool serve ready at (http://\S+)")


class ServerError(RuntimeError):
    """The server did not start, or did not stop, as asked."""


class ServerProcess:
    """One `kvtool serve` process.

    args: serve flags other than --port (the server's default host is 127.0.0.1). port: 0 (the
    default) lets the kernel pick a free one. launcher: the command before those flags, by default
    `python -m kvtool.cli serve`; a test may launch through `python -c CODE serve` to set up
    something in the server process first. env: extra environment variables.
    """

    def __init__(
        self,
        args: Sequence[str] = (),
        *,
        port: int = 0,
        launcher: Sequence[str] | None = None,
        env: dict[str, str] | None = None,
        startup_timeout_s: float = 300.0,
    ) -> None:
        self.args = list(args)
        self.port = port
        self.launcher = list(launcher) if launcher is not None else [sys.executable, "-m", "kvtool.cli", "serve"]
        self.env = dict(env or {})
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen | None = None
        self.url: str | None = None
        self._log_path: Path | None = None

    # ---- lifecycle ----------------------------------------------------------------------------

    def start(self) -> ServerProcess:
        fd, name = tempfile.mkstemp(prefix="kvtool-serve-", suffix=".log")
        os.close(fd)
        self._log_path = Path(name)
        pythonpath = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, "PYTHONPATH": pythonpath, **self.env}
        with open(self._log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [*self.launcher, "--port", str(self.port), *self.args],
                cwd=REPO_ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            )
        try:
            self._wait_ready()
        except BaseException:
            self.kill()
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while self.url is None:
            match = READY_LINE.search(self.logs())
            if match:
                self.url = match.group(1)
                break
            self._refuse_exited("before it was ready")
            if time.monotonic() > deadline:
                raise ServerError(f"no ready line within {self.startup_timeout_s:.0f} s:\n{self.logs()[-4000:]}")
            time.sleep(0.1)
        while True:
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            self._refuse_exited("while waiting for /health")
            if time.monotonic() > deadline:
                raise ServerError(f"/health did not answer 200 within {self.startup_timeout_s:.0f} s")
            time.sleep(0.1)

    def _refuse_exited(self, when: str) -> None:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise ServerError(f"the server exited with status {self.proc.returncode} {when}:\n{self.logs()[-4000:]}")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        """Send `sig` to the server's PID and wait for it to exit; returns its exit status.

        Raises ServerError (after killing it) when it has not exited within timeout_s.
        """
        if self.proc is None:
            raise ServerError("the server was never started")
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
                raise ServerError(f"the server did not exit within {timeout_s:.0f} s of signal {sig}") from None
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        try:
            self.stop()
        finally:
            if self._log_path is not None:
                self._log_path.unlink(missing_ok=True)

    # ---- facts --------------------------------------------------------------------------------

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def base_url(self) -> str:
        """The OpenAI base URL (…/v1)."""
        assert self.url is not None
        return f"{self.url}/v1"

    def logs(self) -> str:
        if self._log_path is None or not self._log_path.exists():
            return ""
        return self._log_path.read_text(errors="replace")

    def metrics(self) -> dict[str, float]:
        """GET /metrics parsed: {"name{labels}": value} per series, and {"name": sum over its series}."""
        assert self.url is not None
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        out: dict[str, float] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            series, value = line.rsplit(" ", 1)
            out[series] = float(value)
            name = series.split("{", 1)[0]
            out[name] = out.get(name, 0.0) + float(value) if name != series else float(value)
        return out
