"""BlockPool: ref counts, prefix hits, LRU eviction of free cached blocks."""

import pytest

from kvtool.engine.core.block_pool import BlockPool


def test_allocate_free_and_integrity():
    pool = BlockPool(8)
    a = pool.allocate(3)
    assert pool.num_free_blocks == 5
    pool.free(a)
    assert pool.num_free_blocks == 8
    pool.check_integrity()
    with pytest.raises(RuntimeError):
        pool.free(a)


def test_cached_blocks_survive_free_until_reused():
    pool = BlockPool(4)
    blocks = pool.allocate(2)
    pool.cache_blocks(blocks, [b"h0", b"h1"], 0, 2)
    pool.free(blocks)
    assert pool.find_cached_prefix([b"h0", b"h1", b"h2"]) == blocks
    pool.touch(blocks)
    assert pool.num_free_blocks == 2
    pool.free(blocks)
    # Allocating everything evicts the cached blocks, least recently freed first.
    pool.allocate(4)
    assert pool.find_cached_prefix([b"h0"]) == []
    pool.check_integrity()


def test_lru_evicts_tail_blocks_of_a_request_first():
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    pool.cache_blocks(blocks, [b"a", b"b", b"c"], 0, 3)
    pool.free(blocks)
    pool.allocate(1)  # evicts the last block of the chain, keeping the prefix useful
    assert pool.find_cached_prefix([b"a", b"b", b"c"]) == blocks[:2]


def test_prefix_caching_off_never_hits():
    pool = BlockPool(2, enable_prefix_caching=False)
    b = pool.allocate(1)
    pool.cache_blocks(b, [b"x"], 0, 1)
    assert pool.find_cached_prefix([b"x"]) == []


def test_groups_cache_the_same_hash_apart_and_the_null_block_stays_out():
    """One pool for every KV cache group: a hash is cached once per group under vLLM's key (the
    hash, then the group as 4 bytes big-endian), each evicted alone; block 0 of a pool with a
    null block is never handed out, referenced or cached, and events name the group."""
    from kvtool.engine.core.block_pool import NULL_BLOCK, group_key

    pool = BlockPool(5, null_block=True)
    pool.events = []
    assert pool.num_usable_blocks == pool.num_free_blocks == 4
    a, b = pool.allocate(2)
    assert NULL_BLOCK not in (a, b)
    pool.cache_blocks([NULL_BLOCK, a], [b"h0", b"h1"], 0, 2, group=0)  # a null entry is skipped
    pool.cache_blocks([b], [b"h1"], 0, 1, group=3)
    assert pool.cached == {group_key(b"h1", 0): a, group_key(b"h1", 3): b}
    assert group_key(b"h1", 3) == b"h1" + b"\x00\x00\x00\x03"
    assert pool.cached_block(b"h1", 3) == b and pool.cached_block(b"h1", 1) is None
    pool.touch([NULL_BLOCK])
    pool.free([NULL_BLOCK, a, b])
    pool.evict([b])
    assert pool.cached_block(b"h1", 0) == a and pool.cached_block(b"h1", 3) is None
    assert pool.events == [("stored", [b"h0", b"h1"], 1, 0), ("stored", [b"h1"], 0, 3),
                           ("removed", b"h1", 3)]
    pool.allocate(4)
    pool.check_integrity()
    assert pool.reset_prefix_cache() is False
