"""The CPU tier, split as its two owners use it: a slot index (scheduler half) and a host pool (worker half).

The pool is one host tensor allocated once, `num_slots` fixed-size slots; a slot holds one
offload block in the pages' own block-major layout `[blocks_per_slot, 2, L, block_size, H, D]`,
so a load or a store is one contiguous copy per engine block. Both halves size it from the same
settings (`plan_num_slots`), so slot numbers mean the same on both sides without any shared object.

The scheduler half alone decides what is where: `SlotIndex` maps keys to slots and keeps the
pins (a slot with a job in flight is never evicted); its eviction policy (eviction.py: lru or
arc) keeps the order in which keys go. A job's pin is released when the worker half reports
the job finished. The worker half only moves bytes into and out of `HostPool` slots named in
the jobs.
"""

from __future__ import annotations

import mmap
from collections.abc import Collection, Sequence

import torch

from kvtool.engine.connectors.offloading.arc_policy import ARCPolicy
from kvtool.engine.connectors.offloading.eviction import EvictionPolicy, LRUPolicy, RequestAccess
from kvtool.engine.kv.pages import DTYPES, KVGeometry


# The eviction_policy names settings.py accepts (POLICY_NAMES), and what each builds.
POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy, "arc": ARCPolicy}


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
    """Which key is in which slot, which slots are pinned, and (through its eviction policy)
    which key goes first. Never touches bytes.

    A slot is pinned while a job uses it (`allocate` pins, `pin` adds one, `unpin` releases
    one); a pinned key is never evicted nor dropped. A key allocated here is *filling* until
    its bytes have landed (`mark_filled`).
    """

    def __init__(self, num_slots: int, eviction_policy: str = "lru") -> None:
        """`eviction_policy`: one of POLICY_NAMES (settings.py has checked it)."""
        self.num_slots = num_slots
        self.policy = POLICIES[eviction_policy](num_slots)
        self._index: dict[bytes, int] = {}  # key -> slot
        self._free = list(range(num_slots - 1, -1, -1))
        self._pins = [0] * num_slots
        self._dropped: set[int] = set()  # forgotten while pinned: freed at the last unpin
        self._filling: set[bytes] = set()
        # Keys evicted to make room, until the owner takes them (take_evicted).
        self._evicted: list[bytes] = []

    def lookup(self, key: bytes) -> int | None:
        """The slot holding `key`, or None. No side effects."""
        return self._index.get(key)

    def is_ready(self, key: bytes) -> bool:
        """Whether `key` is held and its bytes have landed."""
        return key in self._index and key not in self._filling

    def mark_filled(self, key: bytes) -> None:
        self._filling.discard(key)

    def touch(self, keys: Sequence[bytes]) -> None:
        """`keys` (in prefix order) are in use by a running request."""
        self.policy.touch(keys)

    def request_finished(self, access: RequestAccess) -> None:
        self.policy.request_finished(access)

    def allocate(self, key: bytes) -> int | None:
        """`allocate_many([key])[0]`."""
        return self.allocate_many([key])[0]

    def allocate_many(self, keys: Sequence[bytes], protected: Collection[bytes] = ()) -> list[int | None]:
        """A pinned slot per key (in prefix order), evicting what the policy chooses among the
        unpinned keys not in `protected`; None for the keys left over when too few can go.

        A key already held keeps its slot, pinned once more. A new key is indexed at once and
        filling. Evicted keys are kept for `take_evicted`.
        """
        new = [k for k in dict.fromkeys(keys) if k not in self._index]
        if new:
            self.policy.note_store_misses(new)
            shortfall = len(new) - len(self._free)
            if shortfall > 0:
                pins, index = self._pins, self._index
                for victim in self.policy.choose_victims(
                        shortfall, lambda k: not pins[index[k]] and k not in protected):
                    self._free.append(self._index.pop(victim))
                    self._evicted.append(victim)
            placed = new[: len(self._free)]
            for key in placed:
                self._index[key] = self._free.pop()
                self._filling.add(key)
            self.policy.insert(placed)
        slots: list[int | None] = []
        for key in keys:
            slot = self._index.get(key)
            if slot is not None:
                self._pins[slot] += 1
            slots.append(slot)
        return slots

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
            self.policy.remove(key)
            self._filling.discard(key)
            if self._pins[slot]:
                self._dropped.add(slot)
            else:
                self._free.append(slot)

    def clear(self) -> list[bytes]:
        """Forget every key whose slot is not pinned, and what the policy learnt; returns them.

        Pinned keys stay (a job still reads or fills their slot): `len(self)` says how many.
        """
        gone = [key for key, slot in self._index.items() if not self._pins[slot]]
        for key in gone:
            self._free.append(self._index.pop(key))
            self.policy.remove(key)
            self._filling.discard(key)
        self.policy.forget_history()
        return gone

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

    def __init__(self, geometry: KVGeometry, blocks_per_slot: int, num_slots: int, pin_memory: bool,
                 layers_per_block: int | None = None) -> None:
        self.geometry = geometry
        self.blocks_per_slot = blocks_per_slot
        self.num_slots = num_slots
        g = geometry
        # A block's layers: every layer, or with KV cache groups one group's (a slot then holds
        # one group's chunk).
        self.layers_per_block = layers_per_block or g.num_layers
        # [num_slots, blocks_per_slot, 2, L, bs, H, D]
        self.pool = torch.empty(
            (num_slots, blocks_per_slot, 2, self.layers_per_block, g.block_size, g.num_kv_heads, g.head_dim),
            dtype=DTYPES[g.dtype],
            pin_memory=pin_memory,
        )

    @property
    def slot_bytes(self) -> int:
        return self.geometry.block_bytes(self.layers_per_block) * self.blocks_per_slot

    def slot(self, slot: int) -> torch.Tensor:
        """The slot's tensor [blocks_per_slot, 2, L, bs, H, D] (a view into the pool)."""
        return self.pool[slot]
