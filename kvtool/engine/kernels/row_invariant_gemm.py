"""Linear layers whose output rows do not depend on how many rows are multiplied together.

A prompt's rows must come out bit-identical whether they are computed in one prefill of the
whole prompt (thousands of rows) or as the few rows left after a KV hit: otherwise a greedy
token can flip between a run with a connector and one without. cuBLAS picks its kernel by
shape and, for few rows, splits the reduction over K across thread blocks (split-K), which
rounds differently. The Triton kernel here never splits K: every output element is one float32
accumulation in K order, whatever the tile shape, so its rows are the same for any number of
rows and any of the tile configurations below. For many rows cuBLAS's own kernels accumulate
the same way and give the same bits (tests/engine/kernels/test_row_invariance_cuda.py checks both on the GPU
it runs on), and they are faster, so `linear` uses cuBLAS from CUBLAS_MIN_ROWS rows up.

Whether a product takes that path is an argument of the step, `linear(..., row_invariant=)`:
the runner asks for it in steps that compute prefill rows, and in decode steps too in
batch-invariant mode (an engine setting, on by default on CUDA); the fused forwards read it
from the step's `AttentionMetadata.row_invariant`, the logits from `compute_logits`' argument.
Without it decode steps keep cuBLAS, or the GEMV of `gemv` for a single row (a decode row is
computed the same way whether or not a prefix was loaded). No setting here is process state, so
engines of different settings in one process do not affect each other (the split products' tile
counters below are per device, and every product leaves them at zero).

A narrow weight (`k_split`: 1024 to 2048 outputs) leaves most SMs idle when a decode step has a
row or a few: its column tiles are too few. Its K is then split into a fixed number of equal parts
chosen by the weight's shape alone, each output element is the float32 sum of the parts' own K-order
accumulations, added in part order, and every row count computes exactly that: few rows run the
parts in programs of their own (each writes its float32 partial; the last of a tile to finish,
counted by an atomic, adds them in part order and writes the tile), more rows run the parts one
after the other inside one program, and cuBLAS, which does not split this way, is not used for
such a weight at any row count.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kvtool.engine.kernels.fp8_gemm import fp8_mm
from kvtool.engine.kernels.fp8_weight import Fp8Weight
from kvtool.engine.kernels.gemv import gemv, gemv_fits
from kvtool.engine.kernels.tiles import grouped_tile, sm_count, split_launch

# From this many rows up cuBLAS picks kernels that do not split K on the shapes of the presets.
CUBLAS_MIN_ROWS = 1024

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages), each for row counts up to its limit (the
# last for any); they all give the same bits, so the choice is speed alone.
CONFIGS = ((16, (16, 32, 128, 4, 4)), (32, (32, 32, 128, 4, 4)), (128, (64, 64, 64, 4, 4)),
           (CUBLAS_MIN_ROWS, (128, 128, 64, 8, 4)))

# M is not specialized: one compiled kernel per tile configuration serves every row count (one
# row, a multiple of 16 or any other), so a step of a new row count never compiles mid-request.
@triton.jit(do_not_specialize=["M"])
def _gemm_kernel(a_ptr, w_ptr, c_ptr, part_ptr, lock_ptr, M, N, K, KP, stride_a, stride_w, stride_c,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                 SPLIT: tl.constexpr, PARALLEL: tl.constexpr):
    """c = a @ w.T for a [M, K], w [N, K]; grouped tile order so consecutive programs share w tiles.
    SPLIT > 1: K in SPLIT parts of KP columns, each accumulated alone and added in part order, by
    SPLIT programs per tile (PARALLEL, partials in part_ptr [SPLIT, M, N], tile counters in
    lock_ptr) or by one program part after part."""
    pid = tl.program_id(0)
    if PARALLEL:
        part = pid % SPLIT
        pm, pn = grouped_tile(pid // SPLIT, M, N, BM, BN, GROUP_M)
    else:
        pm, pn = grouped_tile(pid, M, N, BM, BN, GROUP_M)
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    out_ok = (rm[:, None] < M) & (rn[None, :] < N)
    c_p = c_ptr + rm[:, None].to(tl.int64) * stride_c + rn[None, :]
    if SPLIT == 1:
        acc = _k_range(a_ptr, w_ptr, rm, rn, M, N, 0, K, stride_a, stride_w, BM, BN, BK)
        tl.store(c_p, acc.to(c_ptr.dtype.element_ty), mask=out_ok)
    elif PARALLEL:
        acc = _k_range(a_ptr, w_ptr, rm, rn, M, N, part * KP, part * KP + KP, stride_a, stride_w, BM, BN, BK)
        at = rm[:, None].to(tl.int64) * N + rn[None, :]
        tl.store(part_ptr + part * M * N + at, acc, mask=out_ok)
        tl.debug_barrier()  # every thread's partial is written before the tile's count moves
        tile = pid // SPLIT
        if tl.atomic_add(lock_ptr + tile, 1) == SPLIT - 1:  # the tile's last part to finish adds them all
            total = tl.zeros((BM, BN), dtype=tl.float32)
            for s in tl.static_range(SPLIT):
                total += tl.load(part_ptr + s * M * N + at, mask=out_ok, other=0.0, cache_modifier=".cg")
            tl.store(c_p, total.to(c_ptr.dtype.element_ty), mask=out_ok)
            tl.atomic_xchg(lock_ptr + tile, 0)  # ready for the next product
    else:
        total = tl.zeros((BM, BN), dtype=tl.float32)
        for s in tl.static_range(SPLIT):
            total += _k_range(a_ptr, w_ptr, rm, rn, M, N, s * KP, s * KP + KP, stride_a, stride_w, BM, BN, BK)
        tl.store(c_p, total.to(c_ptr.dtype.element_ty), mask=out_ok)


@triton.jit
def _k_range(a_ptr, w_ptr, rm, rn, M, N, k_lo, k_hi, stride_a, stride_w,
             BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """One float32 accumulation of a[rm, k] * w[rn, k] over k in [k_lo, k_hi), in K order."""
    rk = tl.arange(0, BK)
    a_p = a_ptr + rm[:, None].to(tl.int64) * stride_a + (k_lo + rk)[None, :]
    w_p = w_ptr + rn[:, None].to(tl.int64) * stride_w + (k_lo + rk)[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BK):
        k_ok = (k0 + rk)[None, :] < k_hi
        a = tl.load(a_p, mask=(rm[:, None] < M) & k_ok, other=0.0)
        w = tl.load(w_p, mask=(rn[:, None] < N) & k_ok, other=0.0)
        acc = tl.dot(a, tl.trans(w), acc)
        a_p += BK
        w_p += BK
    return acc


# A weight of SPLIT_MIN_OUTPUTS to SPLIT_MAX_OUTPUTS outputs and at most SPLIT_MAX_ELEMENTS
# elements splits its K (`k_split`) into parts of at least SPLIT_MIN_PART columns, as many as
# give about SPLIT_PROGRAMS programs of 32 columns at one row.
SPLIT_MIN_OUTPUTS = 1024
SPLIT_MAX_OUTPUTS = 2048
SPLIT_MAX_ELEMENTS = 2048 * 8192
SPLIT_MIN_PART = 512
SPLIT_PROGRAMS = 256
# Products of up to this many rows run the parts of a split K in programs of their own.
SPLIT_PARALLEL_ROWS = 64
def k_split(n: int, k: int) -> int:
    """How many equal parts the K of an [n, k] weight is split into (1: not split). A function of
    the weight's shape alone, so that every row count of every step splits it the same way; each
    part a multiple of 16 columns, the tensor cores' K step."""
    if not SPLIT_MIN_OUTPUTS <= n <= SPLIT_MAX_OUTPUTS or n * k > SPLIT_MAX_ELEMENTS:
        return 1
    parts = min(-(-SPLIT_PROGRAMS * 32 // n), k // SPLIT_MIN_PART)
    while parts > 1 and k % (16 * parts):
        parts -= 1
    return max(parts, 1)


def config_for(rows: int, n: int | None = None, num_sms: int = 0, k: int = 0) -> tuple[int, int, int, int, int]:
    """The tile configuration `triton_mm` uses for `rows` rows (of n output columns and k inputs on
    num_sms SMs): `decode_tiles` up to DECODE_ROWS rows, `row_count_tiles` above. The bits are the
    same whichever tiles run."""
    if n is not None and rows <= DECODE_ROWS:
        return decode_tiles(rows, n, num_sms, k)
    return row_count_tiles(rows, n, num_sms)


def row_count_tiles(rows: int, n: int | None = None, num_sms: int = 0) -> tuple[int, int, int, int, int]:
    """Tiles by row count (CONFIGS). A narrow output leaves most SMs idle under them, so the tiles
    narrow (columns down to 32, then rows down to 64) until every SM has a program or none can
    narrow further."""
    bm, bn, bk, warps, stages = next((cfg for limit, cfg in CONFIGS if rows <= limit), CONFIGS[-1][1])
    if n is not None:
        while triton.cdiv(rows, bm) * triton.cdiv(n, bn) < num_sms:
            if bn > 32:
                bn //= 2
            elif bm > 64:
                bm, warps = bm // 2, 4
            else:
                break
    return bm, bn, bk, warps, stages


# Steps of up to this many rows (batch-invariant decode) take `decode_tiles`.
DECODE_ROWS = 256
# An output this wide (an LM head) has programs enough for any tile shape.
WIDE_OUTPUT = 32768


def decode_tiles(rows: int, n: int, num_sms: int, k: int = 0) -> tuple[int, int, int, int, int]:
    """Tiles for a decode-sized product of n outputs from k inputs, from sweeps of the presets'
    decode shapes (Qwen3-0.6B at 16-256 rows, Qwen3-8B's projections at one row), where they beat
    the row-count tiles."""
    if n >= WIDE_OUTPUT:
        if rows <= 32:
            return (16 if rows <= 16 else 32), 64, 128, 4, 3
        return (64, 128, 64, 8, 3) if rows <= 64 else (128, 128, 64, 8, 3)
    if rows <= 64 and n <= 2048:
        return 16, 32, 256, 4, 3  # a narrow output: 16-row tiles and long K steps give every SM work
    if rows <= 16 and k >= 4096 and n < 8192:
        # A batch-1 step of a 4096-wide model (q/k/v, o_proj, down_proj): 32 columns per program
        # give every SM one or more, a deeper pipeline keeps more of the weights in flight, and a
        # long reduction (down_proj) streams in 512-wide K steps.
        if k >= 8192:
            return 16, 32, 512, 4, 4
        return 16, 32, 128, 4, (4 if n > 4096 else 3)
    bm = 16 if rows <= 16 else 64
    bk = 64 if rows > 128 and n > 4096 else 128
    # 64 columns per program where that still leaves programs for about 0.7 of the SMs.
    bn = 64 if triton.cdiv(rows, bm) * triton.cdiv(n, 64) * 10 >= 7 * num_sms else 32
    return bm, bn, bk, 4, 3


def warm_up_rows(shapes: set[tuple[int, int]], num_sms: int) -> list[int]:
    """Row counts that between them reach every kernel `triton_mm` compiles for products of these
    weight shapes (N, K): each tile configuration `config_for` picks, with the weight's split of K
    and how its parts run. Below CUBLAS_MIN_ROWS for every weight; up to WARM_UP_MAX_ROWS for a
    weight whose K is split (cuBLAS takes the others' larger products), by which row count the
    row-count tiles of a split weight's outputs no longer change."""
    seen: set[tuple] = set()
    rows_needed = []
    for rows in range(1, WARM_UP_MAX_ROWS):
        launches = {(config_for(rows, n, num_sms, k), k_split(n, k), rows <= SPLIT_PARALLEL_ROWS)
                    for n, k in shapes if rows < CUBLAS_MIN_ROWS or k_split(n, k) > 1}
        if not launches <= seen:
            seen |= launches
            rows_needed.append(rows)
    return rows_needed


# See `warm_up_rows`: past this many rows the tiles of an output of SPLIT_MIN_OUTPUTS columns and
# more are the last row-count configuration's, unnarrowed, on a GPU of up to 132 SMs.
WARM_UP_MAX_ROWS = 4 * CUBLAS_MIN_ROWS


def triton_mm(a: torch.Tensor, w: torch.Tensor, config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """a [M, K] @ w [N, K].T with rows independent of M and of the tile shape (K split by the
    weight's shape alone, `k_split`)."""
    m, k = a.shape
    n = w.shape[0]
    if a.stride(1) != 1:
        a = a.contiguous()
    if w.stride(1) != 1:
        w = w.contiguous()
    c = torch.empty((m, n), dtype=a.dtype, device=a.device)
    if m == 0:
        return c
    bm, bn, bk, warps, stages = config or config_for(m, n, sm_count(a.device), k)
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    split = k_split(n, k)
    programs, parts, locks, parallel = split_launch(m, n, tiles, split, SPLIT_PARALLEL_ROWS, c)
    _gemm_kernel[(programs,)](
        a, w, c, parts, locks, m, n, k, k // split, a.stride(0), w.stride(0), c.stride(0),
        BM=bm, BN=bn, BK=bk, GROUP_M=8, SPLIT=split, PARALLEL=parallel, num_warps=warps, num_stages=stages)
    return c


def linear(x: torch.Tensor, weight: torch.Tensor | Fp8Weight, bias: torch.Tensor | None = None, *,
           row_invariant: bool) -> torch.Tensor:
    """F.linear for 2-D x; with `row_invariant`, with rows independent of x's row count (the
    bias is then added after the product, by one elementwise add on either path). An FP8
    checkpoint's weight (`Fp8Weight`) goes to `fp8_gemm`, whose rows are invariant at every count."""
    if isinstance(weight, Fp8Weight):
        y = fp8_mm(x, weight)
        return y if bias is None else y.add_(bias)
    if not row_invariant:
        # A decode step of one sequence: the GEMV streams the weights faster than cuBLAS does.
        return gemv(x, weight) if gemv_fits(x, weight, bias) else F.linear(x, weight, bias)
    cublas = x.shape[0] >= CUBLAS_MIN_ROWS and k_split(*weight.shape) == 1
    y = F.linear(x, weight) if cublas else triton_mm(x, weight)
    return y if bias is None else y.add_(bias)
