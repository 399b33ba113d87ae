"""The services a run starts: a free loopback port, and a stop by PID that always ends the child."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys

from kvtool.workloads.local_process import HOST, free_port, stop_by_pid

# A child that ignores SIGTERM and says so once it does.
STUBBORN = "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(600)"


def test_free_port_can_be_bound_on_loopback():
    port = free_port()
    with socket.socket() as s:
        s.bind((HOST, port))
        s.listen(1)


def test_stop_by_pid_ends_a_child_that_stops_on_sigterm():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    stop_by_pid(proc)
    assert proc.returncode == -signal.SIGTERM


def test_stop_by_pid_kills_a_child_that_ignores_sigterm():
    proc = subprocess.Popen([sys.executable, "-c", STUBBORN], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"  # the handler is in place
    stop_by_pid(proc, grace_s=0.5)
    assert proc.returncode == -signal.SIGKILL
    proc.stdout.close()


def test_stop_by_pid_is_idempotent_on_an_exited_child():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    stop_by_pid(proc)
    stop_by_pid(proc)
    assert proc.returncode == 0
