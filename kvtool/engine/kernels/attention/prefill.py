"""Prefill attention on CUDA: which kernel computes the prefill rows.

Both kernels give each row the same bits wherever the computation starts (`triton_prefill` says
how). On an H200 they also gave each other's bits on every shape checked, but nothing promises
that, so the choice depends only on what is fixed for a model's layer: the device, the dtype and
the head size. On Hopper, for 16-bit heads of 64, 128 or 256 (sliding-window and soft-capped
layers included), the Gluon kernel of `hopper_prefill`, written against the Gluon of Triton 3.6
(an experimental interface: other Triton versions keep the Triton kernel); everywhere else the
Triton kernel.
"""

from __future__ import annotations

import torch

from kvtool.engine.kernels.attention.triton_prefill import triton_prefill_attention
from kvtool.engine.kernels.gluon import gluon_module

HOPPER_PREFILL = "kvtool.engine.kernels.attention.hopper_prefill"


def uses_hopper_kernel(q: torch.Tensor) -> bool:
    """Whether the prefill rows of q's model (its device, dtype, head size) run the Gluon kernel."""
    hopper = gluon_module(HOPPER_PREFILL)
    return hopper is not None and hopper.usable(q)


def prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int,
    scale: float, out: torch.Tensor | None = None, window: int | None = None, softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of packed sequences: q [T, Hq, D], k/v [sum ctx, Hkv, D] (last dim
    contiguous), cu_q/cu_k [S + 1] int32; a sequence's query rows are the last of its keys.
    Writes and returns out [T, Hq, D]. A sliding-window layer's rows see their last `window` keys; a
    soft-capped layer's scores are tanh(s / softcap) * softcap."""
    if out is None:
        out = torch.empty_like(q)
    if q.shape[0] == 0:
        return out
    if uses_hopper_kernel(q):
        return gluon_module(HOPPER_PREFILL).hopper_prefill_attention(q, k, v, cu_q, cu_k, max_q, scale, out, window,
                                                                     softcap)
    return triton_prefill_attention(q, k, v, cu_q, cu_k, max_q, scale, out, window, softcap)
