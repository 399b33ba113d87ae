"""Batch-invariant paged decode: split-KV attention over fixed tiles of TILE tokens.

`triton_ops.paged_decode` cuts a sequence's context into as many splits as the batch leaves room
for, so the same sequence rounds differently with one neighbour than with sixty. Here the
context is cut into fixed tiles (tokens [TILE * t, TILE * t + TILE)): each tile runs its own
online softmax from scratch and writes its (output, log-sum-exp) to its own slot, and a second
kernel merges a sequence's tiles one after another in tile order. The number of programs per
sequence still follows the batch (to fill the GPU), but it only decides which program computes
which tiles, never what a tile computes: a row's bits depend on its context alone. With one
program per sequence (a large batch) and heads of up to 128, each program runs all its sequence's
tiles and folds each into the merge itself, with the merge kernel's arithmetic (`_fold_tile`): no
partials are written and no second kernel runs, and the rows keep their bits.

With a window W a row reads its last W keys, in tiles of WINDOW_TILE tokens (finer than TILE: a
window holds few tiles, and a batch of one row spreads them over its programs): the tiles from
the one holding key ctx - W on, the first masked below it; the tiles before are neither computed
nor merged. Such a layer's partials have slots of their own, WINDOW_SLOTS(W) per sequence (as
many tiles as W keys can touch), so sequence b's tiles start at b * WINDOW_SLOTS(W). What a row
gets still depends on its context and W alone.

Tile slots are flat: sequence b's tiles start at `tile_base[b]`, the exclusive prefix sum of
ceil(context / TILE) (`context.tile_bases`), so the partials take one row per tile of the batch.

fp8 pages are read as `triton_ops` reads them: each K/V tile dequantised to q's dtype after its
load (KV_FP8), the same math after that; so are soft-capped scores (SOFTCAP, `triton_ops.soft_cap`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvtool.engine.kernels.attention.context import TILE

# Tokens per tile of a sliding-window layer (a multiple of every decode BLOCK_N).
WINDOW_TILE = 128


def window_slots(window: int) -> int:
    """Tiles of WINDOW_TILE tokens that a row's last `window` keys can touch."""
    return -(-window // WINDOW_TILE) + 1
from kvtool.engine.kernels.attention.triton_ops import _check_pages, decode_launch, page_scales, qk_factor, soft_cap


@triton.jit
def _fold_tile(m, l, acc, lse, o):
    """Fold one tile's (log-sum-exp, output) into a running merge of rows [R] / [R, DP], in tile
    order. Every product and sum is written out, so the merge kernel and a program that merges its
    own tiles round alike."""
    m_new = tl.maximum(m, lse)
    alpha = tl.exp2(m - m_new)
    w = tl.exp2(lse - m_new)
    return m_new, tl.fma(l, alpha, w), tl.fma(acc, alpha[:, None], o * w[:, None])


@triton.jit(do_not_specialize=["layer"])
def _tile_partials_kernel(
    q_ptr, stride_qt, stride_qh,
    pages_ptr, layer_off, stride_blk, stride_kv, stride_tok, stride_h,
    bt_ptr, stride_bt_row, stride_bt_col,
    ctx_ptr, stride_ctx, base_ptr, stride_base,
    mid_o_ptr, mid_lse_ptr, order_ptr, o_ptr, stride_ot, stride_oh,
    num_q_heads, num_programs, qk_scale_log2,
    k_scale_ptr, v_scale_ptr, layer,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr, DP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, TILE_N: tl.constexpr, WINDOW: tl.constexpr,
    WINDOW_SLOTS: tl.constexpr, KV_FP8: tl.constexpr, SOFTCAP: tl.constexpr, MERGE: tl.constexpr,
):
    """One (KV head, sequence, program): the program's contiguous run of tiles, one partial each
    (with SOFTCAP > 0, over soft-capped scores: qk_scale_log2 is then scale / SOFTCAP). MERGE (one
    program per sequence, which then runs every tile): each tile's partial is folded into the
    merge as `_merge_tiles_kernel` folds it, and the program writes the rows' output itself."""
    kvh = tl.program_id(0)
    b = tl.load(order_ptr + tl.program_id(1))
    prog = tl.program_id(2)
    ctx = tl.load(ctx_ptr + b * stride_ctx)
    lo = 0
    if WINDOW > 0:
        lo = tl.maximum(ctx - WINDOW, 0)
    first_tile = lo // TILE_N
    per = tl.cdiv(tl.cdiv(ctx, TILE_N) - first_tile, num_programs)
    first = first_tile + prog * per
    # From the block of BLOCK_N keys holding key lo: the first block computed holds a key in the
    # window, so no row's state starts from a block it cannot see.
    start = tl.maximum(first * TILE_N, lo // BLOCK_N * BLOCK_N)
    end = tl.minimum((first + per) * TILE_N, ctx)
    if WINDOW_SLOTS > 0:  # a window's slots: the sequence's own WINDOW_SLOTS, from its first tile
        tile_base = b * WINDOW_SLOTS - first_tile
    else:
        tile_base = tl.load(base_ptr + b * stride_base)

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
    merged_m = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    merged_l = tl.zeros([GROUP_PAD], dtype=tl.float32)
    merged = tl.zeros([GROUP_PAD, DP], dtype=tl.float32)
    kv_base = pages_ptr + layer_off + kvh * stride_h
    if KV_FP8:
        ks = tl.load(k_scale_ptr + layer)
        vs = tl.load(v_scale_ptr + layer)
    # One flat loop over the run (the loads pipeline across tile edges); the state is written
    # out and reset at each tile's last block.
    for t0 in range(start, end, BLOCK_N):
        offs = t0 + tl.arange(0, BLOCK_N)
        tmask = (offs < end) & (offs >= lo)
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
        if ((t0 + BLOCK_N) % TILE_N == 0) | (t0 + BLOCK_N >= end):
            if MERGE:
                merged_m, merged_l, merged = _fold_tile(merged_m, merged_l, merged, m + tl.log2(l), acc / l[:, None])
            else:
                idx = (tile_base + t0 // TILE_N) * num_q_heads + heads
                tl.store(mid_o_ptr + idx[:, None].to(tl.int64) * D + d[None, :], acc / l[:, None], mask=out_mask)
                tl.store(mid_lse_ptr + idx, m + tl.log2(l), mask=row_mask)
            m = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
            l = tl.zeros([GROUP_PAD], dtype=tl.float32)
            acc = tl.zeros([GROUP_PAD, DP], dtype=tl.float32)
    if MERGE:
        out = merged / tl.where(merged_l > 0, merged_l, 1.0)[:, None]
        tl.store(o_ptr + b * stride_ot + heads[:, None] * stride_oh + d[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=out_mask)


@triton.jit
def _merge_tiles_kernel(
    mid_o_ptr, mid_lse_ptr, ctx_ptr, stride_ctx, base_ptr, stride_base, o_ptr, stride_ot, stride_oh,
    num_q_heads, D: tl.constexpr, DP: tl.constexpr, TILE_N: tl.constexpr, WINDOW: tl.constexpr,
    WINDOW_SLOTS: tl.constexpr,
):
    """Merge the tiles of one (sequence, query head) in tile order; no tile: a zero row."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    ctx = tl.load(ctx_ptr + b * stride_ctx)
    n = tl.cdiv(ctx, TILE_N)
    first_tile = 0
    if WINDOW > 0:
        first_tile = tl.maximum(ctx - WINDOW, 0) // TILE_N
    if WINDOW_SLOTS > 0:
        tile_base = b * WINDOW_SLOTS - first_tile
    else:
        tile_base = tl.load(base_ptr + b * stride_base)
    d = tl.arange(0, DP)
    d_ok = d < D
    m = tl.full([1], float("-inf"), dtype=tl.float32)
    l = tl.zeros([1], dtype=tl.float32)
    acc = tl.zeros([1, DP], dtype=tl.float32)
    for t in range(first_tile, n):
        idx = (tile_base + t) * num_q_heads + h
        lse = tl.load(mid_lse_ptr + idx + tl.arange(0, 1))
        o = tl.load(mid_o_ptr + idx.to(tl.int64) * D + d[None, :], mask=d_ok[None, :], other=0.0)
        m, l, acc = _fold_tile(m, l, acc, lse, o)
    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(o_ptr + b * stride_ot + h * stride_oh + d[None, :], out.to(o_ptr.dtype.element_ty), mask=d_ok[None, :])


def paged_decode_tiles(
    q: torch.Tensor,
    pages: torch.Tensor,
    layer: int,
    block_table: torch.Tensor,
    context_lens: torch.Tensor,
    tile_base: torch.Tensor,
    num_tiles: int,
    scale: float,
    num_programs: int,
    out: torch.Tensor,
    order: torch.Tensor,
    window: int | None = None,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    softcap: float | None = None,
    page_slot: int | None = None,
) -> None:
    """`triton_ops.paged_decode` with each row's bits independent of the batch (over the last
    `window` keys when given; scores soft-capped at `softcap` when given; `page_slot` as for
    `triton_ops.store_kv`).

    tile_base [B] int32 from `context.tile_bases`; num_tiles: tile slots to allocate (at least the
    batch's tiles; a window layer's slots are its own); num_programs per sequence: any value >= 1
    gives the same bits (a window layer takes up to twice as many, within its tiles); order [B]
    int32: the launch order of the rows (a permutation). fp8 pages need k_scale / v_scale ([L]
    float32), as for `paged_decode`."""
    bs, hkv, d, stride_l = _check_pages(pages)
    ks, vs, fp8_max = page_scales(pages, k_scale, v_scale)
    b, hq, _ = q.shape
    if b == 0:
        return
    group = hq // hkv
    tile_n, per_window = TILE, 0
    if window:  # its own slots and finer tiles; programs enough for a window's tiles at batch 1
        tile_n, per_window = WINDOW_TILE, window_slots(window)
        num_tiles = b * per_window
        if num_programs > 1:
            num_programs = min(per_window, 2 * num_programs)
    # One program per sequence merges its own tiles: no partials to write, no merge kernel. Not for
    # heads past 128, whose two warps hold no second [GROUP_PAD, D] state (the bits are the same).
    merge = num_programs == 1 and d <= 128
    slots = 1 if merge else max(1, num_tiles)
    mid_o = torch.empty((slots, hq, d), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty((slots, hq), dtype=torch.float32, device=q.device)
    if order.stride(0) != 1:
        order = order.contiguous()
    block_n, num_warps, num_stages = decode_launch(d)
    _tile_partials_kernel[(hkv, b, num_programs)](
        q, q.stride(0), q.stride(1),
        pages, (layer if page_slot is None else page_slot) * stride_l, pages.stride(0), pages.stride(1),
        pages.stride(3), pages.stride(4),
        block_table, block_table.stride(0), block_table.stride(1),
        context_lens, context_lens.stride(0), tile_base, tile_base.stride(0),
        mid_o, mid_lse, order, out, out.stride(0), out.stride(1),
        hq, num_programs, qk_factor(scale, softcap), ks, vs, layer,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), D=d, DP=triton.next_power_of_2(d),
        BLOCK_SIZE=bs, BLOCK_N=block_n, TILE_N=tile_n, WINDOW=window or 0, WINDOW_SLOTS=per_window,
        KV_FP8=fp8_max is not None, SOFTCAP=softcap or 0.0, MERGE=merge, num_warps=num_warps, num_stages=num_stages,
    )
    if merge:
        return
    _merge_tiles_kernel[(b, hq)](
        mid_o, mid_lse, context_lens, context_lens.stride(0), tile_base, tile_base.stride(0),
        out, out.stride(0), out.stride(1), hq, D=d, DP=triton.next_power_of_2(d), TILE_N=tile_n, WINDOW=window or 0,
        WINDOW_SLOTS=per_window, num_warps=4,
    )
