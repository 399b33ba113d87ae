"""A request's block tables, one per KV cache group, over the one block pool (vLLM's coordinator).

Each group (`kv.groups`) has its own table of a request's blocks: entry i holds the group's K/V
of tokens [i * bs, (i + 1) * bs). A full-attention group keeps every block until the request
ends. A sliding-window group of window W needs, for its next token at position c, the keys at
positions (c - W, c] only: once a step's result is in, the blocks wholly before c - W + 1 go back
to the pool and their entries become the null block (vLLM's `remove_skipped_blocks`, on the
tokens whose steps are done). Their tokens stay cached in the pool while the blocks sit in its
free queue.

A prefix hit at token p (a multiple of the block size) needs every full-attention group's blocks
of [0, p) and every sliding-window group's blocks of its last ceil((W - 1) / bs) blocks before p,
in the cache under each group's key (`block_pool.group_key`). `find_hit` is vLLM 0.33's
fixed point: each kind of group accepts the candidate length or shortens it, until none does; a
sliding-window group searches from the right for a long enough run of cached blocks (a run from
block 0 counts whatever its length, since no key precedes it).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtool.engine.core.block_pool import NULL_BLOCK, BlockPool
from kvtool.engine.core.hashing import BlockHash
from kvtool.engine.kv.groups import KVCacheLayout


class GroupTables:
    """The block tables of one engine's groups: allocation, freeing and hits for its requests."""

    def __init__(self, pool: BlockPool, layout: KVCacheLayout, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self.windows = [g.sliding_window for g in layout.groups]
        # The kinds of group, full attention first (vLLM's order): (window, group indices).
        kinds: dict[int | None, list[int]] = {}
        for gi, w in enumerate(self.windows):
            kinds.setdefault(w, []).append(gi)
        self.kinds = sorted(kinds.items(), key=lambda kv: kv[0] is not None)

    def empty(self) -> list[list[int]]:
        return [[] for _ in self.windows]

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _skipped(self, window: int | None, num_computed: int) -> int:
        """Entries of a group's table that no token from `num_computed` on attends."""
        return 0 if window is None else max(0, num_computed - window + 1) // self.block_size

    def num_new_blocks(self, tables: Sequence[list[int]], num_tokens: int, num_computed: int = 0) -> int:
        """Blocks to allocate so every group's table covers `num_tokens` tokens, when the tokens
        before `num_computed` are computed (or loaded) already."""
        n = self.blocks_for(num_tokens)
        return sum(max(0, n - max(len(t), min(n, self._skipped(w, num_computed))))
                   for t, w in zip(tables, self.windows))

    def grow(self, tables: Sequence[list[int]], num_tokens: int, num_computed: int = 0) -> None:
        """Append new blocks to every table up to `num_tokens` tokens (can_allocate checked). A
        sliding-window group's new entries that no token from `num_computed` on attends are the
        null block (vLLM's `allocate_new_blocks`: a request admitted with a connector's hit far
        past its window gets blocks for the window only)."""
        n = self.blocks_for(num_tokens)
        for t, w in zip(tables, self.windows):
            if n > len(t):
                skip = min(n, self._skipped(w, num_computed))
                if skip > len(t):
                    t.extend([NULL_BLOCK] * (skip - len(t)))
                t.extend(self.pool.allocate(n - len(t)))

    def max_blocks(self, num_tokens: int, step_tokens: int) -> int:
        """The most blocks a request of `num_tokens` tokens holds at once, computing at most
        `step_tokens` tokens a step (a sliding-window group holds its window and one step's)."""
        n = self.blocks_for(num_tokens)
        return sum(n if w is None else min(n, self.blocks_for(w - 1 + step_tokens) + 1) for w in self.windows)

    def free(self, tables: Sequence[list[int]]) -> None:
        for t in tables:
            self.pool.free(t)

    def free_skipped(self, tables: Sequence[list[int]], num_done: int) -> None:
        """Free each sliding-window group's blocks that no token at or after `num_done` attends
        (their entries become the null block)."""
        bs = self.block_size
        for t, w in zip(tables, self.windows):
            if w is None:
                continue
            end = min(max(0, num_done - w + 1) // bs, len(t))
            freed = []
            for i in range(end - 1, -1, -1):  # from the right: earlier entries are freed already
                if t[i] == NULL_BLOCK:
                    break
                freed.append(t[i])
                t[i] = NULL_BLOCK
            if freed:
                self.pool.free(freed[::-1])

    def cache(self, tables: Sequence[list[int]], block_hashes: Sequence[BlockHash], start: int, end: int) -> None:
        """Register blocks [start, end) of every group under their hashes."""
        for gi, t in enumerate(tables):
            self.pool.cache_blocks(t, block_hashes, start, end, gi)

    def find_hit(self, block_hashes: Sequence[BlockHash], max_blocks: int) -> tuple[list[list[int]], int]:
        """(each group's table of the longest hit, its length in blocks) over the first
        `max_blocks` hashes. No side effects."""
        pool = self.pool
        if not pool.enable_prefix_caching or max_blocks <= 0:
            return self.empty(), 0
        # Full attention is downward-closed: each full group's longest cached prefix, looked up once.
        full = {g: pool.find_cached_prefix(block_hashes[:max_blocks], g)
                for g, w in enumerate(self.windows) if w is None}
        full_len = min((len(t) for t in full.values()), default=max_blocks)

        def cached(i: int, groups: list[int]) -> list[int] | None:
            out = []
            for g in groups:
                b = pool.cached_block(block_hashes[i], g)
                if b is None:
                    return None
                out.append(b)
            return out

        hit = min(max_blocks, full_len)
        found: dict[int, list[int]] = {}  # sliding group -> its table of the hit
        while True:
            cur = hit
            for window, groups in self.kinds:
                if window is None:
                    continue  # full_len bounds every candidate already
                need = -(-(window - 1) // self.block_size)
                run: list[list[int]] = []  # blocks of the run, from the right
                end = 0
                for i in range(cur - 1, -1, -1):
                    blocks = cached(i, groups)
                    if blocks is None:
                        run = []
                        continue
                    run.append(blocks)
                    if len(run) >= need:
                        end = i + len(run)
                        break
                else:
                    end = len(run)  # the run from block 0 (empty when block 0 is not cached)
                run.reverse()
                for k, g in enumerate(groups):
                    found[g] = [NULL_BLOCK] * (end - len(run)) + [blocks[k] for blocks in run]
                cur = end
            if cur >= hit:
                break
            hit = cur
        tables = [full[g][:hit] if w is None else found[g][:hit] for g, w in enumerate(self.windows)]
        return tables, hit

    def num_free_hits(self, tables: Sequence[list[int]]) -> int:
        """Hit blocks that sit in the free queue (taking them uses up free blocks)."""
        ref = self.pool.ref_cnt
        null = self.pool.has_null_block
        return sum(1 for t in tables for b in t if ref[b] == 0 and not (null and b == NULL_BLOCK))
