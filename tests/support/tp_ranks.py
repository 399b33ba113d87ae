"""Connector halves of a tensor-parallel engine, built as its processes build them, without the runtime.

The scheduler half gets the engine identity with tp_size N, tp_rank 0 and rank 0's geometry;
each rank's worker half gets the identity with its rank and its KV-head shard
(shard_layout.kv_head_range) and KVPages of the shard's shape. Metadata reaches the workers as a
pickled copy, as it would cross a process boundary.
"""

from __future__ import annotations

import pickle
import time

import torch

import msgspec

from kvtool.engine.connectors.base import ConnectorContext, EngineIdentity, identity_of_rank
from kvtool.engine.connectors.registry import resolve_connector
from kvtool.engine.core.hashing import extend_block_hashes
from kvtool.engine.core.messages import KVConnectorOutput, ScheduledRequest, SchedulerOutput
from kvtool.engine.core.request import Request
from kvtool.engine.kv.pages import DTYPES, KVPages
from kvtool.engine.models.shard_layout import TPRank, kv_head_range
from kvtool.engine.params import SamplingParams


def head_slice(full: torch.Tensor, num_kv_heads: int, head_dim: int, size: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s KV heads of a KV_2LTD tensor [2, L, T, num_kv_heads*head_dim], contiguous."""
    start, count = kv_head_range(num_kv_heads, TPRank(size, rank))
    return full[..., start * head_dim : (start + count) * head_dim].contiguous()


class RankAggregator:
    """The runtime's merge of the ranks' outputs, as the tensor-parallel contract fixes it.

    Load errors are the union; in every list field of the connector's completions (job ids,
    blocks written or evicted) an item is passed on once EVERY rank has reported it, counting
    across steps.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._seen: dict[tuple[str, object], set[int]] = {}

    def completions(self, parts: list):
        """The completions of every rank (None where a rank had none), merged."""
        first = next((p for p in parts if p is not None), None)
        if first is None:
            return None
        merged, anything = {}, False
        for name in first.__struct_fields__:
            if not isinstance(getattr(first, name), list):
                merged[name] = getattr(first, name)
                continue
            done = []
            for rank, part in enumerate(parts):
                for item in getattr(part, name) if part is not None else []:
                    ranks = self._seen.setdefault((name, item), set())
                    ranks.add(rank)
                    if len(ranks) == self.size:
                        del self._seen[(name, item)]
                        done.append(item)
            merged[name] = done
            anything = anything or bool(done)
        return msgspec.structs.replace(first, **merged) if anything else None

    def aggregate(self, outputs: list[KVConnectorOutput]) -> KVConnectorOutput:
        invalid, reasons = set(), {}
        for out in outputs:
            invalid |= out.invalid_block_ids
            reasons.update(out.invalid_reasons)
        return KVConnectorOutput(step_id=outputs[0].step_id, invalid_block_ids=invalid, invalid_reasons=reasons,
                                 completions=self.completions([o.completions for o in outputs]))


class RankedHalves:
    """One scheduler half and one worker half per rank, over pages of each rank's shard."""

    def __init__(self, config, identity: EngineIdentity, none_hash: bytes, size: int, num_blocks: int = 64) -> None:
        self.connector = resolve_connector(config)
        self.size = size
        self.identities = [identity_of_rank(identity, size, r) for r in range(size)]
        self.aggregator = RankAggregator(size)
        self.scheduler = self.connector.create_scheduler_half(
            ConnectorContext(config=config, identity=self.identities[0], none_hash=none_hash))
        self.workers = []
        self.pages = []
        for ident in self.identities:
            worker = self.connector.create_worker_half(
                ConnectorContext(config=config, identity=ident, none_hash=none_hash))
            pages = KVPages(ident.geometry, num_blocks, torch.device("cpu"))
            pages.tensor.zero_()
            worker.register_kv_caches(pages)
            self.workers.append(worker)
            self.pages.append(pages)
        self.none_hash = none_hash
        self._steps = 0

    def next_step_id(self) -> int:
        """A new step's id, as the engine's scheduler numbers its steps."""
        self._steps += 1
        return self._steps - 1

    def request(self, rid: str, prompt: list[int]) -> Request:
        req = Request(rid, prompt, SamplingParams(max_tokens=1), max_tokens=1, eos_token_ids=frozenset())
        bs = self.identities[0].geometry.block_size
        extend_block_hashes(req.block_hashes, req.all_token_ids, bs, self.none_hash, None)
        return req

    def matched(self, req: Request, timeout_s: float = 30.0) -> int:
        """The scheduler half's answer, asked again while its lookup is in flight (as the scheduler does)."""
        deadline = time.monotonic() + timeout_s
        while (n := self.scheduler.get_num_new_matched_tokens(req, 0)[0]) is None:
            assert time.monotonic() < deadline, "lookup never answered"
            time.sleep(0.01)
        return n

    def step(self, req: Request, first_block: int, matched: int | None = None) -> list[KVConnectorOutput]:
        """Admit `req` (blocks from `first_block`), run one step of its whole prompt on every rank.

        Each rank's worker half gets its own pickled copy of the metadata; the scheduler half then
        sees their outputs as one, as the runtime hands them over (load errors are the union,
        completions every rank's). Returns each rank's output.
        """
        if matched is None:
            matched = self.matched(req)
        bs = self.identities[0].geometry.block_size
        n = len(req.prompt_token_ids)
        req.block_ids = list(range(first_block, first_block + -(-n // bs)))
        self.scheduler.update_state_after_alloc(req, req.block_ids, matched)
        step_id = self.next_step_id()
        so = SchedulerOutput(step_id=step_id, scheduled=[ScheduledRequest(
            request_id=req.request_id, token_ids=req.prompt_token_ids[matched:], start=matched,
            new_block_ids=req.block_ids, sample=True)])
        meta = pickle.dumps(self.scheduler.build_connector_meta(so))
        outputs = []
        for worker in self.workers:
            worker.bind_connector_metadata(pickle.loads(meta))
            worker.start_load_kv()
            worker.wait_for_save()
            worker.flush()
            errors = worker.get_block_ids_with_load_errors()
            outputs.append(KVConnectorOutput(step_id=step_id, invalid_block_ids=set(errors), invalid_reasons=dict(errors),
                                             completions=worker.take_completions()))
            worker.clear_connector_metadata()
        self.scheduler.update_connector_output(self.aggregator.aggregate(outputs))
        return outputs

    def report(self) -> None:
        """Hand the scheduler half what the workers finished since (background disk writes)."""
        self.scheduler.update_connector_output(self.aggregator.aggregate([
            KVConnectorOutput(completions=w.take_completions()) for w in self.workers]))

    def gathered(self, rank: int, block_ids: list[int], num_tokens: int) -> torch.Tensor:
        """Rank `rank`'s pages over `block_ids` as KV_2LTD [2, L, num_tokens, its heads*head_dim]."""
        return self.pages[rank].gather(block_ids, "KV_2LTD", num_tokens)

    def fill(self, rank: int, block_ids: list[int], data: torch.Tensor) -> None:
        """Write a KV_2LTD tensor of rank `rank`'s shard into its pages (what its forward would write)."""
        self.pages[rank].scatter(block_ids, data.to(DTYPES[self.identities[rank].geometry.dtype]), "KV_2LTD",
                                 data.shape[2])

    def shutdown(self) -> None:
        self.scheduler.shutdown()
        for w in self.workers:
            w.shutdown()
