"""vLLM's `store_threshold`: a chunk enters the CPU tier only once it was offered that many times.

Most prompts are never sent twice; storing each one costs a copy and evicts something that may
be. With a threshold of 2 or more the scheduler half counts the offers of each chunk and
stores it only on its threshold-th offer (values below 2 store on the first offer, and no
counter is kept). The counts live in an LRU table of at most `max_tracker_size` keys: a key
seen for the first time takes the place of the least recently offered key that is not part
of the same offer; when every tracked key is, it is not counted at all this time.

An offer is the run of a request's chunks the scheduler half considers for storing in one
step, stored or not (a chunk the tier already holds is offered and counted too); the chunks a
request loaded are not offered again.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class OfferCounter:
    """Offers per key, least recently offered first, for at most `max_keys` keys."""

    def __init__(self, threshold: int, max_keys: int) -> None:
        self.threshold = threshold
        self.max_keys = max_keys
        self._counts: OrderedDict[bytes, int] = OrderedDict()

    def record_offer(self, keys: Sequence[bytes]) -> None:
        """Count one offer of each of `keys`."""
        counts = self._counts
        num_known = 0
        for key in keys:
            if key in counts:
                counts[key] += 1
                counts.move_to_end(key)
                num_known += 1
        # Keys outside this offer, which may make way for its new keys (oldest first).
        num_replaceable = len(counts) - num_known
        for key in keys:
            if key in counts:
                continue
            if len(counts) >= self.max_keys:
                if not num_replaceable:
                    continue
                counts.popitem(last=False)
                num_replaceable -= 1
            counts[key] = 1

    def admits(self, key: bytes) -> bool:
        """Whether `key` has been offered often enough to be stored."""
        return self._counts.get(key, 0) >= self.threshold

    def clear(self) -> None:
        self._counts.clear()

    def __len__(self) -> int:
        return len(self._counts)


def make_offer_counter(threshold: int, max_keys: int) -> OfferCounter | None:
    """The counter for `store_threshold`, or None when the threshold (below 2) filters nothing."""
    return OfferCounter(threshold, max_keys) if threshold >= 2 else None
