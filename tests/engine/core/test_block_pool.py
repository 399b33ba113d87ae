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
