"""Prefill attention on CUDA: which kernel computes the prefill rows.

Both kernels give each row the same bits wherever the computation starts (`triton_prefill` says
how). On an H200 they also gave each other's bits on every shape checked, but nothing promises
that, so the choice depends only on what is fixed for a model's layer: the device, the dtype, the
head size, and whether the layer has a sliding window or a soft cap. On Hopper, for 16-bit heads
of 64 or 128 in layers of neither, the Gluon kernel of `hopper_prefill`, written against the Gluon
of Triton 3.6 (an experimental interface: other Triton versions keep the Triton kernel);
everywhere else the Triton kernel.
"""

from __future__ import annotations

import torch
import triton

from kvtool.engine.kernels.attention.triton_prefill import triton_prefill_attention

_hopper = None  # the hopper_prefill module once imported; False where its Gluon is missing


def _hopper_module():
    global _hopper
    if _hopper is None:
        _hopper = False
        if triton.__version__.startswith("3.6."):
            try:
                from kvtool.engine.kernels.attention import hopper_prefill
            except ImportError:
                pass
            else:
                _hopper = hopper_prefill
    return _hopper


def uses_hopper_kernel(q: torch.Tensor) -> bool:
    """Whether the prefill rows of q's model (its device, dtype, head size) run the Gluon kernel."""
    hopper = _hopper_module()
    return bool(hopper) and hopper.usable(q)


def prefill_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor, max_q: int,
    scale: float, out: torch.Tensor | None = None, window: int | None = None, softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of packed sequences: q [T, Hq, D], k/v [sum ctx, Hkv, D] (last dim
    contiguous), cu_q/cu_k [S + 1] int32; a sequence's query rows are the last of its keys.
    Writes and returns out [T, Hq, D]. A sliding-window layer's rows (`window`) and a soft-capped
    layer's (`softcap`, its scores tanh(s / softcap) * softcap) take the Triton kernel on every GPU."""
    if out is None:
        out = torch.empty_like(q)
    if q.shape[0] == 0:
        return out
    if window is None and softcap is None and uses_hopper_kernel(q):
        return _hopper.hopper_prefill_attention(q, k, v, cu_q, cu_k, max_q, scale, out)
    return triton_prefill_attention(q, k, v, cu_q, cu_k, max_q, scale, out, window, softcap)
