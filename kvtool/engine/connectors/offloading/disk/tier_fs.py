"""File access under a disk tier's root: relative to directory descriptors, never following a link.

Whoever can write into root_dir could plant symbolic links, directories, FIFOs or unreadable
files where the tier expects its own files. Every path under the tier is therefore resolved one
component at a time from a directory descriptor (`os.open(name, ..., dir_fd=parent)`) with
`O_NOFOLLOW`, `..` and empty components are refused, and a file is opened with `O_NONBLOCK`
and `fstat`ed before a byte is read, so a FIFO or a device is refused without ever blocking.

Refusals are `TierFileRefused` (a KVRefused) naming the file: the load-failure policy decides
what a refused block means; no OSError of a planted file escapes as an internal error.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator

from kvtool.engine.connectors.offloading.disk.tier_identity import TierFileRefused

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: opening a FIFO for reading must not wait for a writer; a regular file ignores it.
_FILE_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def file_type_name(mode: int) -> str:
    """What a non-regular file is, in words ("a directory", "a FIFO", ...)."""
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a regular file"


def split_relpath(relpath: str) -> list[str]:
    """The components of a path relative to a tier directory; '..', '.', '' and '/x' refused."""
    parts = relpath.split("/")
    for part in parts:
        if part in ("", ".", "..") or "\0" in part:
            raise TierFileRefused("corrupt", f"{relpath}: not a plain relative path inside the tier")
    return parts


def _refusal(relpath: str, e: OSError, dir_fd: int | None = None, name: str | None = None) -> TierFileRefused:
    """The refusal for an OSError while opening `relpath`; names what is in the way."""
    if e.errno == errno.ENOENT:
        return TierFileRefused("missing", f"{relpath}: not in the tier")
    if e.errno in (errno.EACCES, errno.EPERM):
        return TierFileRefused("unreadable", f"{relpath}: permission denied")
    if e.errno in (errno.ELOOP, errno.ENOTDIR) and dir_fd is not None and name is not None:
        with contextlib.suppress(OSError):
            mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
            return TierFileRefused("not_regular", f"{relpath}: {file_type_name(mode)}, refused")
    if e.errno == errno.ELOOP:
        return TierFileRefused("not_regular", f"{relpath}: a symbolic link, refused")
    return TierFileRefused("unreadable", f"{relpath}: {e.strerror or e}")


def open_dir_at(dir_fd: int, name: str, relpath: str, create: bool = False) -> int:
    """Open directory `name` of `dir_fd` without following a link; with `create`, make it first.

    Raises TierFileRefused for a link, a non-directory, a missing (without `create`) or an
    unreadable directory.
    """
    if create:
        try:
            os.mkdir(name, 0o755, dir_fd=dir_fd)
        except FileExistsError:
            pass  # or a link or a file in the way: the open below refuses those
        except OSError as e:
            raise _refusal(relpath, e, dir_fd, name) from None
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        raise _refusal(relpath, e, dir_fd, name) from None


@contextlib.contextmanager
def parent_dir(base_fd: int, relpath: str, create: bool = False) -> Iterator[tuple[int, str]]:
    """Yield (descriptor of the directory holding `relpath`, its last component).

    Each intermediate component is opened with `O_NOFOLLOW` relative to the previous one; the
    descriptors are closed on exit (`base_fd` is not).
    """
    parts = split_relpath(relpath)
    fd = base_fd
    opened: list[int] = []
    try:
        for i, part in enumerate(parts[:-1]):
            fd = open_dir_at(fd, part, "/".join(parts[: i + 1]), create=create)
            opened.append(fd)
        yield fd, parts[-1]
    finally:
        for d in opened:
            os.close(d)


def open_regular_at(dir_fd: int, name: str, relpath: str, flags: int = os.O_RDONLY) -> tuple[int, os.stat_result]:
    """Open regular file `name` of `dir_fd`; returns (fd, fstat). Anything else is refused.

    A link is refused by `O_NOFOLLOW`; a FIFO or device opens without blocking (`O_NONBLOCK`)
    and is refused after `fstat`, before any read; a directory is refused the same way.
    """
    try:
        fd = os.open(name, flags | _FILE_FLAGS, dir_fd=dir_fd)
    except IsADirectoryError:
        raise TierFileRefused("not_regular", f"{relpath}: a directory, refused") from None
    except OSError as e:
        raise _refusal(relpath, e, dir_fd, name) from None
    try:
        st = os.fstat(fd)
    except OSError as e:
        os.close(fd)
        raise _refusal(relpath, e) from None
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise TierFileRefused("not_regular", f"{relpath}: {file_type_name(st.st_mode)}, refused")
    return fd, st


def open_regular(base_fd: int, relpath: str, flags: int = os.O_RDONLY) -> tuple[int, os.stat_result]:
    """`open_regular_at` for a path of several components below `base_fd`."""
    with parent_dir(base_fd, relpath) as (fd, name):
        return open_regular_at(fd, name, relpath, flags)


def lstat_at(base_fd: int, relpath: str) -> os.stat_result | None:
    """The lstat of `relpath` below `base_fd` (no link followed anywhere); None when absent."""
    try:
        with parent_dir(base_fd, relpath) as (fd, name):
            return os.stat(name, dir_fd=fd, follow_symlinks=False)
    except TierFileRefused as e:
        if e.problem == "missing":
            return None
        raise
    except FileNotFoundError:
        return None


def open_root_dir(path: str | os.PathLike) -> int:
    """Open the user's root_dir itself (the one path that may be a link: the user chose it)."""
    return os.open(os.fspath(path), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
