"""Attention over the paged KV cache.

Models call `attend(layer, q, k, v, scale)` with the new tokens' rotated q [T, Hq, D] and
k, v [T, Hkv, D]. It writes k and v into the pages at the step's slots, runs attention for
every sequence of the batch, and returns [T, Hq * D].

The backend is chosen once from data (`select_backend`: device, dtype, head_dim, whether Triton
imports); the runner then builds the step's metadata for that backend, and
`attend` follows the metadata: a `device_batch` means the CUDA kernels; none means torch's
flash kernel on CPU (`cpu_flash`), or the reference (gather + SDPA per sequence) elsewhere.

The last layer calls `attend_rows` with the step's sampled rows: it stores every new token's
k/v and attends for those rows alone (the rest of the layer only needs theirs). On CUDA the
step's `DeviceBatch.sampled` describes those rows to the kernels; each row keeps its bits, since
no kernel's row depends on the rows computed with it.

On CPU the model may pad the step to a multiple of ROW_MULTIPLE rows (BLAS computes fewer rows
with other kernels, see `cpu_flash`); rows past the step's tokens are never stored and attend to
nothing.

A layer of a sliding-window model passes `window` W: each query row at position p sees the keys
at positions (p - W, p] only (transformers' and vLLM's reading of `sliding_window`). The CPU
paths apply it as a mask over the keys they read, which stay in the pages. A layer may also
pass `softcap` c (Gemma 2): its scores become tanh(s / c) * c before the mask and the softmax.
Every path takes both: the CPU ones and the reference as masks and caps over the scores they
compute, the CUDA kernels (`cuda`) as compile-time constants of the layer's kernels.
"""

from __future__ import annotations

from typing import Literal

import torch

from kvtool.engine.kernels.attention.context import (
    AttentionMetadata,
    DeviceBatch,
    PrefillBatch,
    SeqSpan,
    attention_context,
    current_metadata,
)
from kvtool.engine.kernels.attention.cpu_flash import ROW_MULTIPLE, cpu_flash_attention, cpu_flash_rows
from kvtool.engine.kernels.attention.reference import paged_attention_reference

__all__ = [
    "AttentionMetadata",
    "DeviceBatch",
    "PrefillBatch",
    "ROW_MULTIPLE",
    "SeqSpan",
    "attention_context",
    "attend",
    "attend_rows",
    "current_metadata",
    "select_backend",
]

Backend = Literal["reference", "cuda"]

_cuda_attention = None  # kvtool.engine.kernels.attention.cuda.cuda_attention, once the CUDA backend is chosen


_FP8_PAGES = (torch.float8_e4m3fn, torch.float8_e5m2)


def select_backend(
    device: torch.device, dtype: torch.dtype, head_dim: int, model_dtype: torch.dtype | None = None,
) -> Backend:
    """'cuda' for a CUDA device with bf16/fp16 pages (`dtype`), or fp8 pages on a GPU that
    converts to fp8 (compute capability 8.9 on) with a bf16/fp16 model (`model_dtype`, when
    given: the kernels compute in q's dtype), an even head_dim in [16, 256] (the kernels pad one
    that is not a power of two, such as Phi-3's 96, to the next), and Triton importable;
    'reference' otherwise."""
    global _cuda_attention
    if device.type != "cuda":
        return "reference"
    if dtype in _FP8_PAGES:
        if model_dtype not in (None, torch.bfloat16, torch.float16):
            return "reference"
        if torch.cuda.get_device_capability(device) < (8, 9):
            return "reference"
    elif dtype not in (torch.bfloat16, torch.float16):
        return "reference"
    if head_dim < 16 or head_dim > 256 or head_dim % 2:
        return "reference"
    try:
        from kvtool.engine.kernels.attention.cuda import cuda_attention
    except ImportError:
        return "reference"
    _cuda_attention = cuda_attention
    return "cuda"


def attend(
    layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, kv_stored: bool = False,
    window: int | None = None, softcap: float | None = None,
) -> torch.Tensor:
    """Store k/v of the new tokens, attend, return [T, Hq * D].

    `kv_stored`: the caller already wrote k/v into the pages at the step's slots (the CUDA rope
    kernel does), after calling the layer's `before_layer` hook itself. `window`: the layer's
    sliding window (None: full attention); `softcap`: its score cap (None: none)."""
    meta = current_metadata().for_layer(layer)
    if meta.hooks is not None and not kv_stored:
        meta.hooks.before_layer(layer)
    if meta.device_batch is not None:
        out = _cuda_attention(meta, layer, q, k, v, scale, kv_stored, window=window, softcap=softcap)
    else:
        n = meta.slot_block_ids.numel()
        meta.kv_pages.write(layer, k[:n], v[:n], meta.slot_block_ids, meta.slot_offsets)
        if q.device.type == "cpu" and (meta.kv_pages.tensor.dtype == q.dtype or meta.kv_pages.quantized):
            out = cpu_flash_attention(meta, layer, q, k, v, scale, window, softcap)
        else:
            out = paged_attention_reference(meta, layer, q, scale, window, softcap)
    if meta.hooks is not None:
        meta.hooks.after_layer(layer)
    return out.reshape(out.shape[0], -1)


def attend_rows(
    layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, rows: torch.Tensor,
    kv_stored: bool = False, window: int | None = None, softcap: float | None = None,
) -> torch.Tensor:
    """`attend` with only the query rows `rows` ([S] long) wanted: stores every new token's k/v
    (unless `kv_stored`, as for `attend`), attends for `rows` alone. On CPU (float32 pages)
    returns [S rounded up to ROW_MULTIPLE, Hq * D], zero past S; on CUDA [S, Hq * D], where
    `rows` must be the step's sample rows (the rows of its `DeviceBatch.sampled`)."""
    meta = current_metadata().for_layer(layer)
    if meta.hooks is not None and not kv_stored:
        meta.hooks.before_layer(layer)
    db = meta.device_batch
    if db is not None:
        if db.sampled is None:
            raise RuntimeError("attend_rows on CUDA needs the step's batch of its sampled rows")
        out = _cuda_attention(meta, layer, q.index_select(0, rows), k, v, scale, kv_stored, batch=db.sampled,
                              window=window, softcap=softcap)
    else:
        n = meta.slot_block_ids.numel()
        meta.kv_pages.write(layer, k[:n], v[:n], meta.slot_block_ids, meta.slot_offsets)
        out = cpu_flash_rows(meta, layer, q, rows, scale, window, softcap)
    if meta.hooks is not None:
        meta.hooks.after_layer(layer)
    return out.reshape(out.shape[0], q.shape[1] * q.shape[2])
