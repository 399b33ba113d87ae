"""How big the KV pages are: one rank's geometry, and how many blocks every rank gets.

Every rank holds the same number of blocks (a block id means the same tokens on every rank), so
the engine takes as many as the rank with the least room can hold, at rank 0's geometry (rank 0
holds the most KV heads when they do not divide evenly).
"""

from __future__ import annotations

import torch

from kvtool.engine.errors import ConfigError
from kvtool.engine.kv.groups import KVCacheLayout, layer_windows, plan_layout, single_group
from kvtool.engine.kv.pages import DTYPE_NAMES, KVGeometry
from kvtool.engine.models.shard_layout import TPRank, kv_head_range
from kvtool.engine.params import EngineParams


def rank_kv_geometry(config, block_size: int, dtype: torch.dtype, tp: TPRank) -> KVGeometry:
    """The geometry of one rank's KV pages of `dtype` (the KV cache's: the model's, or fp8): the
    model's layers, the rank's share of its KV heads."""
    return KVGeometry(
        num_layers=config.num_layers,
        num_kv_heads=kv_head_range(config.num_kv_heads, tp)[1],
        head_dim=config.head_dim,
        block_size=block_size,
        dtype=DTYPE_NAMES[dtype],
    )


def kv_cache_layout(params: EngineParams, config, max_model_len: int) -> KVCacheLayout:
    """The engine's KV cache groups (`kv.groups`): a group per kind of layer where the layers'
    windows differ or bind, as vLLM's hybrid KV cache manager forms them; one full-attention
    group of every layer (windows as masks) with --disable-hybrid-kv-cache-manager where sliding
    and global layers mix (a model whose layers all share one window keeps its window group, as
    in vLLM), and with a connector that does not move every group (`hybrid_unsupported`).
    --no-disable-hybrid-kv-cache-manager there is refused in one line, as vLLM refuses it."""
    windows = layer_windows(config, max_model_len)
    flag = params.disable_hybrid_kv_cache_manager
    reason = hybrid_unsupported(params)
    if flag is False and reason is not None:
        raise ConfigError(f"--no-disable-hybrid-kv-cache-manager: {reason}")
    # vLLM's unified layout (the flag): full attention where sliding and global layers mix; a
    # model whose layers all attend within one window keeps its window group.
    layout = plan_layout(windows, hybrid=not flag)
    if layout.hybrid and reason is not None:
        return single_group(config.num_layers)
    return layout


def hybrid_unsupported(params: EngineParams) -> str | None:
    """Why the engine keeps one KV cache group, or None. As vLLM 0.33: a connector that does not
    move every group (`KVConnector.groups_unsupported`, vLLM's `SupportsHMA`: LMCache's is not in
    its peer key modes; the OffloadingConnector, and LMCache's in kvtool's blake3 mode, are),
    whatever the model."""
    ktc = params.kv_transfer_config
    if ktc is not None and ktc.kv_connector is not None:
        from kvtool.engine.connectors.registry import resolve_connector

        reason = resolve_connector(ktc).groups_unsupported(ktc)
        if reason is not None:
            return f"{ktc.kv_connector} {reason}"
    return None


def bytes_per_block(geometry: KVGeometry, layout: KVCacheLayout) -> int:
    """Bytes of one block of pages of `geometry` in `layout` (its slots, not all layers)."""
    return geometry.block_bytes(layout.num_slots)


def num_kv_blocks(params: EngineParams, config, dtype: torch.dtype, max_model_len: int, available: list[int],
                  layout: KVCacheLayout | None = None) -> int:
    """KV blocks per rank (--num-gpu-blocks when given) of pages of `dtype` (the KV cache's) in
    `layout` (default: one group); available: each rank's bytes for KV pages."""
    if params.num_gpu_blocks is not None:
        return params.num_gpu_blocks
    geometry = rank_kv_geometry(config, params.block_size, dtype, TPRank(params.tensor_parallel_size, 0))
    per_block = bytes_per_block(geometry, layout or single_group(geometry.num_layers))
    n = min(available) // per_block
    # More blocks than any set of max_num_seqs full-length requests can use is waste.
    cap = params.max_num_seqs * -(-max_model_len // geometry.block_size) * (layout.num_groups if layout else 1) + 1
    n = min(n, cap)
    if n < 1:
        raise ConfigError(
            f"no room for KV blocks ({per_block} bytes each); "
            "raise --kv-cache-memory / --gpu-memory-utilization or set --num-gpu-blocks"
        )
    return n
