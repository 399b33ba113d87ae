"""Prefix invariance on CUDA: the row-invariant GEMM against itself (any row count, any tile
configuration) and against cuBLAS from its threshold up. Skipped without CUDA.
"""

import pytest
import torch
import torch.nn.functional as F

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEV = torch.device("cuda")

# (N, K) of the projections of the qwen3-0.6b and qwen3-8b presets: qkv, o, gate_up, down.
SHAPES = {
    "0.6b": [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)],
    "8b": [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)],
}


def _operands(n, k, rows, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    a = torch.randn((rows, k), generator=g, device=DEV).to(torch.bfloat16)
    w = (torch.randn((n, k), generator=g, device=DEV) / k**0.5).to(torch.bfloat16)
    return a, w


@pytest.mark.parametrize("model", sorted(SHAPES))
def test_triton_rows_do_not_depend_on_row_count_or_tiles(model):
    from kvtool.engine.row_invariant_gemm import _CONFIGS, triton_mm

    configs = [cfg for _, cfg in _CONFIGS]
    for n, k in SHAPES[model]:
        a, w = _operands(n, k, 1100)
        whole = triton_mm(a, w)
        for rows in (1, 5, 16, 33, 200, 1023):
            assert torch.equal(triton_mm(a[-rows:], w), whole[-rows:]), (n, k, rows)
        for cfg in configs:
            assert torch.equal(triton_mm(a[:300], w, cfg), whole[:300]), (n, k, cfg)
        ref = a.float() @ w.float().T
        assert float((whole.float() - ref).norm() / ref.norm()) < 5e-3


@pytest.mark.parametrize("model", sorted(SHAPES))
def test_cublas_rows_match_from_the_threshold(model):
    """`linear` switches to cuBLAS at CUBLAS_MIN_ROWS rows; that is only sound where cuBLAS's rows
    are the Triton kernel's bits, on this GPU, for row counts a prefill step reaches."""
    from kvtool.engine.row_invariant_gemm import CUBLAS_MIN_ROWS, triton_mm

    for n, k in SHAPES[model]:
        a, w = _operands(n, k, 32768, seed=1)
        whole = triton_mm(a, w)
        for rows in (CUBLAS_MIN_ROWS, 1500, 2048, 4133, 8192, 32768):
            assert torch.equal(F.linear(a[:rows], w), whole[:rows]), (n, k, rows)


def test_linear_switch_and_bias():
    from kvtool.engine.row_invariant_gemm import CUBLAS_MIN_ROWS, linear, row_invariant_gemms

    a, w = _operands(512, 256, CUBLAS_MIN_ROWS + 50)
    bias = torch.randn(512, device=DEV).to(torch.bfloat16)
    plain = linear(a[-10:], w, bias)
    assert torch.equal(plain, F.linear(a[-10:], w, bias))
    with row_invariant_gemms():
        big = linear(a, w, bias)
        small = linear(a[-10:], w, bias)
    assert torch.equal(small, big[-10:])
    assert float((small.float() - plain.float()).norm() / plain.float().norm()) < 1e-2
    assert torch.equal(linear(a[-10:], w, bias), plain)  # the switch is off again
