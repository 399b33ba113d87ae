"""The tensor-parallel head split: vLLM's when it divides, KV groups kept whole when it does not."""

import pytest

from kvtool.engine.errors import ConfigError
from kvtool.engine.models.shard_layout import TPRank, check_tp_fits, kv_head_range, query_head_range, split_range


def test_even_split_is_vllms():
    # Qwen3-8B: 32 query heads, 8 KV heads, TP 4 -> 2 KV heads and 8 query heads per rank.
    assert [kv_head_range(8, TPRank(4, r)) for r in range(4)] == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert [query_head_range(32, 8, TPRank(4, r)) for r in range(4)] == [(0, 8), (8, 8), (16, 8), (24, 8)]


def test_fewer_kv_heads_than_ranks_replicates():
    # 2 KV heads on 4 ranks: ranks 0,1 hold head 0; ranks 2,3 hold head 1.
    assert [kv_head_range(2, TPRank(4, r)) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert [query_head_range(16, 2, TPRank(4, r)) for r in range(4)] == [(0, 4), (4, 4), (8, 4), (12, 4)]


def test_uneven_split_keeps_kv_groups_whole():
    # SmolLM2-135M: 9 query heads in 3 KV groups, TP 2 -> rank 0 holds groups 0-1, rank 1 group 2.
    assert kv_head_range(3, TPRank(2, 0)) == (0, 2)
    assert kv_head_range(3, TPRank(2, 1)) == (2, 1)
    assert query_head_range(9, 3, TPRank(2, 0)) == (0, 6)
    assert query_head_range(9, 3, TPRank(2, 1)) == (6, 3)
    check_tp_fits(9, 3, 2)


def test_split_range_covers_everything_once():
    for n in (1, 7, 1536, 49152):
        for size in (1, 2, 3, 4):
            parts = [split_range(n, size, r) for r in range(size)]
            assert parts[0][0] == 0
            assert all(a[0] + a[1] == b[0] for a, b in zip(parts, parts[1:]))
            assert sum(c for _, c in parts) == n


def test_unfit_sizes_are_refused_in_one_line():
    with pytest.raises(ConfigError, match="multiple of 2"):
        check_tp_fits(16, 2, 3)
    with pytest.raises(ConfigError, match=">= 1"):
        check_tp_fits(16, 2, 0)
    with pytest.raises(ConfigError, match=r"rank 2 must be in \[0, 2\)"):
        TPRank(2, 2)
