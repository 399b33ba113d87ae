"""Products of FP8 checkpoint weights on CUDA: float8_e4m3fn tensor cores, rows independent of the row count.

A projection of an FP8 checkpoint keeps its weight as stored (`Fp8Weight`: float8_e4m3fn [N, K]
and its float32 scales) and `fp8_mm(x, w)` multiplies activations [M, K] by it in two Triton
kernels (the activations quantised, then the product), the scheme of the block-wise FP8
releases (DeepSeek, Qwen) as vLLM and transformers' fine-grained FP8 compute it:

    for each K group of GROUP (128) columns, in K order:
        the activations' group is quantised per row: scale s_a = max(|x|, 1e-10) / 448, x / s_a in FP8
        acc = fma(dot(x_fp8, w_fp8), s_a[row] * s_w[col, group], acc)   (the dot on the tensor cores)

The scales are multiplied first and the product folded in with one rounding: the arithmetic of
cuBLAS's block-scaled FP8 product (`torch._scaled_mm` with 1 x 128 and 128 x 128 scales): on an
H100 every float32 output of cuBLAS's product of Qwen3-8B's gate/up at 1024 rows equalled this
fold of its own per-group products (`gpu-bench.py fp8-kernels`), and test_fp8_gemm_cuda.py checks
cuBLAS's rows against the kernels' on the GPU it runs on, so products of many rows can run there.

Weight scales are per block (`weight_block_size`, the block's K side a multiple of GROUP), per
output channel, or per tensor (given as one scale per channel). Activations are always quantised
per row and group, finer than a checkpoint's per-token scheme asks, never coarser.

Every output element is one float32 sum over the groups in K order, each group's dot computed
alone and scaled before it is added: nothing depends on the tile shape or on the rows beside
a row, so one kernel serves every row count (a decode step, a prefill, a full hit's last rows)
with the same bits. That holds for the warpgroup MMA of row tiles of MIN_BM rows and more; the
mma.sync that smaller tiles run rounds a group's dot otherwise, so no tile is smaller. The tensor
cores read half the weight bytes of bf16 and run FP8 at twice bf16's rate, so both decode
(bandwidth-bound) and prefill (compute-bound) gain.

With SPLIT_PROGRAMS set (off by default, see there), a weight whose column tiles would give a
decode step a program or so per SM (`k_split`: Qwen3-8B's q/k/v, o_proj and down_proj) has each
tile's K groups spread over a fixed number of programs at up to SPLIT_PARALLEL_ROWS rows: each
writes its groups' products unscaled (float32), and the tile's last program to finish, counted
by an atomic, folds them all in K order with the scales as above.
A group's product is the same wherever it is computed, so the sum is the one a single program
makes: K is never summed in parts.

On Hopper, products of CUBLAS_MIN_ROWS rows and more (a prefill's) of a weight whose scales are
128 x 128 blocks run on cuBLAS (`cublas_usable`); others of HOPPER_MIN_ROWS rows and more run
`hopper_fp8_gemm`, the same arithmetic in a warp-specialised Gluon kernel whose tensor cores do
not wait while a group's product is scaled.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvtool.engine.kernels.fp8_weight import GROUP, Fp8Weight
from kvtool.engine.kernels.gluon import gluon_module, is_hopper
from kvtool.engine.kernels.tiles import grouped_tile, sm_count, split_launch

HOPPER_FP8_GEMM = "kvtool.engine.kernels.hopper_fp8_gemm"

# Row counts that between them reach every tile configuration of `config_for`, with K spread over
# parts and not (the runner's warm-up compiles them before the first request).
WARM_UP_ROWS = (1, 9, 65, 257)
# Row tiles of fewer rows run the FP8 dot as mma.sync, whose sums round otherwise than the
# warpgroup MMA of larger tiles: every configuration keeps at least this many rows.
MIN_BM = 64
# Groups one program of the activations' quantisation takes (a row's 1024 columns).
QUANTIZE_GROUPS = 8


@triton.jit
def _quantize_group(x):
    """x [R, G] float32, one group per row: (x / s in FP8, s) with s = max(|x|, 1e-10) / 448 per row."""
    scale = tl.maximum(tl.max(tl.abs(x), 1), 1e-10) / 448.0
    return tl.clamp(x / scale[:, None], -448.0, 448.0).to(tl.float8e4nv), scale


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_x, stride_q, stride_s, G: tl.constexpr,
                          GROUPS: tl.constexpr):
    """GROUPS G-column groups of one row: per group s = max(|x|, 1e-10) / 448, q = x / s in FP8."""
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    cols = g[:, None] * G + tl.arange(0, G)[None, :]
    ok = cols < K
    q, scale = _quantize_group(tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32))
    tl.store(q_ptr + row * stride_q + cols, q, mask=ok)
    tl.store(s_ptr + row * stride_s + g, scale, mask=g * G < K)


@triton.jit(do_not_specialize=["M"])
def _fp8_gemm_kernel(a_ptr, as_ptr, w_ptr, s_ptr, c_ptr, part_ptr, lock_ptr, M, N, K, KP, stride_a, stride_as,
                     stride_w, stride_c, stride_sn, stride_sk, SCALE_ROWS: tl.constexpr, SCALE_COLS: tl.constexpr,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                     PARTS: tl.constexpr, QUANTIZE: tl.constexpr, FOLD_ROWS: tl.constexpr,
                     FOLD_AHEAD: tl.constexpr):
    """c = (a * as) @ (w * s).T, a [M, K] FP8 with one scale per row and BK-group, w [N, K] FP8;
    grouped tile order. PARTS > 1: each tile's K groups are spread over PARTS programs of KP
    columns each, which write their groups' products unscaled (float32, part_ptr [K / BK, M, N]);
    the tile's last program to finish (tile counters in lock_ptr) folds them all in K order, as
    one program folds them with PARTS == 1, so the sum is the same (PARTS > 1 only for up to
    FOLD_ROWS <= BM rows, the one row tile). QUANTIZE (PARTS == 1 only): a
    holds the activations unquantised (16-bit) and each program quantises its rows' groups as
    `_quantize_rows_kernel` does, with its arithmetic."""
    pid = tl.program_id(0)
    part = pid % PARTS
    pm, pn = grouped_tile(pid // PARTS, M, N, BM, BN, GROUP_M)
    k_lo = part * KP
    k_hi = k_lo + KP
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    a_p = a_ptr + rm[:, None].to(tl.int64) * stride_a + (k_lo + rk)[None, :]
    as_p = as_ptr + rm.to(tl.int64) * stride_as
    w_p = w_ptr + rn[:, None].to(tl.int64) * stride_w + (k_lo + rk)[None, :]
    s_p = s_ptr + (rn // SCALE_ROWS) * stride_sn
    m_ok = rm < M
    n_ok = rn < N
    out_ok = m_ok[:, None] & n_ok[None, :]
    at = rm[:, None].to(tl.int64) * N + rn[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        k_ok = (k0 + rk)[None, :] < K
        if QUANTIZE:
            a, a_s = _quantize_group(tl.load(a_p, mask=m_ok[:, None] & k_ok, other=0.0).to(tl.float32))
        else:
            a = tl.load(a_p, mask=m_ok[:, None] & k_ok, other=0.0)
        w = tl.load(w_p, mask=n_ok[:, None] & k_ok, other=0.0)
        prod = tl.dot(a, tl.trans(w))
        if PARTS == 1:
            if not QUANTIZE:
                a_s = tl.load(as_p + k0 // BK, mask=m_ok, other=0.0)
            w_s = tl.load(s_p + (k0 // SCALE_COLS) * stride_sk, mask=n_ok, other=0.0)
            acc += prod * (a_s[:, None] * w_s[None, :])  # one FMA, as cuBLAS folds
        else:
            tl.store(part_ptr + (k0 // BK) * M * N + at, prod, mask=out_ok)
        a_p += BK
        w_p += BK
    c_p = c_ptr + rm[:, None].to(tl.int64) * stride_c + rn[None, :]
    if PARTS == 1:
        tl.store(c_p, acc.to(c_ptr.dtype.element_ty), mask=out_ok)
    else:
        tl.debug_barrier()  # every thread's products are written before the tile's count moves
        tile = pid // PARTS
        if tl.atomic_add(lock_ptr + tile, 1) == PARTS - 1:  # the tile's last part to finish folds them all
            # Over the FOLD_ROWS rows a spread product can have, FOLD_AHEAD groups' loads at a time
            # (independent of the sum, so they are in flight together), folded in K order.
            fr = pm * BM + tl.arange(0, FOLD_ROWS)
            f_ok = fr < M
            f_out = f_ok[:, None] & n_ok[None, :]
            f_at = fr[:, None].to(tl.int64) * N + rn[None, :]
            f_as = as_ptr + fr.to(tl.int64) * stride_as
            total = tl.zeros((FOLD_ROWS, BN), dtype=tl.float32)
            groups = tl.cdiv(K, BK)
            for g0 in range(0, groups, FOLD_AHEAD):
                for u in tl.static_range(FOLD_AHEAD):
                    g = g0 + u
                    live = g < groups
                    prod = tl.load(part_ptr + g * M * N + f_at, mask=f_out & live, other=0.0, cache_modifier=".cg")
                    a_s = tl.load(f_as + g, mask=f_ok & live, other=0.0)
                    w_s = tl.load(s_p + (g * BK // SCALE_COLS) * stride_sk, mask=n_ok & live, other=0.0)
                    total = tl.where(live, total + prod * (a_s[:, None] * w_s[None, :]), total)
            f_c = c_ptr + fr[:, None].to(tl.int64) * stride_c + rn[None, :]
            tl.store(f_c, total.to(c_ptr.dtype.element_ty), mask=f_out)
            tl.atomic_xchg(lock_ptr + tile, 0)  # ready for the next product


def quantize_rows(x: torch.Tensor, rows: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(x in FP8 [M, K], float32 scales [M, ceil(K / GROUP)]): each row's GROUP-column groups
    scaled so their largest magnitude maps to 448. With `rows` beyond M, that many rows, the
    ones past M zero with scale 1."""
    m, k = x.shape
    groups = triton.cdiv(k, GROUP)
    q = torch.empty((max(m, rows), k), dtype=torch.float8_e4m3fn, device=x.device)
    s = torch.empty((max(m, rows), groups), dtype=torch.float32, device=x.device)
    if rows > m:
        q[m:].zero_()
        s[m:].fill_(1.0)
    if m:
        per_program = min(QUANTIZE_GROUPS, triton.next_power_of_2(groups))
        _quantize_rows_kernel[(m, triton.cdiv(groups, per_program))](
            x, q, s, k, x.stride(0), q.stride(0), s.stride(0), G=GROUP, GROUPS=per_program, num_warps=4)
    return q, s


