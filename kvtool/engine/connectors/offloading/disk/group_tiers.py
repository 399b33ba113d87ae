"""A disk tier per KV cache group, addressed by offload keys (block hash + 4-byte group index).

One group (every layer in one table) keeps the tier's one identity, so a tier written before
groups existed, or by an engine of one group, is read as it was. With several groups, group g's
chunks live under an identity of their own: its `num_layers` is the slots of a block (a chunk's
payload holds the group's layers in slot order) and its `byte_layout` names the group and its
layers, so a chunk of one group, or of another grouping, is never read as another's (vLLM's fs
tier keeps a folder per group the same way). The per-group tiers share the root, its ledger and
its capacity, as tensor-parallel ranks do.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from kvtool.engine.connectors.offloading.disk.disk_index import DiskIndex
from kvtool.engine.connectors.offloading.disk.disk_tier import DiskTier
from kvtool.engine.connectors.offloading.disk.tier_identity import KVBlockHeader, KVIdentity
from kvtool.engine.kv.groups import KVCacheLayout

BLOCK_MAJOR = "block_major"


def group_of(key: bytes) -> int:
    """The KV cache group index at the end of an offload key."""
    return int.from_bytes(key[-4:], "big")


def block_hash_of(key: bytes) -> bytes:
    """The block hash inside an offload key (vLLM's layout: block hash + 4-byte group index)."""
    return key[:-4]


def group_identities(identity: KVIdentity, layout: KVCacheLayout) -> list[KVIdentity]:
    """The identity each group's chunks are stored under (one group: `identity` itself)."""
    if layout.num_groups == 1:
        return [identity]
    out = []
    for g, group in enumerate(layout.groups):
        layers = ",".join(map(str, group.layers))
        out.append(msgspec.structs.replace(
            identity, num_layers=layout.num_slots, sliding_window=group.sliding_window,
            byte_layout=f"{BLOCK_MAJOR} kv_cache_group {g} of {layout.num_groups}: layers {layers} "
                        f"in {layout.num_slots} slots"))
    return out


class GroupDiskTiers:
    """The worker half's disk tiers, one per group, read and written by offload key."""

    def __init__(self, tiers: Sequence[DiskTier]) -> None:
        self.tiers = list(tiers)

    def read_into(self, key: bytes, out: object) -> KVBlockHeader:
        return self.tiers[group_of(key)].read_into(block_hash_of(key), out)

    def write(self, key: bytes, num_tokens: int, payload: object) -> bool:
        return self.tiers[group_of(key)].write(block_hash_of(key), num_tokens, payload)

    def take_evicted(self) -> list[bytes]:
        """Keys the tiers evicted for room since the last call."""
        return [bh + g.to_bytes(4, "big") for g, tier in enumerate(self.tiers) for bh in tier.take_evicted()]

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()


class GroupDiskIndex:
    """The scheduler half's index of the disk tiers, one `DiskIndex` per group, by offload key."""

    def __init__(self, indexes: Sequence[DiskIndex]) -> None:
        self.indexes = list(indexes)

    def __contains__(self, key: bytes) -> bool:
        return block_hash_of(key) in self.indexes[group_of(key)]

    def add(self, key: bytes) -> None:
        self.indexes[group_of(key)].add(block_hash_of(key))

    def discard(self, key: bytes) -> None:
        self.indexes[group_of(key)].discard(block_hash_of(key))

    def __len__(self) -> int:
        """Chunks on disk, each group's counted."""
        return sum(len(index) for index in self.indexes)

    def refresh(self) -> None:
        for index in self.indexes:
            index.refresh()

    def close(self) -> None:
        for index in self.indexes:
            index.close()
