"""Triton kernels over the block-major pages: store new K/V, gather K/V, split-KV paged decode.

All kernels take the pages tensor `[num_blocks, 2, L, block_size, H, D]` with its strides, so a
layer's K and V are addressed in place (no per-layer views are materialised). Slots are flat:
`slot = block * block_size + offset`; a negative slot means "skip this row" (CUDA-graph padding).
Block offsets are widened to int64 before they are multiplied by the block stride: a block of an
8B model spans millions of elements and a cache holds tens of thousands of blocks.

fp8 pages (`KVPages.quantized`) hold fp8(clamp(x / scale, -max, max)) with one float32 scale per
layer for K and one for V (`KVPages.k_scale`, `v_scale`, [L] each); the kernels read them with
KV_FP8 set: the writers quantise (`quantize_kv`), the readers compute stored * scale in float32
and round it to q's dtype (or the output's) right after the load, then do the same math as over
pages of that dtype. Without KV_FP8 the scale pointers are never read (the pages tensor stands in
for them) and the kernels compute what they compute without scales. The layer index reaches the
kernels unspecialised, so every layer runs one compiled kernel.

A soft-capped layer (Gemma 2) passes SOFTCAP c > 0: each score s = scale * q.k becomes
tanh(s / c) * c before the mask and the softmax. The kernels then take scale / c for the factor
on q.k, take tanh of the product and multiply by c * log2(e) (`soft_cap`), so the softmax runs in
base 2 over the capped scores as it does over plain ones. With SOFTCAP 0 nothing of it is compiled.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvtool.engine.kv import dtypes

LOG2E = 1.4426950408889634


def qk_factor(scale: float, softcap: float | None) -> float:
    """The factor the attention kernels multiply q.k by: scale * log2(e) (scores in base 2), or for a
    soft-capped layer scale / softcap (the argument of the tanh, `soft_cap`)."""
    return scale * LOG2E if softcap is None else scale / softcap


@triton.jit
def tanh(x):
    """tanh of float32 x through one exp2: 1 - 2 / (e^(2x) + 1), +-1 for large |x| (never NaN)."""
    return 1.0 - 2.0 / (tl.exp2(x * 2.8853900817779268) + 1.0)


@triton.jit
def soft_cap(x, SOFTCAP: tl.constexpr):
    """The soft-capped score in base 2 from x = score / SOFTCAP: tanh(x) * SOFTCAP * log2(e)."""
    return tanh(x) * (SOFTCAP * 1.4426950408889634)


@triton.jit
def quantize_kv(x, scale, page_ptr, FP8_MAX: tl.constexpr):
    """x as fp8 pages at page_ptr store it: x / scale in float32, divided as torch divides (IEEE,
    rounded to nearest), saturated at +-FP8_MAX (NaN stays NaN), converted to the pages' dtype
    rounding to nearest even."""
    y = tl.math.div_rn(x.to(tl.float32), scale)
    y = tl.clamp(y, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    return y.to(page_ptr.dtype.element_ty, fp_downcast_rounding="rtne")


@triton.jit(do_not_specialize=["layer"])
def _store_kv_kernel(
    k_ptr, v_ptr, stride_k, stride_v,
    pages_ptr, layer_off, stride_blk, stride_kv,
    slot_ptr, stride_slot, k_scale_ptr, v_scale_ptr, layer,
    BLOCK_SIZE: tl.constexpr, HD: tl.constexpr, HD_PAD: tl.constexpr,
    KV_FP8: tl.constexpr, FP8_MAX: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t * stride_slot).to(tl.int64)
    if slot >= 0:
        blk = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        dst = pages_ptr + layer_off + blk * stride_blk + off * HD
        o = tl.arange(0, HD_PAD)
        mask = o < HD
        k = tl.load(k_ptr + t * stride_k + o, mask=mask)
        if KV_FP8:
            k = quantize_kv(k, tl.load(k_scale_ptr + layer), pages_ptr, FP8_MAX)
        tl.store(dst + o, k, mask=mask)
        v = tl.load(v_ptr + t * stride_v + o, mask=mask)
        if KV_FP8:
            v = quantize_kv(v, tl.load(v_scale_ptr + layer), pages_ptr, FP8_MAX)
        tl.store(dst + stride_kv + o, v, mask=mask)


@triton.jit(do_not_specialize=["layer"])
def _gather_kv_kernel(
    pages_ptr, layer_off, stride_blk, stride_kv,
    slot_ptr, k_out, v_out, k_scale_ptr, v_scale_ptr, layer,
    BLOCK_SIZE: tl.constexpr, HD: tl.constexpr, HD_PAD: tl.constexpr, KV_FP8: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    src = pages_ptr + layer_off + blk * stride_blk + off * HD
    o = tl.arange(0, HD_PAD)
    mask = o < HD
    row = t.to(tl.int64) * HD
    if KV_FP8:
        k = tl.load(src + o, mask=mask).to(tl.float32) * tl.load(k_scale_ptr + layer)
        v = tl.load(src + stride_kv + o, mask=mask).to(tl.float32) * tl.load(v_scale_ptr + layer)
        tl.store(k_out + row + o, k.to(k_out.dtype.element_ty), mask=mask)
        tl.store(v_out + row + o, v.to(v_out.dtype.element_ty), mask=mask)
    else:
        tl.store(k_out + row + o, tl.load(src + o, mask=mask), mask=mask)
        tl.store(v_out + row + o, tl.load(src + stride_kv + o, mask=mask), mask=mask)


@triton.jit(do_not_specialize=["layer"])
def _decode_split_kernel(
    q_ptr, stride_qt, stride_qh,
    pages_ptr, layer_off, stride_blk, stride_kv, stride_tok, stride_h,
    bt_ptr, stride_bt_row, stride_bt_col,
    ctx_ptr, stride_ctx,
    o_ptr, stride_ot, stride_oh,
    mid_o_ptr, mid_lse_ptr,
    order_ptr,
    num_q_heads, qk_scale_log2,
    k_scale_ptr, v_scale_ptr, layer,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, HAS_ORDER: tl.constexpr,
    WINDOW: tl.constexpr, KV_FP8: tl.constexpr, SOFTCAP: tl.constexpr,
):
    """One (KV head, sequence, split): online softmax over the split's tokens for all query
    heads of the KV group at once (rows padded to GROUP_PAD for tl.dot). With WINDOW > 0 the
    splits cover the last WINDOW keys only; with SOFTCAP > 0 the scores are soft-capped
    (qk_scale_log2 is then `qk_factor`'s scale / SOFTCAP).

    The grid runs KV heads fastest, then sequences in `order` (longest context first), so the
    GPU starts the longest programs first and the short ones fill the tail: programs of very
    different lengths finish close together. The order changes when a program runs, never
    what it computes."""
    kvh = tl.program_id(0)
    b = tl.program_id(1)
    if HAS_ORDER:
        b = tl.load(order_ptr + b)
    split = tl.program_id(2)
    ctx = tl.load(ctx_ptr + b * stride_ctx)
    lo = 0
    if WINDOW > 0:
        lo = tl.maximum(ctx - WINDOW, 0)
    per_split = tl.cdiv(tl.cdiv(ctx - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = lo + split * per_split
    end = tl.minimum(start + per_split, ctx)

    rows = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DP)
    d_ok = d < D
    row_mask = rows < GROUP
    out_mask = row_mask[:, None] & d_ok[None, :]
    heads = kvh * GROUP + rows
    q = tl.load(q_ptr + b * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=out_mask, other=0.0)

    m = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, DP], dtype=tl.float32)
    kv_base = pages_ptr + layer_off + kvh * stride_h
    if KV_FP8:
        ks = tl.load(k_scale_ptr + layer)
        vs = tl.load(v_scale_ptr + layer)
    for t0 in range(start, end, BLOCK_N):
        offs = t0 + tl.arange(0, BLOCK_N)
        tmask = offs < end
        blk = tl.load(bt_ptr + b * stride_bt_row + (offs // BLOCK_SIZE) * stride_bt_col, mask=tmask, other=0)
        tok = kv_base + blk.to(tl.int64) * stride_blk + (offs % BLOCK_SIZE) * stride_tok
        k = tl.load(tok[:, None] + d[None, :], mask=tmask[:, None] & d_ok[None, :], other=0.0)
        v = tl.load(tok[:, None] + stride_kv + d[None, :], mask=tmask[:, None] & d_ok[None, :], other=0.0)
        if KV_FP8:
            k = (k.to(tl.float32) * ks).to(q.dtype)
            v = (v.to(tl.float32) * vs).to(q.dtype)
        s = tl.dot(q, tl.trans(k)) * qk_scale_log2
        if SOFTCAP > 0:
            s = soft_cap(s, SOFTCAP)
        s = tl.where(tmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new

    has = l > 0
    out = acc / tl.where(has, l, 1.0)[:, None]
    if NUM_SPLITS == 1:
        dst = o_ptr + b * stride_ot + heads[:, None] * stride_oh + d[None, :]
        tl.store(dst, out.to(o_ptr.dtype.element_ty), mask=out_mask)
    else:
        idx = (b * num_q_heads + heads) * NUM_SPLITS + split
        tl.store(mid_o_ptr + idx[:, None] * D + d[None, :], out, mask=out_mask)
        lse = tl.where(has, m + tl.log2(tl.where(has, l, 1.0)), float("-inf"))
        tl.store(mid_lse_ptr + idx, lse, mask=row_mask)


@triton.jit
def _decode_combine_kernel(
    mid_o_ptr, mid_lse_ptr, o_ptr, stride_ot, stride_oh, num_q_heads,
    NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
):
    """Merge the splits of one (sequence, query head) by their log-sum-exp (base 2)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, DP)
    d_ok = d < D
    smask = s < NUM_SPLITS
    base = (b * num_q_heads + h) * NUM_SPLITS
    lse = tl.load(mid_lse_ptr + base + s, mask=smask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    denom = tl.sum(w, 0)
    o = tl.load(mid_o_ptr + (base + s)[:, None] * D + d[None, :], mask=smask[:, None] & d_ok[None, :], other=0.0)
    out = tl.sum(o * w[:, None], 0) / tl.where(denom > 0, denom, 1.0)
    tl.store(o_ptr + b * stride_ot + h * stride_oh + d, out.to(o_ptr.dtype.element_ty), mask=d_ok)


def _slot(layer: int, page_slot: int | None) -> int:
    """Where a layer's K/V sit in a block: its slot in a KV cache group layout, else the layer."""
    return layer if page_slot is None else page_slot


def _check_pages(pages: torch.Tensor) -> tuple[int, int, int, int]:
    """(block_size, heads, head_dim, layer stride) of pages [NB, 2, L, bs, H, D], checked dense inside a token."""
    _, _, _, bs, h, d = pages.shape
    if pages.stride(5) != 1 or pages.stride(4) != d or pages.stride(3) != h * d:
        raise ValueError("KV pages must be dense within a block's token rows")
    return bs, h, d, pages.stride(2)


def page_scales(
    pages: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, float | None]:
    """(K scales, V scales, saturation) as the kernels take them: for fp8 pages their [L] float32
    scales (required) and their dtype's largest finite value; for other pages the pages tensor
    twice (pointers never read) and None."""
    fp8_max = dtypes.FP8_MAX.get(str(pages.dtype).removeprefix("torch."))
    if fp8_max is None:
        return pages, pages, None
    if k_scale is None or v_scale is None:
        raise ValueError(f"{pages.dtype} KV pages need their k_scale and v_scale")
    return k_scale, v_scale, fp8_max


def store_kv(pages: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor, *,
             k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
             page_slot: int | None = None) -> None:
    """Write k, v [T, H, D] of one layer at flat slots [T] (negative: skipped); into fp8 pages
    quantised with the layer's scales of k_scale / v_scale ([L] float32, required there).
    `page_slot`: the layer's slot in a block of a KV cache group layout (`kv.groups`; default:
    the layer itself); the scales stay the layer's."""
    bs, h, d, stride_l = _check_pages(pages)
    ks, vs, fp8_max = page_scales(pages, k_scale, v_scale)
    t = k.shape[0]
    if t == 0:
        return
    k = k.reshape(t, h * d)
    v = v.reshape(t, h * d)
    if k.stride(1) != 1:
        k = k.contiguous()
    if v.stride(1) != 1:
        v = v.contiguous()
    hd = h * d
    _store_kv_kernel[(t,)](
        k, v, k.stride(0), v.stride(0),
        pages, _slot(layer, page_slot) * stride_l, pages.stride(0), pages.stride(1),
        slots, slots.stride(0), ks, vs, layer,
        BLOCK_SIZE=bs, HD=hd, HD_PAD=triton.next_power_of_2(hd), KV_FP8=fp8_max is not None,
        FP8_MAX=fp8_max or 0.0,
    )


def gather_kv(
    pages: torch.Tensor, layer: int, slots: torch.Tensor, dtype: torch.dtype | None = None, *,
    k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None, page_slot: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one layer at flat slots [N] (contiguous int), as `dtype` (default: the pages'; fp8
    pages need it, and their values come back dequantised with the layer's scales of k_scale /
    v_scale, [L] float32). `page_slot` as for `store_kv`. Returns ([N, H, D], [N, H, D])."""
    bs, h, d, stride_l = _check_pages(pages)
    ks, vs, fp8_max = page_scales(pages, k_scale, v_scale)
    if dtype is None:
        if fp8_max is not None:
            raise ValueError("K/V gathered from fp8 pages need a dtype")
        dtype = pages.dtype
    n = slots.shape[0]
    k = torch.empty((n, h, d), dtype=dtype, device=pages.device)
    v = torch.empty_like(k)
    if n:
        hd = h * d
        _gather_kv_kernel[(n,)](
            pages, _slot(layer, page_slot) * stride_l, pages.stride(0), pages.stride(1), slots, k, v, ks, vs, layer,
            BLOCK_SIZE=bs, HD=hd, HD_PAD=triton.next_power_of_2(hd), KV_FP8=fp8_max is not None,
        )
    return k, v


def decode_launch(head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_N: keys per step of a program's loop, num_warps, num_stages) of the decode kernels
    for a head size. Up to 128: 64 keys, two warps, three stages, which stream the pages faster
    on an H200 than four warps and two stages for batches of 16 to 256 sequences, and as fast at
    batch 1. Past 128 (Gemma's 256), 64 keys of K and V do not fit two warps' registers (sm_90
    code spills): 32 keys, the same bytes per step as 64 keys of a 128 head. BLOCK_N divides
    the fixed-tile kernel's TILE either way."""
    return (64, 2, 3) if head_dim <= 128 else (32, 2, 3)


def choose_num_splits(batch: int, num_kv_heads: int, max_context: int, num_sms: int) -> int:
    """Splits per sequence so that the grid covers the GPU about twice, each split >= 256 tokens."""
    want = -(-2 * num_sms // max(1, batch * num_kv_heads))
    return max(1, min(want, -(-max_context // 256), 64))


def paged_decode(
    q: torch.Tensor,
    pages: torch.Tensor,
    layer: int,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_splits: int,
    out: torch.Tensor,
    order: torch.Tensor | None = None,
    window: int | None = None,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    softcap: float | None = None,
    page_slot: int | None = None,
) -> None:
    """Attention of one query token per sequence over its pages (its last `window` keys when
    given; its scores soft-capped at `softcap` when given); writes out. `page_slot` as for
    `store_kv`.

    q [B, Hq, D]; block_table [B, W] int (strided views allowed); context_lens [B] int (0 gives
    a zero row); out [B, Hq, D] in q's dtype. num_splits is fixed by the caller (a captured graph
    keeps it); empty splits exit at once. `order` [B] int32, a permutation of the rows: the
    order in which the GPU is given them (`attention.context.longest_first`); None: row order.
    fp8 pages are read dequantised to q's dtype with the layer's scales of k_scale / v_scale
    ([L] float32, required there).
    """
    bs, hkv, d, stride_l = _check_pages(pages)
    ks, vs, fp8_max = page_scales(pages, k_scale, v_scale)
    b, hq, _ = q.shape
    if b == 0:
        return
    group = hq // hkv
    if num_splits > 1:
        mid_o = torch.empty((b, hq, num_splits, d), dtype=torch.float32, device=q.device)
        mid_lse = torch.empty((b, hq, num_splits), dtype=torch.float32, device=q.device)
    else:
        mid_o = mid_lse = out  # unused
    if order is not None and order.stride(0) != 1:
        order = order.contiguous()
    block_n, num_warps, num_stages = decode_launch(d)
    _decode_split_kernel[(hkv, b, num_splits)](
        q, q.stride(0), q.stride(1),
        pages, _slot(layer, page_slot) * stride_l, pages.stride(0), pages.stride(1), pages.stride(3),
        pages.stride(4), block_table, block_table.stride(0), block_table.stride(1),
        context_lens, context_lens.stride(0),
        out, out.stride(0), out.stride(1),
        mid_o, mid_lse,
        order if order is not None else context_lens,
        hq, qk_factor(scale, softcap), ks, vs, layer,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), D=d, DP=triton.next_power_of_2(d),
        BLOCK_SIZE=bs, BLOCK_N=block_n, NUM_SPLITS=num_splits, HAS_ORDER=order is not None,
        WINDOW=window or 0, KV_FP8=fp8_max is not None, SOFTCAP=softcap or 0.0,
        num_warps=num_warps, num_stages=num_stages,
    )
    if num_splits > 1:
        _decode_combine_kernel[(b, hq)](
            mid_o, mid_lse, out, out.stride(0), out.stride(1), hq,
            NUM_SPLITS=num_splits, SPLITS_PAD=max(2, triton.next_power_of_2(num_splits)), D=d,
            DP=triton.next_power_of_2(d),
            num_warps=4,
        )
