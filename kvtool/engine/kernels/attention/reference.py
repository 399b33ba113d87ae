"""Reference paged attention in plain torch (CPU and CUDA): gather the pages, causal SDPA."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvtool.engine.kernels.attention.context import AttentionMetadata


def paged_attention_reference(
    meta: AttentionMetadata, layer: int, q: torch.Tensor, scale: float, window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attention of the packed queries q [T, Hq, D] over each sequence's pages. Returns [T, Hq, D].

    The new tokens' K/V must already be in the pages. Causality is bottom-right aligned: query
    row i of a sequence sits at absolute position ctx_len - q_len + i. With `window` W a row at
    position p sees the keys at (p - W, p] only; with `softcap` c the scores are tanh(s / c) * c
    (computed as transformers' eager attention: products, cap, mask, float32 softmax).
    """
    out = torch.empty_like(q)
    num_heads = q.shape[1]
    for s in meta.seqs:
        k, v = meta.kv_pages.read_layer(layer, s.block_ids, s.ctx_len, q.dtype)  # [C, Hkv, D]
        qs = q[s.q_start : s.q_start + s.q_len].transpose(0, 1)  # [Hq, Q, D]
        k = k.transpose(0, 1)
        v = v.transpose(0, 1)
        # Grouped-query attention inside SDPA, as transformers computes it (same rounding).
        gqa = num_heads != k.shape[0]
        if softcap is not None:
            pos_q = torch.arange(s.ctx_len - s.q_len, s.ctx_len, device=q.device)
            pos_k = torch.arange(s.ctx_len, device=q.device)
            allowed = pos_k[None, :] <= pos_q[:, None]
            if window is not None:
                allowed &= pos_k[None, :] > pos_q[:, None] - window
            group = num_heads // k.shape[0]
            scores = torch.matmul(qs, k.repeat_interleave(group, 0).transpose(1, 2)) * scale
            scores = torch.tanh(scores / softcap) * softcap
            scores = scores.masked_fill(~allowed, float("-inf"))
            p = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            o = torch.matmul(p, v.repeat_interleave(group, 0))
        elif window is not None and s.ctx_len > window:
            pos_q = torch.arange(s.ctx_len - s.q_len, s.ctx_len, device=q.device)
            pos_k = torch.arange(s.ctx_len, device=q.device)
            mask = (pos_k[None, :] <= pos_q[:, None]) & (pos_k[None, :] > pos_q[:, None] - window)
            o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
        elif s.q_len == s.ctx_len:
            o = F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        elif s.q_len == 1:
            o = F.scaled_dot_product_attention(qs, k, v, scale=scale, enable_gqa=gqa)
        else:
            pos_q = torch.arange(s.ctx_len - s.q_len, s.ctx_len, device=q.device)
            pos_k = torch.arange(s.ctx_len, device=q.device)
            mask = pos_k[None, :] <= pos_q[:, None]  # [Q, C]
            o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
        out[s.q_start : s.q_start + s.q_len] = o.transpose(0, 1)
    return out
