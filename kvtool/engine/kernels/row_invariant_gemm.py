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
computed the same way whether or not a prefix was loaded). Nothing here is process state, so
engines of different settings in one process do not affect each other.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kvtool.engine.kernels.fp8_gemm import fp8_mm
from kvtool.engine.kernels.fp8_weight import Fp8Weight
from kvtool.engine.kernels.gemv import gemv, gemv_fits
from kvtool.engine.kernels.tiles import grouped_tile, sm_count

# From this many rows up cuBLAS picks kernels that do not split K on the shapes of the presets.
CUBLAS_MIN_ROWS = 1024

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages), each for row counts up to its limit (the
# last for any); they all give the same bits, so the choice is speed alone.
CONFIGS = ((16, (16, 32, 128, 4, 4)), (32, (32, 32, 128, 4, 4)), (128, (64, 64, 64, 4, 4)),
           (CUBLAS_MIN_ROWS, (128, 128, 64, 8, 4)))

# M is not specialized: one compiled kernel per tile configuration serves every row count (one
# row, a multiple of 16 or any other), so a step of a new row count never compiles mid-request.
@triton.jit(do_not_specialize=["M"])
def _gemm_kernel(a_ptr, w_ptr, c_ptr, M, N, K, stride_a, stride_w, stride_c,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr):
    """c = a @ w.T for a [M, K], w [N, K]; grouped tile order so consecutive programs share w tiles."""
    pm, pn = grouped_tile(tl.program_id(0), M, N, BM, BN, GROUP_M)
    rm = pm * BM + tl.arange(0, BM)
    rn = pn * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    a_p = a_ptr + rm[:, None].to(tl.int64) * stride_a + rk[None, :]
    w_p = w_ptr + rn[:, None].to(tl.int64) * stride_w + rk[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        k_ok = (k0 + rk)[None, :] < K
        a = tl.load(a_p, mask=(rm[:, None] < M) & k_ok, other=0.0)
        w = tl.load(w_p, mask=(rn[:, None] < N) & k_ok, other=0.0)
        acc = tl.dot(a, tl.trans(w), acc)
        a_p += BK
        w_p += BK
    c_p = c_ptr + rm[:, None].to(tl.int64) * stride_c + rn[None, :]
    tl.store(c_p, acc.to(c_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


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
    """Row counts below CUBLAS_MIN_ROWS that between them reach every tile configuration
    `config_for` picks for products of these weight shapes (N, K): one product of each compiles
    them all."""
    seen: set[tuple[int, int, int, int, int]] = set()
    rows_needed = []
    for rows in range(1, CUBLAS_MIN_ROWS):
        configs = {config_for(rows, n, num_sms, k) for n, k in shapes}
        if not configs <= seen:
            seen |= configs
            rows_needed.append(rows)
    return rows_needed


def triton_mm(a: torch.Tensor, w: torch.Tensor, config: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """a [M, K] @ w [N, K].T without split-K (rows independent of M and of the tile shape)."""
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
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)
    _gemm_kernel[grid](a, w, c, m, n, k, a.stride(0), w.stride(0), c.stride(0),
                       BM=bm, BN=bn, BK=bk, GROUP_M=8, num_warps=warps, num_stages=stages)
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
    y = F.linear(x, weight) if x.shape[0] >= CUBLAS_MIN_ROWS else triton_mm(x, weight)
    return y if bias is None else y.add_(bias)
