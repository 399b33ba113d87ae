"""What is in a disk tier: a header scan (or a full verify) of root_dir, and which blocks an
engine config could load. `kvtool inspect` renders these Structs as a table or as JSON.
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal

import blake3
import msgspec

from kvtool.engine.connectors.offloading.disk.disk_tier import read_ledger
from kvtool.engine.connectors.offloading.disk.tier_fs import open_dir_at, open_regular, open_root_dir
from kvtool.engine.connectors.offloading.disk.tier_layout import (
    TIER_SUBDIR,
    TierEntry,
    block_relpath,
    is_orphaned_temp,
    walk_tier,
)
from kvtool.engine.connectors.offloading.disk.tier_identity import (
    FieldDiff,
    KVBlockHeader,
    KVIdentity,
    TierFileRefused,
    count_fields,
    describe_differences,
    identity_differences,
    read_header_fd,
    tier_digest,
)
from kvtool.engine.errors import ConfigError

# BlockProblem kinds a scan can see, plus the two that only a directory walk finds.
ProblemKind = Literal[
    "foreign_format", "future_format", "corrupt", "truncated", "torn", "misplaced", "orphaned_temp", "stray",
    "not_regular", "unreadable", "sparse",
]
# (files_done, files_total); called from the scanning thread after each file.
ProgressFn = Callable[[int, int], None]

_VERIFY_CHUNK_BYTES = 8 << 20
# Files per thread-pool task: large enough to amortise the hand-off, small enough for progress.
_HEADER_BATCH_FILES = 256
_VERIFY_BATCH_FILES = 8


class TierFileProblem(msgspec.Struct, frozen=True, kw_only=True):
    """One damaged, foreign or leftover file: never loaded by any engine."""

    path: str  # relative to root_dir
    problem: ProblemKind
    detail: str  # one line naming what is wrong
    size_bytes: int
    # The identity directory the file sits in, when it sits in one.
    tier_digest: str | None = None


class IdentityGroup(msgspec.Struct, frozen=True, kw_only=True):
    """The healthy blocks written under one identity (one distinct header)."""

    tier_digest: str
    identity: KVIdentity
    num_blocks: int
    num_tokens: int
    total_bytes: int
    oldest_used_at: str  # ISO 8601 UTC of the least recently used block (file mtime)
    newest_used_at: str


class GroupVerdict(msgspec.Struct, frozen=True, kw_only=True):
    """Whether one identity group's blocks would load into a given engine config, and why not."""

    tier_digest: str
    loadable: bool
    num_blocks: int
    differences: list[FieldDiff]
    reason: str  # one line


class TierReport(msgspec.Struct, kw_only=True):
    """A scan of one root_dir; every number is exact for the moment of the scan."""

    root_dir: str
    verified: bool  # payload checksums were re-read (--verify); else headers only
    num_files: int  # every file under <root>/kv except the ledger
    total_bytes: int
    num_blocks: int  # healthy block files
    block_bytes: int
    # Every block file, damaged ones included: what the capacity limit counts.
    tier_bytes: int
    num_temp_files_in_flight: int  # temp files of live writers: not damage
    capacity_bytes: int  # from the ledger; 0 when no writer set one
    capacity_used: float | None  # tier_bytes / capacity_bytes
    oldest_used_at: str | None
    newest_used_at: str | None
    num_damaged: int  # len(problems)
    groups: list[IdentityGroup]
    problems: list[TierFileProblem]
    scan_ms: float
    # Set by `with_loadability` (inspect --model): one verdict per group, in `groups` order.
    loadability: list[GroupVerdict] | None = None

    @property
    def has_damage(self) -> bool:
        return bool(self.problems)


class _FileResult(msgspec.Struct):
    relpath: str
    size_bytes: int
    mtime_ns: int
    is_block: bool = False  # a block file by name (healthy or not)
    header: KVBlockHeader | None = None
    problem: ProblemKind | None = None
    detail: str = ""
    in_flight: bool = False
    vanished: bool = False  # deleted (evicted) between the walk and the check


def _iso(ns: int) -> str:
    return datetime.datetime.fromtimestamp(ns / 1e9, tz=datetime.timezone.utc).isoformat(timespec="seconds")


# Per distinct header identity: its tier digest. Thousands of files share a few identities.
_IdentityKey = tuple


def _identity_key(header: KVBlockHeader) -> _IdentityKey:
    return tuple(getattr(header, f) for f in KVIdentity.__struct_fields__)


