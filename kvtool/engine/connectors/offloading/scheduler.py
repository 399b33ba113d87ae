"""The OffloadingConnector's scheduler half: what the tiers hold, what to load, what to store.

It alone owns the state: the CPU slot index (keys, LRU order, pins) and the in-memory disk
index. Lookups are dict and set operations, never a file system call. Each load or store job it
plans pins its slot; the pin is released when the worker half reports the job finished.

Keys are vLLM's: the chained block hash of the last engine block of an offload block, followed
by the KV-cache group index as 4 big-endian bytes. A lookup walks the chain longest-prefix
first, in the CPU tier, then on disk; a disk hit is promoted into a CPU slot and loaded from it.

With KV cache groups (`kv.groups`) every group's chunk is an entry of its own (its key ends in
its group; a CPU slot holds one group's blocks). A hit at token p needs every full-attention
group's chunks from the local hit up to p, and each sliding-window group's chunks that hold the
tokens its window still reads at p (from p - W + 1, or from the local hit if that is later);
the engine scheduler gives such a group the null block below its window at admission, so the
loads fill exactly the entries it allocated. A group's chunk is stored only while every block
of it is in the group's table (a window shorter than a chunk frees the chunk's first blocks
before its last ones are written: that group's chunk is then not offloaded).

Each step, a request offers the chunks it completed to the CPU tier, one batch per request (its
loaded chunks are not offered again). With store_threshold the batch is counted first and only
chunks offered often enough are stored (store_filter.py); room is made by the eviction policy
(eviction.py), never at the expense of the batch itself or of a pinned slot. The policy learns
from each request's loads and offers when the request finishes, as vLLM's CPU tier does.
"""

from __future__ import annotations

import itertools

from kvtool.engine.connectors.base import ConnectorContext, SchedulerHalf
from kvtool.engine.connectors.group_chunks import GroupChunks
from kvtool.engine.connectors.offloading.cpu_tier import SlotIndex
from kvtool.engine.connectors.offloading.disk.group_tiers import GroupDiskIndex
from kvtool.engine.connectors.offloading.eviction import RequestAccess
from kvtool.engine.connectors.offloading.jobs import LoadJob, OffloadingCompletions, OffloadingMetadata, StoreJob
from kvtool.engine.connectors.offloading.store_filter import make_offer_counter
from kvtool.engine.core.messages import KVConnectorOutput
from kvtool.engine.events.kv_events import MEDIUM_CPU, MEDIUM_STORAGE, OffloadEventRecorder, event_extra_keys
from kvtool.engine.outputs import CPUTierUsage

__all__ = ["OffloadingScheduler", "StorageLocalityRecorder"]


class StorageLocalityRecorder(OffloadEventRecorder):
    """The tier's KV events, its STORAGE ones carrying the fs tier's `locality`, as vLLM labels them."""

    def __init__(self, locality: str, group_specs=()) -> None:
        super().__init__(group_specs=group_specs)
        self.locality = locality

    def take_events(self) -> list:
        events = super().take_events()
        for event in events:
            if event.medium == MEDIUM_STORAGE:
                event.locality = self.locality
        return events


