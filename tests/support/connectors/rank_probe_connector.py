"""A test-only connector that records, in files, the identity each half was built with (so a test
sees which rank and KV geometry every tensor-parallel worker got), stores blocks as the dict
connector does (per process), and whose worker half raises in the step of a request with
kv_transfer_params {"explode_rank": R} on rank R.

kv_connector_extra_config: {"probe_dir": DIR}. Each half writes DIR/<role>-<pid>.json.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tests.support.connectors.dict_connector import DictMetadata, DictScheduler, DictWorker
from kvtool.engine.connectors.base import KVConnector


class ProbeMetadata(DictMetadata):
    explode_rank: int | None = None


def _record(ctx, role: str, extra: dict | None = None) -> None:
    ident = ctx.identity
    doc = {"role": role, "tp_size": ident.tp_size, "tp_rank": ident.tp_rank,
           "num_kv_heads": ident.geometry.num_kv_heads, **(extra or {})}
    path = Path(ctx.config.kv_connector_extra_config["probe_dir"]) / f"{role}-{os.getpid()}.json"
    path.write_text(json.dumps(doc))


class ProbeScheduler(DictScheduler):
    def __init__(self, ctx):
        super().__init__(ctx)
        _record(ctx, "scheduler")
        self.explode_rank = None

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        super().update_state_after_alloc(request, block_ids, num_external_tokens)
        rank = (request.kv_transfer_params or {}).get("explode_rank")
        if rank is not None:
            self.explode_rank = rank

    def build_connector_meta(self, scheduler_output):
        meta = super().build_connector_meta(scheduler_output)
        out = ProbeMetadata(loads=meta.loads, stores=meta.stores, explode_rank=self.explode_rank)
        self.explode_rank = None
        return out


class ProbeWorker(DictWorker):
    def register_kv_caches(self, kv_pages):
        super().register_kv_caches(kv_pages)
        _record(self.ctx, "worker", {"pages_kv_heads": kv_pages.geometry.num_kv_heads})

    def start_load_kv(self):
        if self._meta.explode_rank == self.ctx.identity.tp_rank:
            raise RuntimeError(f"rank {self.ctx.identity.tp_rank}'s load blew up")
        super().start_load_kv()


class RankProbeConnector(KVConnector):
    scheduler_half = ProbeScheduler
    worker_half = ProbeWorker
