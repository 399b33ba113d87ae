"""The disk tier: one identity-checked file per offload block under a shared root_dir.

The layout is in tier_layout.py: a ledger, and `<root>/kv/<tier_digest>/<h[:2]>/<h[2:4]>/<h>.kvb`.

A write goes to a temporary name in the final directory, is fsynced, then renamed into place
(and the directory fsynced): a crash leaves at most a temporary file, never half a block under
a real name. A read checks magic, header, identity, block hash, length and checksum before it
returns. Several processes may share one root_dir: each commit and eviction runs under an
flock on the ledger, and a file's mtime is the LRU clock every process reads and touches.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import heapq
import logging
import os
import stat
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import NamedTuple

import msgspec

from kvtool.engine.connectors.offloading.disk.tier_identity import (
    BLOCK_HASH_BYTES,
    KVBlockHeader,
    KVIdentity,
    TierFileRefused,
    encode_header,
    identity_differences,
    make_block_header,
    payload_checksum,
    read_header_fd,
    refuse_foreign_header,
    tier_digest,
)
from kvtool.engine.connectors.offloading.disk.tier_fs import (
    lstat_at,
    open_dir_at,
    open_regular,
    open_regular_at,
    open_root_dir,
    parent_dir,
)
from kvtool.engine.connectors.offloading.disk.tier_layout import (  # noqa: F401 (re-exported)
    BLOCK_SUFFIX,
    HOST_TAG,
    LEDGER_NAME,
    TEMP_GRACE_S,
    TEMP_SUFFIX,
    TIER_SUBDIR,
    TierEntry,
    TierFileKind,
    block_relpath,
    classify_name,
    is_orphaned_temp,
    make_temp_name,
    walk_tier,
)
from kvtool.engine.errors import ConfigError

logger = logging.getLogger(__name__)

_COMPARE_CHUNK_BYTES = 8 << 20

class TierLedger(msgspec.Struct, kw_only=True):
    """Shared bookkeeping in `<root>/kv/.ledger`; read and written only under its flock."""

    # Bytes of committed block files of every identity under root_dir.
    used_bytes: int = 0
    # The capacity the last writer with a limit enforced (0: none seen); shown by inspect.
    capacity_bytes: int = 0


_LEDGER_DECODER = msgspec.json.Decoder(TierLedger)
_LEDGER_MAX_BYTES = 4096


class TierBlock(NamedTuple):
    """A block this engine could load, found by a header-only scan (`DiskTier.scan`)."""

    block_hash: bytes
    num_tokens: int
    file_bytes: int
    used_ns: int  # mtime: the LRU clock


def _as_byte_view(buf: object, writable: bool) -> memoryview:
    """A flat byte view of bytes, a buffer, or a CPU contiguous tensor (no copy)."""
    # Only a tensor if torch is already loaded: `inspect` never imports it.
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(buf, torch.Tensor):
        if buf.device.type != "cpu" or not buf.is_contiguous():
            raise ValueError(
                f"disk tier needs a contiguous CPU tensor, got {buf.device} contiguous={buf.is_contiguous()}"
            )
        buf = buf.detach().reshape(-1).view(torch.uint8).numpy()
    view = memoryview(buf)  # type: ignore[arg-type]
    if writable and view.readonly:
        raise ValueError("disk tier read needs a writable buffer")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _unlink_at(base_fd: int, relpath: str) -> None:
    """Remove `relpath` below `base_fd` (a link itself, never its target); absent is fine."""
    with contextlib.suppress(FileNotFoundError, TierFileRefused), parent_dir(base_fd, relpath) as (fd, name):
        os.unlink(name, dir_fd=fd)


def _read_payload(fd: int, file_bytes: int, expected: KVIdentity, block_hash_hex: str, view: memoryview, where: str) -> KVBlockHeader:
    """Checks and reads of an open regular block file (see `read_file`)."""
    header, offset = read_header_fd(fd, file_bytes, where)
    refuse_foreign_header(expected, header, what=where)
    if header.block_hash != block_hash_hex:
        raise TierFileRefused("misplaced", f"{where}: file holds block {header.block_hash[:16]} instead")
    if header.payload_bytes != len(view):
        raise TierFileRefused(
            "size_mismatch",
            f"{where}: payload of {header.payload_bytes} bytes does not fit a {len(view)}-byte destination",
        )
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n == 0:
            raise TierFileRefused("truncated", f"{where}: file shrank while it was read")
        done += n
    if payload_checksum(view) != header.payload_checksum:
        raise TierFileRefused("torn", f"{where}: payload checksum mismatch (torn block)")
    return header


def read_file(path: Path | str, expected: KVIdentity, block_hash_hex: str, out: object) -> KVBlockHeader:
    """Read one block file into `out`, refusing it unless every check passes.

    Checks, in order: a regular file (a link, FIFO or directory is refused unopened for
    reading), magic, header checksum, format version, header fields, file length, identity
    (`refuse_foreign_header`), block hash, payload length == len(out), payload checksum.
    Raises TierFileRefused (a KVRefused) naming the problem; after a refusal the contents of
    `out` are unspecified and must not be used. Returns the header on success. `out` is a
    writable buffer or a contiguous CPU tensor (pinned is fine), filled in place.
    """
    view = _as_byte_view(out, writable=True)
    where = f"disk tier block {block_hash_hex[:16]}"
    path = Path(path)
    parent = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fd, st = open_regular_at(parent, path.name, str(path))
    except TierFileRefused as e:
        if e.problem == "missing":
            raise TierFileRefused("missing", f"{where}: not in the tier (evicted or never written)") from None
        raise
    finally:
        os.close(parent)
    try:
        return _read_payload(fd, st.st_size, expected, block_hash_hex, view, where)
    except OSError as e:
        raise TierFileRefused("unreadable", f"{where}: {e.strerror or e}") from None
    finally:
        os.close(fd)


class DiskTier:
    """One engine's view of a disk tier: writes under its identity, reads refusing any other.

    Thread-safe; several processes may share `root_dir`. With `capacity_bytes` > 0 the block
    files under root_dir (all identities) never exceed it after a commit: least recently
    used files (oldest mtime) are evicted first. In-flight temporary files are not counted.
    Every file is reached through descriptors of `<root>/kv` without following a link
    (tier_fs.py): nothing outside root_dir is read, written or touched.
    """

    def __init__(self, root_dir: Path | str, identity: KVIdentity, capacity_bytes: int = 0) -> None:
        """Create the tier's directories and ledger; with a capacity, scan and evict down to it.

        Raises ConfigError when root_dir cannot be created or written, or when `kv`, the
        identity's directory or the ledger is a link or not what it should be.
        """
        if capacity_bytes < 0:
            raise ConfigError(f"disk tier capacity must be >= 0 bytes, got {capacity_bytes}")
        self.root_dir = Path(root_dir)
        self.identity = identity
        self.capacity_bytes = capacity_bytes
        self.tier_root = self.root_dir / TIER_SUBDIR
        self.digest = tier_digest(identity)
        self._hash_bytes = BLOCK_HASH_BYTES.get(identity.hash_algorithm)
        # errnos already warned about: a full disk fails every write, one line is enough.
        self._warned_errnos: set[int | None] = set()
        self._kv_fd = self._ledger_fd = -1
        if "\0" in str(root_dir):
            raise ConfigError("disk tier root_dir contains a NUL character")
        try:
            self.root_dir.mkdir(parents=True, exist_ok=True)
            root_fd = open_root_dir(self.root_dir)
            try:
                self._kv_fd = open_dir_at(root_fd, TIER_SUBDIR, TIER_SUBDIR, create=True)
            finally:
                os.close(root_fd)
            os.close(open_dir_at(self._kv_fd, self.digest, f"{TIER_SUBDIR}/{self.digest}", create=True))
            self._ledger_fd = os.open(
                LEDGER_NAME, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644,
                dir_fd=self._kv_fd,
            )
            if not stat.S_ISREG(os.fstat(self._ledger_fd).st_mode):
                raise TierFileRefused("not_regular", f"{TIER_SUBDIR}/{LEDGER_NAME}: not a regular file")
        except TierFileRefused as e:
            self.close()
            raise ConfigError(f"disk tier root {self.root_dir} is not usable: {e}") from None
        except OSError as e:
            self.close()
            what = "a symbolic link" if e.errno == errno.ELOOP else e.strerror
            raise ConfigError(f"disk tier root {self.root_dir} is not usable: {e.filename or LEDGER_NAME}: {what}") from None
        # flock is per open file, so threads of this process also need a lock of their own.
        self._commit_lock = threading.Lock()
        self._clock_lock = threading.Lock()
        self._last_ns = 0
        # LRU candidates (mtime_ns, relpath under kv/, size); stale entries are re-checked when popped.
        self._lru: list[tuple[int, str, int]] | None = None
        # Block hashes of this identity evicted to stay under the capacity, until take_evicted().
        self._evicted: list[bytes] = []
        if capacity_bytes:
            # Recount at start: a crash between a rename and its ledger update leaves drift.
            with self._ledger_locked() as ledger:
                if self._lru is None:
                    self._rescan_locked(ledger)
                self._evict_locked(ledger, room=0, keep=None)

    def close(self) -> None:
        """Release the ledger and directory descriptors; the tier's files stay."""
        for name in ("_ledger_fd", "_kv_fd"):
            fd = getattr(self, name, -1)
            if fd >= 0:
                os.close(fd)
                setattr(self, name, -1)

    def __enter__(self) -> DiskTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- paths and lookups

    def relpath_for(self, block_hash: bytes) -> str:
        """Where this identity keeps `block_hash`, relative to `<root>/kv`.

        Raises ValueError for a hash of the wrong length for the identity's hash algorithm
        (for instance an offload key with its 4 group bytes still attached): that would
        otherwise be a silent miss.
        """
        if self._hash_bytes is not None and len(block_hash) != self._hash_bytes:
            raise ValueError(
                f"disk tier: a {self.identity.hash_algorithm} block hash has {self._hash_bytes} bytes, "
                f"got {len(block_hash)}"
            )
        return block_relpath(self.digest, block_hash.hex())

    def path_for(self, block_hash: bytes) -> Path:
        """The path of `block_hash`'s file, for messages and tools (I/O goes through descriptors)."""
        return self.tier_root / self.relpath_for(block_hash)

    def contains(self, block_hash: bytes) -> bool:
        """Whether a regular file exists for the block; no side effects (lookups may repeat).

        A hit is a promise to try, not a proof: `read_into` still checks everything.
        """
        try:
            st = lstat_at(self._kv_fd, self.relpath_for(block_hash))
        except (TierFileRefused, OSError):
            return False
        return st is not None and stat.S_ISREG(st.st_mode)

    def touch(self, block_hashes: Iterable[bytes]) -> None:
        """Mark blocks as just used (the LRU clock); blocks that vanished are skipped."""
        for block_hash in block_hashes:
            used_ns = self._clock_ns()
            # follow_symlinks=False: a planted link's target is never touched.
            with contextlib.suppress(OSError, TierFileRefused), parent_dir(
                self._kv_fd, self.relpath_for(block_hash)
            ) as (fd, name):
                os.utime(name, ns=(used_ns, used_ns), dir_fd=fd, follow_symlinks=False)

    def scan(self, max_blocks: int | None = None) -> list[TierBlock]:
        """The blocks of this identity the tier holds, from a header-only scan (no payload read).

        Each file is opened without following links and only its header (at most 64 KiB) is
        read; a file that is not regular, unreadable, foreign, damaged or misplaced is left
        out (`inspect` names those). At most `max_blocks` are returned (None: all).
        """
        blocks: list[TierBlock] = []
        for entry in walk_tier(self._kv_fd, only_digest=self.digest):
            if entry.kind != "block" or entry.st is None:
                continue
            if max_blocks is not None and len(blocks) >= max_blocks:
                break
            try:
                fd, st = open_regular(self._kv_fd, entry.relpath)
            except TierFileRefused:
                continue
            try:
                header, _ = read_header_fd(fd, st.st_size, entry.relpath)
                refuse_foreign_header(self.identity, header, what=entry.relpath)
                if block_relpath(self.digest, header.block_hash) != entry.relpath:
                    continue
                blocks.append(TierBlock(bytes.fromhex(header.block_hash), header.num_tokens, st.st_size, st.st_mtime_ns))
            except (TierFileRefused, OSError, ValueError):
                continue
            finally:
                os.close(fd)
        return blocks

    # -- write

    def write(self, block_hash: bytes, num_tokens: int, payload: object) -> bool:
        """Store one block atomically; returns whether the tier now holds it.

        `payload` is bytes, a buffer, or a contiguous CPU tensor; it is only read. An
        identical valid file already present is kept and touched. Never raises on I/O
        failure (full disk, quota, vanished directory, a link or directory in the way):
        returns False and removes the temporary file. Returns False too when the block
        alone exceeds the capacity.
        """
        data = _as_byte_view(payload, writable=False)
        block_hash_hex = block_hash.hex()
        header = make_block_header(self.identity, block_hash_hex, num_tokens, len(data), payload_checksum(data))
        head = encode_header(header)
        file_bytes = len(head) + len(data)
        if self.capacity_bytes and file_bytes > self.capacity_bytes:
            logger.warning(
                "disk tier: block of %d bytes exceeds capacity %d; not stored", file_bytes, self.capacity_bytes
            )
            return False
        relpath = self.relpath_for(block_hash)
        if self._holds_identical(relpath, header, data):
            self.touch([block_hash])
            return True
        try:
            with parent_dir(self._kv_fd, relpath, create=True) as (dir_fd, name):
                tmp = make_temp_name(name)
                try:
                    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                                 dir_fd=dir_fd)
                    try:
                        _write_all(fd, head)
                        _write_all(fd, data)
                        used_ns = self._clock_ns()
                        os.utime(fd, ns=(used_ns, used_ns))  # the rename keeps it: the LRU clock
                        os.fsync(fd)
                    finally:
                        os.close(fd)
                    self._commit(dir_fd, tmp, name, relpath, file_bytes, used_ns)
                except OSError:
                    with contextlib.suppress(OSError):
                        os.unlink(tmp, dir_fd=dir_fd)
                    raise
        except (OSError, TierFileRefused) as e:
            code = getattr(e, "errno", None)
            log = logger.debug if code in self._warned_errnos else logger.warning
            self._warned_errnos.add(code)
            log("disk tier: could not store block %s: %s", block_hash_hex[:16], e)
            return False
        return True

    def _holds_identical(self, relpath: str, header: KVBlockHeader, data: memoryview) -> bool:
        """Whether `relpath` already holds exactly these bytes under a compatible header.

        Compares the payload too, so that a damaged file is rewritten rather than kept: a
        read costs less than a write and its fsync, and stores of present blocks are rare
        (the connector asks `contains` first).
        """
        try:
            fd, st = open_regular(self._kv_fd, relpath)
        except (OSError, TierFileRefused):
            return False
        try:
            found, offset = read_header_fd(fd, st.st_size, relpath)
            if (
                identity_differences(header, found)
                or found.block_hash != header.block_hash
                or found.payload_checksum != header.payload_checksum
                or found.num_tokens != header.num_tokens
            ):
                return False
            for pos in range(0, len(data), _COMPARE_CHUNK_BYTES):
                want = bytes(data[pos : pos + _COMPARE_CHUNK_BYTES])  # bytes == bytes is a memcmp
                if os.pread(fd, len(want), offset + pos) != want:
                    return False
            return True
        except (OSError, TierFileRefused):
            return False
        finally:
            os.close(fd)

    def _commit(self, dir_fd: int, tmp: str, name: str, relpath: str, file_bytes: int, used_ns: int) -> None:
        """Under the shared lock: make room, rename into place, fsync the directory, count it."""
        with self._ledger_locked() as ledger:
            try:
                st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
                replaced_bytes = st.st_size if stat.S_ISREG(st.st_mode) else 0
            except FileNotFoundError:
                replaced_bytes = 0
            self._evict_locked(ledger, room=file_bytes - replaced_bytes, keep=relpath)
            # A link in the way is replaced itself; a directory in the way fails the rename.
            os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            ledger.used_bytes += file_bytes - replaced_bytes
            if self._lru is not None:
                heapq.heappush(self._lru, (used_ns, relpath, file_bytes))
        os.fsync(dir_fd)

    # -- read

    def read_into(self, block_hash: bytes, out: object) -> KVBlockHeader:
        """Read a block into the preallocated `out` after every check passes; touch it.

        Raises TierFileRefused (a KVRefused) naming the reason: missing, not a regular file
        (a link, directory or FIFO: refused without reading it), unreadable (permission
        denied), foreign format, future format, corrupt header, foreign identity (every
        differing field named), misplaced, size mismatch, truncated, torn. After a refusal
        `out` must not be used. Returns the header (its num_tokens tells how much of the
        block is valid).
        """
        view = _as_byte_view(out, writable=True)
        block_hash_hex = block_hash.hex()
        relpath = self.relpath_for(block_hash)
        where = f"disk tier block {block_hash_hex[:16]}"
        try:
            fd, st = open_regular(self._kv_fd, relpath)
        except TierFileRefused as e:
            if e.problem == "missing":
                raise TierFileRefused("missing", f"{where}: not in the tier (evicted or never written)") from None
            raise TierFileRefused(e.problem, f"{where}: {self.tier_root}/{e}") from None
        try:
            header = _read_payload(fd, st.st_size, self.identity, block_hash_hex, view, where)
            used_ns = self._clock_ns()
            with contextlib.suppress(OSError):
                os.utime(fd, ns=(used_ns, used_ns))  # the file itself, never a link's target
            return header
        except OSError as e:
            raise TierFileRefused("unreadable", f"{where}: {self.tier_root}/{relpath}: {e.strerror or e}") from None
        finally:
            os.close(fd)

    # -- capacity

    @property
    def used_bytes(self) -> int:
        """Bytes of committed block files under root_dir, as the shared ledger counts them."""
        with self._ledger_locked() as ledger:
            return ledger.used_bytes

    def evict_to_capacity(self) -> int:
        """Evict least recently used files until the tier fits its capacity; returns bytes freed.

        Writes already do this; call it after lowering `capacity_bytes`. No-op without a capacity.
        """
        with self._ledger_locked() as ledger:
            before = ledger.used_bytes
            self._evict_locked(ledger, room=0, keep=None)
            return before - ledger.used_bytes

    def _evict_locked(self, ledger: TierLedger, room: int, keep: str | None) -> None:
        """Delete oldest-mtime block files until `room` more bytes fit. Caller holds the lock.

        Files that another process touched since they were queued are re-queued; files it
        deleted are skipped. When the queue runs dry the tier is rescanned once, which also
        repairs a drifted ledger.
        """
        if not self.capacity_bytes:
            return
        if self._lru is None:
            self._rescan_locked(ledger)
        rescanned = False
        while ledger.used_bytes + room > self.capacity_bytes:
            if not self._lru:
                if rescanned:
                    break
                self._rescan_locked(ledger)
                rescanned = True
                continue
            used_ns, relpath, _ = heapq.heappop(self._lru)
            if relpath == keep:
                continue
            try:
                st = lstat_at(self._kv_fd, relpath)
            except (TierFileRefused, OSError):
                continue
            if st is None or not stat.S_ISREG(st.st_mode):
                continue
            if st.st_mtime_ns != used_ns:
                heapq.heappush(self._lru, (st.st_mtime_ns, relpath, st.st_size))
                continue
            try:
                with parent_dir(self._kv_fd, relpath) as (fd, name):
                    os.unlink(name, dir_fd=fd)
            except (FileNotFoundError, TierFileRefused):
                continue
            ledger.used_bytes -= st.st_size
            self._note_evicted(relpath)

    def _note_evicted(self, relpath: str) -> None:
        """Remember an evicted block of this identity (`<digest>/<h[:2]>/<h[2:4]>/<h>.kvb` under kv/)."""
        parts = relpath.split("/")
        if parts[0] != self.digest or not parts[-1].endswith(BLOCK_SUFFIX):
            return
        try:
            self._evicted.append(bytes.fromhex(parts[-1][: -len(BLOCK_SUFFIX)]))
        except ValueError:
            pass

    def take_evicted(self) -> list[bytes]:
        """Block hashes of this identity that evictions removed since the last call."""
        with self._commit_lock:
            evicted, self._evicted = self._evicted, []
        return evicted

    def _rescan_locked(self, ledger: TierLedger) -> None:
        """Recount every block file under root_dir, rebuild the LRU queue, drop orphaned temp files."""
        lru: list[tuple[int, str, int]] = []
        used = 0
        now_s = time.time()
        for entry in walk_tier(self._kv_fd):
            st = entry.st
            if st is None or not stat.S_ISREG(st.st_mode):
                continue  # links, FIFOs, directories in the way: never counted, never followed
            if entry.kind == "block":
                used += st.st_size
                lru.append((st.st_mtime_ns, entry.relpath, st.st_size))
            elif entry.kind == "temp" and is_orphaned_temp(entry.name, st.st_mtime, now_s):
                _unlink_at(self._kv_fd, entry.relpath)
        heapq.heapify(lru)
        ledger.used_bytes = used
        self._lru = lru if self.capacity_bytes else None

    @contextlib.contextmanager
    def _ledger_locked(self) -> Iterator[TierLedger]:
        """Hold the process-wide and cross-process lock; yield the ledger, write it back after."""
        with self._commit_lock:
            fcntl.flock(self._ledger_fd, fcntl.LOCK_EX)
            try:
                raw = os.pread(self._ledger_fd, _LEDGER_MAX_BYTES, 0)
                try:
                    ledger = _LEDGER_DECODER.decode(raw)
                except msgspec.DecodeError:
                    ledger = TierLedger()  # new or damaged: count from the files
                    self._rescan_locked(ledger)
                try:
                    yield ledger
                finally:
                    # Also after a failure: evictions already done must stay counted.
                    if self.capacity_bytes:
                        ledger.capacity_bytes = self.capacity_bytes
                    ledger.used_bytes = max(ledger.used_bytes, 0)  # files removed behind our back
                    data = msgspec.json.encode(ledger)
                    if data != raw:
                        os.pwrite(self._ledger_fd, data, 0)
                        os.ftruncate(self._ledger_fd, len(data))
            finally:
                fcntl.flock(self._ledger_fd, fcntl.LOCK_UN)

    # -- LRU clock

    def _clock_ns(self) -> int:
        """Wall-clock ns, strictly increasing within this process (coarse fs timestamps tie)."""
        with self._clock_lock:
            self._last_ns = max(time.time_ns(), self._last_ns + 1)
            return self._last_ns


def read_ledger(root_dir: Path | str) -> TierLedger | None:
    """The ledger of a tier, read without locking (for reports); None if absent, unreadable or not a file."""
    try:
        root_fd = open_root_dir(root_dir)
    except OSError:
        return None
    try:
        fd, _ = open_regular(root_fd, f"{TIER_SUBDIR}/{LEDGER_NAME}")
    except (OSError, TierFileRefused):
        return None
    finally:
        os.close(root_fd)
    try:
        return _LEDGER_DECODER.decode(os.pread(fd, _LEDGER_MAX_BYTES, 0))
    except (OSError, msgspec.DecodeError):
        return None
    finally:
        os.close(fd)
