"""Ref-counted KV blocks with vLLM-compatible prefix caching and an LRU of free cached blocks.

Only this module changes ref counts, the free queue and the hash map. The scheduler and the
connectors' scheduler halves get block ids, never the pool's internals.

With KV cache groups (`kv.groups`) one pool serves every group: a cached block is found by its
block hash and its group (vLLM's BlockHashWithGroupId: the hash, then the group index as 4 bytes
big-endian), since the same tokens have one block per group. A pool with `null_block` keeps
block 0 out of circulation, as vLLM's does: a sliding-window group's table points its freed
blocks (and a hit's blocks before the window) at it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

from kvtool.engine.core.hashing import BlockHash

NULL_BLOCK = 0


def group_key(block_hash: BlockHash, group: int) -> bytes:
    """vLLM's BlockHashWithGroupId: the block hash, then the group index (4 bytes, big-endian)."""
    return block_hash + group.to_bytes(4, "big")


class BlockPool:
    """Blocks are free (ref 0, in the LRU queue, possibly still cached) or in use (ref > 0).

    A freed block keeps its hash and can be hit again until it is popped for a new allocation:
    the queue's head is the least recently freed block, evicted first.
    """

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True, null_block: bool = False) -> None:
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.has_null_block = null_block
        self.ref_cnt = [0] * num_blocks
        # The hash map's key of each cached block (group_key), None when uncached.
        self.block_hash: list[bytes | None] = [None] * num_blocks
        first = NULL_BLOCK + 1 if null_block else 0
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(first, num_blocks))
        self.cached: dict[bytes, int] = {}
        # KV events hook (kvtool/engine/events/kv_events.py): when a list, the pool appends
        # ("stored", block_hashes, i, group) / ("removed", hash, group) / ("cleared",) as the hash
        # map changes.
        self.events: list[tuple] | None = None

    @property
    def num_usable_blocks(self) -> int:
        """Blocks requests can hold (all but the null block)."""
        return self.num_blocks - self.has_null_block

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def find_cached_prefix(self, block_hashes: Sequence[BlockHash], group: int = 0) -> list[int]:
        """Longest run of leading block hashes present in the cache for `group`. No side effects."""
        hits: list[int] = []
        if not self.enable_prefix_caching:
            return hits
        get, suffix = self.cached.get, group.to_bytes(4, "big")
        for h in block_hashes:  # 2,048 hashes for a 32k prompt: kept to plain dict work
            block_id = get(h + suffix)
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def cached_block(self, block_hash: BlockHash, group: int) -> int | None:
        """The block caching `block_hash` for `group`, or None."""
        if not self.enable_prefix_caching:
            return None
        return self.cached.get(group_key(block_hash, group))

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take a reference on hit blocks (removing free ones from the LRU queue); the null block
        is skipped."""
        for b in block_ids:
            if b == NULL_BLOCK and self.has_null_block:
                continue
            if self.ref_cnt[b] == 0:
                del self.free_queue[b]
            self.ref_cnt[b] += 1

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self.free_queue)

    def allocate(self, num_blocks: int) -> list[int]:
        """Pop blocks from the LRU head; a popped cached block leaves the hash map."""
        if num_blocks > len(self.free_queue):
            raise RuntimeError(f"allocate({num_blocks}) with {len(self.free_queue)} free blocks")
        queue, hashes, ref_cnt = self.free_queue, self.block_hash, self.ref_cnt
        out = []
        for _ in range(num_blocks):  # 2,048 blocks for a 32k prompt: kept to plain list and dict work
            b = queue.popitem(last=False)[0]
            if hashes[b] is not None:
                self._uncache(b)
            ref_cnt[b] = 1
            out.append(b)
        return out

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each block (the null block is skipped). Tail blocks are queued
        first so they are evicted first."""
        null = self.has_null_block
        for b in reversed(block_ids):
            if null and b == NULL_BLOCK:
                continue
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] < 0:
                raise RuntimeError(f"block {b} freed twice")
            if self.ref_cnt[b] == 0:
                self.free_queue[b] = None

    def cache_blocks(self, block_ids: Sequence[int], block_hashes: Sequence[BlockHash], start: int, end: int,
                     group: int = 0) -> None:
        """Register blocks [start, end) of a request's table for `group` under their hashes
        (their tokens are final); null entries (freed by a sliding window) are skipped."""
        if not self.enable_prefix_caching:
            return
        null = self.has_null_block
        suffix = group.to_bytes(4, "big")
        for i in range(start, end):
            b = block_ids[i]
            if null and b == NULL_BLOCK:
                continue
            if self.block_hash[b] is not None:
                continue
            key = block_hashes[i] + suffix
            if key in self.cached:
                # Another block already holds these tokens; this one stays uncached.
                continue
            self.block_hash[b] = key
            self.cached[key] = b
            if self.events is not None:
                self.events.append(("stored", block_hashes, i, group))

    def evict(self, block_ids: Iterable[int]) -> None:
        """Drop blocks from the hash map (their content is not to be trusted)."""
        for b in block_ids:
            self._uncache(b)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (vLLM's reset): True; False, changing nothing, while any block
        is in use (a running request, or a connector holding a finished request's blocks)."""
        if len(self.free_queue) != self.num_usable_blocks:
            return False
        events, self.events = self.events, None  # one "cleared" record, not one per block
        for b in range(self.num_blocks):
            self._uncache(b)
        self.events = events
        if events is not None:
            events.append(("cleared",))
        return True

    def _uncache(self, b: int) -> None:
        key = self.block_hash[b]
        if key is not None:
            if self.cached.get(key) == b:
                del self.cached[key]
                if self.events is not None:
                    self.events.append(("removed", key[:-4], int.from_bytes(key[-4:], "big")))
            self.block_hash[b] = None

    def check_integrity(self) -> None:
        """free + in use == total, no negative refs, hash map and block hashes agree."""
        in_use = sum(1 for r in self.ref_cnt if r > 0)
        if any(r < 0 for r in self.ref_cnt):
            raise AssertionError("negative ref count")
        if in_use + len(self.free_queue) != self.num_usable_blocks:
            raise AssertionError(f"in use {in_use} + free {len(self.free_queue)} != {self.num_usable_blocks}")
        if self.has_null_block and (NULL_BLOCK in self.free_queue or self.ref_cnt[NULL_BLOCK]
                                    or self.block_hash[NULL_BLOCK] is not None):
            raise AssertionError("the null block was allocated, referenced or cached")
        for b in self.free_queue:
            if self.ref_cnt[b] != 0:
                raise AssertionError(f"free block {b} has ref {self.ref_cnt[b]}")
        for h, b in self.cached.items():
            if self.block_hash[b] != h:
                raise AssertionError(f"hash map points at block {b} with another hash")
