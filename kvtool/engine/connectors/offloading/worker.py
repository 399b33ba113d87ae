"""The OffloadingConnector's worker half: moves blocks between the pages, the host pool and the disk tier.

It owns the bytes (the host pool, the disk tier's files) and no index: every job names its slot
and key. It reports back, in `KVConnectorOutput.completions`, the jobs it no longer needs a slot
for, the blocks it wrote to disk and the blocks the disk tier evicted; the scheduler half updates
its own state from that.

On CPU pages every copy is synchronous. On CUDA pages (a pinned pool) the copies are queued on
their own streams by `SlotTransfers`. Loads of LAYER_GROUP_LOAD_MIN_BLOCKS blocks or more go in
groups of layers as pitched copies on the copy engine, the forward's layer l waiting for its
group only (a full hit's one-token forward runs beside the copies instead of after them);
smaller ones go as whole blocks before the forward. Stores go as whole blocks after the forward,
beside the next step; or, when `layerwise` is set, layer by layer through the layer kernel where
the device can address the pool (a store of layer l starts when layer l has written its K/V),
and then loads of any size go layerwise too (through the layer kernel where the driver has no
pitched copy). The disk writer waits for its slot's store. With several KV cache groups the
pages' layer dimension holds slots (`kv.groups`), and the layerwise copies move a slot of every
block at a time: layer l waits for its slot's loads, and a slot is saved once the last layer in
it has written its K/V.

The host never waits for a step's loads: their jobs are reported finished (their slots free
again) once a later step finds their event complete, so a step with loads keeps the scheduler
running ahead of the device. Stores may still read the pages when `wait_for_save` returns. The
runner therefore calls `order_page_writes` with the blocks each step writes, and asks
`has_layer_work` whether the forward must run eagerly (layerwise loads or saves) instead of
replaying a CUDA graph.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from kvtool.engine.connectors.base import ConnectorContext, WorkerHalf
from kvtool.engine.connectors.offloading.copy.transfers import SlotTransfers
from kvtool.engine.connectors.offloading.cpu_tier import HostPool
from kvtool.engine.connectors.offloading.disk.group_tiers import GroupDiskTiers
from kvtool.engine.connectors.offloading.jobs import OffloadingCompletions
from kvtool.engine.errors import KVRefused
from kvtool.engine.kv.pages import refuse_geometry_mismatch

logger = logging.getLogger("kvtool.offloading")

# With `layerwise`, a step's stores go layer by layer from this many engine blocks up; smaller
# ones are not worth two kernel launches per layer and an eager forward.
LAYERWISE_MIN_BLOCKS = 32
# Loads of this many engine blocks or more go in groups of layers (the copies then hide the
# forward: A/B against whole blocks on Qwen3-8B from 8k tokens up); smaller ones stay whole
# blocks, the same threshold as layerwise saves (not measured on its own).
LAYER_GROUP_LOAD_MIN_BLOCKS = 32


class OffloadingWorker(WorkerHalf):
    """Moves blocks between the pages and the CPU tier (and the disk tier behind it)."""

    def __init__(self, ctx: ConnectorContext, settings, pool: HostPool, disk: GroupDiskTiers | None) -> None:
        super().__init__(ctx)
        self.pool = pool
        self.disk = disk
        self.block_size = ctx.identity.geometry.block_size
        self.obt = settings.offload_block_tokens or self.block_size
        self.writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtool-disk") if disk is not None else None
        self.pending_writes: list[Future] = []
        self._staging: torch.Tensor | None = None
        # Load and save layer by layer (overlapping the forward) when the device allows it;
        # False: whole blocks through the copy engine, loads before the forward, saves after it.
        self.layerwise = settings.layerwise
        self.transfers: SlotTransfers | None = None
        self._load_jobs: list[int] = []  # this step's queued loads, handed to their ticket
        self._layerwise_step = False
        # This step's save run layer by layer: (page block, pool block) pairs and their device copy.
        self._layer_save: tuple[list[tuple[int, int]], torch.Tensor] | None = None
        self._layer_job_ids: set[int] = set()
        self._layer_ticket = None
        self._slot_of: tuple[int, ...] = ()  # each layer's slot in a block (`register_kv_caches`)
        self._slot_saved_after: dict[int, int] = {}  # layer -> the slot saved after it
        # What the scheduler half is told next (the disk writer thread appends too).
        self._done_lock = threading.Lock()
        self._finished: list[int] = []
        self._written: list[bytes] = []

    def register_kv_caches(self, kv_pages) -> None:
        super().register_kv_caches(kv_pages)
        refuse_geometry_mismatch(self.pool.geometry, kv_pages.geometry, "OffloadingConnector CPU tier")
        if self.pool.layers_per_block != kv_pages.layout.num_slots:
            raise ValueError(f"OffloadingConnector CPU tier slots hold {self.pool.layers_per_block} layers a block; "
                             f"the pages hold {kv_pages.layout.num_slots} ({kv_pages.layout.describe()})")
        if kv_pages.device.type == "cuda" and self.pool.pool.is_pinned():
            self.transfers = SlotTransfers(self.pool.pool, kv_pages)
        # Layerwise transfers move a slot of the pages' layer dimension at a time (the layer
        # itself with one KV cache group): a load's slot s is in place for every layer in slot s,
        # and a save of slot s goes once the last layer in slot s has written its K/V.
        self._slot_of = kv_pages.layout.layer_slot
        last = {slot: layer for layer, slot in enumerate(self._slot_of)}  # the last layer in each slot
        self._slot_saved_after = {layer: slot for slot, layer in last.items()}

    def _finish_jobs(self, job_ids) -> None:
        with self._done_lock:
            self._finished.extend(job_ids)

    def take_completions(self) -> OffloadingCompletions | None:
        self._reap()
        evicted = self.disk.take_evicted() if self.disk is not None else []
        with self._done_lock:
            finished, self._finished = self._finished, []
            written, self._written = self._written, []
        if not (finished or written or evicted):
            return None
        return OffloadingCompletions(finished_job_ids=finished, written=written, evicted=evicted)

    def _staging_buffer(self) -> torch.Tensor:
        if self._staging is None:
            self._staging = torch.empty_like(self.pool.slot(0))
        return self._staging

    def has_layer_work(self) -> bool:
        """True when this step's loads arrive or its saves leave layer by layer (the forward must run eagerly)."""
        return self._layerwise_step or self._layer_save is not None

    def _failed_requests(self) -> set[str]:
        return {job.request_id for job in self._meta.loads if not self.errors.keys().isdisjoint(job.block_ids)}

    def _plan_layer_saves(self) -> None:
        """Run this step's stores layer by layer during the forward when asked to, the device can
        address the pool, and they are large enough to pay for two launches per layer."""
        self._layer_save = None
        self._layer_job_ids = set()
        self._layer_ticket = None
        if not (self.layerwise and self.transfers is not None and self._meta.stores):
            return
        failed = self._failed_requests()
        jobs = [j for j in self._meta.stores if j.copy_from_pages and j.request_id not in failed]
        bps = self.pool.blocks_per_slot
        pairs = [(b, j.slot * bps + i) for j in jobs for i, b in enumerate(j.block_ids)]
        if len(pairs) < LAYERWISE_MIN_BLOCKS or not self.transfers.can_copy_layerwise():
            return
        index = self.transfers.device_index(np.asarray(pairs, dtype=np.int64))
        self._layer_save = (pairs, index)
        self._layer_job_ids = {j.job_id for j in jobs}

    def save_kv_layer(self, layer: int) -> None:
        slot = self._slot_saved_after.get(layer)
        if self._layer_save is not None and slot is not None:
            ticket = self.transfers.store_layer(*self._layer_save, slot)
            if ticket is not None:
                self._layer_ticket = ticket

    def start_load_kv(self) -> None:
        pages = self.kv_pages
        self._reap()
        bad_slots: set[int] = set()
        pairs: list[tuple[int, int]] = []
        bps = self.pool.blocks_per_slot
        for job in self._meta.loads:
            t0 = time.perf_counter()
            queued = False
            try:
                if job.slot is not None and job.slot in bad_slots:
                    raise KVRefused("its CPU tier slot failed to load earlier in this step")
                buf = self.pool.slot(job.slot) if job.slot is not None else self._staging_buffer()
                if job.from_disk:
                    if self.disk is None:
                        raise KVRefused("block is not in the CPU tier and there is no disk tier")
                    self.disk.read_into(job.key, buf)
                # Re-check before a single byte enters the pages.
                refuse_geometry_mismatch(self.pool.geometry, pages.geometry, "OffloadingConnector load")
                if self.transfers is not None and job.slot is not None:
                    base = job.slot * bps + job.first
                    pairs.extend((base + i, b) for i, b in enumerate(job.block_ids))
                    self._load_jobs.append(job.job_id)
                    queued = True
                else:
                    pages.scatter(job.block_ids, buf[job.first : job.first + len(job.block_ids)])
                self.stats.bytes_loaded += len(job.block_ids) * pages.block_bytes
                n = job.tokens
                self.stats.tokens_loaded[job.request_id] = self.stats.tokens_loaded.get(job.request_id, 0) + n
                if job.from_disk:
                    disk = self.stats.tokens_loaded_from_disk
                    disk[job.request_id] = disk.get(job.request_id, 0) + n
            except KVRefused as e:
                if job.slot is not None:
                    bad_slots.add(job.slot)
                self.stats.load_failures += 1
                for b in job.block_ids:
                    self.errors[b] = str(e)
            finally:
                if not queued:
                    self._finish_jobs([job.job_id])
                    self.stats.load_s += time.perf_counter() - t0
        self._layerwise_step = False
        self._plan_layer_saves()
        if pairs:
            # In groups of layers through pitched copies on the copy engine (large loads, or any
            # with `layerwise`), or layer by layer through the layer kernel where the driver has
            # no pitched copy and `layerwise` is set; whole blocks otherwise.
            t = self.transfers
            if t.can_copy_rows():
                layerwise = self.layerwise or len(pairs) >= LAYER_GROUP_LOAD_MIN_BLOCKS
            else:
                layerwise = self.layerwise and t.can_copy_layerwise()
            t.load(pairs, layerwise).job_ids.extend(self._load_jobs)
            self._layerwise_step = layerwise
        else:
            self._finish_jobs(self._load_jobs)  # jobs of no block: nothing to wait for
        self._load_jobs = []

    def wait_for_layer_load(self, layer: int) -> None:
        if self._layerwise_step:
            self.transfers.wait_layer(self._slot_of[layer])

    def order_page_writes(self, block_ids) -> None:
        """Called by the runner before the forward with the page blocks it writes: the compute
        stream waits for queued stores that still read any of them."""
        if self.transfers is not None and self.transfers.stores:
            self.transfers.order_page_writes(block_ids)

    def wait_for_save(self) -> None:
        self._layerwise_step = False
        self._reap()
        self.pending_writes = [f for f in self.pending_writes if not f.done()]
        failed = self._failed_requests()
        pairs: list[tuple[int, int]] = []
        queued_jobs: list[int] = []
        layer_jobs: list[int] = []
        to_disk: list = []
        bps = self.pool.blocks_per_slot
        for job in self._meta.stores:
            if job.request_id in failed:
                # Computed over KV that failed to load: never let it into a tier.
                self._finish_jobs([job.job_id])
                continue
            t0 = time.perf_counter()
            layer_saved = job.job_id in self._layer_job_ids
            if job.copy_from_pages:
                if self.transfers is None:
                    self.pool.slot(job.slot).copy_(self.kv_pages.gather(job.block_ids))
                    self.stats.store_s += time.perf_counter() - t0
                elif not layer_saved:  # (a layerwise save was queued during the forward)
                    pairs.extend((b, job.slot * bps + i) for i, b in enumerate(job.block_ids))
                self.stats.bytes_stored += len(job.block_ids) * self.kv_pages.block_bytes
                n = job.tokens
                self.stats.tokens_stored[job.request_id] = self.stats.tokens_stored.get(job.request_id, 0) + n
            if job.write_to_disk and self.writer is not None:
                to_disk.append(job)
            elif self.transfers is not None and job.copy_from_pages:
                (layer_jobs if layer_saved else queued_jobs).append(job.job_id)
            else:
                self._finish_jobs([job.job_id])
        if self._layer_save is not None:
            assert self._layer_ticket is not None, "a layerwise save ran without all its layers"
            self._layer_ticket.job_ids.extend(layer_jobs)
            self._layer_save, self._layer_job_ids, self._layer_ticket = None, set(), None
        if pairs:
            self.transfers.store(pairs).job_ids.extend(queued_jobs)
        # A slot's bytes may still be on their way from the pages (this step or an earlier one):
        # the disk writer waits for the newest store first.
        after = self.transfers.last_store if self.transfers is not None else None
        for job in to_disk:
            self.pending_writes.append(self.writer.submit(self._write_through, job.job_id, job.key, job.slot, after))

    def _write_through(self, job_id: int, key: bytes, slot: int, after: torch.cuda.Event | None) -> None:
        try:
            if after is not None:
                after.synchronize()
            if self.disk.write(key, self.obt, self.pool.slot(slot)):
                with self._done_lock:
                    self._written.append(key)
        except Exception:  # noqa: BLE001 - a failed write-through only loses a cache entry
            logger.exception("disk tier write failed")
        finally:
            self._finish_jobs([job_id])

    def _reap(self, wait: bool = False) -> None:
        """Report the jobs of finished loads and stores (their slots are free again) and count
        their GPU time; with `wait`, of every queued one."""
        if self.transfers is None:
            return
        loads, stores = self.transfers.completed_loads(wait), self.transfers.completed_stores(wait)
        self.stats.load_s += sum(t.start.elapsed_time(t.event) for t in loads) / 1000.0
        self.stats.store_s += sum(t.start.elapsed_time(t.event) for t in stores) / 1000.0
        for t in (*loads, *stores):
            self._finish_jobs(t.job_ids)

    def flush(self) -> None:
        """Wait until every queued load and store is done and every disk write is on disk."""
        self._reap(wait=True)
        for f in self.pending_writes:
            f.result()
        self.pending_writes = []

    def shutdown(self) -> None:
        self._reap(wait=True)
        if self.writer is not None:
            self.writer.shutdown(wait=True)
            self.pending_writes = []
        if self.disk is not None:
            self.disk.close()
