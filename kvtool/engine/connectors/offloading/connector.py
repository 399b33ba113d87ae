"""OffloadingConnector: a CPU tier and an optional disk tier, with a working worker half.

Keys are vLLM's: the chained block hash of the last engine block of an offload block, followed
by the KV-cache group index as 4 big-endian bytes. A lookup walks the chain longest-prefix
first, in the CPU tier, then on disk; a disk hit is promoted into the CPU tier and loaded from
there. Stores copy newly completed prompt blocks into the CPU tier after the forward and write
them through to disk on a background thread, off the critical path.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor

import msgspec
import torch

from kvtool.engine.connectors.base import (
    ConnectorContext,
    EngineIdentity,
    KVConnector,
    KVConnectorMetadata,
    KVConnectorOutput,
    SchedulerHalf,
    WorkerHalf,
)
from kvtool.engine.connectors.offloading.cpu_tier import CPUTier, make_cpu_tier
from kvtool.engine.connectors.offloading.disk_tier import DiskTier
from kvtool.engine.connectors.offloading.identity import KVIdentity, make_identity
from kvtool.engine.connectors.offloading.settings import OffloadingSettings, parse_settings  # noqa: F401
from kvtool.engine.connectors.offloading.transfers import SlotTransfers
from kvtool.engine.errors import KVRefused
from kvtool.engine.kv_pages import refuse_geometry_mismatch

logger = logging.getLogger("kvtool.offloading")

DEFAULT_CPU_BYTES = 1 << 30
# A step's stores go layer by layer (with `layerwise`) from this many engine blocks up; smaller
# ones are not worth two kernel launches per layer and an eager forward.
LAYERWISE_MIN_BLOCKS = 32


def disk_identity(identity: EngineIdentity, offload_block_tokens: int) -> KVIdentity:
    """The identity header every disk-tier file of this engine carries."""
    return make_identity(
        model_name=identity.model_name,
        config_digest=identity.config_digest,
        weights_digest=identity.weights_digest,
        architecture=identity.architecture,
        geometry=identity.geometry,
        offload_block_tokens=offload_block_tokens,
        none_hash_seed=identity.none_hash_seed,
        rope_digest=identity.rope_digest,
        engine_id=identity.engine_id or "kvtool",
        hash_algorithm=identity.block_hash_algo,
        sliding_window=identity.sliding_window or None,
        weight_quantization=identity.weight_quantization,
        kv_quantization=identity.kv_quantization,
        tp_size=identity.tp_size,
        tp_rank=identity.tp_rank,
        pp_size=identity.pp_size,
    )


def block_hash_of(key: bytes) -> bytes:
    """The block hash inside an offload key (vLLM's layout: block hash + 4-byte group index).

    Disk files are named by the block hash alone; their header carries the identity.
    """
    return key[:-4]


class LoadJob(msgspec.Struct, kw_only=True):
    request_id: str
    key: bytes
    index: int  # offload block index within the request
    block_ids: list[int]  # engine blocks to fill
    first: int  # index, inside the offload block, of block_ids[0]
    slot: int | None  # CPU slot (pinned); None: read from disk through a staging buffer
    from_disk: bool  # promote from disk into the slot first


class StoreJob(msgspec.Struct, kw_only=True):
    request_id: str
    key: bytes
    block_ids: list[int]  # the offload block's engine blocks
    slot: int  # pinned CPU slot
    copy_from_pages: bool  # False: the slot already holds the bytes (disk write only)
    write_to_disk: bool


class OffloadingMetadata(KVConnectorMetadata):
    loads: list[LoadJob] = []
    stores: list[StoreJob] = []


class OffloadingScheduler(SchedulerHalf):
    def __init__(self, ctx: ConnectorContext, settings: OffloadingSettings, cpu: CPUTier, disk: DiskTier | None) -> None:
        super().__init__(ctx)
        self.settings = settings
        self.cpu = cpu
        self.disk = disk
        self.block_size = ctx.identity.geometry.block_size
        self.obt = settings.offload_block_tokens or self.block_size
        self.blocks_per_offload = self.obt // self.block_size
        self.group_suffix = settings.group_idx.to_bytes(4, "big")
        self.requests: dict = {}
        self.next_store: dict[str, int] = {}
        self.pending_loads: list[LoadJob] = []
        self.inflight_loads: list[LoadJob] = []
        self.inflight_stores: list[StoreJob] = []
        # Keys whose bytes were refused in this process: not matched again until re-stored.
        self.refused: set[bytes] = set()

    def _key(self, request, j: int) -> bytes:
        return request.block_hashes[(j + 1) * self.blocks_per_offload - 1] + self.group_suffix

    def _available(self, key: bytes) -> bool:
        if key in self.refused:
            return False
        return self.cpu.lookup(key) is not None or (self.disk is not None and self.disk.contains(block_hash_of(key)))

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self.config.is_kv_consumer:
            return 0, False
        # Whole offload blocks only, and at least the last prompt token is left to compute.
        last = min((request.num_tokens - 1) // self.obt, len(request.block_hashes) // self.blocks_per_offload)
        j = num_computed_tokens // self.obt
        while j < last and self._available(self._key(request, j)):
            j += 1
        return max(0, j * self.obt - num_computed_tokens), False

    def update_state_after_alloc(self, request, block_ids: list[int], num_external_tokens: int) -> None:
        self.requests[request.request_id] = request
        if num_external_tokens <= 0:
            return
        start = request.num_computed_tokens
        end = start + num_external_tokens
        k = self.blocks_per_offload
        for j in range(start // self.obt, -(-end // self.obt)):
            lo = max(j * k, start // self.block_size)
            hi = min((j + 1) * k, -(-end // self.block_size))
            key = self._key(request, j)
            slot = self.cpu.lookup(key)
            if slot is not None:
                self.cpu.pin(slot)
                self.cpu.touch(key)
                from_disk = False
            else:
                slot = self.cpu.allocate(key)  # promotion target; None when every slot is busy
                from_disk = True
            self.pending_loads.append(
                LoadJob(request_id=request.request_id, key=key, index=j, block_ids=block_ids[lo:hi], first=lo - j * k,
                        slot=slot, from_disk=from_disk)
            )

    def build_connector_meta(self, scheduler_output) -> OffloadingMetadata:
        stores: list[StoreJob] = []
        if self.config.is_kv_producer:
            for s in scheduler_output.scheduled:
                req = self.requests.get(s.request_id)
                if req is not None:
                    stores.extend(self._plan_stores(req, s))
        meta = OffloadingMetadata(loads=self.pending_loads, stores=stores)
        self.inflight_loads = self.pending_loads
        self.inflight_stores = stores
        self.pending_loads = []
        return meta

    def _plan_stores(self, req, s) -> list[StoreJob]:
        done = s.start + s.num_tokens
        if self.settings.offload_prompt_only:
            done = min(done, req.num_prompt_tokens)
        full = min(done // self.obt, len(req.block_hashes) // self.blocks_per_offload)
        j = self.next_store.get(req.request_id, 0)
        k = self.blocks_per_offload
        jobs = []
        while j < full:
            key = self._key(req, j)
            repair = key in self.refused
            slot = None if repair else self.cpu.lookup(key)
            on_disk = self.disk is not None and not repair and self.disk.contains(block_hash_of(key))
            if slot is not None:
                self.cpu.touch(key)
                if self.disk is not None and not on_disk:
                    self.cpu.pin(slot)
                    jobs.append(StoreJob(request_id=req.request_id, key=key, block_ids=s.block_ids[j * k : (j + 1) * k],
                                         slot=slot, copy_from_pages=False, write_to_disk=True))
            elif not on_disk:
                slot = self.cpu.allocate(key)
                if slot is not None:
                    self.refused.discard(key)
                    jobs.append(StoreJob(request_id=req.request_id, key=key, block_ids=s.block_ids[j * k : (j + 1) * k],
                                         slot=slot, copy_from_pages=True, write_to_disk=self.disk is not None))
            j += 1
        self.next_store[req.request_id] = j
        return jobs

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        if output.invalid_block_ids:
            failed: dict[str, int] = {}
            for job in self.inflight_loads:
                if not output.invalid_block_ids.isdisjoint(job.block_ids):
                    self.cpu.drop(job.key)
                    self.refused.add(job.key)
                    failed[job.request_id] = min(failed.get(job.request_id, job.index), job.index)
            # The worker skipped these requests' stores (computed over KV that failed to load):
            # forget their slots, and store again from the first bad block after a recompute.
            for job in self.inflight_stores:
                if job.request_id in failed and job.copy_from_pages:
                    self.cpu.drop(job.key)
            for rid, j in failed.items():
                if rid in self.next_store:
                    self.next_store[rid] = min(self.next_store[rid], j)
        self.inflight_loads = []
        self.inflight_stores = []

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict | None]:
        self.requests.pop(request.request_id, None)
        self.next_store.pop(request.request_id, None)
        return False, None


class OffloadingWorker(WorkerHalf):
    """Moves blocks between the pages and the CPU tier (and the disk tier behind it).

    On CPU pages every copy is synchronous. On CUDA pages (a pinned pool) the copies are queued
    on their own streams by `SlotTransfers`: loads before the forward and stores after it,
    running beside the next step, whole blocks through the copy engine; or, when `layerwise` is
    set and the device can address the pool, both layer by layer during the forward (a store of
    layer l starts when layer l has written its K/V). A slot stays pinned in the tier until the
    copies that read or fill it are done; the disk writer waits for its slot's store.

    Stores may still read the pages when `wait_for_save` returns. The runner therefore calls
    `order_page_writes` with the blocks each step writes, and asks `has_layer_work` whether the
    forward must run eagerly (layerwise loads or saves) instead of replaying a CUDA graph.
    """

    def __init__(self, ctx: ConnectorContext, settings: OffloadingSettings, cpu: CPUTier, disk: DiskTier | None) -> None:
        super().__init__(ctx)
        self.cpu = cpu
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
        self._load_slots: list[int] = []  # pinned until this step's loads are done
        self._layerwise_step = False
        # This step's save run layer by layer: (page block, pool block) pairs and their device copy.
        self._layer_save: tuple[list[tuple[int, int]], torch.Tensor] | None = None
        self._layer_jobs: set[int] = set()  # id() of the store jobs in it
        self._layer_ticket = None
        self._store_slots: dict[int, list[int]] = {}  # id(ticket) -> slots unpinned when it is done

    def register_kv_caches(self, kv_pages) -> None:
        super().register_kv_caches(kv_pages)
        refuse_geometry_mismatch(self.cpu.geometry, kv_pages.geometry, "OffloadingConnector CPU tier")
        if kv_pages.device.type == "cuda" and self.cpu.pool.is_pinned():
            self.transfers = SlotTransfers(self.cpu.pool, kv_pages)

    def _staging_buffer(self) -> torch.Tensor:
        if self._staging is None:
            self._staging = torch.empty_like(self.cpu.slot(0))
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
        self._layer_jobs = set()
        self._layer_ticket = None
        if not (self.layerwise and self.transfers is not None and self._meta.stores):
            return
        failed = self._failed_requests()
        jobs = [j for j in self._meta.stores if j.copy_from_pages and j.request_id not in failed]
        bps = self.cpu.blocks_per_slot
        pairs = [(b, j.slot * bps + i) for j in jobs for i, b in enumerate(j.block_ids)]
        if len(pairs) < LAYERWISE_MIN_BLOCKS or not self.transfers.can_copy_layerwise():
            return
        index = torch.tensor(pairs, dtype=torch.int64).pin_memory().to(self.kv_pages.device, non_blocking=True)
        self._layer_save = (pairs, index)
        self._layer_jobs = {id(j) for j in jobs}

    def save_kv_layer(self, layer: int) -> None:
        if self._layer_save is not None:
            ticket = self.transfers.store_layer(*self._layer_save, layer)
            if ticket is not None:
                self._layer_ticket = ticket

    def start_load_kv(self) -> None:
        pages = self.kv_pages
        self._reap_stores()
        bad_slots: set[int] = set()
        pairs: list[tuple[int, int]] = []
        bps = self.cpu.blocks_per_slot
        for job in self._meta.loads:
            t0 = time.perf_counter()
            queued = False
            try:
                if job.slot is not None and job.slot in bad_slots:
                    raise KVRefused("its CPU tier slot failed to load earlier in this step")
                buf = self.cpu.slot(job.slot) if job.slot is not None else self._staging_buffer()
                if job.from_disk:
                    if self.disk is None:
                        raise KVRefused("block is not in the CPU tier and there is no disk tier")
                    self.disk.read_into(block_hash_of(job.key), buf)
                # Re-check before a single byte enters the pages.
                refuse_geometry_mismatch(self.cpu.geometry, pages.geometry, "OffloadingConnector load")
                if self.transfers is not None and job.slot is not None:
                    base = job.slot * bps + job.first
                    pairs.extend((base + i, b) for i, b in enumerate(job.block_ids))
                    self._load_slots.append(job.slot)
                    queued = True
                else:
                    pages.scatter(job.block_ids, buf[job.first : job.first + len(job.block_ids)])
                moved = len(job.block_ids) * pages.geometry.bytes_per_block
                self.stats.bytes_loaded += moved
                n = len(job.block_ids) * self.block_size
                self.stats.tokens_loaded[job.request_id] = self.stats.tokens_loaded.get(job.request_id, 0) + n
            except KVRefused as e:
                if job.slot is not None:
                    bad_slots.add(job.slot)
                self.stats.load_failures += 1
                for b in job.block_ids:
                    self.errors[b] = str(e)
            finally:
                if job.slot is not None and not queued:
                    self.cpu.unpin(job.slot)
                if not queued:
                    self.stats.load_s += time.perf_counter() - t0
        self._layerwise_step = False
        self._plan_layer_saves()
        if pairs:
            layerwise = self.layerwise and self.transfers.can_copy_layerwise()
            self.transfers.load(pairs, layerwise)
            self._layerwise_step = layerwise

    def wait_for_layer_load(self, layer: int) -> None:
        if self._layerwise_step:
            self.transfers.wait_layer(layer)

    def order_page_writes(self, block_ids) -> None:
        """Called by the runner before the forward with the page blocks it writes: the compute
        stream waits for queued stores that still read any of them."""
        if self.transfers is not None and self.transfers.stores:
            self.transfers.order_page_writes(block_ids)

    def _finish_loads(self) -> None:
        if self.transfers is not None and self._load_slots:
            self.stats.load_s += self.transfers.finish_loads()
            for slot in self._load_slots:
                self.cpu.unpin(slot)
            self._load_slots = []
        self._layerwise_step = False

    def wait_for_save(self) -> None:
        self._finish_loads()
        self.pending_writes = [f for f in self.pending_writes if not f.done()]
        failed = self._failed_requests()
        pairs: list[tuple[int, int]] = []
        queued_slots: list[int] = []
        layer_slots: list[int] = []
        to_disk: list = []
        bps = self.cpu.blocks_per_slot
        for job in self._meta.stores:
            if job.request_id in failed:
                # Computed over KV that failed to load: never let it into a tier.
                self.cpu.unpin(job.slot)
                continue
            t0 = time.perf_counter()
            layer_saved = id(job) in self._layer_jobs
            if job.copy_from_pages:
                if self.transfers is None:
                    self.cpu.slot(job.slot).copy_(self.kv_pages.gather(job.block_ids))
                    self.stats.store_s += time.perf_counter() - t0
                elif not layer_saved:  # (a layerwise save was queued during the forward)
                    pairs.extend((b, job.slot * bps + i) for i, b in enumerate(job.block_ids))
                moved = len(job.block_ids) * self.kv_pages.geometry.bytes_per_block
                self.stats.bytes_stored += moved
                n = len(job.block_ids) * self.block_size
                self.stats.tokens_stored[job.request_id] = self.stats.tokens_stored.get(job.request_id, 0) + n
            if job.write_to_disk and self.writer is not None:
                to_disk.append(job)
            elif self.transfers is not None and job.copy_from_pages:
                (layer_slots if layer_saved else queued_slots).append(job.slot)
            else:
                self.cpu.unpin(job.slot)
        if self._layer_save is not None:
            assert self._layer_ticket is not None, "a layerwise save ran without all its layers"
            self._store_slots[id(self._layer_ticket)] = layer_slots
            self._layer_save, self._layer_jobs, self._layer_ticket = None, set(), None
        if pairs:
            ticket = self.transfers.store(pairs)
            self._store_slots[id(ticket)] = queued_slots
        # A slot's bytes may still be on their way from the pages (this step or an earlier one):
        # the disk writer waits for the newest store first.
        after = self.transfers.last_store if self.transfers is not None else None
        for job in to_disk:
            self.pending_writes.append(self.writer.submit(self._write_through, job.key, job.slot, after))

    def _write_through(self, key: bytes, slot: int, after: torch.cuda.Event | None) -> None:
        try:
            if after is not None:
                after.synchronize()
            self.disk.write(block_hash_of(key), self.obt, self.cpu.slot(slot))
        except Exception:  # noqa: BLE001 - a failed write-through only loses a cache entry
            logger.exception("disk tier write failed")
        finally:
            self.cpu.unpin(slot)

    def _reap_stores(self, wait: bool = False) -> None:
        """Unpin the slots of finished stores and count their GPU time."""
        if self.transfers is None:
            return
        for t in self.transfers.completed_stores(wait):
            self.stats.store_s += t.start.elapsed_time(t.event) / 1000.0
            for slot in self._store_slots.pop(id(t), []):
                self.cpu.unpin(slot)

    def flush(self) -> None:
        """Wait until every queued store is in the CPU tier and every disk write is on disk."""
        self._reap_stores(wait=True)
        for f in self.pending_writes:
            f.result()
        self.pending_writes = []

    def shutdown(self) -> None:
        self._finish_loads()
        self._reap_stores(wait=True)
        if self.writer is not None:
            self.writer.shutdown(wait=True)
            self.pending_writes = []
        if self.disk is not None:
            self.disk.close()


class OffloadingConnector(KVConnector):
    scheduler_half = OffloadingScheduler
    worker_half = OffloadingWorker

    @classmethod
    def create_halves(cls, ctx: ConnectorContext) -> tuple[SchedulerHalf, WorkerHalf]:
        identity = ctx.identity
        settings = parse_settings(dict(ctx.config.kv_connector_extra_config), identity.geometry.block_size,
                                  kv_bytes_per_block=identity.geometry.bytes_per_block)
        obt = settings.offload_block_tokens
        blocks_per_slot = obt // identity.geometry.block_size
        cpu_bytes = settings.cpu_bytes_to_use
        if cpu_bytes is None and settings.num_cpu_blocks is None:
            cpu_bytes = DEFAULT_CPU_BYTES
        cpu = make_cpu_tier(identity.geometry, blocks_per_slot, cpu_bytes, settings.num_cpu_blocks,
                            pin_memory=identity.device_type == "cuda")
        disk = None
        if settings.root_dir:
            disk = DiskTier(settings.root_dir, disk_identity(identity, obt), settings.fs_capacity_bytes)
        return (
            OffloadingScheduler(ctx, settings, cpu, disk),
            OffloadingWorker(ctx, settings, cpu, disk),
        )
