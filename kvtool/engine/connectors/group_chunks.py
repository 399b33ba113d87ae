"""Which chunks of each KV cache group a connector's hit needs, a load fills and a store may take.

A connector that moves every group (the OffloadingConnector's offload blocks, LMCache's chunks
in its blake3 mode) keeps each group's chunk as an entry of its own, under a key naming the
group; these rules say which of them a hit needs:

    tokens     0 ........ local hit ............ hit end p
    full       |          [== loaded ===========]
    window W   |          null block   [= loaded]    from max(local hit, p - W + 1)

A hit at p needs every full-attention group's chunks from the local hit up to p, and each
sliding-window group's chunks that hold the tokens its window still reads at p. The engine
scheduler gives such a group the null block below its window at admission, so a load fills
exactly the blocks it allocated. A group's chunk is stored only while none of its blocks is the
null block: a window shorter than a chunk frees the chunk's first blocks before its last ones
are written, and that group's chunk is then not stored. One group of full attention reduces to
the plain rule: the leading chunks the tier holds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvtool.engine.core.block_pool import NULL_BLOCK
from kvtool.engine.kv.groups import KVCacheLayout

__all__ = ["GroupChunks"]


class GroupChunks:
    """The chunk rules of one engine's KV cache groups, for chunks of `chunk_tokens` tokens."""

    def __init__(self, layout: KVCacheLayout, block_size: int, chunk_tokens: int) -> None:
        self.block_size = block_size
        self.chunk_tokens = chunk_tokens
        self.blocks_per_chunk = chunk_tokens // block_size
        self.windows = [g.sliding_window for g in layout.groups]
        self.full_groups = [g for g, w in enumerate(self.windows) if w is None]
        self.sliding_groups = [g for g, w in enumerate(self.windows) if w is not None]
        # Whether block 0 is the pool's null block (entries freed behind a window, never stored).
        self.has_null_block = layout.hybrid

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def hit_end(self, num_tokens: int, num_chunks: int) -> int:
        """The tokens computed after a hit of the first `num_chunks` chunks (the last token is
        always computed: a full hit leaves it to the forward)."""
        return min(num_chunks * self.chunk_tokens, num_tokens - 1)

    def first_block(self, g: int, start: int, end: int) -> int:
        """The first of group g's blocks a load of tokens [start, end) fills: a sliding-window
        group's entries that no token from `end` on attends are the null block."""
        first = start // self.block_size
        w = self.windows[g]
        return first if w is None else max(first, max(0, end - w + 1) // self.block_size)

    def chunks(self, g: int, start: int, end: int) -> range:
        """Group g's chunks a load of tokens [start, end) reads."""
        return range(self.first_block(g, start, end) // self.blocks_per_chunk, -(-end // self.chunk_tokens))

    def loads(self, start: int, end: int) -> list[tuple[int, int, range]]:
        """(chunk, group, chunks it counts) of every group's chunk a load of tokens [start, end)
        reads, chunk by chunk in group order. Each chunk of the load is counted once: by its
        first group's job, or, where no group reads it (a window left it behind), by the next job."""
        firsts = [self.first_block(g, start, end) // self.blocks_per_chunk for g in range(self.num_groups)]
        out = []
        counted = start // self.chunk_tokens
        for i in range(counted, -(-end // self.chunk_tokens)):
            for g, first in enumerate(firsts):
                if i >= first:
                    out.append((i, g, range(counted, i + 1)))
                    counted = i + 1
        return out

    def longest_hit(self, available: Callable[[int, int], bool], first: int, last: int, start: int,
                    num_tokens: int) -> int:
        """The most leading chunks, from `first` up to `last`, that a hit after a local hit of
        `start` tokens can take: every full group has each chunk from `first` on, every
        sliding-window group the chunks its window reads at the hit's end. `available(i, g)`
        says whether group g's chunk i can be loaded."""
        end = first
        while end < last and all(available(end, g) for g in self.full_groups):
            end += 1
        while end > first and not all(
                available(i, g)
                for g in self.sliding_groups for i in self.chunks(g, start, self.hit_end(num_tokens, end))):
            end -= 1
        return end

    def storable(self, table: Sequence[int], i: int) -> bool:
        """Whether chunk i of a group whose block table is `table` may be stored (none of its
        blocks is the null block)."""
        k = self.blocks_per_chunk
        return not (self.has_null_block and NULL_BLOCK in table[i * k : (i + 1) * k])
