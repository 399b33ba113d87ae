"""Where a disk tier keeps what, and a walk over it that never follows a link.

    <root_dir>/kv/.ledger                                       used bytes, under flock
    <root_dir>/kv/<tier_digest>/<h[:2]>/<h[2:4]>/<h>.kvb        header + payload (tier_identity.py)
    <root_dir>/kv/<tier_digest>/<h[:2]>/<h[2:4]>/.<h>.kvb.<host>.<pid>.<rand>.tmp   in flight

The digest covers every compared identity field, tp_size and tp_rank included: each
tensor-parallel rank writes its own KV-head shard under a directory of its own.
"""

from __future__ import annotations

import os
import secrets
import socket
import stat
from collections.abc import Iterator
from typing import Literal, NamedTuple

import blake3

from kvtool.engine.connectors.offloading.disk.tier_fs import file_type_name, open_dir_at
from kvtool.engine.connectors.offloading.disk.tier_identity import TierFileRefused

TIER_SUBDIR = "kv"
BLOCK_SUFFIX = ".kvb"
TEMP_SUFFIX = ".tmp"
LEDGER_NAME = ".ledger"
# A temporary file older than this is a crashed writer's leftover, whoever wrote it.
TEMP_GRACE_S = 600.0
HOST_TAG = blake3.blake3(socket.gethostname().encode()).hexdigest()[:8]

TierFileKind = Literal["block", "temp", "ledger", "stray", "special", "unreadable"]
# Directory levels below <root>/kv: <digest>/<h[:2]>/<h[2:4]>/ hold the files.
_DIR_LEVELS = 3


class TierEntry(NamedTuple):
    """One entry found under `<root>/kv`, never followed if it is a link."""

    relpath: str  # relative to <root>/kv, '/'-separated
    name: str
    kind: TierFileKind
    st: os.stat_result | None  # lstat; None for an unreadable directory
    detail: str = ""  # for "special" and "unreadable": what it is


def block_relpath(digest: str, block_hash_hex: str) -> str:
    """Path of a block file relative to `<root>/kv`: `<digest>/<h[:2]>/<h[2:4]>/<h>.kvb`."""
    h = block_hash_hex
    return f"{digest}/{h[:2]}/{h[2:4]}/{h}{BLOCK_SUFFIX}"


def make_temp_name(final_name: str) -> str:
    """A writer-unique hidden name beside `final_name`: host, pid and a random suffix."""
    return f".{final_name}.{HOST_TAG}.{os.getpid()}.{secrets.token_hex(4)}{TEMP_SUFFIX}"


def classify_name(name: str, top_level: bool) -> TierFileKind:
    """What a file under `<root>/kv` is, from its name alone."""
    if top_level and name == LEDGER_NAME:
        return "ledger"
    if name.startswith(".") and name.endswith(TEMP_SUFFIX):
        return "temp"
    if name.endswith(BLOCK_SUFFIX) and not name.startswith("."):
        return "block"
    return "stray"


def is_orphaned_temp(name: str, mtime_s: float, now_s: float) -> bool:
    """True when a temporary file's writer is gone: dead pid on this host, or older than the grace.

    A temp file of a live writer (this host, pid alive, recent) is in flight, not damage.
    """
    if now_s - mtime_s > TEMP_GRACE_S:
        return True
    parts = name[1 : -len(TEMP_SUFFIX)].rsplit(".", 3)
    if len(parts) != 4 or not parts[2].isdigit():
        return True
    host, pid = parts[1], int(parts[2])
    if host != HOST_TAG:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def walk_tier(kv_fd: int, only_digest: str | None = None) -> Iterator[TierEntry]:
    """Every entry under `<root>/kv` (the directory open as `kv_fd`), with its kind.

    Directories are entered only at the levels the layout has, by descriptor and never
    through a link; a link, FIFO, socket or device anywhere, or a directory where a file
    belongs, is a "special" entry; a directory that cannot be opened is "unreadable".
    Directories vanishing mid-walk (concurrent eviction) are skipped.
    """
    # Directories still to list, by path: holding a descriptor for each would run out of them.
    stack: list[tuple[str, int]] = [("", 0)]
    while stack:
        prefix, depth = stack.pop()
        opened: list[int] = []
        try:
            dir_fd = kv_fd
            parts = prefix.rstrip("/").split("/") if prefix else []
            for n, part in enumerate(parts):
                dir_fd = open_dir_at(dir_fd, part, "/".join(parts[: n + 1]))
                opened.append(dir_fd)
        except TierFileRefused as e:  # replaced since it was listed
            for fd in opened:
                os.close(fd)
            if e.problem != "missing":
                yield TierEntry(prefix.rstrip("/"), parts[-1], "special", None, str(e))
            continue
        try:
            yield from _walk_dir(dir_fd, prefix, depth, only_digest, stack)
        finally:
            for fd in opened:
                os.close(fd)


def _walk_dir(
    dir_fd: int, prefix: str, depth: int, only_digest: str | None, stack: list[tuple[str, int]]
) -> Iterator[TierEntry]:
    """The entries of one directory; subdirectories to enter are pushed on `stack`."""
    try:
        with os.scandir(dir_fd) as it:
            found = []
            for entry in it:
                if depth == 0 and only_digest is not None and entry.name != only_digest:
                    continue
                try:
                    found.append((entry.name, entry.stat(follow_symlinks=False)))
                except FileNotFoundError:
                    continue
    except OSError as e:
        where = prefix.rstrip("/")
        yield TierEntry(where, where.rsplit("/", 1)[-1], "unreadable", None, f"{where}: {e.strerror or e}")
        return
    for name, st in found:
        rel = f"{prefix}{name}"
        if stat.S_ISDIR(st.st_mode) and depth < _DIR_LEVELS:
            try:  # opened once here to tell an unreadable directory from one to enter
                os.close(open_dir_at(dir_fd, name, rel))
            except TierFileRefused as e:
                if e.problem != "missing":
                    kind: TierFileKind = "unreadable" if e.problem == "unreadable" else "special"
                    yield TierEntry(rel, name, kind, st, str(e))
                continue
            stack.append((f"{rel}/", depth + 1))
        elif stat.S_ISREG(st.st_mode):
            yield TierEntry(rel, name, classify_name(name, depth == 0), st)
        else:
            yield TierEntry(rel, name, "special", st, f"{rel}: {file_type_name(st.st_mode)}, refused")
