"""Whether a stored LMCache chunk fits one rank's KV pages: the one check for loads and `verify-keys --peer`.

A chunk is KV_2LTD `[2, num_layers, num_tokens, kv_hidden_size]`, where the KV hidden size is
the writing rank's KV heads times head_dim: a rank of a TP-N vLLM + LMCache writes its own head
shard under its own `worker_id`, never the whole model's heads. The check compares the memory
format, every dimension, the dtype itself (a float16 chunk does not fit bfloat16 pages, though
both have 2-byte elements) and the payload length, and names every field that differs.
"""

from __future__ import annotations

import msgspec
import torch

from kvtool.engine.connectors.lmcache.stores.protocol import ChunkHeader, MemoryFormat, torch_dtype_from_code
from kvtool.engine.errors import ConfigError, PeerError
from kvtool.engine.kv.groups import KVCacheLayout
from kvtool.engine.kv.pages import KVGeometry
from kvtool.engine.models.shard_layout import TPRank, kv_head_range

__all__ = ["ChunkGeometry", "chunk_geometry_of_pages", "chunk_geometry_of_rank", "chunk_problem"]


def _torch_dtype(name: str) -> torch.dtype | None:
    dtype = getattr(torch, name, None)
    return dtype if isinstance(dtype, torch.dtype) else None


class ChunkGeometry(msgspec.Struct, frozen=True, kw_only=True):
    """The KV_2LTD chunk one rank writes: `[2, num_layers, num_tokens, kv_hidden_size]` of `dtype`."""

    num_layers: int
    kv_hidden_size: int  # KV heads of one rank x head_dim
    dtype: str  # torch name of the KV dtype, e.g. "float32"

    @property
    def element_size(self) -> int:
        return _torch_dtype(self.dtype).itemsize

    def shape(self, num_tokens: int) -> tuple[int, int, int, int]:
        return (2, self.num_layers, num_tokens, self.kv_hidden_size)

    def num_bytes(self, num_tokens: int) -> int:
        return 2 * self.num_layers * num_tokens * self.kv_hidden_size * self.element_size


def chunk_geometry_of_pages(geometry: KVGeometry, layout: KVCacheLayout) -> ChunkGeometry:
    """The chunk a rank with these KV pages writes and can load (its geometry is already per rank):
    one KV cache group's blocks, so its layers are the layout's slots (every layer with one group);
    an fp8 cache's chunk is uint8, as vLLM's pages are."""
    return ChunkGeometry(num_layers=layout.num_slots, kv_hidden_size=geometry.kv_hidden_size,
                         dtype=geometry.storage_dtype)


def chunk_geometry_of_rank(
    num_layers: int, num_kv_heads: int, head_dim: int, kv_dtype: str, tp: TPRank
) -> ChunkGeometry:
    """The chunk rank `tp.rank` of a TP-`tp.size` writer of a model with `num_kv_heads` writes.

    The rank's KV heads are shard_layout's split (vLLM's when they divide evenly). Raises
    ConfigError for a dtype torch does not know.
    """
    dtype = _torch_dtype(kv_dtype)
    if dtype is None:
        raise ConfigError(f"--kv-dtype {kv_dtype!r} is not a torch dtype")
    kv_dtype = str(dtype).removeprefix("torch.")  # torch's own name ("half" -> "float16")
    heads = kv_head_range(num_kv_heads, tp)[1]
    return ChunkGeometry(num_layers=num_layers, kv_hidden_size=heads * head_dim, dtype=kv_dtype)


def chunk_problem(header: ChunkHeader, num_tokens: int, geometry: ChunkGeometry) -> str | None:
    """Why a stored chunk (its `ChunkHeader`) does not fit `geometry` for `num_tokens`; None when it fits.

    One line naming every field that differs, each with the value found and the one expected.
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
        found_dtype = str(torch_dtype_from_code(header.dtype_code)).removeprefix("torch.")
    except PeerError as e:
        problems.append(str(e))
    else:
        if found_dtype != geometry.dtype:
            problems.append(f"dtype {found_dtype}, expected {geometry.dtype}")
    if not problems and header.length != geometry.num_bytes(num_tokens):
        problems.append(f"payload {header.length} bytes, expected {geometry.num_bytes(num_tokens)}")
    return "; ".join(problems) or None
