"""The CPU tier: one host pool allocated once, fixed-size slots, LRU eviction.

A slot holds one offload block in the pages' own block-major layout
`[blocks_per_slot, 2, L, block_size, H, D]`, so a load or a store is one contiguous copy per
engine block. Slots with a transfer in flight (a load this step, a pending disk write) are
pinned and never evicted. The pool is the medium both connector halves share: the scheduler
half owns the index (which key is in which slot), the worker half moves the bytes.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch

from kvtool.engine.kv_pages import DTYPES, KVGeometry


class CPUTier:
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
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()  # key -> slot, least recently used first
        self._key_of: dict[int, bytes] = {}
        self._free = list(range(num_slots - 1, -1, -1))
        self._pins = [0] * num_slots
        self._dropped: set[int] = set()  # forgotten while pinned: freed at the last unpin

    @property
    def slot_bytes(self) -> int:
        return self.geometry.bytes_per_block * self.blocks_per_slot

    def slot(self, slot: int) -> torch.Tensor:
        """The slot's tensor [blocks_per_slot, 2, L, bs, H, D] (a view into the pool)."""
        return self.pool[slot]

    def lookup(self, key: bytes) -> int | None:
        """The slot holding `key`, or None. No side effects."""
        with self._lock:
            return self._index.get(key)

    def touch(self, key: bytes) -> None:
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)

    def allocate(self, key: bytes) -> int | None:
        """A slot for `key`, evicting the least recently used unpinned slot; None when all are pinned.

        The returned slot is pinned (release with `unpin`) and indexed under `key` at once.
        """
        with self._lock:
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
                del self._key_of[slot]
            self._index[key] = slot
            self._key_of[slot] = key
            self._pins[slot] += 1
            return slot

    def pin(self, slot: int) -> None:
        with self._lock:
            self._pins[slot] += 1

    def unpin(self, slot: int) -> None:
        with self._lock:
            self._pins[slot] -= 1
            if self._pins[slot] < 0:
                raise RuntimeError(f"CPU tier slot {slot} unpinned twice")
            if self._pins[slot] == 0 and slot in self._dropped:
                self._dropped.discard(slot)
                self._free.append(slot)

    def drop(self, key: bytes) -> None:
        """Forget `key` (its bytes failed a check); the slot becomes free once unpinned."""
        with self._lock:
            slot = self._index.pop(key, None)
            if slot is not None:
                del self._key_of[slot]
                if self._pins[slot]:
                    self._dropped.add(slot)
                else:
                    self._free.append(slot)

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)


def make_cpu_tier(geometry: KVGeometry, blocks_per_slot: int, cpu_bytes: int | None, num_slots: int | None, pin_memory: bool) -> CPUTier:
    """Size the pool from cpu_bytes_to_use (vLLM's key) or num_cpu_blocks; at least one slot."""
    slot_bytes = geometry.bytes_per_block * blocks_per_slot
    if num_slots is None:
        num_slots = max(1, (cpu_bytes or 0) // slot_bytes)
    return CPUTier(geometry, blocks_per_slot, num_slots, pin_memory)