class OffloadingScheduler(SchedulerHalf):
    def __init__(self, ctx: ConnectorContext, settings, num_slots: int, disk_index: GroupDiskIndex | None) -> None:
        super().__init__(ctx)
        self.settings = settings
        self.slots = SlotIndex(num_slots, settings.eviction_policy)
        self.offer_counter = make_offer_counter(settings.store_threshold, settings.max_tracker_size)
        self.disk = disk_index
        self.block_size = ctx.identity.geometry.block_size
        self.obt = settings.offload_block_tokens or self.block_size
        self.blocks_per_offload = self.obt // self.block_size
        layout = ctx.kv_layout
        self.groups = GroupChunks(layout, self.block_size, self.obt)
        self.suffixes = [g.to_bytes(4, "big") for g in range(layout.num_groups)]
        # The groups' BlockStored annotations (kvtool's groups only; one group keeps vLLM's plain ones).
        self.group_specs = [(g.kind, g.sliding_window) for g in layout.groups] if layout.hybrid else []
        self.requests: dict = {}
        self.next_store: dict[str, int] = {}
        # Per request: the offload blocks it loaded (never offered again), and the CPU-tier keys
        # it used, which the eviction policy learns from when it finishes.
        self.hit_chunks: dict[str, int] = {}
        self.accesses: dict[str, RequestAccess] = {}
        self.pending_loads: list[LoadJob] = []
        # job id -> the slot whose pin the job holds (released when the worker reports it finished).
        self.job_slots: dict[int, int | None] = {}
        # job id -> the key whose slot the job fills (a store's copy, a promotion from disk).
        self.filling_jobs: dict[int, bytes] = {}
        self._job_ids = itertools.count()
        # Disk writes in flight (job id -> key, and a count per key): not planned twice.
        self.writing: dict[int, bytes] = {}
        self.num_writing: dict[bytes, int] = {}
        # Keys whose bytes were refused in this process: not matched again until re-stored.
        self.refused: set[bytes] = set()
        # vLLM KV events of the tiers (kv_event_recorder()): what each job announces once it is done.
        self.events: OffloadEventRecorder | None = None
        self.job_events: dict[int, tuple] = {}
        self.disk_events: dict[bytes, tuple] = {}
        # The disk tier's STORAGE events are off for a secondary_tiers fs entry without
        # enable_kv_events, as vLLM's fs tier publishes none then.
        self.publish_disk_events = settings.disk_events

    def kv_event_recorder(self) -> OffloadEventRecorder:
        if self.events is None:
            locality = self.settings.disk_locality
            self.events = (StorageLocalityRecorder(locality, self.group_specs) if locality
                           else OffloadEventRecorder(group_specs=self.group_specs))
        return self.events

    def _access(self, request_id: str) -> RequestAccess:
        access = self.accesses.get(request_id)
        if access is None:
            access = self.accesses[request_id] = RequestAccess()
        return access

    def _event_args(self, request, j: int, g: int) -> tuple:
        """(key, block hashes, parent hash, tokens) of group g's offload block j, as its BlockStored carries them."""
        k = self.blocks_per_offload
        hashes = request.block_hashes[j * k : (j + 1) * k]
        parent = request.block_hashes[j * k - 1] if j else None
        tokens = request.token_ids_slice(j * self.obt, (j + 1) * self.obt)
        return self._key(request, j, g), list(hashes), parent, tokens, [
            event_extra_keys(i, request.cache_salt) for i in range(j * k, (j + 1) * k)]

    def _key(self, request, j: int, g: int = 0) -> bytes:
        return request.block_hashes[(j + 1) * self.blocks_per_offload - 1] + self.suffixes[g]

    def _on_disk(self, key: bytes) -> bool:
        return self.disk is not None and key in self.disk

    def _available(self, key: bytes) -> bool:
        if key in self.refused:
            return False
        return self.slots.lookup(key) is not None or self._on_disk(key)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self.config.is_kv_consumer:
            return 0, False
        # Whole offload blocks, the last one too: on a full hit the scheduler leaves only the last
        # token to compute, and the load still fills that token's block whole.
        last = min(request.num_tokens // self.obt, len(request.block_hashes) // self.blocks_per_offload)
        end = self.groups.longest_hit(lambda j, g: self._available(self._key(request, j, g)),
                                      num_computed_tokens // self.obt, last, num_computed_tokens, request.num_tokens)
        return max(0, self.groups.hit_end(request.num_tokens, end) - num_computed_tokens), False

    def _load_tokens(self, j: int, start: int, end: int) -> int:
        """The tokens of a load of [start, end) that fall in offload block j, in whole engine blocks."""
        k, bs = self.blocks_per_offload, self.block_size
        return (min((j + 1) * k, -(-end // bs)) - max(j * k, start // bs)) * bs

    def _job(self, slot: int | None) -> int:
        job_id = next(self._job_ids)
        self.job_slots[job_id] = slot
        return job_id

    def update_state_after_alloc(self, request, block_ids: list[int], num_external_tokens: int) -> None:
        rid = request.request_id
        self.requests[rid] = request
        if num_external_tokens <= 0:
            return
        start = request.num_computed_tokens
        end = start + num_external_tokens
        k = self.blocks_per_offload
        tables = request.group_block_ids
        # Every group's chunks of the load, chunk by chunk: (chunk, group) -> key.
        groups = self.groups
        plan = groups.loads(start, end)
        keys = {(j, g): self._key(request, j, g) for j, g, _ in plan}
        access = self._access(rid)
        slots: dict[tuple[int, int], int | None] = {}
        for (j, g), key in keys.items():
            slot = slots[j, g] = self.slots.lookup(key)
            if slot is not None:
                self.slots.pin(slot)
                access.saw(key, j, reused=self.slots.is_ready(key))
        self.slots.touch([key for jg, key in keys.items() if slots[jg] is not None])
        slots_before_promotion = dict(slots)
        # Disk hits are promoted into CPU slots (None when every slot is busy: through staging).
        promoted = [jg for jg in keys if slots[jg] is None]
        if promoted:
            targets = self.slots.allocate_many([keys[jg] for jg in promoted], protected=set(keys.values()))
            for jg, slot in zip(promoted, targets):
                slots[jg] = slot
                if slot is not None:
                    access.saw(keys[jg], jg[0], inserted=True)
        for j, g, counted in plan:
            key = keys[j, g]
            lo = max(j * k, groups.first_block(g, start, end))
            hi = min((j + 1) * k, -(-end // self.block_size))
            slot = slots[j, g]
            from_disk = slots_before_promotion[j, g] is None
            job_id = self._job(slot)
            if from_disk and slot is not None:
                self.filling_jobs[job_id] = key
                if self.events is not None:
                    self.job_events[job_id] = self._event_args(request, j, g)  # a promotion into the CPU tier
            tokens = sum(self._load_tokens(c, start, end) for c in counted)
            self.pending_loads.append(LoadJob(job_id=job_id, request_id=rid, key=key, index=j,
                                              block_ids=list(tables[g][lo:hi]), first=lo - j * k, slot=slot,
                                              from_disk=from_disk, tokens=tokens))
        self.hit_chunks[rid] = max(self.hit_chunks.get(rid, 0), -(-end // self.obt))

    def build_connector_meta(self, scheduler_output) -> OffloadingMetadata:
        stores: list[StoreJob] = []
        if self.config.is_kv_producer:
            for s in scheduler_output.scheduled:
                req = self.requests.get(s.request_id)
                if req is not None:
                    stores.extend(self._plan_stores(req, s))
        meta = OffloadingMetadata(loads=self.pending_loads, stores=stores)
        self.steps_in_flight.add(scheduler_output.step_id, meta)
        self.pending_loads = []
        return meta

    def _plan_stores(self, req, s) -> list[StoreJob]:
        rid = req.request_id
        done = s.start + s.num_tokens
        if self.settings.offload_prompt_only:
            done = min(done, req.num_prompt_tokens)
        full = min(done // self.obt, len(req.block_hashes) // self.blocks_per_offload)
        first = self.next_store.get(rid, 0)
        self.next_store[rid] = max(first, full)
        if first >= full:
            return []
        hit_end = self.hit_chunks.get(rid, 0)
        tables = req.group_block_ids
        # Every group's chunk whose blocks are all in the group's table (none freed behind a window).
        offer = {(j, g): self._key(req, j, g) for j in range(first, full) for g in range(self.groups.num_groups)
                 if self.groups.storable(tables[g], j)}
        if self.offer_counter is not None:
            self.offer_counter.record_offer([key for (j, _), key in offer.items() if j >= hit_end])
        access = self._access(rid)
        has_disk = self.disk is not None
        jobs: list[tuple[tuple[int, int], StoreJob]] = []
        held: list[bytes] = []
        to_copy: list[tuple[int, int]] = []
        for (j, g), key in offer.items():
            repair = key in self.refused
            slot = None if repair else self.slots.lookup(key)
            on_disk = has_disk and not repair and (key in self.disk or key in self.num_writing)
            if slot is not None:
                held.append(key)
                if j >= hit_end:
                    access.saw(key, j, reused=self.slots.is_ready(key))
                if has_disk and not on_disk:
                    self.slots.pin(slot)
                    jobs.append(((j, g), self._store(req, j, g, slot, copy=False)))
            elif not on_disk and (self.offer_counter is None or self.offer_counter.admits(key)):
                to_copy.append((j, g))
        self.slots.touch(held)
        if to_copy:
            # Room for the batch never comes from the batch itself.
            targets = self.slots.allocate_many([offer[jg] for jg in to_copy], protected=set(offer.values()))
            counted: set[int] = set()
            for (j, g), slot in zip(to_copy, targets):
                if slot is None:
                    continue
                key = offer[j, g]
                self.refused.discard(key)
                access.saw(key, j, inserted=True)
                # A chunk's tokens count as stored once, by the first of its groups copied.
                job = self._store(req, j, g, slot, copy=True, tokens=0 if j in counted else self.obt)
                counted.add(j)
                self.filling_jobs[job.job_id] = key
                jobs.append(((j, g), job))
        jobs.sort(key=lambda x: x[0])
        return [job for _, job in jobs]

    def _store(self, req, j: int, g: int, slot: int, copy: bool, tokens: int = 0) -> StoreJob:
        key = self._key(req, j, g)
        k = self.blocks_per_offload
        blocks = list(req.group_block_ids[g][j * k : (j + 1) * k])
        job_id = self._job(slot)
        write = self.disk is not None
        if self.events is not None:
            args = self._event_args(req, j, g)
            if copy:
                self.job_events[job_id] = args
            if write and self.publish_disk_events:
                self.disk_events[key] = args
        if write:
            self.writing[job_id] = key
            self.num_writing[key] = self.num_writing.get(key, 0) + 1
        return StoreJob(job_id=job_id, request_id=req.request_id, key=key, block_ids=blocks, slot=slot,
                        copy_from_pages=copy, write_to_disk=write, tokens=tokens)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        # Under tensor parallelism these are the runtime's aggregate: a job id or a written block
        # arrives once every rank reported it (each rank writes its own shard).
        step = self.steps_in_flight.answered(output)
        failed_loads = [] if step is None or not output.invalid_block_ids else [
            j for j in step.loads if not output.invalid_block_ids.isdisjoint(j.block_ids)]
        done = output.completions
        if isinstance(done, OffloadingCompletions):
            if self.disk is not None:
                for key in done.written:
                    self.disk.add(key)
                    if self.events is not None and key in self.disk_events:
                        self._announce(MEDIUM_STORAGE, self.disk_events.pop(key))
                for key in done.evicted:
                    self.disk.discard(key)
                    if self.events is not None and self.publish_disk_events:
                        self.events.removed(MEDIUM_STORAGE, key)
            if self.events is not None:
                failed_keys = {j.key for j in failed_loads}
                for job_id in done.finished_job_ids:
                    args = self.job_events.pop(job_id, None)
                    if args is not None and args[0] not in failed_keys and self.slots.lookup(args[0]) is not None:
                        self._announce(MEDIUM_CPU, args)
            for job_id in done.finished_job_ids:
                written = self.writing.pop(job_id, None)
                if written is not None:
                    left = self.num_writing.pop(written) - 1
                    if left:
                        self.num_writing[written] = left
                key = self.filling_jobs.pop(job_id, None)
                if key is not None:
                    self.slots.mark_filled(key)  # a failed load's key is dropped below
                slot = self.job_slots.pop(job_id, None)
                if slot is not None:
                    self.slots.unpin(slot)
        evicted = self.slots.take_evicted()
        if self.events is not None:
            for key in evicted:
                self.events.removed(MEDIUM_CPU, key)
        if failed_loads:
            failed: dict[str, int] = {}
            for job in failed_loads:
                self._drop(job.key)
                self.refused.add(job.key)
                failed[job.request_id] = min(failed.get(job.request_id, job.index), job.index)
            # The worker skipped these requests' stores of the step (computed over KV that failed
            # to load): forget their slots, and store again from the first bad block after a recompute.
            for job in step.stores:
                if job.request_id in failed and job.copy_from_pages:
                    self._drop(job.key)
            for rid, j in failed.items():
                if rid in self.next_store:
                    self.next_store[rid] = min(self.next_store[rid], j)
                if rid in self.hit_chunks:
                    self.hit_chunks[rid] = min(self.hit_chunks[rid], j)

    def _announce(self, medium: str, args: tuple) -> None:
        key, hashes, parent, tokens, extra_keys = args
        self.events.stored(medium, key, hashes, parent, tokens, self.block_size, extra_keys)

    def _drop(self, key: bytes) -> None:
        self.slots.drop(key)
        if self.events is not None:
            self.events.removed(MEDIUM_CPU, key)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict | None]:
        rid = request.request_id
        self.requests.pop(rid, None)
        self.next_store.pop(rid, None)
        self.hit_chunks.pop(rid, None)
        access = self.accesses.pop(rid, None)
        if access is not None:
            self.slots.request_finished(access)
        return False, None

    def reset_cache(self) -> bool:
        """Forget every CPU-tier entry, the offer counts of store_threshold and what the eviction
        policy learnt; the disk tier (and its index) is kept.

        A slot pinned by a job in flight cannot be dropped: its entry stays, and the answer is
        False once everything else is gone, for the caller to retry after a step. Each dropped
        entry is announced as a CPU BlockRemoved when KV events are on (vLLM 0.33 announces
        none, which leaves a subscriber holding blocks the tier no longer has). Running
        requests offer their chunks again from the first, as after vLLM's reset.
        """
        for key in self.slots.clear():
            if self.events is not None:
                self.events.removed(MEDIUM_CPU, key)
        if self.offer_counter is not None:
            self.offer_counter.clear()
        self.next_store = dict.fromkeys(self.next_store, 0)
        self.hit_chunks.clear()
        self.accesses.clear()
        return len(self.slots) == 0

    def cpu_tier_usage(self) -> CPUTierUsage:
        # Every pin is a job's (job_slots), so the pinned slots are counted from the few jobs in
        # flight rather than by a walk over every slot at each step.
        pinned = {slot for slot in self.job_slots.values() if slot is not None}
        return CPUTierUsage(num_slots=self.slots.num_slots, num_filled=len(self.slots), num_pinned=len(pinned))

    def shutdown(self) -> None:
        if self.disk is not None:
            self.disk.close()
