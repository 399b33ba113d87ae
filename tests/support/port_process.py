"""A test helper script that prints the port it listens on as its first line, run for one block."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator

from tests.conftest import REPO


@contextlib.contextmanager
def port_process(script: str, *args: str) -> Iterator[int]:
    """Run tests/support/`script` with `args` on this interpreter; yield the port it prints; kill it by PID."""
    proc = subprocess.Popen([sys.executable, str(REPO / "tests" / "support" / script), *args], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        yield int(proc.stdout.readline())
    finally:
        proc.kill()
        proc.wait()
