"""Attention on CUDA over the block-major pages.

Per step and layer: one Triton kernel stores the new tokens' K/V; the decode rows (q_len == 1)
go through the Triton split-KV paged kernel; the prefill rows go through

* cuDNN-backed SDPA (torch's default choice on Hopper) when one sequence with nothing in the
  pages before it is the whole prefill part: plain causal attention over its own K/V;
* FlashAttention-2 varlen otherwise, bottom-right causal (`window_size=(-1, 0)`), over the new
  K/V, or over K/V gathered from the pages when some sequence has a cached prefix (torch 2.11's
  varlen attention takes no block table).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.varlen import varlen_attn

from kvtool.engine.attention import triton_ops
from kvtool.engine.attention.context import AttentionMetadata


def cuda_attention(meta: AttentionMetadata, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Store k/v [T, Hkv, D] of the new tokens, attend with q [T, Hq, D]. Returns [T, Hq, D]."""
    db = meta.device_batch
    pages = meta.kv_pages.tensor
    triton_ops.store_kv(pages, layer, k, v, db.slot_mapping)
    nd = db.num_decode
    p = db.prefill
    if nd == 0 and p is not None and p.single_causal:
        return causal_attention(q, k, v, scale)
    out = torch.empty_like(q)
    if nd:
        triton_ops.paged_decode(q[:nd], pages, layer, db.block_table, db.context_lens, scale, db.num_splits, out[:nd])
    if p is not None:
        qs = q[p.q_start :]
        if p.single_causal:
            o = causal_attention(qs, k[p.q_start :], v[p.q_start :], scale)
        else:
            if p.key_slots is not None:
                kk, vv = triton_ops.gather_kv(pages, layer, p.key_slots)
            else:
                kk, vv = k[p.q_start :], v[p.q_start :]
            o = varlen_attn(qs, kk, vv, p.cu_q, p.cu_k, p.max_q, p.max_k, scale=scale, window_size=(-1, 0))
        out[p.q_start :] = o
    return out


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of one sequence: q [S, Hq, D], k/v [S, Hkv, D]. Returns [S, Hq, D] (a view)."""
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        k.transpose(0, 1).unsqueeze(0),
        v.transpose(0, 1).unsqueeze(0),
        is_causal=True,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return o[0].transpose(0, 1)