def config_for(rows: int, n: int, num_sms: int, k: int) -> tuple[int, int, int, int]:
    """(BM, BN, num_warps, num_stages) for `rows` rows of n output columns from k inputs; the bits
    are the same for every choice (BM at least MIN_BM), so it is speed alone. From `gpu-bench.py
    fp8-tiles` on an H100 (Qwen3-8B's block-wise projections, K spread as `k_split` spreads it):
    at one row 64 columns per program once the programs of all parts cover the SMs one and a half
    times, else 32; at 8192 rows 64-row tiles 128 wide, 256 wide for a long K (down_proj), and
    128 x 128 tiles over eight warps for a wide output (gate/up)."""
    if rows <= 64:
        parts = k_split(n, k) if rows <= SPLIT_PARALLEL_ROWS else 1
        wide = triton.cdiv(n, 64) * parts * 2 >= 3 * num_sms
        return (64, 64, 4, 3) if wide else (64, 32, 4, 4)
    if rows <= 256:
        return 64, 128, 4, 4
    if n >= 8192:
        return 128, 128, 8, 3
    return (64, 256, 8, 3) if k >= 8192 else (64, 128, 4, 3)


# A weight whose column tiles at one row give fewer than about SPLIT_PROGRAMS programs (each of
# MIN_BM rows and 32 columns) spreads each tile's K groups over parts of at least SPLIT_MIN_PART
# columns in programs of their own (`k_split`) at a decode step's few rows, so its weights stream
# through several programs per SM. The products are folded in K order all the same. Off (0):
# since the fold reads every group's product back, one program per tile is the faster at one
# row for every weight that spread its K (H100, 2026-12-07, `gpu-bench.py fp8-kernels`, one row
# of Qwen3-8B's block-wise projections: q/k/v 14.4 against 18.2 µs in 2 parts, o_proj 11.7
# against 15.7 in 4, down_proj 36.8 against 39.8 in 4). 512 spreads them as before.
SPLIT_PROGRAMS = 0
SPLIT_MIN_PART = 1024
# Products of up to this many rows spread K over parts. Each part writes its groups' products in
# float32, rows x groups x N x 4 bytes that the folding program reads back: beside the weight's
# N x K bytes that is rows / 16 more traffic each way, half the weight's at 8 rows.
SPLIT_PARALLEL_ROWS = 8
# Groups whose products the folding program loads at a time: their loads are in flight together,
# so a down_proj's 96 groups cost 12 round trips to L2, not 96.
FOLD_AHEAD = 8
# From this many rows on Hopper the product runs `hopper_fp8_gemm`'s warp-specialised kernel (the
# same bits) where cuBLAS does not take it. On an H100 (2026-12-07), Qwen3-8B's four block-wise
# projections took it 0.69 ms together at 1024 rows against the Triton kernel's 0.73, and 5.15
# against 5.72 at 8192; at 256 rows 0.25 against 0.23 (what `gpu-bench.py fp8-kernels` times).
HOPPER_MIN_ROWS = 1024
# From this many rows on Hopper a weight that `cublas_usable` takes runs cuBLAS's block-scaled FP8
# product, whose bits are the kernels' there (tests/engine/kernels/test_fp8_gemm_cuda.py checks it
# on the GPU it runs on). Qwen3-8B's projections at 8192 rows on an H100, without quantisation:
# 0.378 / 0.250 / 1.444 / 0.733 ms (q/k/v, o_proj, gate/up, down_proj) against the Gluon kernel's
# 0.797 / 0.536 / 2.305 / 1.494 with it (2026-12-07, `gpu-bench.py fp8-kernels`).
CUBLAS_MIN_ROWS = 1024
# cuBLAS reads the column-major scale matrices with a leading dimension of a multiple of this:
# it refuses activation scales of other row counts (CUBLAS_STATUS_NOT_SUPPORTED; fp8_mm pads the
# rows with zeros) and misreads weight scales of other K / 128 without an error (H100, CUDA 13.0:
# K = 384 gave 14% of the outputs' bits), so such weights stay on kvtool's kernels.
CUBLAS_SCALE_MULTIPLE = 4
# Products of up to this many rows whose K is not spread over parts may quantise their
# activations inside the product's programs (one launch instead of two per projection); others
# are quantised once by `quantize_rows` first (the parts' folding program reads the scales back).
# The same arithmetic either way. Off (0): every program of a tile quantises all MIN_BM rows of
# its tile, masked or not, once per column tile, and on an H100 the FP8 Qwen3-8B's batch-1 step
# took 8.99 ms with it at 64 (2026-12-07) against 4.63 ms before it. `gpu-bench.py fp8-kernels`
# times one row both ways.
FUSED_QUANTIZE_ROWS = 0