def _check_block(kv_fd: int, relpath: str, verify: bool, digests: dict[_IdentityKey, str]) -> _FileResult:
    """Header checks for one block file; with `verify` also the payload checksum.

    The file is opened without following a link and refused unread unless it is regular;
    reads never go past its real size, and a file with holes (a sparse file claiming more
    bytes than were written) is named at once instead of being read through.
    """
    try:
        fd, st = open_regular(kv_fd, relpath)
    except TierFileRefused as e:
        if e.problem == "missing":
            return _FileResult(relpath, 0, 0, vanished=True)
        return _FileResult(relpath, 0, 0, is_block=True, problem=e.problem, detail=str(e))  # type: ignore[arg-type]
    try:
        result = _FileResult(relpath, st.st_size, st.st_mtime_ns, is_block=True)
        try:
            header, offset = read_header_fd(fd, st.st_size, relpath)
            key = _identity_key(header)
            digest = digests.get(key)
            if digest is None:
                digest = digests[key] = tier_digest(header)
            expected = block_relpath(digest, header.block_hash)
            if relpath != expected:
                raise TierFileRefused("misplaced", f"{relpath}: header says it belongs at {expected}")
            hole = _first_hole(fd, st.st_size)
            if hole < st.st_size:
                raise TierFileRefused(
                    "sparse",
                    f"{relpath}: a sparse file: {st.st_size} bytes long but nothing written past byte {hole}",
                )
            if verify:
                hasher = blake3.blake3()
                pos, end = offset, st.st_size
                while pos < end:
                    chunk = os.pread(fd, min(_VERIFY_CHUNK_BYTES, end - pos), pos)
                    if not chunk:
                        raise TierFileRefused("truncated", f"{relpath}: file shrank while it was verified")
                    hasher.update(chunk)
                    pos += len(chunk)
                if hasher.hexdigest() != header.payload_checksum:
                    raise TierFileRefused("torn", f"{relpath}: payload checksum mismatch (torn block)")
            result.header = header
        except TierFileRefused as e:
            result.problem = e.problem  # type: ignore[assignment]
            result.detail = str(e)
        except OSError as e:
            result.problem = "unreadable"
            result.detail = f"{relpath}: {e.strerror or e}"
        return result
    finally:
        os.close(fd)


def _first_hole(fd: int, size: int) -> int:
    """Offset of the first hole of an open file (its size when it has none or the fs cannot say)."""
    try:
        return os.lseek(fd, 0, os.SEEK_HOLE)
    except OSError:
        return size


def _check_entry(
    kv_fd: int, entry: TierEntry, verify: bool, now_s: float, digests: dict[_IdentityKey, str]
) -> _FileResult:
    relpath = entry.relpath
    if entry.kind in ("special", "unreadable"):
        st = entry.st
        return _FileResult(
            relpath, st.st_size if st else 0, st.st_mtime_ns if st else 0,
            problem="not_regular" if entry.kind == "special" else "unreadable", detail=entry.detail,
        )
    if entry.kind == "block":
        return _check_block(kv_fd, relpath, verify, digests)
    st = entry.st
    assert st is not None
    result = _FileResult(relpath, st.st_size, st.st_mtime_ns)
    if entry.kind == "temp":
        if is_orphaned_temp(entry.name, st.st_mtime, now_s):
            result.problem = "orphaned_temp"
            result.detail = f"{relpath}: temporary file left by a writer that is gone"
        else:
            result.in_flight = True
    else:
        result.problem = "stray"
        result.detail = f"{relpath}: not a kvtool tier file name"
    return result


def scan(root_dir: Path | str, verify: bool = False, progress: ProgressFn | None = None) -> TierReport:
    """Walk `<root_dir>/kv` and classify every file; nothing is changed or deleted.

    Headers only unless `verify`, which re-reads every payload and checks its checksum.
    Files are checked in batches on a thread pool (I/O waits and hashing release the GIL);
    `progress(done, total)` is called on the calling thread after each batch. A root with no
    tier in it is an empty report. Files vanishing mid-scan (concurrent eviction) are left out.
    Links, directories where files belong, FIFOs and devices are reported as `not_regular`
    and never opened for reading; permission errors as `unreadable`. Raises ConfigError when
    root_dir itself cannot be opened.
    """
    start = time.perf_counter()
    root = Path(root_dir)
    try:
        root_fd = open_root_dir(root)
    except OSError as e:
        raise ConfigError(f"disk tier root {root}: {e.strerror or e}") from None
    try:
        kv_fd = open_dir_at(root_fd, TIER_SUBDIR, TIER_SUBDIR)
    except TierFileRefused as e:
        os.close(root_fd)
        if e.problem == "missing":
            return _aggregate(root, verify, [], {}, time.perf_counter() - start)
        top = _FileResult(TIER_SUBDIR, 0, 0, problem=e.problem, detail=str(e))  # type: ignore[arg-type]
        return _aggregate(root, verify, [top], {}, time.perf_counter() - start, prefixed=True)
    os.close(root_fd)
    try:
        entries = [e for e in walk_tier(kv_fd) if e.kind != "ledger"]
        now_s = time.time()
        digests: dict[_IdentityKey, str] = {}

        def check_batch(batch: list[TierEntry]) -> list[_FileResult]:
            return [_check_entry(kv_fd, e, verify, now_s, digests) for e in batch]

        batch_files = _VERIFY_BATCH_FILES if verify else _HEADER_BATCH_FILES
        batches = [entries[i : i + batch_files] for i in range(0, len(entries), batch_files)]
        results: list[_FileResult] = []
        with ThreadPoolExecutor(max_workers=min(8, (os.cpu_count() or 2) * 2)) as pool:
            for batch_results in pool.map(check_batch, batches):
                results.extend(batch_results)
                if progress is not None:
                    progress(len(results), len(entries))
    finally:
        os.close(kv_fd)
    return _aggregate(root, verify, results, digests, time.perf_counter() - start)


