"""Services a run starts for itself on loopback: a free port to bind, and a stop by PID.

The LMCache server and the redis-server processes of the `lmcache` and `redis*` arms (and of the
tests) are children of the run, bound to 127.0.0.1 on ports the kernel just handed out, and
stopped by their PID when the run ends: a signal, a bounded wait, then SIGKILL.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
from collections.abc import Iterator

HOST = "127.0.0.1"
STOP_GRACE_S = 10.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def stop_by_pid(proc: subprocess.Popen, sig: int = signal.SIGTERM, grace_s: float = STOP_GRACE_S) -> None:
    """Send `sig` to a child still running and wait for it; SIGKILL after `grace_s`. Idempotent."""
    if proc.poll() is not None:
        return
    os.kill(proc.pid, sig)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()


@contextlib.contextmanager
def port_process(argv: list[str]) -> Iterator[int]:
    """Run `argv`, a server that prints the port it listens on as its first line; yield that port;
    kill it by PID when the block ends."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        yield int(proc.stdout.readline())
    finally:
        stop_by_pid(proc, signal.SIGKILL)
