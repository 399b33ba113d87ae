"""The CPU tier's eviction policies: which key gives up its slot when a store needs one.

A policy sees keys only. `SlotIndex` (cpu_tier.py) owns the slots and the pins and asks the
policy for victims with a predicate saying which keys may go (unpinned, and not part of the
offer being stored). Two policies, named as vLLM's `eviction_policy` names them:

  lru   least recently used first (this module);
  arc   Adaptive Replacement Cache (arc_policy.py).

Both learn the way vLLM 0.33's CPU tier does: a key is used when a request loads it or finds
it already stored, and a request's uses count once, at its end (`request_finished`), head of
the prefix last. Because block hashes chain, a chunk is only reachable through the chunks
before it: the head of a prefix is the most valuable part of it, so within one request the
tail goes first.
"""

from __future__ import annotations

import abc
from collections import OrderedDict
from collections.abc import Callable, Sequence

POLICY_NAMES = ("lru", "arc")  # what eviction_policy may name (cpu_tier.POLICIES builds each)


class RequestAccess:
    """The CPU-tier keys one request used, for the policy to learn from when the request ends.

    `inserted`: keys this request stored (or promoted from disk) into the tier; `reused`: keys
    it found already stored and ready (loaded, or offered again), never ones it inserted itself.
    """

    __slots__ = ("positions", "inserted", "reused")

    def __init__(self) -> None:
        self.positions: dict[bytes, int] = {}  # key -> offload block index in the request
        self.inserted: set[bytes] = set()
        self.reused: set[bytes] = set()

    def saw(self, key: bytes, index: int, *, inserted: bool = False, reused: bool = False) -> None:
        self.positions.setdefault(key, index)
        if inserted:
            self.inserted.add(key)
        elif reused and key not in self.inserted:
            self.reused.add(key)

    def in_prefix_order(self) -> list[bytes]:
        return sorted(self.positions, key=self.positions.__getitem__)


class EvictionPolicy(abc.ABC):
    """The order in which a CPU tier's keys are evicted. Holds exactly the keys that have a slot."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity

    @abc.abstractmethod
    def __contains__(self, key: bytes) -> bool: ...

    @abc.abstractmethod
    def __len__(self) -> int: ...

    @abc.abstractmethod
    def insert(self, keys: Sequence[bytes]) -> None:
        """`keys` (one request's, in prefix order) were just given slots."""

    @abc.abstractmethod
    def remove(self, key: bytes) -> None:
        """`key` left the tier without being evicted (dropped after a failed check, or a reset)."""

    def note_store_misses(self, keys: Sequence[bytes]) -> None:
        """`keys` (in prefix order) are about to be stored because the tier did not hold them;
        called before the eviction that makes room for them."""

    def touch(self, keys: Sequence[bytes]) -> None:
        """`keys` (in prefix order) are in use by a request that has not ended yet."""

    @abc.abstractmethod
    def request_finished(self, access: RequestAccess) -> None:
        """A request ended: learn from the keys it used (keys no longer held are skipped)."""

    @abc.abstractmethod
    def choose_victims(self, n: int, can_evict: Callable[[bytes], bool]) -> list[bytes]:
        """Up to `n` keys for which `can_evict` holds, removed from the policy; fewer when the
        tier holds fewer such keys."""

    @abc.abstractmethod
    def forget_history(self) -> None:
        """Drop whatever the policy learnt beyond the keys it holds (a cache reset)."""


class LRUPolicy(EvictionPolicy):
    """Least recently used first. A request's keys become the most recent at its end, its head
    last; while it runs, the keys it loads or stores are already ordered that way."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._order: OrderedDict[bytes, None] = OrderedDict()  # least recently used first

    def __contains__(self, key: bytes) -> bool:
        return key in self._order

    def __len__(self) -> int:
        return len(self._order)

    def insert(self, keys: Sequence[bytes]) -> None:
        for key in reversed(keys):
            self._order[key] = None
            self._order.move_to_end(key)

    def remove(self, key: bytes) -> None:
        self._order.pop(key, None)

    def touch(self, keys: Sequence[bytes]) -> None:
        for key in reversed(keys):
            if key in self._order:
                self._order.move_to_end(key)

    def request_finished(self, access: RequestAccess) -> None:
        self.touch(access.in_prefix_order())

    def choose_victims(self, n: int, can_evict: Callable[[bytes], bool]) -> list[bytes]:
        victims = []
        for key in self._order:
            if len(victims) == n:
                break
            if can_evict(key):
                victims.append(key)
        for key in victims:
            del self._order[key]
        return victims

    def forget_history(self) -> None:
        pass

