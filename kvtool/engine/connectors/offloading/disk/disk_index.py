"""The scheduler half's in-memory index of the disk tier: which block hashes it holds for this identity.

Lookups inside schedule() are set lookups: no file system round trip on the scheduling path.
The index is built once at start-up from the names under the identity's directory (under
tensor parallelism: each rank's directory, a block counting only when every rank holds its
shard), then kept current from the worker half's reports (blocks it wrote, blocks the tier evicted to stay under
its capacity). Other processes sharing root_dir write and evict too: a background thread lists
the directory again every `refresh_s` seconds, off the scheduling path. An entry is a promise to
try, never a proof: the worker half still checks every header, and a block gone in between is a
load failure that the load-failure policy handles.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

from kvtool.engine.connectors.offloading.disk.tier_identity import KVIdentity, tier_digest
from kvtool.engine.connectors.offloading.disk.tier_layout import BLOCK_SUFFIX, TIER_SUBDIR

REFRESH_S = 2.0


def list_block_hashes(identity_dir: Path) -> Iterator[bytes]:
    """Block hashes named by the files `<h[:2]>/<h[2:4]>/<h>.kvb` under one identity's directory.

    Names only (no header is read, no symlink is followed, the identity directory itself
    included); a name that is not a block file's is skipped.
    """
    if os.path.islink(identity_dir) or os.path.islink(identity_dir.parent):
        return
    stack = [(str(identity_dir), 0)]
    while stack:
        directory, depth = stack.pop()
        try:
            with os.scandir(directory) as it:
                entries = list(it)
        except OSError:
            continue
        for entry in entries:
            name = entry.name
            if depth < 2:
                if len(name) == 2 and entry.is_dir(follow_symlinks=False):
                    stack.append((entry.path, depth + 1))
                continue
            if name.startswith(".") or not name.endswith(BLOCK_SUFFIX):
                continue
            if not entry.is_file(follow_symlinks=False):
                continue
            try:
                yield bytes.fromhex(name[: -len(BLOCK_SUFFIX)])
            except ValueError:
                continue


class DiskIndex:
    """The set of block hashes on disk, as the scheduler half knows it."""

    def __init__(self, root_dir: Path | str, identity: KVIdentity | Sequence[KVIdentity],
                 refresh_s: float = REFRESH_S) -> None:
        """`identity`: the engine's, or one per tensor-parallel rank (each rank writes its own directory)."""
        identities = [identity] if isinstance(identity, KVIdentity) else list(identity)
        self.identity_dirs = [Path(root_dir) / TIER_SUBDIR / tier_digest(i) for i in identities]
        self.identity_dir = self.identity_dirs[0]
        self._present: set[bytes] = self._list()
        self._lock = threading.Lock()
        # Changes reported while a refresh lists the directory; applied on top of its result.
        self._added: set[bytes] | None = None
        self._removed: set[bytes] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if refresh_s > 0:
            self._thread = threading.Thread(
                target=self._refresh_loop, args=(refresh_s,), name="kvtool-disk-index", daemon=True
            )
            self._thread.start()

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._present

    def __len__(self) -> int:
        return len(self._present)

    def add(self, block_hash: bytes) -> None:
        """The worker half reported the block written."""
        with self._lock:
            self._present.add(block_hash)
            if self._added is not None:
                self._added.add(block_hash)
                self._removed.discard(block_hash)

    def discard(self, block_hash: bytes) -> None:
        """The block left the tier (evicted, or its file failed a check)."""
        with self._lock:
            self._present.discard(block_hash)
            if self._removed is not None:
                self._removed.add(block_hash)
                self._added.discard(block_hash)

    def refresh(self) -> None:
        """List the directory again (what other processes wrote or evicted); never on the scheduling path."""
        with self._lock:
            self._added, self._removed = set(), set()
        listed = self._list()
        with self._lock:
            self._present = (listed | self._added) - self._removed
            self._added = self._removed = None

    def _list(self) -> set[bytes]:
        """Block hashes whose file exists under every rank's directory."""
        present = set(list_block_hashes(self.identity_dirs[0]))
        for directory in self.identity_dirs[1:]:
            if not present:
                break
            present &= set(list_block_hashes(directory))
        return present

    def _refresh_loop(self, refresh_s: float) -> None:
        while not self._stop.wait(refresh_s):
            self.refresh()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