def k_split(n: int, k: int) -> int:
    """Over how many programs a tile's K groups are spread at few rows (1: one program), by the
    weight's shape alone; each part whole groups."""
    parts = min(-(-SPLIT_PROGRAMS * 32 // n), k // SPLIT_MIN_PART)
    while parts > 1 and k % (GROUP * parts):
        parts -= 1
    return max(parts, 1)


def cublas_usable(x: torch.Tensor, w: Fp8Weight) -> bool:
    """Whether cuBLAS's block-scaled FP8 product gives this product's bits: a Hopper GPU (the one
    its arithmetic was checked on), bf16 activations, and weight scales in 128 x 128 blocks over
    whole blocks of N and K, K / 128 a multiple of CUBLAS_SCALE_MULTIPLE."""
    n, k = w.data.shape
    return (x.dtype == torch.bfloat16 and w.scale_rows == GROUP and w.scale_cols == GROUP and n % GROUP == 0
            and k % (GROUP * CUBLAS_SCALE_MULTIPLE) == 0 and w.scale.shape == (n // GROUP, k // GROUP)
            and w.scale.is_contiguous() and w.data.is_contiguous() and is_hopper(x.device))


def fp8_mm(x: torch.Tensor, w: Fp8Weight, config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x [M, K] (bf16/fp16) @ the FP8 weight [N, K].T -> [M, N] in x's dtype."""
    m, k = x.shape
    n = w.data.shape[0]
    if x.stride(1) != 1:
        x = x.contiguous()
    if config is None and m >= CUBLAS_MIN_ROWS and cublas_usable(x, w):
        # cuBLAS's block-scaled product takes a multiple of CUBLAS_SCALE_MULTIPLE rows; the rows
        # added are zeros, and each row's result does not depend on the others
        q, q_scale = quantize_rows(x, rows=triton.cdiv(m, CUBLAS_SCALE_MULTIPLE) * CUBLAS_SCALE_MULTIPLE)
        # cuBLAS takes the activation scales column-major and the weight's as [K / 128, N / 128]
        return torch._scaled_mm(q, w.data.t(), scale_a=q_scale.t().contiguous().t(), scale_b=w.scale.t(),
                                out_dtype=x.dtype)[:m]
    c = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return c
    bm, bn, warps, stages = config or config_for(m, n, sm_count(x.device), k)
    if bm < MIN_BM:
        raise ValueError(f"FP8 row tiles of {bm} rows round otherwise than those of {MIN_BM} and more")
    split = k_split(n, k) if m <= SPLIT_PARALLEL_ROWS else 1
    fused = m <= FUSED_QUANTIZE_ROWS and split == 1
    q, q_scale = (x, x) if fused else quantize_rows(x)  # fused: the kernel quantises x itself
    if config is None and m >= HOPPER_MIN_ROWS:
        hopper = gluon_module(HOPPER_FP8_GEMM)
        if hopper is not None and hopper.usable(x, w):
            return hopper.hopper_fp8_mm(q, q_scale, w, c)
    stride_sk = w.scale.stride(1) if w.scale.shape[1] > 1 else 0
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    # A spread K's parts write every group's product: [groups, m, n] float32.
    programs, products, locks, _ = split_launch(m, n, tiles, split, SPLIT_PARALLEL_ROWS, c,
                                                slots=triton.cdiv(k, GROUP))
    _fp8_gemm_kernel[(programs,)](
        q, q_scale, w.data, w.scale, c, products, locks, m, n, k, k // split, q.stride(0), q_scale.stride(0),
        w.data.stride(0), c.stride(0), w.scale.stride(0), stride_sk, SCALE_ROWS=w.scale_rows,
        SCALE_COLS=w.scale_cols, BM=bm, BN=bn, BK=GROUP, GROUP_M=8, PARTS=split, QUANTIZE=fused,
        FOLD_ROWS=SPLIT_PARALLEL_ROWS, FOLD_AHEAD=FOLD_AHEAD, num_warps=warps, num_stages=stages)
    return c
