"""Attention on CUDA over the block-major pages.

Per step and layer: one Triton kernel stores the new tokens' K/V (or the fused rope kernel
before it did); the decode rows (q_len == 1) go through the Triton split-KV paged kernel (in
batch-invariant mode, the fixed-tile one of `triton_tiles`); the prefill rows through the prefill
kernel (`prefill`: Gluon on Hopper, Triton elsewhere), over the new K/V, or over K/V gathered
from the pages when some sequence has a cached prefix. That kernel gives each row the same bits
wherever the computation starts, so a prompt computed after a KV hit matches the same prompt
computed whole.

Every kernel takes a layer's sliding window (`window`: each row over its last W keys) and its
score cap (`softcap`, Gemma 2: scores tanh(s / c) * c before the mask and the softmax) as
compile-time constants; a layer of either runs the Triton prefill kernel, on Hopper too.

fp8 pages hold the K/V rounded (`KVPages.quantized`): a later hit reads those values back, so
the prefill rows always attend over K/V gathered from the pages, dequantised to q's dtype, the
new tokens' too (with no prefix their slots are the step's slots of the prefill rows), and a
prompt computed whole sees what it would see after a hit."""

from __future__ import annotations

import torch

from kvtool.engine.kernels.attention import triton_ops
from kvtool.engine.kernels.attention.context import AttentionMetadata, DeviceBatch
from kvtool.engine.kernels.attention.prefill import prefill_attention
from kvtool.engine.kernels.attention.triton_tiles import paged_decode_tiles


def cuda_attention(
    meta: AttentionMetadata, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
    kv_stored: bool = False, out: torch.Tensor | None = None, batch: DeviceBatch | None = None,
    window: int | None = None, softcap: float | None = None,
) -> torch.Tensor:
    """Store k/v [T, Hkv, D] of the new tokens (unless `kv_stored`), attend with q [T, Hq, D].
    Returns [T, Hq, D]: `out` when given, else a new tensor.

    `batch` (default: the step's) says which rows q holds: the step's `sampled` batch takes q of
    the sampled rows alone [S, Hq, D] (k/v are still every new token's) and returns [S, Hq, D].
    `window`: the layer's sliding window (each row attends its last `window` keys), or None;
    `softcap`: the layer's score cap (scores tanh(s / softcap) * softcap), or None."""
    db = meta.device_batch if batch is None else batch
    kv = meta.kv_pages
    pages = kv.tensor
    # The layer's scales; its K/V in its slot of a block (the layer itself with one KV cache group).
    layer_kv = {"k_scale": kv.k_scale, "v_scale": kv.v_scale, "page_slot": kv.slot_of[layer]}
    if not kv_stored:
        if kv.scales_pending:  # --calculate-kv-scales: from this step's tokens (eager: the first step is a prefill)
            real = db.slot_mapping[: k.shape[0]] >= 0
            kv.calculate_scales(layer, k[real], v[real])
        triton_ops.store_kv(pages, layer, k, v, db.slot_mapping, **layer_kv)
    nd = db.num_decode
    p = db.prefill
    if out is None:
        out = torch.empty_like(q)
    if nd and db.tile_base is not None:
        paged_decode_tiles(
            q[:nd], pages, layer, db.block_table, db.context_lens, db.tile_base, db.num_tiles, scale,
            db.num_splits, out[:nd], db.decode_order, window, softcap=softcap, **layer_kv,
        )
    elif nd:
        triton_ops.paged_decode(
            q[:nd], pages, layer, db.block_table, db.context_lens, scale, db.num_splits, out[:nd], db.decode_order,
            window, softcap=softcap, **layer_kv,
        )
    if p is not None:
        if p.key_slots is not None or kv.quantized:
            slots = p.key_slots if p.key_slots is not None else db.slot_mapping[p.q_start :]
            kk, vv = triton_ops.gather_kv(pages, layer, slots, q.dtype, **layer_kv)
        else:
            kk, vv = k[p.q_start :], v[p.q_start :]
        prefill_attention(q[p.q_start :], kk, vv, p.cu_q, p.cu_k, p.max_q, scale, out[p.q_start :], window, softcap)
    return out
