"""LMCacheConnector: KV chunks in a remote store: LMCache's server over the lm:// wire, or Redis,
Redis Cluster or Valkey in LMCache's layouts (store.py picks one by `remote_url`).

Keys are LMCache's own (ChunkedTokenDatabase rules, keys.py), so a Python vLLM + LMCache peer
and kvtool find each other's chunks; in kvtool's own blake3 mode they also carry the engine's
identity digest (identity_digest.py), and each chunk a payload digest (payload_digest.py), so
another checkpoint's chunks miss and changed bytes are refused. Chunk bytes are KV_2LTD `[2, L, tokens, kv_heads*head_dim]`,
what LMCache inside vLLM writes. Under tensor parallelism each rank is one LMCache worker, as in
a TP-N vLLM: its worker half stores and loads its own KV-head shard under its own key
(`model@N@rank@hash@dtype`; world_size and worker_id come from the engine, never from the
config). The scheduler half asks the server (EXIST) which leading chunks of a prompt it holds,
a chunk counting only when every rank's key for it is there; the worker half GETs them into
host buffers, checks each reply against its pages (chunk_fit.py, the check `verify-keys --peer`
uses too), and scatters them; after the forward it gathers newly completed prompt chunks, copies
them to the host without holding the step up (store_staging.py) and PUTs them on a background
thread.

With KV cache groups (`kv.groups`, blake3 mode only: in the peer modes the engine keeps one
group, as vLLM turns its hybrid manager off for LMCache) each group's chunk is an object of its
own, `[2, slots, tokens, kv_heads*head_dim]` of the group's blocks, keyed in a chain of the
group's own (`make_group_digests`); `connectors.group_chunks` says which chunks a hit needs, a load fills
and a store may take.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import msgspec
import torch

from kvtool.engine.connectors.base import (
    ConnectorContext,
    KVConnector,
    KVConnectorCompletions,
    KVConnectorMetadata,
    KVConnectorOutput,
    SchedulerHalf,
    WorkerHalf,
)
from kvtool.engine.connectors.lmcache.chunk_fit import chunk_geometry_of_pages, chunk_problem
from kvtool.engine.connectors.lmcache.store_staging import StagedChunks, StoreStaging
from kvtool.engine.connectors.group_chunks import GroupChunks
from kvtool.engine.connectors.lmcache.identity_digest import make_group_key_settings, make_identity_digest
from kvtool.engine.connectors.lmcache.keys import (
    LMCacheKeySettings,
    check_request_tags,
    key_for_worker,
    make_chunk_keys,
    tags_from_request_configs,
)
from kvtool.engine.connectors.lmcache.payload_digest import (
    DIGEST_BYTES,
    DIGEST_HEADER,
    DIGEST_TAG,
    digest_key,
    payload_digest,
    payload_secret,
    refuse_payload,
)
from kvtool.engine.connectors.lmcache.settings import (  # noqa: F401 (re-exported)
    DEFAULT_HOST,  # noqa: F401
    DEFAULT_PORT,  # noqa: F401
    LMCacheSettings,
    parse_hash_algo,
    parse_settings,
)
from kvtool.engine.connectors.lmcache.stores.protocol import ChunkHeader, kv_chunk_header, tensor_buffer
from kvtool.engine.connectors.lmcache.stores.store import RemoteStore, StoreAddress, store_address
from kvtool.engine.connectors.lmcache.stores.store_factory import open_store
from kvtool.engine.errors import KVRefused, KVToolError, PeerError
from kvtool.engine.kv.pages import KVGeometry, KVPages
from kvtool.engine.models.shard_layout import TPRank

logger = logging.getLogger("kvtool.lmcache")

# Store staging buffers a CUDA engine pins when it starts (the rest of max_local_cpu_size as
# first needed): four full steps' chunks at the default 2048-token step and 256-token chunks.
EAGER_STAGING_BUFFERS = 32


class ChunkJob(msgspec.Struct, kw_only=True):
    request_id: str
    key: str
    start: int  # first token of the chunk
    end: int  # one past its last token
    skip: int  # leading tokens of the chunk not written: a local hit, or null blocks below a window
    block_ids: list[int]  # the group's engine blocks covering [start, end)
    tokens: int  # tokens the job counts as loaded or stored (a chunk counts once, whatever its groups)


class LMCacheMetadata(KVConnectorMetadata):
    loads: list[ChunkJob] = []
    stores: list[ChunkJob] = []


class LMCacheCompletions(KVConnectorCompletions):
    """Chunks whose PUT the store confirmed since the last report, by rank 0's key (under tensor
    parallelism a key counts once every rank stored its shard)."""

    stored: list[str] = []


def _request_tags(request) -> dict[str, str]:
    tags = tags_from_request_configs(request.kv_transfer_params)
    if request.cache_salt:
        # LMCache's isolation tag for vLLM's cache_salt (a digest, never the salt itself).
        tags["cachesalt"] = hashlib.sha256(request.cache_salt.encode()).hexdigest()[:16]
    return tags


def _request_keys(request, group_key_settings: list[LMCacheKeySettings]) -> list[list]:
    """Each KV cache group's chunk keys of the request's prompt, in group order."""
    tags = _request_tags(request) or None
    return [make_chunk_keys(request.prompt_token_ids, ks, tags=tags) for ks in group_key_settings]


class _Lookup(msgspec.Struct):
    """An EXIST lookup running on the lookup thread for one request."""

    num_computed_tokens: int  # the local hit it was asked with
    first: int  # index of the first chunk asked about
    last: int  # one past the last (every group's chunks of [first, last), chunk by chunk)
    future: Future
    started_s: float  # time.monotonic()


class LMCacheScheduler(SchedulerHalf):
    """Plans loads and stores; its EXIST lookups run on a thread of their own.

    The engine loop never waits on the server: a request whose lookup is in flight is
    answered "ask again later" (None) and skipped for that step; a lookup that takes more than
    `lookup_timeout_s` is given up on and the request runs without the hit.
    """

    def __init__(self, ctx: ConnectorContext, settings: LMCacheSettings, key_settings: LMCacheKeySettings, client: RemoteStore) -> None:
        super().__init__(ctx)
        self.settings = settings
        self.key_settings = key_settings
        self.client = client
        self.block_size = ctx.identity.geometry.block_size
        self.cs = key_settings.chunk_tokens
        self.groups = GroupChunks(ctx.kv_layout, self.block_size, self.cs)
        self.group_key_settings = make_group_key_settings(key_settings, ctx.identity, ctx.kv_layout)
        # request id -> each group's chunk keys of its prompt
        self.keys: dict[str, list[list]] = {}
        # request id -> (local hit it was asked with, matched tokens); lookups hit the network once.
        self.lookups: dict[str, tuple[int, int]] = {}
        self.inflight_lookups: dict[str, _Lookup] = {}
        self._lookup_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtool-lmcache-lookup")
        self.requests: dict = {}
        self.next_store: dict[str, int] = {}
        self.pending_loads: list[ChunkJob] = []
        # Chunks whose bytes were refused on load in this process: a miss until this process has
        # stored them again (a store the worker reports as landed), so no request loads them twice.
        self.refused: set[str] = set()
        # Each rank stores its own shard under its own worker_id: a chunk is a hit only when all are there.
        self.num_ranks = key_settings.world_size

    def _keys(self, request) -> list[list]:
        keys = self.keys.get(request.request_id)
        if keys is None:
            keys = self.keys[request.request_id] = _request_keys(request, self.group_key_settings)
        return keys

    def check_request(self, request) -> None:
        """Refuse (InputError) a request whose LMCache tags the server could not key."""
        tags = _request_tags(request)
        if self.settings.verify_payload:
            tags[DIGEST_TAG[0]] = DIGEST_TAG[1]  # the digest's key is the chunk's plus this tag
        # The longest key is the last rank's (its worker id may have more digits than rank 0's).
        check_request_tags(tags, msgspec.structs.replace(self.key_settings, worker_id=self.num_ranks - 1))

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self.config.is_kv_consumer:
            return 0, False
        rid = request.request_id
        cached = self.lookups.get(rid)
        if cached is not None and cached[0] == num_computed_tokens:
            return cached[1], False
        keys = self._keys(request)
        first = num_computed_tokens // self.cs
        # Whole chunks, the last one too: on a full hit the scheduler leaves only the last token
        # to compute, and the load still writes that token's chunk whole. A trailing partial
        # chunk (save_unfull_chunk) is never a hit.
        last = min(request.num_tokens, request.num_prompt_tokens) // self.cs
        if self.refused:
            last = next((i for i in range(first, last)
                         if any(keys[g][i].key in self.refused for g in self.groups.full_groups)), last)
        if last <= first:
            self.lookups[rid] = (num_computed_tokens, 0)
            return 0, False
        lookup = self.inflight_lookups.get(rid)
        if lookup is None or lookup.num_computed_tokens != num_computed_tokens:
            wanted = [group_keys[i].key for i in range(first, last) for group_keys in keys]
            try:
                future = self._lookup_pool.submit(self._exist_on_every_rank, wanted)
            except RuntimeError:  # shut down
                return 0, False
            self.inflight_lookups[rid] = _Lookup(num_computed_tokens, first, last, future, time.monotonic())
            return None, False
        if not lookup.future.done():
            if time.monotonic() - lookup.started_s < self.settings.lookup_timeout_s:
                return None, False
            logger.warning(
                "LMCache lookup of request %s took over %g s; computing it instead",
                rid, self.settings.lookup_timeout_s,
            )
            return self._settle(rid, num_computed_tokens, 0)
        try:
            present = lookup.future.result()
        except KVToolError as e:
            logger.warning("LMCache lookup failed, computing instead: %s", e)
            present = []
        num_groups = self.groups.num_groups

        def available(i: int, g: int) -> bool:
            at = (i - lookup.first) * num_groups + g
            # A chunk refused after the lookup was asked is a miss too.
            return at < len(present) and present[at] and keys[g][i].key not in self.refused

        end = self.groups.longest_hit(available, lookup.first, lookup.last, num_computed_tokens, request.num_tokens)
        hit_end = self.groups.hit_end(request.num_tokens, end)
        return self._settle(rid, num_computed_tokens, max(0, hit_end - num_computed_tokens))

    def _exist_on_every_rank(self, keys: list[str]) -> list[bool]:
        """EXIST of each chunk's key for every rank, in one pipelined batch (on the lookup thread)."""
        if self.num_ranks == 1:
            return self.client.exist_many(keys)
        asked = [key_for_worker(k, r) for k in keys for r in range(self.num_ranks)]
        found = self.client.exist_many(asked)
        n = self.num_ranks
        return [all(found[i * n : (i + 1) * n]) for i in range(len(keys))]

    def _settle(self, rid: str, num_computed_tokens: int, matched: int) -> tuple[int, bool]:
        self.inflight_lookups.pop(rid, None)
        self.lookups[rid] = (num_computed_tokens, matched)
        return matched, False

    def update_state_after_alloc(self, request, block_ids: list[int], num_external_tokens: int) -> None:
        self.requests[request.request_id] = request
        start = request.num_computed_tokens
        end = start + num_external_tokens
        # Chunks that come from the store need no storing back (a full hit's last chunk included).
        self.next_store[request.request_id] = max(self.next_store.get(request.request_id, 0), -(-end // self.cs))
        if num_external_tokens <= 0:
            return
        keys = self._keys(request)
        tables = request.group_block_ids
        bs = self.block_size
        # Every group's chunks that the load reads, chunk by chunk, each chunk's tokens counted once.
        for i, g, counted in self.groups.loads(start, end):
            k = keys[g][i]
            first_token = max(start, self.groups.first_block(g, start, end) * bs)
            self.pending_loads.append(ChunkJob(
                request_id=request.request_id, key=k.key, start=k.start, end=k.end,
                skip=max(0, first_token - k.start), block_ids=tables[g][k.start // bs : -(-k.end // bs)],
                tokens=sum(keys[0][c].end - max(start, keys[0][c].start) for c in counted)))

    def build_connector_meta(self, scheduler_output) -> LMCacheMetadata:
        stores: list[ChunkJob] = []
        if self.config.is_kv_producer:
            for s in scheduler_output.scheduled:
                req = self.requests.get(s.request_id)
                if req is not None:
                    stores.extend(self._plan_stores(req, s))
        meta = LMCacheMetadata(loads=self.pending_loads, stores=stores)
        self.steps_in_flight.add(scheduler_output.step_id, meta)
        self.pending_loads = []
        return meta

    def _plan_stores(self, req, s) -> list[ChunkJob]:
        done = s.start + s.num_tokens
        if self.settings.offload_prompt_only:
            done = min(done, req.num_prompt_tokens)
        keys = self._keys(req)
        tables = req.group_block_ids
        bs = self.block_size
        jobs = []
        i = self.next_store.get(req.request_id, 0)
        while i < len(keys[0]) and keys[0][i].end <= done:
            # Every group's chunk whose blocks are all in the group's table; the chunk's tokens
            # count as stored once, by the first of them.
            tokens = keys[0][i].end - keys[0][i].start
            for g, table in enumerate(tables):
                if self.groups.storable(table, i):
                    k = keys[g][i]
                    jobs.append(ChunkJob(request_id=req.request_id, key=k.key, start=k.start, end=k.end, skip=0,
                                         block_ids=table[k.start // bs : -(-k.end // bs)], tokens=tokens))
                    tokens = 0
            i += 1
        self.next_store[req.request_id] = i
        return jobs

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        done = output.completions
        if isinstance(done, LMCacheCompletions):
            self.refused.difference_update(done.stored)
        step = self.steps_in_flight.answered(output)
        if step is None or not output.invalid_block_ids:
            return
        for job in step.loads:
            if not output.invalid_block_ids.isdisjoint(job.block_ids):
                # Refuse the chunk, and store it again from the first bad chunk after a recompute.
                self.refused.add(job.key)
                self.next_store[job.request_id] = min(self.next_store.get(job.request_id, 0), job.start // self.cs)
        # Every answer given so far may count a refused chunk: ask again.
        self.lookups.clear()

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict | None]:
        rid = request.request_id
        for d in (self.keys, self.lookups, self.requests, self.next_store, self.inflight_lookups):
            d.pop(rid, None)
        return False, None

    def shutdown(self) -> None:
        # Closing the client first ends a lookup in flight at once, whatever the server does.
        self.client.close()
        self._lookup_pool.shutdown(wait=True, cancel_futures=True)


class LMCacheWorker(WorkerHalf):
    def __init__(self, ctx: ConnectorContext, settings: LMCacheSettings, client: RemoteStore) -> None:
        super().__init__(ctx)
        self.settings = settings
        self.client = client
        # This rank's pages: its KV-head shard (the identity's geometry is already per rank).
        self.geometry: KVGeometry = ctx.identity.geometry
        # A chunk holds one KV cache group's blocks: its layers are the pages' slots.
        self.chunk_geometry = chunk_geometry_of_pages(self.geometry, ctx.kv_layout)
        self.num_slots = ctx.kv_layout.num_slots
        self.worker_id = settings.worker_id
        self.dtype = getattr(torch, self.geometry.storage_dtype)  # an fp8 cache's chunks are uint8
        self.pin = ctx.identity.device_type == "cuda"
        self.putter = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtool-lmcache-put")
        self._fetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtool-lmcache-get")
        self._pool: list[torch.Tensor] = []  # host buffers for GETs, one per chunk in flight
        self.chunk_tokens = settings.chunk_tokens
        self.pending_puts: list[Future] = []
        self._staging: StoreStaging | None = None  # host copies of stored chunks, made at the first store
        self._stored: list[str] = []  # rank 0's keys of the chunks stored since take_completions
        self.verify_payload = settings.verify_payload
        self._secret = payload_secret() if settings.verify_payload else None

    def register_kv_caches(self, kv_pages: KVPages) -> None:
        """On a CUDA engine, pin the GET ring and the first store staging buffers now, at start-up:
        pinning takes milliseconds per buffer, which the first loads and stores would otherwise
        add to their steps."""
        super().register_kv_caches(kv_pages)
        if self.pin:
            if self.config.is_kv_consumer:
                self._ensure_pool(self._ring_size())
            if self.config.is_kv_producer:
                self._staging_buffers().reserve(EAGER_STAGING_BUFFERS)

    def _ring_size(self, num_loads: int | None = None) -> int:
        """Host buffers a load streams through (at most; fewer for fewer chunks)."""
        ring = max(16, 4 * self.settings.connections)
        return ring if num_loads is None else min(num_loads, ring)

    def _staging_buffers(self) -> StoreStaging:
        if self._staging is None:
            g = self.geometry
            chunk_bytes = 2 * self.num_slots * self.chunk_tokens * g.kv_hidden_size * self.dtype.itemsize
            self._staging = StoreStaging(self.kv_pages, chunk_bytes, int(self.settings.max_local_cpu_size * (1 << 30)),
                                         wait=self.settings.force_store_wait)
        return self._staging

    def _ensure_pool(self, n: int) -> None:
        """Host buffers [2, slots, chunk_tokens, H*D] for n chunks, allocated once and reused.

        Pinned on CUDA engines, so GETs land where the copy engine reads; pinning is slow (it
        grows with the size), which must not be paid per load.
        """
        g = self.geometry
        while len(self._pool) < n:
            self._pool.append(
                torch.empty((2, self.num_slots, self.chunk_tokens, g.kv_hidden_size), dtype=self.dtype,
                            pin_memory=self.pin)
            )

    def bind_connector_metadata(self, meta: LMCacheMetadata) -> None:
        """The scheduler half keys jobs as rank 0; another rank moves its own shard under its own key."""
        if self.worker_id:
            meta = LMCacheMetadata(
                loads=[msgspec.structs.replace(j, key=key_for_worker(j.key, self.worker_id)) for j in meta.loads],
                stores=[msgspec.structs.replace(j, key=key_for_worker(j.key, self.worker_id)) for j in meta.stores],
            )
        super().bind_connector_metadata(meta)

    def _expected(self, num_tokens: int) -> ChunkHeader:
        g = self.geometry
        return kv_chunk_header((2, self.num_slots, num_tokens, g.kv_hidden_size), self.dtype)

    def start_load_kv(self) -> None:
        loads = self._meta.loads
        if not loads:
            return
        t0 = time.perf_counter()
        # GETs stream in over the pool's connections into a ring of host buffers, while this
        # thread scatters each chunk into the pages as soon as it has arrived; chunk i reuses
        # the buffer of chunk i - ring once that one is in the pages, so host memory is bounded.
        digests = self._fetch_digests(loads) if self.verify_payload else None
        ring = self._ring_size(len(loads))
        self._ensure_pool(ring)
        items = [(j.key, tensor_buffer(self._pool[i % ring]), None) for i, j in enumerate(loads)]
        scattered = [threading.Event() for _ in loads]
        aborted = threading.Event()
        done: queue.Queue = queue.Queue()

        def wait_for_buffer(i: int) -> None:
            if i >= ring:
                while not scattered[i - ring].wait(0.05):
                    if aborted.is_set():
                        raise RuntimeError("load aborted")

        fetch = self._fetcher.submit(
            self.client.get_many_into, items, lambda i, r: done.put((i, r)), wait_for_buffer
        )
        try:
            for _ in loads:
                while True:
                    try:
                        i, result = done.get(timeout=0.05)
                        break
                    except queue.Empty:
                        if fetch.done():
                            fetch.result()  # re-raises what stopped the fetch before all items ended
                self._load_one(loads[i], self._pool[i % ring], result, None if digests is None else digests[i])
                scattered[i].set()
            fetch.result()
        finally:
            aborted.set()
        self.stats.load_s += time.perf_counter() - t0

    def _fetch_digests(self, loads: list[ChunkJob]) -> list[tuple[object, memoryview]]:
        """The payload digest of each chunk to load (verify_payload), fetched before the chunks."""
        store = memoryview(bytearray(DIGEST_BYTES * len(loads)))
        views = [store[i * DIGEST_BYTES : (i + 1) * DIGEST_BYTES] for i in range(len(loads))]
        found = self.client.get_many_into([(digest_key(j.key), v, None) for j, v in zip(loads, views)])
        return list(zip(found, views))

    def _load_one(self, job: ChunkJob, pooled: torch.Tensor, result, digest=None) -> None:
        bs = self.geometry.block_size
        n = job.end - job.start
        try:
            if result is None:
                raise KVRefused(f"chunk {job.key} is no longer in {self.client.url} (was it restarted or evicted?)")
            if isinstance(result, KVToolError):
                raise result
            self._refuse_reply(result, job)
            # The bytes arrived as a contiguous [2, slots, n, H*D] at the head of the pooled buffer.
            buf = pooled.reshape(-1)[: 2 * self.num_slots * n * self.geometry.kv_hidden_size]
            buf = buf.view(2, self.num_slots, n, self.geometry.kv_hidden_size)
            if digest is not None:
                refuse_payload(job.key, tensor_buffer(buf), digest[0], digest[1], self._secret)
            # Only the tokens beyond the local hit; that hit is block-aligned.
            first_block = job.skip // bs
            self.kv_pages.scatter(job.block_ids[first_block:], buf[:, :, job.skip :], "KV_2LTD", n - job.skip)
            self.stats.bytes_loaded += result.length
            self.stats.tokens_loaded[job.request_id] = self.stats.tokens_loaded.get(job.request_id, 0) + job.tokens
        except KVToolError as e:
            self.stats.load_failures += 1
            for b in job.block_ids[job.skip // bs :]:
                self.errors[b] = str(e)

    def _refuse_reply(self, header: ChunkHeader, job: ChunkJob) -> None:
        """A chunk is scattered only when it fits this rank's pages (chunk_fit.chunk_problem)."""
        problem = chunk_problem(header, job.end - job.start, self.chunk_geometry)
        if problem is not None:
            raise KVRefused(f"LMCache chunk {job.key} does not fit this rank's KV pages: {problem}")

    def wait_for_save(self) -> None:
        failed = {j.request_id for j in self._meta.loads if not self.errors.keys().isdisjoint(j.block_ids)}
        # A chunk computed over KV that failed to load is never stored.
        jobs = [job for job in self._meta.stores if job.request_id not in failed]
        if not jobs:
            return
        t0 = time.perf_counter()
        staged = self._staging_buffers().stage([(job.block_ids, job.end - job.start) for job in jobs])
        with self._stats_lock:
            self.stats.store_s += time.perf_counter() - t0
            # Every staging buffer in flight: the chunks from there on are not stored (store_staging).
            self.stats.store_skipped_chunks += len(jobs) - len(staged.hosts)
        jobs = jobs[: len(staged.hosts)]
        if not jobs:
            return
        self.pending_puts = [f for f in self.pending_puts if not f.done()]
        self.pending_puts.append(self.putter.submit(self._put_staged, jobs, staged))

    def _put_staged(self, jobs: list[ChunkJob], staged: StagedChunks) -> None:
        try:
            staged.wait()
            self._put(list(zip(jobs, staged.hosts)))
        finally:
            self._staging.release(staged)

    def _put(self, items: list[tuple[ChunkJob, torch.Tensor]]) -> None:
        t0 = time.perf_counter()
        batch = [(job.key, tensor_buffer(buf), self._expected(job.end - job.start)) for job, buf in items]
        ok = self.client.put_many(batch)
        if self.verify_payload:
            # After the chunk: a reader that finds a chunk without its digest refuses it.
            digests = [(digest_key(key), payload_digest(key, view, self._secret), DIGEST_HEADER)
                       for (key, view, _), stored in zip(batch, ok) if stored]
            stored_digests = iter(self.client.put_many(digests))
            ok = [stored and next(stored_digests) for stored in ok]
        with self._stats_lock:
            for (job, buf), stored in zip(items, ok):
                if stored:
                    self._stored.append(key_for_worker(job.key, 0) if self.worker_id else job.key)
                    self.stats.bytes_stored += buf.numel() * buf.element_size()
                    stored_tokens = self.stats.tokens_stored.get(job.request_id, 0) + job.tokens
                    self.stats.tokens_stored[job.request_id] = stored_tokens
            self.stats.store_s += time.perf_counter() - t0

    def take_completions(self) -> LMCacheCompletions | None:
        with self._stats_lock:
            stored, self._stored = self._stored, []
        return LMCacheCompletions(stored=stored) if stored else None

    def flush(self) -> None:
        """Wait until every queued PUT was confirmed (or failed)."""
        for f in self.pending_puts:
            f.result()
        self.pending_puts = []

    def shutdown(self) -> None:
        self.putter.shutdown(wait=True)
        self._fetcher.shutdown(wait=True)
        self.client.close()


class LMCacheConnector(KVConnector):
    scheduler_half = LMCacheScheduler
    worker_half = LMCacheWorker

    @classmethod
    def groups_unsupported(cls, config) -> str | None:
        # kvtool's own blake3 keys move every group; the peer modes key what LMCache 0.5.6 keys
        # inside vLLM 0.33, which turns its hybrid manager off for LMCache (not SupportsHMA).
        if parse_hash_algo(dict(config.kv_connector_extra_config)) == "blake3":
            return None
        return "does not support the hybrid KV cache manager (as in vLLM)"

    @classmethod
    def hit_unit_tokens(cls, config, block_size: int) -> int:
        settings, _ = parse_settings(dict(config.kv_connector_extra_config), "model", "float32", block_size)
        return settings.chunk_tokens

    @classmethod
    def hit_source(cls, config, rebuilt: bool) -> str:
        url = str(config.extra("remote_url") or config.extra("lmcache.remote_url") or "")
        scheme = url.partition("://")[0] if "://" in url else "lm"
        return {"redis": "redis", "rediss": "redis", "unix": "redis", "redis-sentinel": "redis",
                "redis-cluster": "redis-cluster", "valkey": "valkey", "resp": "redis"}.get(scheme, "lmcache")

    @staticmethod
    def _settings(ctx: ConnectorContext) -> tuple[LMCacheSettings, LMCacheKeySettings]:
        identity = ctx.identity
        settings, key_settings = parse_settings(
            dict(ctx.config.kv_connector_extra_config), identity.model_name, identity.geometry.storage_dtype,
            identity.geometry.block_size, tp=TPRank(identity.tp_size, identity.tp_rank),
            identity_digest=make_identity_digest(identity),
        )
        assert settings.host is not None and settings.port is not None
        return settings, key_settings

    # --- remote store (store.py): each half opens its own; the halves share no state, only the store ---

    @staticmethod
    def _open_store(ctx: ConnectorContext, settings: LMCacheSettings, connections: int) -> RemoteStore:
        address = StoreAddress("lm", ((settings.host, settings.port),))
        if settings.remote_url and not settings.remote_url.startswith("lm://"):
            address = store_address(settings.remote_url, save_unfull_chunk=settings.save_unfull_chunk,
                                    valkey_enable_ttl=settings.valkey_enable_ttl, valkey_ttl_sec=settings.valkey_ttl_sec)
        g = ctx.identity.geometry
        full_chunk = kv_chunk_header((2, ctx.kv_layout.num_slots, settings.chunk_tokens, g.kv_hidden_size),
                                     getattr(torch, g.storage_dtype))
        return open_store(address, connections=connections, timeout_s=settings.timeout_s, chunk_header=full_chunk,
                          valkey_ttl_s=address.ttl_s, backoff_s=settings.peer_backoff_s)

    @classmethod
    def create_scheduler_half(cls, ctx: ConnectorContext) -> LMCacheScheduler:
        settings, key_settings = cls._settings(ctx)
        lookup_client = cls._open_store(ctx, settings, 1)
        name = "LMCache server" if lookup_client.url.startswith("lm://") else "remote store"
        try:
            healthy = lookup_client.health()  # raises ConfigError for refused credentials
        except KVToolError:
            lookup_client.close()
            raise
        if not healthy:
            if ctx.config.kv_load_failure_policy == "fail":
                lookup_client.close()
                raise PeerError(
                    f"cannot reach the {name} at {lookup_client.url}; start it or use "
                    '"kv_load_failure_policy": "recompute" to run without it'
                )
            logger.warning("%s at %s is not reachable; prompts are computed until it is", name, lookup_client.url)
        return LMCacheScheduler(ctx, settings, key_settings, lookup_client)

    @classmethod
    def create_worker_half(cls, ctx: ConnectorContext) -> LMCacheWorker:
        settings, _ = cls._settings(ctx)
        return LMCacheWorker(ctx, settings, cls._open_store(ctx, settings, settings.connections))
