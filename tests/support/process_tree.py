"""The processes below a PID, read from /proc (Linux), for tests that check nothing is left behind."""

from __future__ import annotations

import os
import time
from pathlib import Path


def _parent_of(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may hold spaces: split after its end.
    fields = stat[stat.rindex(")") + 2 :].split()
    return int(fields[1]) if fields[0] != "Z" else None


def descendants(pid: int) -> list[int]:
    """Every live (non-zombie) process whose chain of parents reaches `pid`."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            ppid = _parent_of(int(entry))
            if ppid is not None:
                parents[int(entry)] = ppid
    found, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        children = [c for c, pp in parents.items() if pp == p]
        found += children
        frontier += children
    return sorted(found)


def running(pids: list[int]) -> list[int]:
    """Those of `pids` that are still running (not gone, not zombies)."""
    alive = []
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        if stat[stat.rindex(")") + 2] != "Z":
            alive.append(pid)
    return alive


def wait_gone(pids: list[int], timeout_s: float = 15.0) -> list[int]:
    """Wait until none of `pids` runs; returns those still running after timeout_s."""
    deadline = time.monotonic() + timeout_s
    while running(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return running(pids)
