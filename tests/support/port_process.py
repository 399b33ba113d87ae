"""A test helper script that prints the port it listens on as its first line, run for one block."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

from kvtool.workloads import local_process
from tests.conftest import REPO


@contextlib.contextmanager
def port_process(script: str, *args: str) -> Iterator[int]:
    """Run tests/support/`script` with `args` on this interpreter; yield the port it prints; kill it by PID."""
    with local_process.port_process([sys.executable, str(REPO / "tests" / "support" / script), *args]) as port:
        yield port
