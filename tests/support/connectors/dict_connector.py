"""A test-only connector that stores whole blocks in a Python dict, keyed by block hash.

It exercises the framework end to end (scheduler half -> metadata -> worker half -> output),
the geometry re-check and the load-failure policy. Loaded through kv_connector_module_path.
"""

from __future__ import annotations

import msgspec
import torch

from kvtool.engine.connectors.base import (
    KVConnector,
    KVConnectorMetadata,
    SchedulerHalf,
    WorkerHalf,
)
from kvtool.engine.errors import KVRefused
from kvtool.engine.kv.pages import KVGeometry, refuse_geometry_mismatch

# block hash -> (geometry recorded at store time, block-major block tensor)
STORE: dict[bytes, tuple[KVGeometry, torch.Tensor]] = {}
# Called at the start of every worker load with the step's load list (tests remove blocks here).
BEFORE_LOAD: list = []
# Per-run counters the tests read.
CALLS: list[str] = []


class BlockJob(msgspec.Struct):
    request_id: str
    block_id: int
    block_hash: bytes
    num_tokens: int


class DictMetadata(KVConnectorMetadata):
    loads: list[BlockJob] = []
    stores: list[BlockJob] = []


class DictScheduler(SchedulerHalf):
    def __init__(self, ctx):
        super().__init__(ctx)
        self.bs = ctx.identity.geometry.block_size
        self.requests = {}
        self.stored_blocks: dict[str, int] = {}
        self.pending_loads: list[BlockJob] = []

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        CALLS.append("get_num_new_matched_tokens")
        if not self.config.is_kv_consumer:
            return 0, False
        first = num_computed_tokens // self.bs
        n = 0
        for h in request.block_hashes[first:]:
            if h not in STORE:
                break
            n += 1
        return n * self.bs, False

    def update_state_after_alloc(self, request, block_ids, num_external_tokens):
        CALLS.append("update_state_after_alloc")
        self.requests[request.request_id] = request
        first = request.num_computed_tokens // self.bs
        # Whole blocks: a full hit leaves the last token to compute, and its block is loaded whole.
        end = -(-(request.num_computed_tokens + num_external_tokens) // self.bs)
        for i in range(first, end):
            self.pending_loads.append(BlockJob(request.request_id, block_ids[i], request.block_hashes[i], self.bs))
        # Blocks that come from the store need no storing back.
        self.stored_blocks[request.request_id] = end

    def build_connector_meta(self, scheduler_output):
        CALLS.append("build_connector_meta")
        stores = []
        if self.config.is_kv_producer:
            for s in scheduler_output.scheduled:
                req = self.requests.get(s.request_id)
                if req is None:
                    continue
                done = self.stored_blocks.get(req.request_id, 0)
                full = min((s.start + s.num_tokens) // self.bs, req.num_prompt_tokens // self.bs)
                for i in range(done, full):
                    stores.append(BlockJob(req.request_id, req.block_ids[i], req.block_hashes[i], self.bs))
                self.stored_blocks[req.request_id] = max(done, full)
        meta = DictMetadata(loads=self.pending_loads, stores=stores)
        self.steps_in_flight.add(scheduler_output.step_id, meta)
        self.pending_loads = []
        return meta

    def update_connector_output(self, output):
        # A request whose load failed stores nothing from this step; after a recompute it
        # stores again from its first bad block.
        step = self.steps_in_flight.answered(output)
        for job in step.loads if step is not None else []:
            if job.block_id in output.invalid_block_ids:
                req = self.requests.get(job.request_id)
                if req is not None:
                    bad = req.block_hashes.index(job.block_hash)
                    self.stored_blocks[job.request_id] = min(self.stored_blocks.get(job.request_id, 0), bad)

    def request_finished(self, request, block_ids):
        CALLS.append("request_finished")
        self.requests.pop(request.request_id, None)
        self.stored_blocks.pop(request.request_id, None)
        return False, None


class DictWorker(WorkerHalf):
    def start_load_kv(self):
        CALLS.append("start_load_kv")
        meta = self._meta
        for hook in BEFORE_LOAD:
            hook(meta.loads)
        pages = self.kv_pages
        for job in meta.loads:
            entry = STORE.get(job.block_hash)
            if entry is None:
                self.errors[job.block_id] = f"block {job.block_hash.hex()[:12]} is gone from the store"
                continue
            geometry, data = entry
            try:
                refuse_geometry_mismatch(geometry, pages.geometry, "dict connector load")
            except KVRefused as e:
                self.errors[job.block_id] = str(e)
                continue
            pages.scatter([job.block_id], data.unsqueeze(0))
            self.stats.bytes_loaded += data.numel() * data.element_size()
            self.stats.tokens_loaded[job.request_id] = self.stats.tokens_loaded.get(job.request_id, 0) + job.num_tokens

    def wait_for_save(self):
        CALLS.append("wait_for_save")
        failed = {job.request_id for job in self._meta.loads if job.block_id in self.errors}
        for job in self._meta.stores:
            if job.request_id in failed:
                continue  # computed over KV that failed to load: never store it
            block = self.kv_pages.gather([job.block_id])[0].clone()
            STORE[job.block_hash] = (self.kv_pages.geometry, block)
            self.stats.bytes_stored += block.numel() * block.element_size()
            self.stats.tokens_stored[job.request_id] = self.stats.tokens_stored.get(job.request_id, 0) + job.num_tokens



class DictConnector(KVConnector):
    scheduler_half = DictScheduler
    worker_half = DictWorker


class SchedulerOnlyConnector(KVConnector):
    """Has a scheduler half and no worker half: the refusal guard must stop it everywhere."""

    scheduler_half = DictScheduler
    worker_half = None
