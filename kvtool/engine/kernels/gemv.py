"""One-row projections on CUDA: a Triton GEMV for decode steps of a single sequence.

A batch-1 decode step reads every weight once for one row, so it is bound by memory bandwidth;
cuBLAS picks tile shapes made for many rows there (far under the bandwidth for Qwen3-0.6B's
o_proj), and a decode step of a small model is a few hundred such projections.
This kernel gives each program a few output rows and walks K in wide contiguous chunks, so the
loads stream at close to the bandwidth limit. Each output is one float32 sum in a fixed order:
deterministic, and independent of anything but the row and the weight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Output features above this go to cuBLAS (an LM head is large enough for its kernels to stream).
MAX_OUTPUT_FEATURES = 32768


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, N, K, stride_w, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y[n] = sum_k x[k] * w[n, k] for BLOCK_N consecutive n."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = n < N
    rows = w_ptr + n[:, None].to(tl.int64) * stride_w
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_mask = k < K
        w = tl.load(rows + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        x = tl.load(x_ptr + k, mask=k_mask, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    tl.store(y_ptr + n, tl.sum(acc, 1).to(y_ptr.dtype.element_ty), mask=n_mask)


def gemv_fits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether `gemv` serves F.linear(x, weight, bias): one CUDA row, a half-precision weight of at
    most MAX_OUTPUT_FEATURES rows with unit inner stride, no bias."""
    return (
        x.dim() == 2 and x.shape[0] == 1 and x.is_cuda and bias is None
        and weight.dtype in (torch.bfloat16, torch.float16) and x.dtype == weight.dtype
        and weight.shape[0] <= MAX_OUTPUT_FEATURES and weight.stride(1) == 1 and x.stride(1) == 1
    )


def gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [1, K] @ weight [N, K].T -> [1, N] in x's dtype (see `gemv_fits`)."""
    n, k = weight.shape
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    # Tiles from a sweep of the Qwen3-0.6B and 8B projection shapes on an H200.
    block_n = 4 if n < 4096 else 8
    block_k = 256 if k <= 1024 else 512
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, y, n, k, weight.stride(0), BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=8 if k >= 8192 else 4, num_stages=3,
    )
    return y
