"""How a model splits across tensor-parallel ranks: which heads and rows each rank holds.

Megatron-style, as vLLM shards: query/KV heads and MLP rows are column-parallel, split in
contiguous ranges, rank 0 first. When the KV heads divide evenly the split is vLLM's exactly;
when there are fewer KV heads than ranks each KV head is replicated on `size // num_kv_heads`
consecutive ranks (vLLM's rule). When they do not divide (the embedded SmolLM2-135M has 3 KV
heads), the first `num_kv_heads % size` ranks hold one KV head more, and each rank's query
heads are the ones of its KV groups, so attention never crosses ranks.

A leaf module: it imports nothing of the engine but its errors, so the engine, the model
builders and the connectors can all ask it the same question.
"""

from __future__ import annotations

import msgspec

from kvtool.engine.errors import ConfigError

__all__ = ["TPRank", "check_tp_fits", "kv_head_range", "query_head_range", "split_range"]


class TPRank(msgspec.Struct, frozen=True):
    """One rank of a tensor-parallel group of `size` ranks."""

    size: int = 1
    rank: int = 0

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ConfigError(f"tensor-parallel rank {self.rank} must be in [0, {self.size})")


def split_range(n: int, size: int, rank: int) -> tuple[int, int]:
    """(start, count) of rank's contiguous share of n items; the first n % size ranks get one more."""
    base, extra = divmod(n, size)
    start = rank * base + min(rank, extra)
    return start, base + (1 if rank < extra else 0)


def kv_head_range(num_kv_heads: int, tp: TPRank) -> tuple[int, int]:
    """(first KV head, number of KV heads) held by rank `tp.rank`."""
    if num_kv_heads >= tp.size:
        return split_range(num_kv_heads, tp.size, tp.rank)
    replicas = tp.size // num_kv_heads
    return tp.rank // replicas, 1


def query_head_range(num_heads: int, num_kv_heads: int, tp: TPRank) -> tuple[int, int]:
    """(first query head, number of query heads) held by rank `tp.rank`: those of its KV groups."""
    group = num_heads // num_kv_heads
    if num_kv_heads >= tp.size:
        kv_start, kv_count = kv_head_range(num_kv_heads, tp)
        return kv_start * group, kv_count * group
    per_rank = num_heads // tp.size
    return tp.rank * per_rank, per_rank


def check_tp_fits(num_heads: int, num_kv_heads: int, size: int) -> None:
    """Refuse a tensor-parallel size the model's heads cannot be split into (one line)."""
    if size < 1:
        raise ConfigError(f"--tensor-parallel-size must be >= 1, got {size}")
    if num_heads % num_kv_heads:
        raise ConfigError(f"{num_heads} query heads do not group into {num_kv_heads} KV heads")
    if num_kv_heads >= size:
        return
    if size % num_kv_heads or num_heads % size:
        raise ConfigError(
            f"--tensor-parallel-size {size} does not fit the model: with {num_kv_heads} KV heads "
            f"(fewer than the ranks) the size must be a multiple of {num_kv_heads} dividing "
            f"the {num_heads} query heads"
        )
