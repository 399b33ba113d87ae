"""Fused kernels for CUDA models, applied from outside the model (gpt-fast style).

The models stay plain PyTorch. On a CUDA device with bf16/fp16 weights and the CUDA attention
backend, `models.fast_paths.apply_fast_paths` calls `apply_fused_ops(model)`, which sets each
module's `fast_forward` field (and the LM head's `logits_product`) to the forwards below:

* RMSNorm: one Triton kernel instead of seven eager ops, and the residual add before each norm
  in the same kernel (the decoder loop is replaced by one that carries the residual, and that
  computes the last layer for a step's sampled rows alone when the runner passes them);
* attention (Llama, Mistral, Qwen2, Qwen3, Gemma 2 and 3): q/k/v projections as one GEMM over a
  concatenated weight and bias (Qwen2's q/k/v biases; the three parameters become views of
  them), then one kernel that splits q/k/v, applies Qwen3's or Gemma 3's per-head q/k RMSNorm
  and RoPE (a Gemma 3 local layer's own), and writes q, k, v contiguous (eager: 14 kernels), and
  k, v into the KV pages at the step's slots as well (the separate store kernel is skipped; into
  fp8 pages quantised as `triton_ops.store_kv` does); the layer's window and score cap go to the
  attention kernels;
* gated MLP: gate and up as one GEMM, then one SiLU-times-up kernel (Gemma's GeGLU: a gelu-tanh
  one);
* Gemma's decoder (`gemma`): its (1 + w) norms in float32, each block's output norm, the
  residual add and the next norm in one kernel (two per layer), the embedding scaled as its
  forward scales it; Gemma 2's logit cap stays in `compute_logits`;
* MoE block (Mixtral, Qwen3-MoE): the router through `linear`, the routing in torch ops, the
  experts through `kernels.fused_moe` over weights stacked per block (`SparseMoeBlock.stack_experts`);
* every projection, the LM head's too, through `row_invariant_gemm.linear` (cuBLAS, or where the
  step asks for it a kernel whose rows do not depend on the row count: the projections read
  that from the step's `AttentionMetadata.row_invariant`, the LM head from `compute_logits`);
  the FP8 projections of an FP8 checkpoint (`fp8_linear.Fp8Linear`) through `kernels.fp8_gemm`,
  stacked the same way (their FP8 weights and scales).

On a tensor-parallel shard the row-parallel o_proj and down_proj keep their one all-reduce
(`RowParallelLinear.reduce` after the bias-free GEMM); the embedding is the module's own.

Decode steps are a few hundred kernels, so their count sets the graph replay time on small
models; prefill gains from the larger GEMMs and from fewer passes over activations. The kernels
keep the eager rounding points: norm statistics in float32 with the normalised value cast to
the activation dtype before the weight multiplies it (Gemma's: scaled by 1 + w in float32, then
cast), RoPE's two products rounded before their sum, SiLU (gelu) rounded before the product.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import nn

from kvtool.engine.kernels.attention import attend, attend_rows, current_metadata
from kvtool.engine.kernels.attention.triton_ops import page_scales, quantize_kv
from kvtool.engine.kernels.fp8_weight import Fp8Weight
from kvtool.engine.kernels.fused_moe import fused_experts
from kvtool.engine.kernels.row_invariant_gemm import linear
from kvtool.engine.kv.pages import KVPages
from kvtool.engine.models.fp8_linear import Fp8Linear, concat_fp8_linears
from kvtool.engine.models.gemma import GegluMLP, GemmaDecoderLayer, GemmaModel, GemmaRMSNorm
from kvtool.engine.models.layers import CausalLM, DecoderLayer, DecoderModel, GatedMLP, RMSNorm, concat_linear_params
from kvtool.engine.models.llama import LlamaAttention
from kvtool.engine.models.moe import SparseMoeBlock
from kvtool.engine.models.parallel import RowParallelLinear
from kvtool.engine.models.quantization import FP8_DTYPE


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, y_ptr, stride_x, stride_y, n, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    o = tl.arange(0, BLOCK)
    mask = o < n
    x = tl.load(x_ptr + row * stride_x + o, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / n + eps)
    normed = (xf * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + o, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * stride_y + o, (normed * w).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _add_rms_norm_kernel(x_ptr, d_ptr, w_ptr, h_ptr, y_ptr, n, eps, BLOCK: tl.constexpr):
    """h = x + d (rounded to the activation dtype, as the eager residual add), y = RMSNorm(h) * w."""
    row = tl.program_id(0).to(tl.int64)
    o = tl.arange(0, BLOCK)
    mask = o < n
    x = tl.load(x_ptr + row * n + o, mask=mask, other=0.0)
    d = tl.load(d_ptr + row * n + o, mask=mask, other=0.0)
    h = (x.to(tl.float32) + d.to(tl.float32)).to(x.dtype)
    tl.store(h_ptr + row * n + o, h, mask=mask)
    hf = h.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(hf * hf, 0) / n + eps)
    normed = (hf * rstd).to(x.dtype).to(tl.float32)
    w = tl.load(w_ptr + o, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * n + o, (normed * w).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_mul_kernel(gu_ptr, y_ptr, stride_gu, inter, BLOCK: tl.constexpr):
    """y[t] = silu(gu[t, :inter]) * gu[t, inter:] for one row t and one column block."""
    t = tl.program_id(0).to(tl.int64)
    o = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = o < inter
    g = tl.load(gu_ptr + t * stride_gu + o, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype).to(tl.float32)
    u = tl.load(gu_ptr + t * stride_gu + inter + o, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + t * inter + o, (s * u).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gemma_normed(xf, w_ptr, o, mask, n, eps):
    """Gemma's RMSNorm of one float32 row: (x * rstd) * (1 + w), all in float32 (the caller casts)."""
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / n + eps)
    w = tl.load(w_ptr + o, mask=mask, other=0.0).to(tl.float32)
    return (xf * rstd) * (1.0 + w)


