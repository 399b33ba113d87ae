"""ARC, the Adaptive Replacement Cache (Megiddo & Modha, FAST 2003), as the CPU tier's `arc` policy.

ARC splits the cache in two LRU lists and learns how to share it between them:

    recent   (T1)  keys used once since they entered the tier
    frequent (T2)  keys reused at least once since then
    recent_ghosts, frequent_ghosts (B1, B2)  keys recently evicted from T1 / T2 (no bytes)
    target_recent (p)  how many slots T1 should have, between 0 and the capacity

A victim comes from T1 while T1 holds at least p keys, else from T2. A store miss on a key
found in B1 says T1 was evicting too early: p grows by max(1, |B2| / |B1|); one found in B2
shrinks p by max(1, |B1| / |B2|), as in the paper. A one-time scan therefore washes through T1
and never evicts T2, where a chunk that requests keep reusing lives; LRU would evict it.

The rules follow vLLM 0.33's `arc` eviction_policy (the same hits and evictions on the same
accesses; tests/engine/connectors/offloading/test_arc_policy.py checks it against vLLM's own), which departs from the
paper in three ways, kept here for vLLM's meaning:

  * a key re-stored after a ghost hit enters T1, not T2: only a reuse makes a key frequent;
  * the victim comes from T1 when |T1| >= floor(p) (the paper: |T1| > p, or = p on a B2 hit);
  * each ghost list keeps at most `capacity` keys (the paper bounds |T1|+|B1| and the total).

Reuses are learnt when a request ends (`request_finished`), so a request's own stores are not
a second use, and pinned keys (a transfer in flight) are never victims.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence

from kvtool.engine.connectors.offloading.eviction import EvictionPolicy, RequestAccess


class ARCPolicy(EvictionPolicy):
    """ARC over the tier's keys; each list is least recently used first."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.target_recent = 0.0
        self.recent: OrderedDict[bytes, None] = OrderedDict()
        self.frequent: OrderedDict[bytes, None] = OrderedDict()
        self.recent_ghosts: OrderedDict[bytes, None] = OrderedDict()
        self.frequent_ghosts: OrderedDict[bytes, None] = OrderedDict()

    def __contains__(self, key: bytes) -> bool:
        return key in self.recent or key in self.frequent

    def __len__(self) -> int:
        return len(self.recent) + len(self.frequent)

    def insert(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            self.recent[key] = None
            self.recent_ghosts.pop(key, None)
            self.frequent_ghosts.pop(key, None)

    def remove(self, key: bytes) -> None:
        if key in self.recent:
            del self.recent[key]
        else:
            self.frequent.pop(key, None)

    def note_store_misses(self, keys: Sequence[bytes]) -> None:
        for key in reversed(keys):
            if key in self.recent_ghosts:
                step = max(1.0, len(self.frequent_ghosts) / len(self.recent_ghosts))
                self.target_recent = min(self.target_recent + step, float(self.capacity))
                self.recent_ghosts.move_to_end(key)
            elif key in self.frequent_ghosts:
                step = max(1.0, len(self.recent_ghosts) / len(self.frequent_ghosts))
                self.target_recent = max(self.target_recent - step, 0.0)
                self.frequent_ghosts.move_to_end(key)

    def request_finished(self, access: RequestAccess) -> None:
        only_inserted = access.inserted - access.reused
        # Tail first, so that the head of the prefix ends up the most recent of its list.
        for key in reversed(access.in_prefix_order()):
            if key in only_inserted:
                # Storing is not a reuse: the key stays in its list, as its most recent entry.
                for keys in (self.recent, self.frequent):
                    if key in keys:
                        keys.move_to_end(key)
                        break
            elif key in access.reused:
                if key in self.recent:
                    del self.recent[key]
                    self.frequent[key] = None
                elif key in self.frequent:
                    self.frequent.move_to_end(key)

    def choose_victims(self, n: int, can_evict: Callable[[bytes], bool]) -> list[bytes]:
        # One pass over each list, least recently used first: the candidates are chosen as if
        # evicted one by one, then all moved to the ghost lists together.
        def candidates(keys: OrderedDict[bytes, None]) -> Iterator[bytes]:
            return (key for key in list(keys) if can_evict(key))

        from_recent, from_frequent = candidates(self.recent), candidates(self.frequent)
        recent_left = len(self.recent)
        chosen: list[tuple[bytes, bool]] = []  # (key, taken from T1)
        for _ in range(n):
            key = next(from_recent, None) if recent_left >= int(self.target_recent) else None
            in_recent = key is not None
            if key is None:
                key = next(from_frequent, None)
            if key is None:
                key = next(from_recent, None)
                in_recent = key is not None
            if key is None:
                break
            if in_recent:
                recent_left -= 1
            chosen.append((key, in_recent))
        for key, in_recent in chosen:
            if in_recent:
                del self.recent[key]
                self.recent_ghosts[key] = None
            else:
                del self.frequent[key]
                self.frequent_ghosts[key] = None
        for ghosts in (self.recent_ghosts, self.frequent_ghosts):
            while len(ghosts) > self.capacity:
                ghosts.popitem(last=False)
        return [key for key, _ in chosen]

    def forget_history(self) -> None:
        self.recent_ghosts.clear()
        self.frequent_ghosts.clear()
        self.target_recent = 0.0
