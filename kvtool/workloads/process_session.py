"""Ending a process started in a session of its own (a vLLM arm: the driver and vLLM's engine-core
process), and waiting for the GPU memory it held to come back."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path


def session_members(sid: int) -> list[int]:
    """The processes of session `sid` still running (zombies, which hold no memory, left out)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[3]) == sid:  # state, session id
            members.append(int(stat.parent.name))
    return members


def end_session(proc: subprocess.Popen, wait_s: float) -> str | None:
    """Kill `proc`'s session and wait, at most `wait_s` in all, until none of it is left and the
    GPU memory it held is free again. Returns None then, else what is still held, in words."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.poll()  # reaps the leader itself
        left = session_members(proc.pid)
        if not left:
            break
        if time.monotonic() > deadline:
            return f"processes {left} outlived a kill by {wait_s:.0f}s"
        time.sleep(0.2)
    return _wait_gpu_memory_back(deadline)


def _wait_gpu_memory_back(deadline: float) -> str | None:
    # The driver frees a killed process's memory some time after the process is gone.
    import torch

    if not torch.cuda.is_available():
        return None
    total = torch.cuda.mem_get_info()[1]
    while True:
        free = torch.cuda.mem_get_info()[0]
        # Whatever this process holds itself, plus its context, is not the session's.
        if free >= total - torch.cuda.memory_reserved() - (2 << 30):
            return None
        if time.monotonic() > deadline:
            return f"{(total - free) / 2**30:.1f} GiB of GPU memory still held after the session ended"
        time.sleep(0.5)