def _aggregate(
    root: Path, verify: bool, results: list[_FileResult], digests: dict[_IdentityKey, str], elapsed_s: float,
    prefixed: bool = False,
) -> TierReport:
    groups: dict[_IdentityKey, list[_FileResult]] = {}
    problems: list[TierFileProblem] = []
    num_files = total_bytes = tier_bytes = in_flight = 0
    for r in results:
        if r.vanished:
            continue
        num_files += 1
        total_bytes += r.size_bytes
        tier_bytes += r.size_bytes if r.is_block else 0
        if r.in_flight:
            in_flight += 1
        elif r.problem is not None:
            first = r.relpath.split("/", 1)[0]
            problems.append(
                TierFileProblem(
                    path=r.relpath if prefixed else f"{TIER_SUBDIR}/{r.relpath}",
                    problem=r.problem,
                    detail=r.detail.removeprefix(f"{r.relpath}: "),
                    size_bytes=r.size_bytes,
                    tier_digest=first if "/" in r.relpath else None,
                )
            )
        elif r.header is not None:
            # One group per distinct header identity; engines differing only in provenance
            # fields share a digest (and so their files) but show as separate groups.
            groups.setdefault(_identity_key(r.header), []).append(r)
    out_groups = [
        IdentityGroup(
            tier_digest=digests[key],
            identity=members[0].header.tier_identity(),  # type: ignore[union-attr]
            num_blocks=len(members),
            num_tokens=sum(m.header.num_tokens for m in members if m.header),
            total_bytes=sum(m.size_bytes for m in members),
            oldest_used_at=_iso(min(m.mtime_ns for m in members)),
            newest_used_at=_iso(max(m.mtime_ns for m in members)),
        )
        for key, members in sorted(groups.items(), key=lambda kv: -len(kv[1]))
    ]
    healthy = [m for members in groups.values() for m in members]
    block_bytes = sum(m.size_bytes for m in healthy)
    ledger = read_ledger(root)
    capacity = ledger.capacity_bytes if ledger else 0
    problems.sort(key=lambda p: (p.problem, p.path))
    return TierReport(
        root_dir=str(root),
        verified=verify,
        num_files=num_files,
        total_bytes=total_bytes,
        num_blocks=len(healthy),
        block_bytes=block_bytes,
        tier_bytes=tier_bytes,
        num_temp_files_in_flight=in_flight,
        capacity_bytes=capacity,
        capacity_used=tier_bytes / capacity if capacity else None,
        oldest_used_at=_iso(min(m.mtime_ns for m in healthy)) if healthy else None,
        newest_used_at=_iso(max(m.mtime_ns for m in healthy)) if healthy else None,
        num_damaged=len(problems),
        groups=out_groups,
        problems=problems,
        scan_ms=round(elapsed_s * 1000, 3),
    )


def loadability(report: TierReport, identity: KVIdentity | Sequence[KVIdentity]) -> list[GroupVerdict]:
    """For each identity group, in order: would an engine with `identity` load its blocks; if not, why.

    A group loads only when every compared identity field agrees; the verdict lists each
    field that differs with the engine's value and the tier's. An engine with KV cache groups
    writes under one identity per group (`group_tiers.group_identities`): pass them all, and a
    group is judged against the one it differs from least. Damaged files are not in any group
    (see `report.problems`): no engine loads them.
    """
    identities = [identity] if isinstance(identity, KVIdentity) else list(identity)
    verdicts = []
    for group in report.groups:
        diffs = min((identity_differences(i, group.identity) for i in identities), key=len)
        if diffs:
            reason = f"refused: {count_fields(len(diffs))}: {describe_differences(diffs)}"
        elif report.verified:
            reason = "loadable: identity matches, payloads verified"
        else:
            reason = "loadable: identity matches (payloads not verified; use --verify)"
        verdicts.append(
            GroupVerdict(
                tier_digest=group.tier_digest,
                loadable=not diffs,
                num_blocks=group.num_blocks,
                differences=diffs,
                reason=reason,
            )
        )
    return verdicts


def with_loadability(report: TierReport, identity: KVIdentity | Sequence[KVIdentity]) -> TierReport:
    """A copy of `report` with its `loadability` verdicts for `identity` filled in."""
    return msgspec.structs.replace(report, loadability=loadability(report, identity))
