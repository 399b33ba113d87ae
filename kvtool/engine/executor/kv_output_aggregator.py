"""One KVConnectorOutput from the N tensor-parallel ranks' outputs of a step, as vLLM's KVOutputAggregator.

Each rank's worker half moves its own KV shard, so a transfer is done only once every rank has
done its part, and the ranks may finish in different steps (stores land in the background):

* finished_sending / finished_recving, and every list in the connector's completions (job ids,
  block hashes written or evicted): an item is reported once EVERY rank has reported it,
  counting across steps; until then it is held here;
* invalid blocks (failed loads): the union, with the first reason given for each;
* bytes and seconds of the transfer stats: summed (the work of all ranks); the per-request token
  counts: rank 0's (every rank moves the same tokens, maybe in another step, so a sum or a
  per-step maximum would count a token more than once); failed loads and chunks not stored: the
  most of any rank.
"""

from __future__ import annotations

from collections import Counter

import msgspec

from kvtool.engine.core.messages import KVConnectorCompletions, KVConnectorOutput, TransferStats


class _AllRanks:
    """Items that count once every rank has reported them (a rank may report one several times)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._seen: dict[object, Counter] = {}

    def add(self, rank: int, items) -> list:
        """Record rank's items; return those every rank has now reported (each taken once)."""
        done = []
        for item in items:
            counts = self._seen.setdefault(item, Counter())
            counts[rank] += 1
            if len(counts) == self.size:
                done.append(item)
                for r in list(counts):
                    counts[r] -= 1
                    if not counts[r]:
                        del counts[r]
                if not counts:
                    del self._seen[item]
        return done


class KVOutputAggregator:
    """Merges the ranks' KVConnectorOutput of each step into the one the scheduler half sees."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._sending = _AllRanks(size)
        self._recving = _AllRanks(size)
        self._completion_lists: dict[str, _AllRanks] = {}

    def aggregate(self, outputs: list[KVConnectorOutput | None]) -> KVConnectorOutput | None:
        """The step's merged output, rank 0 first in `outputs`; None when no rank reported one."""
        if all(o is None for o in outputs):
            return None
        sending: list = []
        recving: list = []
        invalid: dict[int, str] = {}
        for rank, out in enumerate(outputs):
            if out is None:
                continue
            sending += self._sending.add(rank, out.finished_sending)
            recving += self._recving.add(rank, out.finished_recving)
            for block in sorted(out.invalid_block_ids):
                invalid.setdefault(block, out.invalid_reasons.get(block, "the load failed"))
        present = [o for o in outputs if o is not None]
        steps = {o.step_id for o in present}
        if len(steps) != 1:
            raise RuntimeError(f"the ranks answered different steps: {sorted(steps, key=str)}")
        return KVConnectorOutput(
            step_id=steps.pop(),
            finished_sending=set(sending),
            finished_recving=set(recving),
            invalid_block_ids=set(invalid),
            invalid_reasons=invalid,
            completions=self.merge_completions([o.completions if o is not None else None for o in outputs]),
            stats=merge_stats([o.stats for o in present]),  # rank 0 always reports when any rank does
        )

    def merge_completions(self, parts: list[KVConnectorCompletions | None]) -> KVConnectorCompletions | None:
        """The connector's completions with, in each list field, only what every rank has reported.

        Other fields are rank 0's (the first rank that reported). None when no rank reported any
        and nothing became complete.
        """
        first = next((p for p in parts if p is not None), None)
        if first is None:
            return None
        merged = {}
        anything = False
        for name in first.__struct_fields__:
            value = getattr(first, name)
            if not isinstance(value, list):
                merged[name] = value
                continue
            tracker = self._completion_lists.setdefault(f"{type(first).__qualname__}.{name}", _AllRanks(self.size))
            done: list = []
            for rank, part in enumerate(parts):
                if part is not None:
                    done += tracker.add(rank, getattr(part, name))
            merged[name] = done
            anything = anything or bool(done)
        return msgspec.structs.replace(first, **merged) if anything else None


def merge_stats(parts: list[TransferStats]) -> TransferStats:
    """The ranks' transfer stats of one step as one, rank 0 first (the module docstring has the rules)."""
    if not parts:
        return TransferStats()
    return TransferStats(
        bytes_loaded=sum(p.bytes_loaded for p in parts),
        bytes_stored=sum(p.bytes_stored for p in parts),
        load_s=sum(p.load_s for p in parts),
        store_s=sum(p.store_s for p in parts),
        load_failures=max(p.load_failures for p in parts),
        store_skipped_chunks=max(p.store_skipped_chunks for p in parts),
        tokens_loaded=dict(parts[0].tokens_loaded),
        tokens_stored=dict(parts[0].tokens_stored),
        tokens_loaded_from_disk=dict(parts[0].tokens_loaded_from_disk),
    )