@triton.jit
def _gemma_rms_norm_kernel(x_ptr, w_ptr, y_ptr, stride_x, stride_y, n, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    o = tl.arange(0, BLOCK)
    mask = o < n
    x = tl.load(x_ptr + row * stride_x + o, mask=mask, other=0.0)
    y = _gemma_normed(x.to(tl.float32), w_ptr, o, mask, n, eps)
    tl.store(y_ptr + row * stride_y + o, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gemma_add_norms_kernel(x_ptr, d_ptr, wd_ptr, w_ptr, h_ptr, y_ptr, n, eps_d, eps, BLOCK: tl.constexpr):
    """Gemma's residual add between two of its norms: h = x + GemmaNorm(d) (weight wd), each
    rounded to the activation dtype as the eager ops round them, then y = GemmaNorm(h) (weight w)."""
    row = tl.program_id(0).to(tl.int64)
    o = tl.arange(0, BLOCK)
    mask = o < n
    x = tl.load(x_ptr + row * n + o, mask=mask, other=0.0)
    d = tl.load(d_ptr + row * n + o, mask=mask, other=0.0)
    dn = _gemma_normed(d.to(tl.float32), wd_ptr, o, mask, n, eps_d).to(x.dtype)
    h = (x.to(tl.float32) + dn.to(tl.float32)).to(x.dtype)
    tl.store(h_ptr + row * n + o, h, mask=mask)
    y = _gemma_normed(h.to(tl.float32), w_ptr, o, mask, n, eps)
    tl.store(y_ptr + row * n + o, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gelu_tanh_mul_kernel(gu_ptr, y_ptr, stride_gu, inter, BLOCK: tl.constexpr):
    """y[t] = gelu_tanh(gu[t, :inter]) * gu[t, inter:] for one row t and one column block: gelu
    with torch's constants, its 0.5 x (1 + tanh(u)) written as x / (1 + e^(-2u)) (no cancellation
    where tanh(u) nears -1), rounded before the product as eager rounds it."""
    t = tl.program_id(0).to(tl.int64)
    o = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = o < inter
    g = tl.load(gu_ptr + t * stride_gu + o, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    cube = gf * gf * gf
    inner = 0.7978845608028654 * (gf + 0.044715 * cube)
    a = (gf / (1.0 + tl.exp(-2.0 * inner))).to(g.dtype).to(tl.float32)
    u = tl.load(gu_ptr + t * stride_gu + inter + o, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + t * inter + o, (a * u).to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _norm_rope_heads(src, dst, page_dst, page_scale_ptr, w_ptr, cos1, cos2, sin1, sin2, eps, NUM_HEADS: tl.constexpr,
                     H_PAD: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
                     HAS_NORM: tl.constexpr, TO_PAGE: tl.constexpr, KV_FP8: tl.constexpr, FP8_MAX: tl.constexpr,
                     GEMMA_NORM: tl.constexpr):
    h = tl.arange(0, H_PAD)
    c = tl.arange(0, HALF_PAD)
    mask = (h < NUM_HEADS)[:, None] & (c < HALF)[None, :]
    off = h[:, None] * D + c[None, :]
    x1 = tl.load(src + off, mask=mask, other=0.0)
    x2 = tl.load(src + off + HALF, mask=mask, other=0.0)
    dtype = x1.dtype
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    if HAS_NORM:
        rstd = 1.0 / tl.sqrt((tl.sum(a * a, 1) + tl.sum(b * b, 1)) / D + eps)
        w1 = tl.load(w_ptr + c, mask=c < HALF, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + c, mask=c < HALF, other=0.0).to(tl.float32)
        if GEMMA_NORM:  # Gemma's: (x * rstd) * (1 + w) in float32, one rounding
            a = ((a * rstd[:, None]) * (1.0 + w1[None, :])).to(dtype).to(tl.float32)
            b = ((b * rstd[:, None]) * (1.0 + w2[None, :])).to(dtype).to(tl.float32)
        else:
            a = ((a * rstd[:, None]).to(dtype).to(tl.float32) * w1[None, :]).to(dtype).to(tl.float32)
            b = ((b * rstd[:, None]).to(dtype).to(tl.float32) * w2[None, :]).to(dtype).to(tl.float32)
    # x * cos + cat(-x2, x1) * sin, each product rounded as eager does
    o1 = ((a * cos1[None, :]).to(dtype).to(tl.float32) + (-b * sin1[None, :]).to(dtype).to(tl.float32)).to(dtype)
    o2 = ((b * cos2[None, :]).to(dtype).to(tl.float32) + (a * sin2[None, :]).to(dtype).to(tl.float32)).to(dtype)
    tl.store(dst + off, o1, mask=mask)
    tl.store(dst + off + HALF, o2, mask=mask)
    if TO_PAGE:
        # The token's row in the KV pages: heads dense, as in the contiguous output.
        if KV_FP8:
            page_scale = tl.load(page_scale_ptr)
            tl.store(page_dst + off, quantize_kv(o1, page_scale, page_dst, FP8_MAX), mask=mask)
            tl.store(page_dst + off + HALF, quantize_kv(o2, page_scale, page_dst, FP8_MAX), mask=mask)
        else:
            tl.store(page_dst + off, o1.to(page_dst.dtype.element_ty), mask=mask)
            tl.store(page_dst + off + HALF, o2.to(page_dst.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["layer"])
def _qkv_norm_rope_kernel(
    qkv_ptr, stride_qkv, q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, stride_cs, qw_ptr, kw_ptr, eps,
    pages_ptr, layer_off, stride_blk, stride_kv, slot_ptr, stride_slot, k_scale_ptr, v_scale_ptr, layer,
    HQ: tl.constexpr, HQ_PAD: tl.constexpr, HKV: tl.constexpr, HKV_PAD: tl.constexpr,
    D: tl.constexpr, DP: tl.constexpr, HAS_NORM: tl.constexpr, TO_PAGES: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    KV_FP8: tl.constexpr, FP8_MAX: tl.constexpr, GEMMA_NORM: tl.constexpr,
):
    """One token: q and k rotated (after their per-head RMSNorm for Qwen3, or Gemma's with
    GEMMA_NORM), v copied; all
    contiguous out, and with TO_PAGES k and v also written at the token's page slot (a negative
    slot, a CUDA graph's padding row, writes nothing there): the step's separate store kernel
    is then not needed. With KV_FP8 the page values are quantised with the layer's scales, from
    the rounded k and v the contiguous outputs hold, as `triton_ops.store_kv` quantises them."""
    t = tl.program_id(0).to(tl.int64)
    HALF: tl.constexpr = D // 2
    HALF_PAD: tl.constexpr = DP // 2
    c = tl.arange(0, HALF_PAD)
    c_ok = c < HALF
    cs = t * stride_cs
    cos1 = tl.load(cos_ptr + cs + c, mask=c_ok, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + cs + HALF + c, mask=c_ok, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + cs + c, mask=c_ok, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + cs + HALF + c, mask=c_ok, other=0.0).to(tl.float32)
    row = qkv_ptr + t * stride_qkv
    to_page = False
    page_row = pages_ptr
    if TO_PAGES:
        slot = tl.load(slot_ptr + t * stride_slot).to(tl.int64)
        to_page = slot >= 0
        safe = tl.maximum(slot, 0)
        page_row = pages_ptr + layer_off + (safe // BLOCK_SIZE) * stride_blk + (safe % BLOCK_SIZE) * (HKV * D)
    _norm_rope_heads(row, q_ptr + t * HQ * D, q_ptr, k_scale_ptr, qw_ptr, cos1, cos2, sin1, sin2, eps, HQ, HQ_PAD,
                     D, HALF, HALF_PAD, HAS_NORM, False, False, FP8_MAX, GEMMA_NORM)
    hv = tl.arange(0, HKV_PAD)
    d = tl.arange(0, DP)
    vmask = (hv < HKV)[:, None] & (d < D)[None, :]
    voff = hv[:, None] * D + d[None, :]
    vrow = tl.load(row + (HQ + HKV) * D + voff, mask=vmask)
    tl.store(v_ptr + t * HKV * D + voff, vrow, mask=vmask)
    if to_page:
        _norm_rope_heads(row + HQ * D, k_ptr + t * HKV * D, page_row, k_scale_ptr + layer, kw_ptr, cos1, cos2, sin1,
                         sin2, eps, HKV, HKV_PAD, D, HALF, HALF_PAD, HAS_NORM, True, KV_FP8, FP8_MAX, GEMMA_NORM)
        if KV_FP8:
            tl.store(page_row + stride_kv + voff, quantize_kv(vrow, tl.load(v_scale_ptr + layer), page_row, FP8_MAX),
                     mask=vmask)
        else:
            tl.store(page_row + stride_kv + voff, vrow, mask=vmask)
    else:
        _norm_rope_heads(row + HQ * D, k_ptr + t * HKV * D, page_row, k_scale_ptr, kw_ptr, cos1, cos2, sin1, sin2,
                         eps, HKV, HKV_PAD, D, HALF, HALF_PAD, HAS_NORM, False, False, FP8_MAX, GEMMA_NORM)


def _norm_rows(kernel, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`kernel` (a row norm: one program per row) over the last dim of x [..., N]. Returns x's shape."""
    n = x.shape[-1]
    rows = x.reshape(-1, n)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        block = triton.next_power_of_2(n)
        kernel[(rows.shape[0],)](
            rows, weight, y, rows.stride(0), n, n, eps, BLOCK=block, num_warps=min(16, max(1, block // 256))
        )
    return y


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x [..., N] (x and weight of one dtype). Returns x's shape."""
    return _norm_rows(_rms_norm_kernel, x, weight, eps)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and the next RMSNorm in one pass: (x + delta, RMSNorm(x + delta)), [T, N] each."""
    x, delta = x.contiguous(), delta.contiguous()
    t, n = x.shape
    h = torch.empty_like(x)
    y = torch.empty_like(x)
    if t:
        block = triton.next_power_of_2(n)
        _add_rms_norm_kernel[(t,)](x, delta, weight, h, y, n, eps, BLOCK=block, num_warps=min(16, max(1, block // 256)))
    return h, y


def gemma_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm (scaling by 1 + weight in float32, then the cast) over the last dim of x
    [..., N]. Returns x's shape."""
    return _norm_rows(_gemma_rms_norm_kernel, x, weight, eps)


def gemma_add_norms(x: torch.Tensor, delta: torch.Tensor, delta_weight: torch.Tensor, delta_eps: float,
                    weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Gemma's residual add, between the norm of the block's output and the next norm, in one
    pass: (h = x + GemmaNorm(delta), GemmaNorm(h)), [T, N] each."""
    x, delta = x.contiguous(), delta.contiguous()
    t, n = x.shape
    h = torch.empty_like(x)
    y = torch.empty_like(x)
    if t:
        block = triton.next_power_of_2(n)
        _gemma_add_norms_kernel[(t,)](x, delta, delta_weight, weight, h, y, n, delta_eps, eps, BLOCK=block,
                                      num_warps=min(16, max(1, block // 256)))
    return h, y


def _gated(kernel, gate_up: torch.Tensor) -> torch.Tensor:
    """`kernel` (act(gate) * up, one program per row and 1024 columns) of gate_up [T, 2I] (gate
    first; rows may be strided). Returns [T, I]."""
    t, two_i = gate_up.shape
    inter = two_i // 2
    if gate_up.stride(1) != 1:
        gate_up = gate_up.contiguous()
    y = torch.empty((t, inter), dtype=gate_up.dtype, device=gate_up.device)
    if t:
        block = 1024
        kernel[(t, triton.cdiv(inter, block))](gate_up, y, gate_up.stride(0), inter, BLOCK=block, num_warps=4)
    return y


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu(gate, tanh approximation) * up of gate_up [T, 2I] (gate first). Returns [T, I]."""
    return _gated(_gelu_tanh_mul_kernel, gate_up)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of gate_up [T, 2I] (gate first; rows may be strided). Returns [T, I]."""
    return _gated(_silu_mul_kernel, gate_up)


def qkv_norm_rope(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
    q_weight: torch.Tensor | None, k_weight: torch.Tensor | None, eps: float,
    pages: torch.Tensor | None = None, layer: int = 0, slots: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None, gemma_norm: bool = False,
    page_slot: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split qkv [T, (Hq + 2 Hkv) * D], normalise q/k per head when weights are given (RMSNorm as
    `rms_norm`, or with `gemma_norm` as `gemma_rms_norm`), rotate them by cos/sin [T, D]. Returns
    contiguous q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D].

    With `pages` ([NB, 2, L, bs, Hkv, D], dense within a block's token rows) and `slots` [T]
    (flat slots, a strided view is fine; negative: skip), k and v are also written into layer `layer`'s pages
    (fp8 pages: quantised with the layer's scales of k_scale / v_scale, [L] float32); in slot
    `page_slot` of a block under a KV cache group layout (`kv.groups`; default: `layer`)."""
    t = qkv.shape[0]
    q = torch.empty((t, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    k = torch.empty((t, num_kv_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    v = torch.empty_like(k)
    if t:
        if cos.stride(1) != 1 or sin.stride(1) != 1 or cos.stride(0) != sin.stride(0):
            cos, sin = cos.contiguous(), sin.contiguous()
        has_norm = q_weight is not None
        to_pages = pages is not None
        ks = vs = qkv
        fp8_max = None
        if to_pages:
            ks, vs, fp8_max = page_scales(pages, k_scale, v_scale)
            _, _, _, block_size, hkv, d = pages.shape
            if (hkv, d) != (num_kv_heads, head_dim) or pages.stride(3) != hkv * d or pages.stride(5) != 1 \
                    or pages.stride(4) != d:
                raise ValueError("KV pages must be dense within a block's token rows and match the heads")
        _qkv_norm_rope_kernel[(t,)](
            qkv, qkv.stride(0), q, k, v, cos, sin, cos.stride(0),
            q_weight if has_norm else qkv, k_weight if has_norm else qkv, eps,
            pages if to_pages else qkv, (layer if page_slot is None else page_slot) * pages.stride(2) if to_pages else 0,
            pages.stride(0) if to_pages else 0, pages.stride(1) if to_pages else 0,
            slots if to_pages else qkv, slots.stride(0) if to_pages else 0, ks, vs, layer,
            HQ=num_heads, HQ_PAD=triton.next_power_of_2(num_heads),
            HKV=num_kv_heads, HKV_PAD=triton.next_power_of_2(num_kv_heads),
            D=head_dim, DP=triton.next_power_of_2(head_dim), HAS_NORM=has_norm, TO_PAGES=to_pages, BLOCK_SIZE=pages.shape[3] if to_pages else 1,
            KV_FP8=fp8_max is not None, FP8_MAX=fp8_max or 0.0, GEMMA_NORM=gemma_norm,
            num_warps=4,
        )
    return q, k, v


# ---- module forwards ---------------------------------------------------------------------------


def _fused_rms_forward(self: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    return rms_norm(x, self.weight, self.eps)


def _fused_gemma_norm_forward(self: GemmaRMSNorm, x: torch.Tensor) -> torch.Tensor:
    return gemma_rms_norm(x, self.weight, self.eps)


class LogitsProduct:
    """The LM head's product through `row_invariant_gemm.linear` (a model's `logits_product`)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight

    def __call__(self, hidden: torch.Tensor, row_invariant: bool) -> torch.Tensor:
        return linear(hidden, self.weight, row_invariant=row_invariant)


def _step_row_invariant() -> bool:
    """Whether the running step asks for row-invariant products (set by whoever binds its metadata)."""
    return current_metadata().row_invariant


def _project_out(proj: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """o_proj / down_proj of x; a row-parallel one sums its partial product over the ranks."""
    if isinstance(proj, RowParallelLinear):
        return proj.reduce(linear(x, proj.weight, None, row_invariant=_step_row_invariant()))
    weight = proj.fp8_weight if isinstance(proj, Fp8Linear) else proj.weight
    return linear(x, weight, proj.bias, row_invariant=_step_row_invariant())


def _stacked_weights(linears: list[nn.Module]) -> torch.Tensor | Fp8Weight:
    """The linears' weights as one [sum(out), in] operand (their own weights become views of it):
    dense, or FP8 where they are `Fp8Linear`s."""
    if all(isinstance(m, Fp8Linear) for m in linears):
        return concat_fp8_linears(linears)
    return concat_linear_params(linears, "weight")


def _fused_mlp_forward(self: GatedMLP, x: torch.Tensor) -> torch.Tensor:
    gate_up = linear(x, self.gate_up_weight, row_invariant=_step_row_invariant())
    return _project_out(self.down_proj, silu_mul(gate_up))


def _fused_geglu_forward(self: GegluMLP, x: torch.Tensor) -> torch.Tensor:
    gate_up = linear(x, self.gate_up_weight, row_invariant=_step_row_invariant())
    return _project_out(self.down_proj, gelu_tanh_mul(gate_up))


def _fused_moe_forward(self: SparseMoeBlock, x: torch.Tensor) -> torch.Tensor:
    weights, experts = self.route_logits(linear(x, self.gate.weight, row_invariant=_step_row_invariant()))
    out = fused_experts(x, self.w13, self.w2, weights, experts)
    if self.tp.size > 1:
        torch.distributed.all_reduce(out)
    return out


def qkv_projection(attn: LlamaAttention, x: torch.Tensor) -> torch.Tensor:
    """q, k and v of x [T, hidden] in one GEMM: [T, (Hq + 2 Hkv) * D]."""
    return linear(x, attn.qkv_weight, attn.qkv_bias, row_invariant=_step_row_invariant())


def rotate_qkv(
    attn: LlamaAttention, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
    kv_pages: KVPages | None = None, slots: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`qkv_norm_rope` with the layer's heads and q/k norms; k/v also into `kv_pages` (with their
    scales) at `slots` when given. cos/sin: [T, D], or a Gemma 3 decoder's [2, T, D] (`rope_tables`),
    of which the layer's own."""
    q_norm = getattr(attn, "q_norm", None)
    k_norm = getattr(attn, "k_norm", None)
    if cos.dim() == 3:
        cos, sin = cos[int(attn.local)], sin[int(attn.local)]
    pages = kv_pages.tensor if kv_pages is not None else None
    k_scale = kv_pages.k_scale if kv_pages is not None else None
    v_scale = kv_pages.v_scale if kv_pages is not None else None
    return qkv_norm_rope(
        qkv, cos, sin, attn.num_heads, attn.num_kv_heads, attn.head_dim,
        q_norm.weight if q_norm is not None else None, k_norm.weight if k_norm is not None else None,
        q_norm.eps if q_norm is not None else 0.0, pages=pages, layer=attn.layer_idx, slots=slots,
        k_scale=k_scale, v_scale=v_scale, gemma_norm=isinstance(q_norm, GemmaRMSNorm),
        page_slot=kv_pages.slot_of[attn.layer_idx] if kv_pages is not None else None,
    )


def attention_softcap(attn: LlamaAttention) -> float | None:
    """The layer's attention score cap (Gemma 2's `GemmaAttention.softcap`), or None."""
    return getattr(attn, "softcap", None)


def _rotated_into_pages(attn: LlamaAttention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """(q, k, v, whether k/v are in the pages) of x: the new K/V go straight into the pages from
    the rope kernel on the CUDA backend, after a connector's layer hook (a layerwise load of this
    layer lands before the store); `attend` calls the hook after the attention."""
    qkv = qkv_projection(attn, x)
    meta = current_metadata().for_layer(attn.layer_idx)
    db = meta.device_batch
    # While --calculate-kv-scales waits for this step's K/V, `attend` stores them after the scales.
    into_pages = db is not None and not meta.kv_pages.scales_pending
    if into_pages and meta.hooks is not None:
        meta.hooks.before_layer(attn.layer_idx)
    q, k, v = rotate_qkv(attn, qkv, cos, sin, meta.kv_pages if into_pages else None,
                         db.slot_mapping if into_pages else None)
    return q, k, v, into_pages


def _fused_attention_forward(self: LlamaAttention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    q, k, v, into_pages = _rotated_into_pages(self, x, cos, sin)
    return _project_out(self.o_proj, attend(self.layer_idx, q, k, v, self.scale, kv_stored=into_pages,
                                            window=self.sliding_window, softcap=attention_softcap(self)))


def attention_rows(attn: LlamaAttention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   rows: torch.Tensor) -> torch.Tensor:
    """The attention block of x [T, hidden] for `rows` only ([S] long, the step's sample rows):
    every row's K/V stored, attention and o_proj for `rows`. Returns [S, hidden]."""
    q, k, v, into_pages = _rotated_into_pages(attn, x, cos, sin)
    out = attend_rows(attn.layer_idx, q, k, v, attn.scale, rows, kv_stored=into_pages, window=attn.sliding_window,
                      softcap=attention_softcap(attn))
    if out.shape[0] == 0:  # no product (nor a tensor-parallel all-reduce) of no rows
        return x[:0]
    return _project_out(attn.o_proj, out)


def rope_tables(model: DecoderModel | GemmaModel, positions: torch.Tensor, dtype: torch.dtype):
    """cos and sin of the decoder's RoPE at `positions` [T]: [T, D] each, or for a Gemma 3 decoder,
    whose local layers rotate by their own RoPE, [2, T, D] each (the global layers' table, then
    the local ones'; `rotate_qkv` takes the layer's)."""
    cos, sin = model.rotary_emb(positions, dtype)
    local = getattr(model, "local_rotary_emb", None)
    if local is None:
        return cos, sin
    local_cos, local_sin = local(positions, dtype)
    return torch.stack((cos, local_cos)), torch.stack((sin, local_sin))


def decoder_input(model: DecoderModel | GemmaModel, input_ids: torch.Tensor,
                  positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The fused decoder before its first layer: (embeddings h, the first layer's normed input x,
    cos, sin), [T, hidden] x2 and the `rope_tables`. A Gemma decoder's embeddings are scaled as its
    forward scales them (by sqrt(hidden) rounded to their dtype) and normed by Gemma's norm."""
    h = model.embed_tokens(input_ids)
    cos, sin = rope_tables(model, positions, h.dtype)
    first = model.layers[0].input_layernorm
    if isinstance(model, GemmaModel):
        h = h * torch.tensor(model.embed_scale, dtype=h.dtype)
        return h, gemma_rms_norm(h, first.weight, first.eps), cos, sin
    return h, rms_norm(h, first.weight, first.eps), cos, sin


def layer_output(model: DecoderModel | GemmaModel, i: int, h: torch.Tensor,
                 attn_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer i after its attention block (attn_out: the block's output [T, hidden], o_proj
    applied): the residual adds, each fused into the RMSNorm after it, and the MLP. Returns (the
    residual stream h, the next layer's normed input x or, after the last layer, the final norm).
    A Gemma layer norms each block's output before its residual add, in the same kernel."""
    layers = model.layers
    layer = layers[i]
    after = layers[i + 1].input_layernorm if i + 1 < len(layers) else model.norm
    if isinstance(layer, GemmaDecoderLayer):
        post, pre = layer.post_attention_layernorm, layer.pre_feedforward_layernorm
        h, x = gemma_add_norms(h, attn_out, post.weight, post.eps, pre.weight, pre.eps)
        post = layer.post_feedforward_layernorm
        return gemma_add_norms(h, layer.mlp(x), post.weight, post.eps, after.weight, after.eps)
    post = layer.post_attention_layernorm
    h, x = add_rms_norm(h, attn_out, post.weight, post.eps)
    return add_rms_norm(h, layer.mlp(x), after.weight, after.eps)


def attention_output(attn: LlamaAttention, out: torch.Tensor) -> torch.Tensor:
    """o_proj of the attention's rows out [T, Hq, D] (a row-parallel one all-reduced)."""
    return _project_out(attn.o_proj, out.reshape(out.shape[0], -1))


def _fused_decoder_forward(self: DecoderModel | GemmaModel, input_ids: torch.Tensor, positions: torch.Tensor,
                           rows: torch.Tensor | None = None) -> torch.Tensor:
    """The decoder loop with each residual add fused into the RMSNorm that follows it (the
    layers' own norms and the final one): two kernels fewer per layer, the same rounding (a Gemma
    layer's four norms: two kernels per layer, `layer_output`).

    With `rows` ([S] long: the step's sample rows, whose batch the step's `DeviceBatch.sampled`
    describes) the last layer stores every row's K/V and computes the rest for those rows alone,
    and the result is theirs, [S, hidden]: a prefill of N tokens samples one, so N - 1 rows of the
    last layer's attention, o_proj and MLP are skipped (a chunk that samples nothing skips them
    all). Each of those kernels computes a row the same way whatever rows come with it, so the
    sampled rows keep their bits."""
    h, x, cos, sin = decoder_input(self, input_ids, positions)
    last = len(self.layers) - 1
    for i, layer in enumerate(self.layers):
        if i == last and rows is not None:
            attn_out = attention_rows(layer.self_attn, x, cos, sin, rows)
            if rows.shape[0] == 0:
                return attn_out
            h = h.index_select(0, rows)
        else:
            attn_out = layer.self_attn(x, cos, sin)
        h, x = layer_output(self, i, h, attn_out)
    return x


def can_fuse(model: nn.Module) -> bool:
    """Whether the model's parameters are all on CUDA in bf16/fp16 (the kernels' only case), FP8
    projection weights (`Fp8Linear`) aside."""
    params = list(model.parameters())
    return bool(params) and all(p.is_cuda and p.dtype in (torch.bfloat16, torch.float16, FP8_DTYPE) for p in params)


class FusedModules(NamedTuple):
    """What `apply_fused_ops` set, for `FastPaths`."""

    attention: int  # attention blocks on a q/k/v GEMM and the norm-rope-store kernel
    num_attention: int  # attention blocks in all (one of an odd head_dim keeps its own forward)
    mlps: int  # gate/up GEMM + SiLU kernel (Gemma's: + GeGLU kernel)
    moe: int  # MoE blocks on the fused experts
    decoder: bool  # the decoder loop with the residual adds in the norms (`_fused_decoder_forward`)


def apply_fused_ops(model: CausalLM) -> FusedModules:
    """Set the model's norms, attention blocks, MLPs, decoder loop and LM head to the fused
    kernels (their `fast_forward` / `logits_product` fields). Returns what it set."""
    attention = num_attention = mlps = moe = 0
    decoder = False
    if not model.cuda_fused_forwards:  # modules these forwards are not written for (`CausalLM`)
        return FusedModules(attention, num_attention, mlps, moe, decoder)
    for module in model.modules():
        if isinstance(module, CausalLM):
            weight = module.model.embed_tokens.weight if module.lm_head is None else module.lm_head.weight
            module.logits_product = LogitsProduct(weight)
        elif (isinstance(module, DecoderModel) and all(type(layer) is DecoderLayer for layer in module.layers)
              or isinstance(module, GemmaModel)):
            # Its pieces (`decoder_input`, `layer_output`) also serve prefill_graphs.
            module.fast_forward = _fused_decoder_forward
            decoder = True
        elif isinstance(module, Fp8Linear):
            module.fp8_weight = module.fp8()  # o_proj, down_proj (q/k/v, gate/up: stacked below)
        elif isinstance(module, RMSNorm):
            module.fast_forward = _fused_rms_forward
        elif isinstance(module, GemmaRMSNorm):
            module.fast_forward = _fused_gemma_norm_forward
        elif isinstance(module, GegluMLP):
            module.gate_up_weight = _stacked_weights([module.gate_proj, module.up_proj])
            module.fast_forward = _fused_geglu_forward
            mlps += 1
        elif isinstance(module, GatedMLP):
            module.gate_up_weight = _stacked_weights([module.gate_proj, module.up_proj])
            module.fast_forward = _fused_mlp_forward
            mlps += 1
        elif isinstance(module, SparseMoeBlock):
            module.w13, module.w2 = module.stack_experts()
            module.fast_forward = _fused_moe_forward
            moe += 1
        elif isinstance(module, LlamaAttention):
            num_attention += 1
            if module.head_dim % 2 == 0:
                projections = [module.q_proj, module.k_proj, module.v_proj]
                module.qkv_weight = _stacked_weights(projections)
                module.qkv_bias = concat_linear_params(projections, "bias")
                module.fast_forward = _fused_attention_forward
                attention += 1
    return FusedModules(attention, num_attention, mlps, moe, decoder)
