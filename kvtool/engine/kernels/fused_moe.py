"""The experts of a sparse MoE block on CUDA in four Triton launches, with no host decision.

`fused_experts(x, w13, w2, topk_weights, topk_ids)` computes what `moe.SparseMoeBlock`'s loop
computes, each (token, choice) row through its expert's SwiGLU MLP, weighted and summed per token:

    align      one program: counts each expert's rows, gives each expert a run of BM-row blocks
               (`sorted_ids`: the flat row ids t * k + j of each block, padding = T * k) and
               each block its expert (`block_expert`, -1 past the last)
    gate_up    per (block, column tile): gate and up of the block's rows against their expert's
               stacked weight w13 [E, 2I, H], each rounded to the activation dtype, then
               silu(gate) * up, rounded again (the rounding steps of `silu(gate(x)) * up(x)`)
    down       per (block, column tile): act @ w2[e].T [E, H, I], one row per (token, choice)
    combine    per token: its k rows times their routing weights, each product rounded to the
               activation dtype and added in ascending expert order, rounding after each add
               (the loop's `index_add_` into zeros, expert by expert)

Every launch has a shape fixed by T (the number of blocks is bounded by cdiv(T * k, BM) + min(E,
T * k)), so the block runs inside a CUDA graph. Every product accumulates each output element in
float32 in K order, never split over K, like `row_invariant_gemm`'s kernel: a row's bits do not
depend on the rows beside it, on the block it lands in, or on the tile shape, so the experts
are row-invariant at every batch size. Which slot of its expert's run a row takes depends on
the order of the alignment's atomics; no result does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ALIGN_CHUNK = 1024  # row ids per iteration of the alignment loops
ALIGN_BLOCKS = 64  # blocks per iteration of the block-to-expert loop


@triton.jit(do_not_specialize=["num_ids", "num_blocks"])
def _align_kernel(ids_ptr, sorted_ptr, block_expert_ptr, cursor_ptr, num_ids, num_blocks,
                  E: tl.constexpr, E_POW2: tl.constexpr, BM: tl.constexpr, CHUNK: tl.constexpr,
                  BLOCKS: tl.constexpr):
    bins = tl.arange(0, E_POW2)
    o = tl.arange(0, CHUNK)
    # Every slot starts as padding.
    for start in range(0, num_blocks * BM, CHUNK):
        tl.store(sorted_ptr + start + o, num_ids, mask=start + o < num_blocks * BM)
    counts = tl.zeros((E_POW2,), dtype=tl.int32)
    for start in range(0, num_ids, CHUNK):
        valid = start + o < num_ids
        e = tl.load(ids_ptr + start + o, mask=valid, other=0).to(tl.int32)
        counts += tl.histogram(e, E_POW2)
        # Masked lanes were counted in bin 0.
        counts -= tl.where(bins == 0, tl.sum((~valid).to(tl.int32), 0), 0)
    padded = (counts + BM - 1) // BM * BM
    ends = tl.cumsum(padded, 0)
    tl.store(cursor_ptr + bins, ends - padded)
    tl.debug_barrier()
    for start in range(0, num_ids, CHUNK):
        valid = start + o < num_ids
        e = tl.load(ids_ptr + start + o, mask=valid, other=0).to(tl.int32)
        slot = tl.atomic_add(cursor_ptr + e, 1, mask=valid)
        tl.store(sorted_ptr + slot, start + o, mask=valid)
    b = tl.arange(0, BLOCKS)
    for start in range(0, num_blocks, BLOCKS):
        first = (start + b) * BM
        # A block's expert: the number of experts whose run ends at or before its first slot.
        expert = tl.sum((ends[None, :] <= first[:, None]).to(tl.int32), 1)
        tl.store(block_expert_ptr + start + b, tl.where(expert >= E, -1, expert), mask=start + b < num_blocks)


@triton.jit(do_not_specialize=["num_ids"])
def _gate_up_kernel(x_ptr, w_ptr, act_ptr, sorted_ptr, block_expert_ptr, num_ids, inter, hidden,
                    stride_x, stride_we, stride_wn, stride_act,
                    TOP_K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pb = tl.program_id(0)
    pn = tl.program_id(1)
    e = tl.load(block_expert_ptr + pb)
    if e < 0:
        return
    rows = tl.load(sorted_ptr + pb * BM + tl.arange(0, BM))
    valid = rows < num_ids
    tok = rows // TOP_K
    rn = pn * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    a_p = x_ptr + tok[:, None].to(tl.int64) * stride_x + rk[None, :]
    g_p = w_ptr + e.to(tl.int64) * stride_we + rn[:, None].to(tl.int64) * stride_wn + rk[None, :]
    u_p = g_p + inter * stride_wn
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    n_ok = rn[:, None] < inter
    for k0 in range(0, hidden, BK):
        k_ok = (k0 + rk)[None, :] < hidden
        a = tl.load(a_p, mask=valid[:, None] & k_ok, other=0.0)
        g = tl.load(g_p, mask=n_ok & k_ok, other=0.0)
        u = tl.load(u_p, mask=n_ok & k_ok, other=0.0)
        acc_g = tl.dot(a, tl.trans(g), acc_g)
        acc_u = tl.dot(a, tl.trans(u), acc_u)
        a_p += BK
        g_p += BK
        u_p += BK
    dt = act_ptr.dtype.element_ty
    gf = acc_g.to(dt).to(tl.float32)
    s = (gf / (1.0 + tl.exp(-gf))).to(dt).to(tl.float32)
    y = (s * acc_u.to(dt).to(tl.float32)).to(dt)
    c_p = act_ptr + rows[:, None].to(tl.int64) * stride_act + rn[None, :]
    tl.store(c_p, y, mask=valid[:, None] & (rn[None, :] < inter))


@triton.jit(do_not_specialize=["num_ids"])
def _down_kernel(a_ptr, w_ptr, y_ptr, sorted_ptr, block_expert_ptr, num_ids, hidden, inter,
                 stride_a, stride_we, stride_wn, stride_y,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pb = tl.program_id(0)
    pn = tl.program_id(1)
    e = tl.load(block_expert_ptr + pb)
    if e < 0:
        return
    rows = tl.load(sorted_ptr + pb * BM + tl.arange(0, BM))
    valid = rows < num_ids
    rn = pn * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    a_p = a_ptr + rows[:, None].to(tl.int64) * stride_a + rk[None, :]
    w_p = w_ptr + e.to(tl.int64) * stride_we + rn[:, None].to(tl.int64) * stride_wn + rk[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    n_ok = rn[:, None] < hidden
    for k0 in range(0, inter, BK):
        k_ok = (k0 + rk)[None, :] < inter
        a = tl.load(a_p, mask=valid[:, None] & k_ok, other=0.0)
        w = tl.load(w_p, mask=n_ok & k_ok, other=0.0)
        acc = tl.dot(a, tl.trans(w), acc)
        a_p += BK
        w_p += BK
    c_p = y_ptr + rows[:, None].to(tl.int64) * stride_y + rn[None, :]
    tl.store(c_p, acc.to(y_ptr.dtype.element_ty), mask=valid[:, None] & (rn[None, :] < hidden))


@triton.jit
def _combine_kernel(y_ptr, order_ptr, w_ptr, out_ptr, hidden, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    o = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = o < hidden
    dt = out_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        c = tl.load(order_ptr + t * TOP_K + j)
        y = tl.load(y_ptr + (t * TOP_K + c) * hidden + o, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + t * TOP_K + c).to(tl.float32)
        acc = (acc + (y * w).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    tl.store(out_ptr + t * hidden + o, acc.to(dt), mask=mask)


def tiles(num_ids: int) -> tuple[int, int, int, int, int]:
    """(BM, BN, BK, num_warps, num_stages) for a step of num_ids (token, choice) rows. Every
    choice gives the same bits (module docstring); the choice is speed alone."""
    if num_ids <= 256:
        return 16, 64, 128, 4, 4
    return 64, 64, 64, 4, 3


def align(topk_ids: torch.Tensor, num_experts: int, bm: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_ids [num_blocks * bm] int32, block_expert [num_blocks] int32) for topk_ids [T, k]."""
    ids = topk_ids.reshape(-1)
    n = ids.numel()
    num_blocks = triton.cdiv(n, bm) + min(num_experts, n)
    dev = ids.device
    sorted_ids = torch.empty(num_blocks * bm, dtype=torch.int32, device=dev)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=dev)
    e_pow2 = triton.next_power_of_2(num_experts)
    cursor = torch.empty(e_pow2, dtype=torch.int32, device=dev)
    _align_kernel[(1,)](ids, sorted_ids, block_expert, cursor, n, num_blocks, E=num_experts, E_POW2=e_pow2,
                        BM=bm, CHUNK=ALIGN_CHUNK, BLOCKS=ALIGN_BLOCKS, num_warps=4)
    return sorted_ids, block_expert


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H] (each expert's gate rows, then its up rows); w2 [E, H, I];
    topk_weights [T, k] (float32 or x's dtype) and topk_ids [T, k] -> [T, H] in x's dtype: each
    token's experts' outputs, weighted, summed in ascending expert order."""
    t, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    k = topk_ids.shape[1]
    out = torch.empty_like(x)
    if t == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    n = t * k
    bm, bn, bk, warps, stages = tiles(n)
    sorted_ids, block_expert = align(topk_ids, num_experts, bm)
    num_blocks = block_expert.shape[0]
    act = torch.empty((n, inter), dtype=x.dtype, device=x.device)
    _gate_up_kernel[(num_blocks, triton.cdiv(inter, bn))](
        x, w13, act, sorted_ids, block_expert, n, inter, hidden,
        x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        TOP_K=k, BM=bm, BN=bn, BK=bk, num_warps=warps, num_stages=stages)
    y = torch.empty((n, hidden), dtype=x.dtype, device=x.device)
    _down_kernel[(num_blocks, triton.cdiv(hidden, bn))](
        act, w2, y, sorted_ids, block_expert, n, hidden, inter,
        act.stride(0), w2.stride(0), w2.stride(1), y.stride(0),
        BM=bm, BN=bn, BK=bk, num_warps=warps, num_stages=stages)
    # Each token's choices in ascending expert order (its ids are distinct).
    order = torch.argsort(topk_ids, dim=1).to(torch.int32).contiguous()
    block = min(1024, triton.next_power_of_2(hidden))
    _combine_kernel[(t, triton.cdiv(hidden, block))](y, order, topk_weights.contiguous(), out, hidden,
                                                     TOP_K=k, BLOCK=block, num_warps=4)
    return out
