"""What an lm:// server holds under a list of keys, and whether each chunk fits one rank's KV geometry (chunk_fit.py)."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import torch

from kvtool.engine.connectors.lmcache.chunk_fit import (  # noqa: F401 (re-exported)
    ChunkGeometry,
    chunk_geometry_of_rank,
    chunk_problem,
)
from kvtool.engine.connectors.lmcache.stores.lm_client import LMClient
from kvtool.engine.connectors.lmcache.stores.protocol import tensor_buffer, torch_dtype_from_code
from kvtool.engine.errors import ConfigError, PeerError
from kvtool.engine.kv.groups import KVCacheLayout
from kvtool.engine.models.model_dir import ModelConfig
from kvtool.engine.models.shard_layout import TPRank

# A GET reads a whole chunk (the protocol has no header-only read) into one buffer of
# READ_HEADROOM x the largest expected chunk, at most MAX_READ_BYTES: a chunk up to that
# size is read and its header reported; a larger one is refused before its payload is read.
READ_HEADROOM = 4
MAX_READ_BYTES = 1 << 30


class ChunkProbe(msgspec.Struct, frozen=True, kw_only=True):
    """What an lm:// server holds under one key, checked against the expected geometry."""

    present: bool  # EXIST said so and the GET found it
    shape: list[int] | None  # as stored; None when absent or unreadable
    dtype: str | None  # torch dtype name as stored; None when absent, unreadable or untyped
    fits: bool | None  # None when absent
    problem: str | None  # why it does not fit (or could not be read); None when it fits


def make_chunk_geometry(config: ModelConfig, kv_dtype: str, world_size: int = 1, worker_id: int = 0,
                        layout: KVCacheLayout | None = None) -> ChunkGeometry:
    """The chunk rank `worker_id` of a `world_size`-way tensor-parallel writer of a model config writes.

    The rank's KV heads are shard_layout's split, as the engine shards them (vLLM's when they
    divide evenly). With the writer's KV cache groups (`layout`) a chunk holds one group's
    blocks, so its layers are the layout's slots, as `chunk_geometry_of_pages` gives the
    connector. Raises ConfigError for a dtype torch does not know or a rank outside the size.
    """
    tp = TPRank(world_size, worker_id)
    num_layers = config.num_layers if layout is None else layout.num_slots
    return chunk_geometry_of_rank(num_layers, config.num_kv_heads, config.head_dim, kv_dtype, tp)


def probe_chunks(
    client: LMClient, chunks: Sequence[tuple[str, int]], geometry: ChunkGeometry
) -> dict[str, ChunkProbe]:
    """Ask an `LMClient`'s server about each `(key, num_tokens)`: EXIST for all, GET each present one.

    Every GET reads into one preallocated buffer of READ_HEADROOM x the largest expected chunk
    (at most MAX_READ_BYTES). A chunk that cannot be read (too large, malformed reply, lost
    connection) is a finding: present, does not fit, the reason in `problem`.

    Raises ConfigError when a chunk of this geometry exceeds MAX_READ_BYTES, and PeerError when
    the EXIST requests (or, with no keys to ask, a HEALTH request) fail: the server is
    unreachable or misbehaves.
    """
    wanted = dict(chunks)  # key -> tokens; keys shared by several sequences are asked once
    if not wanted:
        if not client.health():  # nothing to ask, but a bad address is still an error
            raise PeerError(f"{client.url}: HEALTH failed (unreachable or unhealthy)")
        return {}
    largest = geometry.num_bytes(max(wanted.values()))
    if largest > MAX_READ_BYTES:
        raise ConfigError(
            f"a chunk of this model is {largest} bytes, over the {MAX_READ_BYTES}-byte read cap; "
            "use a smaller --chunk-tokens"
        )
    keys = list(wanted)
    present = client.exist_many(keys)
    buffer = tensor_buffer(torch.empty(min(READ_HEADROOM * largest, MAX_READ_BYTES), dtype=torch.uint8))
    result = {}
    for key, exists in zip(keys, present):
        if not exists:
            result[key] = ChunkProbe(present=False, shape=None, dtype=None, fits=None, problem=None)
            continue
        try:
            header = client.get_into(key, buffer)
        except PeerError as e:
            result[key] = ChunkProbe(present=True, shape=None, dtype=None, fits=False, problem=str(e))
            continue
        if header is None:
            result[key] = ChunkProbe(
                present=False, shape=None, dtype=None, fits=None, problem="gone between EXIST and GET"
            )
            continue
        try:
            dtype = str(torch_dtype_from_code(header.dtype_code)).removeprefix("torch.")
        except PeerError:
            dtype = None
        problem = chunk_problem(header, wanted[key], geometry)
        result[key] = ChunkProbe(
            present=True, shape=list(header.shape), dtype=dtype, fits=problem is None, problem=problem
        )
    return result
