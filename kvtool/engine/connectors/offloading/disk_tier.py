"""The disk tier: one identity-checked file per offload block under a shared root_dir.

    <root_dir>/kv/.ledger                                       used bytes, under flock
    <root_dir>/kv/<tier_digest>/<h[:2]>/<h[2:4]>/<h>.kvb        header + payload (identity.py)
    <root_dir>/kv/<tier_digest>/<h[:2]>/<h[2:4]>/.<h>.kvb.<host>.<pid>.<rand>.tmp   in flight

A write goes to a temporary name in the final directory, is fsynced, then renamed into place
(and the directory fsynced): a crash leaves at most a temporary file, never half a block under
a real name. A read checks magic, header, identity, block hash, length and checksum before it
returns. Several processes may share one root_dir: each commit and eviction runs under an
flock on the ledger, and a file's mtime is the LRU clock every process reads and touches.
"""

from __future__ import annotations

import contextlib
import fcntl
import heapq
import logging
import os
import secrets
import socket
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Literal

import blake3
import msgspec

from kvtool.engine.connectors.offloading.identity import (
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
from kvtool.engine.errors import ConfigError

logger = logging.getLogger(__name__)

TIER_SUBDIR = "kv"
BLOCK_SUFFIX = ".kvb"
TEMP_SUFFIX = ".tmp"
LEDGER_NAME = ".ledger"
# A temporary file older than this is a crashed writer's leftover, whoever wrote it.
TEMP_GRACE_S = 600.0
_COMPARE_CHUNK_BYTES = 8 << 20
HOST_TAG = blake3.blake3(socket.gethostname().encode()).hexdigest()[:8]

TierFileKind = Literal["block", "temp", "ledger", "stray"]


class TierLedger(msgspec.Struct, kw_only=True):
    """Shared bookkeeping in `<root>/kv/.ledger`; read and written only under its flock."""

    # Bytes of committed block files of every identity under root_dir.
    used_bytes: int = 0
    # The capacity the last writer with a limit enforced (0: none seen); shown by inspect.
    capacity_bytes: int = 0


_LEDGER_DECODER = msgspec.json.Decoder(TierLedger)


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


def walk_tier(tier_root: Path) -> Iterator[tuple[os.DirEntry, TierFileKind]]:
    """Every file under `<root>/kv` with its kind; directories vanishing mid-walk are skipped."""
    stack = [(str(tier_root), True)]
    while stack:
        directory, top_level = stack.pop()
        try:
            with os.scandir(directory) as it:
                entries = list(it)
        except (FileNotFoundError, NotADirectoryError):
            continue
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                stack.append((entry.path, False))
            else:
                yield entry, classify_name(entry.name, top_level)


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


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlink_quiet(path: Path | str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def read_file(path: Path | str, expected: KVIdentity, block_hash_hex: str, out: object) -> KVBlockHeader:
    """Read one block file into `out`, refusing it unless every check passes.

    Checks, in order: magic, header checksum, format version, header fields, file length,
    identity (`refuse_foreign_header`), block hash, payload length == len(out), payload
    checksum. Raises TierFileRefused (a KVRefused) naming the problem; after a refusal the
    contents of `out` are unspecified and must not be used. Returns the header on success.
    `out` is a writable buffer or a contiguous CPU tensor (pinned is fine), filled in place.
    """
    view = _as_byte_view(out, writable=True)
    where = f"disk tier block {block_hash_hex[:16]}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise TierFileRefused("missing", f"{where}: not in the tier (evicted or never written)") from None
    try:
        file_bytes = os.fstat(fd).st_size
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
    finally:
        os.close(fd)


class DiskTier:
    """One engine's view of a disk tier: writes under its identity, reads refusing any other.

    Thread-safe; several processes may share `root_dir`. With `capacity_bytes` > 0 the block
    files under root_dir (all identities) never exceed it after a commit: least recently
    used files (oldest mtime) are evicted first. In-flight temporary files are not counted.
    """

    def __init__(self, root_dir: Path | str, identity: KVIdentity, capacity_bytes: int = 0) -> None:
        """Create the tier's directories and ledger; with a capacity, scan and evict down to it.

        Raises ConfigError when root_dir cannot be created or written.
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
        try:
            (self.tier_root / self.digest).mkdir(parents=True, exist_ok=True)
            self._ledger_fd = os.open(self.tier_root / LEDGER_NAME, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise ConfigError(f"disk tier root {self.root_dir} is not usable: {e.strerror}") from None
        # flock is per open file, so threads of this process also need a lock of their own.
        self._commit_lock = threading.Lock()
        self._clock_lock = threading.Lock()
        self._last_ns = 0
        # LRU candidates (mtime_ns, path, size); stale entries are re-checked when popped.
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
        """Release the ledger file; the tier's files stay."""
        if self._ledger_fd >= 0:
            os.close(self._ledger_fd)
            self._ledger_fd = -1

    def __enter__(self) -> DiskTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- paths and lookups

    def path_for(self, block_hash: bytes) -> Path:
        """Where this identity keeps `block_hash`.

        Raises ValueError for a hash of the wrong length for the identity's hash algorithm
        (for instance an offload key with its 4 group bytes still attached): that would
        otherwise be a silent miss.
        """
        if self._hash_bytes is not None and len(block_hash) != self._hash_bytes:
            raise ValueError(
                f"disk tier: a {self.identity.hash_algorithm} block hash has {self._hash_bytes} bytes, "
                f"got {len(block_hash)}"
            )
        return self.tier_root / block_relpath(self.digest, block_hash.hex())

    def contains(self, block_hash: bytes) -> bool:
        """Whether a file exists for the block; no side effects (lookups may repeat).

        A hit is a promise to try, not a proof: `read_into` still checks everything.
        """
        return os.path.exists(self.path_for(block_hash))

    def touch(self, block_hashes: Iterable[bytes]) -> None:
        """Mark blocks as just used (the LRU clock); blocks that vanished are skipped."""
        for block_hash in block_hashes:
            self._touch_path(self.path_for(block_hash))

    # -- write

    def write(self, block_hash: bytes, num_tokens: int, payload: object) -> bool:
        """Store one block atomically; returns whether the tier now holds it.

        `payload` is bytes, a buffer, or a contiguous CPU tensor; it is only read. An
        identical valid file already present is kept and touched. Never raises on I/O
        failure (full disk, quota, vanished directory): returns False and removes the
        temporary file. Returns False too when the block alone exceeds the capacity.
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
        path = self.path_for(block_hash)
        if self._holds_identical(path, header, data):
            self._touch_path(path)
            return True
        tmp = path.parent / make_temp_name(path.name)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            try:
                _write_all(fd, head)
                _write_all(fd, data)
                used_ns = self._clock_ns()
                os.utime(fd, ns=(used_ns, used_ns))  # the rename keeps it: the LRU clock
                os.fsync(fd)
            finally:
                os.close(fd)
            self._commit(tmp, path, file_bytes, used_ns)
        except OSError as e:
            _unlink_quiet(tmp)
            log = logger.debug if e.errno in self._warned_errnos else logger.warning
            self._warned_errnos.add(e.errno)
            log("disk tier: could not store block %s: %s", block_hash_hex[:16], e)
            return False
        return True

    def _holds_identical(self, path: Path, header: KVBlockHeader, data: memoryview) -> bool:
        """Whether `path` already holds exactly these bytes under a compatible header.

        Compares the payload too, so that a damaged file is rewritten rather than kept: a
        read costs less than a write and its fsync, and stores of present blocks are rare
        (the connector asks `contains` first).
        """
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            return False
        try:
            size = os.fstat(fd).st_size
            found, offset = read_header_fd(fd, size, str(path))
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

    def _commit(self, tmp: Path, path: Path, file_bytes: int, used_ns: int) -> None:
        """Under the shared lock: make room, rename into place, fsync the directory, count it."""
        with self._ledger_locked() as ledger:
            try:
                replaced_bytes = os.stat(path).st_size
            except FileNotFoundError:
                replaced_bytes = 0
            self._evict_locked(ledger, room=file_bytes - replaced_bytes, keep=str(path))
            os.replace(tmp, path)
            ledger.used_bytes += file_bytes - replaced_bytes
            if self._lru is not None:
                heapq.heappush(self._lru, (used_ns, str(path), file_bytes))
        _fsync_dir(path.parent)

    # -- read

    def read_into(self, block_hash: bytes, out: object) -> KVBlockHeader:
        """Read a block into the preallocated `out` after every check passes; touch it.

        Raises TierFileRefused (a KVRefused) naming the reason: missing, foreign format,
        future format, corrupt header, foreign identity (every differing field named),
        misplaced, size mismatch, truncated, torn. After a refusal `out` must not be used.
        Returns the header (its num_tokens tells how much of the block is valid).
        """
        path = self.path_for(block_hash)
        header = read_file(path, self.identity, block_hash.hex(), out)
        self._touch_path(path)
        return header

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
            used_ns, path, _ = heapq.heappop(self._lru)
            if path == keep:
                continue
            try:
                st = os.stat(path)
            except FileNotFoundError:
                continue
            if st.st_mtime_ns != used_ns:
                heapq.heappush(self._lru, (st.st_mtime_ns, path, st.st_size))
                continue
            try:
                os.unlink(path)
            except FileNotFoundError:
                continue
            ledger.used_bytes -= st.st_size
            self._note_evicted(path)

    def _note_evicted(self, path: str) -> None:
        name = os.path.basename(path)
        if os.path.basename(os.path.dirname(os.path.dirname(os.path.dirname(path)))) != self.digest:
            return
        try:
            self._evicted.append(bytes.fromhex(name[: -len(BLOCK_SUFFIX)]))
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
        for entry, kind in walk_tier(self.tier_root):
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if kind == "block":
                used += st.st_size
                lru.append((st.st_mtime_ns, entry.path, st.st_size))
            elif kind == "temp" and is_orphaned_temp(entry.name, st.st_mtime, now_s):
                _unlink_quiet(entry.path)
        heapq.heapify(lru)
        ledger.used_bytes = used
        self._lru = lru if self.capacity_bytes else None

    @contextlib.contextmanager
    def _ledger_locked(self) -> Iterator[TierLedger]:
        """Hold the process-wide and cross-process lock; yield the ledger, write it back after."""
        with self._commit_lock:
            fcntl.flock(self._ledger_fd, fcntl.LOCK_EX)
            try:
                raw = os.pread(self._ledger_fd, 4096, 0)
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

    def _touch_path(self, path: Path) -> None:
        used_ns = self._clock_ns()
        with contextlib.suppress(FileNotFoundError):
            os.utime(path, ns=(used_ns, used_ns))


def read_ledger(root_dir: Path | str) -> TierLedger | None:
    """The ledger of a tier, read without locking (for reports); None if absent or unreadable."""
    try:
        raw = (Path(root_dir) / TIER_SUBDIR / LEDGER_NAME).read_bytes()
        return _LEDGER_DECODER.decode(raw)
    except (OSError, msgspec.DecodeError):
        return None
