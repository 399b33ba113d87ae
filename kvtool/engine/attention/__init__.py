"""Attention over the paged KV cache.

Models call `attend(layer, q, k, v, scale)` with the new tokens' rotated q [T, Hq, D] and
k, v [T, Hkv, D]. It writes k and v into the pages at the step's slots, runs attention for
every sequence of the batch, and returns [T, Hq * D]. The backend is chosen from data.
"""

from __future__ import annotations

import torch

from kvtool.engine.attention.context import (
    AttentionMetadata,
    SeqSpan,
    attention_context,
    current_metadata,
)
from kvtool.engine.attention.reference import paged_attention_reference

__all__ = ["AttentionMetadata", "SeqSpan", "attention_context", "attend"]


def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Store k/v of the new tokens, attend, return [T, Hq * D]."""
    meta = current_metadata()
    if meta.hooks is not None:
        meta.hooks.before_layer(layer)
    meta.kv_pages.write(layer, k, v, meta.slot_block_ids, meta.slot_offsets)
    out = paged_attention_reference(meta, layer, q, scale)
    if meta.hooks is not None:
        meta.hooks.after_layer(layer)
    return out.reshape(out.shape[0], -1)
