"""The CPU tier, split as its two owners use it: a slot index (scheduler half) and a host pool (worker half).

The pool is one host tensor allocated once, `num_slots` fixed-size slots; a slot holds one
offload block in the pages' own block-major layout `[blocks_per_slot, 2, L, block_size, H, D]`,
so a load or a store is one contiguous copy per engine block. Both halves size it from the same
settings (`plan_num_slots`), so slot numbers mean the same on both sides without any shared object.

The scheduler half alone decides what is where: `SlotIndex` maps keys to slots, keeps the LRU
order and the pins (a slot with a job in flight is never evicted). A job's pin is released when
the worker half reports the job finished. The worker half only moves bytes into and out of
`HostPool` slots named in the jobs.
"""

from __future__ import annotations

import mmap
from collections import OrderedDict

import torch

from kvtool.engine.kv_pages import DTYPES, KVGeometry


def plan_num_slots(slot_bytes_all_ranks: int, cpu_bytes: int | None, num_slots: int | None) -> int:
    """Slots of the pool from num_cpu_blocks, or from cpu_bytes_to_use as vLLM sizes it; at least one.

    `slot_bytes_all_ranks`: one offload block's bytes summed over every tensor-parallel rank.
    vLLM counts cpu_bytes_to_use across all workers and gives each offload block a page-aligned
    share, so a slot costs that sum rounded up to the page size (cpu/spec.py); the same
    cpu_bytes_to_use gives kvtool the same number of slots, each rank holding its shard of each.
    """
    if num_slots is not None:
        return num_slots
    aligned = -(-slot_bytes_all_ranks // mmap.PAGESIZE) * mmap.PAGESIZE
    return max(1, (cpu_bytes or 0) // aligned)


class SlotIndex:
    """Which key is in which slot, in LRU order, and which slots are pinned. Never touches bytes."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> slot, least recently used first
        self._free = list(range(num_slots - 1, -1, -1))
        self._pins = [0] * num_slots
        self._dropped: set[int] = set()  # forgotten while pinned: freed at the last unpin
        # Keys evicted to make room, until the owner takes them (take_evicted).
        self._evicted: list[bytes] = []

    def lookup(self, key: bytes) -> int | None:
        """The slot holding `key`, or None. No side effects."""
        return self._index.get(key)

    def touch(self, key: bytes) -> None:
        if key in self._index:
            self._index.move_to_end(key)

    def allocate(self, key: bytes) -> int | None:
        """A slot for `key`, evicting the least recently used unpinned slot; None when all are pinned.

        The returned slot is pinned (release with `unpin`) and indexed under `key` at once.
        """
        if key in self._index:
            slot = self._index[key]
            self._index.move_to_end(key)
            self._pins[slot] += 1
            return slot
        if self._free:
            slot = self._free.pop()
        else:
            victim = next((k for k, s in self._index.items() if self._pins[s] == 0), None)
            if victim is None:
                return None
            slot = self._index.pop(victim)
            self._evicted.append(victim)
        self._index[key] = slot
        self._pins[slot] += 1
        return slot

    def pin(self, slot: int) -> None:
        self._pins[slot] += 1

    def unpin(self, slot: int) -> None:
        self._pins[slot] -= 1
        if self._pins[slot] < 0:
            raise RuntimeError(f"CPU tier slot {slot} unpinned twice")
        if self._pins[slot] == 0 and slot in self._dropped:
            self._dropped.discard(slot)
            self._free.append(slot)

    def drop(self, key: bytes) -> None:
        """Forget `key` (its bytes failed a check); the slot becomes free once unpinned."""
        slot = self._index.pop(key, None)
        if slot is not None:
            if self._pins[slot]:
                self._dropped.add(slot)
            else:
                self._free.append(slot)

    def take_evicted(self) -> list[bytes]:
        """Keys evicted by `allocate` since the last call."""
        evicted, self._evicted = self._evicted, []
        return evicted

    def keys(self) -> list[bytes]:
        return list(self._index)

    @property
    def num_pinned(self) -> int:
        return sum(1 for p in self._pins if p)

    def __len__(self) -> int:
        return len(self._index)


class HostPool:
    """The CPU tier's bytes: `num_slots` slots in one host tensor (pinned for CUDA engines)."""

    def __init__(self, geometry: KVGeometry, blocks_per_slot: int, num_slots: int, pin_memory: bool) -> None:
        self.geometry = geometry
        self.blocks_per_slot = blocks_per_slot
        self.num_slots = num_slots
        g = geometry
        # [num_slots, blocks_per_slot, 2, L, bs, H, D]
        self.pool = torch.empty(
            (num_slots, blocks_per_slot, 2, g.num_layers, g.block_size, g.num_kv_heads, g.head_dim),
            dtype=DTYPES[g.dtype],
            pin_memory=pin_memory,
        )

    @property
    def slot_bytes(self) -> int:
        return self.geometry.bytes_per_block * self.blocks_per_slot

    def slot(self, slot: int) -> torch.Tensor:
        """The slot's tensor [blocks_per_slot, 2, L, bs, H, D] (a view into the pool)."""
        return self.pool[slot]
