"""What an lm:// server holds under a list of keys, and whether each chunk fits a model's KV geometry."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import torch

from kvtool.engine.connectors.lmcache.wire import (
    ChunkHeader,
    LMClient,
    MemoryFormat,
    tensor_buffer,
    torch_dtype_from_code,
)
from kvtool.engine.errors import ConfigError, PeerError
from kvtool.engine.model_dir import ModelConfig

# A GET reads a whole chunk (the protocol has no header-only read) into one buffer of
# READ_HEADROOM x the largest expected chunk, at most MAX_READ_BYTES: a chunk up to that
# size is read and its header reported; a larger one is refused before its payload is read.
READ_HEADROOM = 4
MAX_READ_BYTES = 1 << 30


class ChunkGeometry(msgspec.Struct, frozen=True, kw_only=True):
    """The KV_2LTD chunk a model writes: `[2, num_layers, num_tokens, kv_hidden_size]`."""

    num_layers: int
    kv_hidden_size: int  # KV heads of one rank x head_dim
    element_size: int  # bytes per element of the KV dtype
    dtype: str = ""  # torch name of the KV dtype; "" compares the element size only

    def shape(self, num_tokens: int) -> tuple[int, int, int, int]:
        return (2, self.num_layers, num_tokens, self.kv_hidden_size)

    def num_bytes(self, num_tokens: int) -> int:
        return 2 * self.num_layers * num_tokens * self.kv_hidden_size * self.element_size


class ChunkProbe(msgspec.Struct, frozen=True, kw_only=True):
    """What an lm:// server holds under one key, checked against the expected geometry."""

    present: bool  # EXIST said so and the GET found it
    shape: list[int] | None  # as stored; None when absent or unreadable
    dtype: str | None  # torch dtype name as stored; None when absent, unreadable or untyped
    fits: bool | None  # None when absent
    problem: str | None  # why it does not fit (or could not be read); None when it fits


def make_chunk_geometry(config: ModelConfig, kv_dtype: str, world_size: int = 1) -> ChunkGeometry:
    """The chunk geometry of a model config (`ModelConfig`) for a KV dtype name.

    With world_size N the writer is taken to be N-way tensor parallel: each rank holds
    max(1, num_kv_heads // N) heads, as vLLM shards them. Raises ConfigError for a dtype torch
    does not know.
    """
    dtype = getattr(torch, kv_dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"--kv-dtype {kv_dtype!r} is not a torch dtype")
    num_kv_heads = max(1, config.num_kv_heads // world_size)
    return ChunkGeometry(
        num_layers=config.num_layers,
        kv_hidden_size=num_kv_heads * config.head_dim,
        element_size=dtype.itemsize,
        dtype=str(dtype).removeprefix("torch."),
    )


def geometry_problem(header: ChunkHeader, num_tokens: int, geometry: ChunkGeometry) -> str | None:
    """Why a stored chunk (`wire.ChunkHeader`) does not fit `geometry`; None when it fits.

    Checks the memory format (KV_2LTD), the shape `[2, layers, tokens, KV hidden size]` and the
    dtype itself (a float16 chunk does not fit bfloat16 pages, though both have 2-byte
    elements), and names every field that differs with the value expected and found.
    """
    problems = []
    if header.fmt != MemoryFormat.KV_2LTD:
        try:
            name = MemoryFormat(header.fmt).name
        except ValueError:
            name = str(header.fmt)
        problems.append(f"format {name}, expected KV_2LTD")
    shape = tuple(header.shape)
    want = geometry.shape(num_tokens)
    if len(shape) != 4:
        problems.append(f"shape {list(shape)} has {len(shape)} dims, expected {list(want)}")
    else:
        for label, expected, found in zip(("K/V", "layers", "tokens", "KV hidden size"), want, shape):
            if expected != found:
                problems.append(f"{label} {found}, expected {expected}")
    try:
        found_dtype = torch_dtype_from_code(header.dtype_code)
    except PeerError as e:
        problems.append(str(e))
    else:
        found_name = str(found_dtype).removeprefix("torch.")
        if geometry.dtype and found_name != geometry.dtype:
            problems.append(f"dtype {found_name}, expected {geometry.dtype}")
        elif found_dtype.itemsize != geometry.element_size:
            problems.append(f"element size {found_dtype.itemsize} bytes, expected {geometry.element_size}")
    return "; ".join(problems) or None


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
        problem = geometry_problem(header, wanted[key], geometry)
        result[key] = ChunkProbe(
            present=True, shape=list(header.shape), dtype=dtype, fits=problem is None, problem=problem
        )
    return result
