"""The block hashes of recent prompts, so a prompt that begins like one of them hashes only its
new blocks.

A prompt's block hashes chain through SHA-256 over every full block (`hashing`): 2,048 links for
32k tokens, milliseconds of host time before the scheduler can even look the prompt up, on the
path of every request. The prompts that KV reuse is for repeat: the same document asked again,
the next turn of a chat that carries the last one, a long shared system prompt. This memo keeps
the last few prompts' token ids (as one uint32 array each) and hashes. A new prompt is compared
with them in C; its hashes start with the longest run of full blocks it shares with one of them
(same cache salt), and only the blocks after that run are hashed. The hashes are the same bytes
either way: a block's hash is a function of the tokens up to its end and of the salt, and both
are compared before any hash is reused.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvtool.engine.core.hashing import BlockHash, extend_block_hashes, uint32_ids

DEFAULT_CAPACITY = 16  # prompts remembered


class _Entry:
    __slots__ = ("salt", "values", "hashes")

    def __init__(self, salt: str | None, values: np.ndarray, hashes: list[BlockHash]) -> None:
        self.salt = salt
        self.values = values  # the prompt's ids, uint32
        self.hashes = hashes  # one per full block of values


def shared_full_blocks(a: np.ndarray, b: np.ndarray, block_size: int) -> int:
    """How many full blocks from the start a and b share, token for token."""
    n = min(a.size, b.size) // block_size * block_size
    if n == 0:
        return 0
    differ = a[:n] != b[:n]
    first = int(differ.argmax())
    if not differ[first]:
        return n // block_size
    return first // block_size


class BlockHashMemo:
    """Block hashes of the last `capacity` prompts, most recent first."""

    def __init__(self, block_size: int, none_hash: BlockHash, capacity: int = DEFAULT_CAPACITY) -> None:
        self.block_size = block_size
        self.none_hash = none_hash
        self.capacity = capacity
        self.entries: list[_Entry] = []
        self.hits = 0  # prompts that reused at least one block's hash
        self.reused_blocks = 0

    def prompt_hashes(
        self, token_ids: Sequence[int], cache_salt: str | None, values: np.ndarray | None = None,
    ) -> list[BlockHash]:
        """A new list of the hashes of every full block of the prompt `token_ids`, as
        `extend_block_hashes` computes them; the prompt is remembered for the next ones.
        `values`: the same ids as a uint32 array, when the caller has one."""
        bs = self.block_size
        if values is None:
            values = uint32_ids(token_ids)
        if values is None or values.size < bs:
            return extend_block_hashes([], token_ids, bs, self.none_hash, cache_salt)
        best, best_blocks = None, 0
        for entry in self.entries:
            # The first block decides most candidates without touching the rest.
            if entry.salt != cache_salt or not np.array_equal(entry.values[:bs], values[:bs]):
                continue
            shared = shared_full_blocks(entry.values, values, bs)
            if shared > best_blocks:
                best, best_blocks = entry, shared
        hashes = best.hashes[:best_blocks] if best is not None else []
        if best_blocks:
            self.hits += 1
            self.reused_blocks += best_blocks
        extend_block_hashes(hashes, token_ids, bs, self.none_hash, cache_salt, values)
        self._remember(_Entry(cache_salt, values, hashes[:]), best, best_blocks)
        return hashes

    def _remember(self, entry: _Entry, matched: _Entry | None, matched_blocks: int) -> None:
        # An entry the new prompt extends (a chat's previous turn) says nothing the new one does not.
        if matched is not None and matched_blocks == len(matched.hashes):
            self.entries.remove(matched)
        self.entries.insert(0, entry)
        del self.entries[self.capacity :]
