"""vLLM's KV cache events: the wire structs, and their collection from the engine's caches.

The structs reproduce vLLM 0.33's (`vllm/distributed/kv_events.py`) byte for byte: the same class
names (they are the msgpack tags), the same field order, the same options. An `EventBatch` is a
msgpack array `[ts, events, data_parallel_rank]`; each event a map tagged `"type"`, defaults left
out. Block hashes go out as vLLM sends them: by default the low 64 bits of the 32-byte digest read
big-endian, as an int; the full bytes when `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0` (vLLM's switch).

Collection. The block pool appends small records to its `events` list when it is set (see
`BlockPool.events`); once per engine step `KVEventStream.drain` turns them into `BlockStored` /
`BlockRemoved` / `AllBlocksCleared` with medium "GPU" (vLLM's name for the engine's own cache,
whatever the device), adds what the offloading tiers recorded (`OffloadEventRecorder`, media
"CPU" and "STORAGE"), and hands one batch to the publisher.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import msgspec

from kvtool.engine.events.config import KVEventsConfig

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
# vLLM's name for a file-system tier (`Medium.STORAGE`): kvtool's disk tier.
MEDIUM_STORAGE = "STORAGE"

ExternalBlockHash = bytes | int


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the events; the tag (field "type") is the class name."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def use_int_block_hashes() -> bool:
    """vLLM's `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES` (default on)."""
    return bool(int(os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1")))


def external_block_hash(block_hash: bytes, as_int: bool = True) -> ExternalBlockHash:
    """A block hash as the events carry it (vLLM's `maybe_convert_block_hash`)."""
    if not as_int:
        return block_hash
    return int.from_bytes(block_hash, byteorder="big") & ((1 << 64) - 1)


def event_extra_keys(block_index: int, cache_salt: str | None) -> tuple | None:
    """One block's extra keys as events publish them: untagged, the cache salt on block 0 only."""
    return (cache_salt,) if block_index == 0 and cache_salt else None


# ---- the offloading tiers ----------------------------------------------------------------------


class OffloadEventRecorder:
    """KV events of an offloading tier's scheduler half (media "CPU" and "STORAGE").

    Call `stored` when an offload block becomes loadable from a tier and `removed` when the tier
    evicts or drops it; the engine takes the events once per step (`take_events`). An offload
    block is keyed by its offload key and covers one or more engine blocks: a store announces
    each constituent block hash, and the removal fans out to the same hashes, as vLLM's
    `OffloadingEventsTracker` does (it remembers them until the removal).
    """

    def __init__(self, as_int: bool | None = None, group_specs: Sequence[tuple[str, int | None]] = ()) -> None:
        self.as_int = use_int_block_hashes() if as_int is None else as_int
        # Each KV cache group's (kv_cache_spec_kind, sliding window), which its BlockStored carry
        # (the group is the offload key's last 4 bytes); none given: group 0, unannotated.
        self.group_specs = list(group_specs)
        self._hashes: dict[tuple[str, bytes], list[ExternalBlockHash]] = {}
        self._events: list[KVCacheEvent] = []

    def stored(
        self,
        medium: str,
        key: bytes,
        block_hashes: Sequence[bytes],
        parent_block_hash: bytes | None,
        token_ids: Sequence[int],
        block_size: int,
        extra_keys: list | None = None,
    ) -> None:
        """Offload block `key` (engine blocks `block_hashes`, tokens `token_ids`) is now in `medium`.

        `extra_keys`: one entry per engine block (event_extra_keys), for salted requests."""
        if (medium, key) in self._hashes:
            return
        hashes = [external_block_hash(h, self.as_int) for h in block_hashes]
        self._hashes[(medium, key)] = hashes
        parent = external_block_hash(parent_block_hash, self.as_int) if parent_block_hash is not None else None
        event = offload_block_stored(medium, hashes, parent, list(token_ids), block_size, extra_keys,
                                     group_idx=int.from_bytes(key[-4:], "big"))
        if event.group_idx < len(self.group_specs):
            event.kv_cache_spec_kind, event.kv_cache_spec_sliding_window = self.group_specs[event.group_idx]
        self._events.append(event)

    def removed(self, medium: str, key: bytes) -> None:
        """Offload block `key` left `medium` (evicted, dropped after a failed check, deleted)."""
        hashes = self._hashes.pop((medium, key), None)
        if hashes is not None:
            self._events.append(offload_block_removed(medium, hashes, int.from_bytes(key[-4:], "big")))

    def take_events(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events


def offload_block_stored(
    medium: str, block_hashes: list[ExternalBlockHash], parent: ExternalBlockHash | None, token_ids: list[int],
    block_size: int, extra_keys: list | None = None, group_idx: int = 0,
) -> BlockStored:
    """A tier's BlockStored, shaped as vLLM's offloading connector sends it (no LoRA)."""
    if extra_keys is not None and not any(k is not None for k in extra_keys):
        extra_keys = None
    return BlockStored(
        block_hashes=block_hashes, parent_block_hash=parent, token_ids=token_ids, block_size=block_size,
        lora_id=None, medium=medium, lora_name=None, extra_keys=extra_keys, group_idx=group_idx,
    )


def offload_block_removed(medium: str, block_hashes: list[ExternalBlockHash], group_idx: int = 0) -> BlockRemoved:
    """A tier's BlockRemoved for every constituent block hash of one offload block."""
    return BlockRemoved(block_hashes=block_hashes, medium=medium, group_idx=group_idx)


# ---- the engine's cache ------------------------------------------------------------------------


class KVEventStream:
    """Turns the block pool's records (and the tiers' events) into one batch per step, published.

    `pool_events` is the list installed as the pool's `events`: records `("stored", hashes, i, g)`
    (block i of the request whose `block_hashes` list is `hashes` got cached for KV cache group
    g), `("removed", h, g)` and `("cleared",)`, in the order they happened. As vLLM 0.33's, every
    BlockStored names its group's kind and window (`group_specs`, from the engine's layout).
    """

    def __init__(self, config: KVEventsConfig, block_size: int, publisher) -> None:
        self.config = config
        self.block_size = block_size
        self.publisher = publisher
        self.as_int = use_int_block_hashes()
        self.pool_events: list[tuple] = []
        self.recorders: list[OffloadEventRecorder] = []
        # (kind, sliding window) of each KV cache group (`kv.groups`); one full-attention group
        # until `attach` says otherwise.
        self.group_specs: list[tuple[str, int | None]] = [("full_attention", None)]

    def drain(self, requests: Iterable) -> None:
        """Publish what happened since the last drain as one EventBatch (nothing when nothing did).

        `requests` are the engine's live requests: a "stored" record names its request by the
        identity of that request's `block_hashes` list, which gives the tokens and cache salt.
        """
        events = self._gpu_events(requests) if self.pool_events else []
        for recorder in self.recorders:
            events.extend(recorder.take_events())
        if events:
            self.publisher.publish(KVEventBatch(ts=time.time(), events=events))

    def _gpu_events(self, requests: Iterable) -> list[KVCacheEvent]:
        records = self.pool_events[:]
        self.pool_events.clear()  # in place: the pool holds this very list
        by_hashes: Mapping[int, Any] = {id(r.block_hashes): r for r in requests}
        events: list[KVCacheEvent] = []
        run: list[int] = []  # consecutive newly cached block indices of one request and group
        run_hashes: list[bytes] | None = None
        run_group = 0

        def flush() -> None:
            if run:
                events.append(self._stored(run_hashes, by_hashes.get(id(run_hashes)), run, run_group))
                run.clear()

        for record in records:
            kind = record[0]
            if kind == "stored":
                _, hashes, i, group = record
                if run and (hashes is not run_hashes or i != run[-1] + 1 or group != run_group):
                    flush()
                run_hashes, run_group = hashes, group
                run.append(i)
                continue
            flush()
            if kind == "removed":
                events.append(BlockRemoved(block_hashes=[self._ext(record[1])], medium=MEDIUM_GPU, group_idx=record[2]))
            else:
                events.append(AllBlocksCleared())
        flush()
        return events

    def _stored(self, hashes: list[bytes], req, indices: list[int], group: int) -> BlockStored:
        first, last = indices[0], indices[-1]
        bs = self.block_size
        # The request is always live during the step that cached its blocks; were it not, the
        # hashes still describe the cache exactly and only the tokens are left out.
        salt = req.cache_salt if req is not None else None
        return BlockStored(
            block_hashes=[self._ext(hashes[i]) for i in indices],
            parent_block_hash=self._ext(hashes[first - 1]) if first else None,
            token_ids=req.token_ids_slice(first * bs, (last + 1) * bs) if req is not None else [],
            block_size=bs,
            lora_id=None,
            medium=MEDIUM_GPU,
            lora_name=None,
            extra_keys=[event_extra_keys(i, salt) for i in indices],
            group_idx=group,
            kv_cache_spec_kind=self.group_specs[group][0],
            kv_cache_spec_sliding_window=self.group_specs[group][1],
        )

    def _ext(self, block_hash: bytes) -> ExternalBlockHash:
        return external_block_hash(block_hash, self.as_int)

    def attach(self, pool, layout=None) -> None:
        """Make `pool` record into this stream (the pool's `events` hook); `layout` (a
        `kv.groups.KVCacheLayout`) names the groups' kinds and windows."""
        pool.events = self.pool_events
        if layout is not None:
            self.group_specs = [(g.kind, g.sliding_window) for g in layout.groups]

    def close(self) -> None:
        self.publisher.shutdown()
