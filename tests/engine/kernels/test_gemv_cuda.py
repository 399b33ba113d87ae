"""The batch-1 decode GEMV against a float64 reference, on the presets' projection shapes."""

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEV = torch.device("cuda")


@pytest.mark.parametrize("n,k", [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (6144, 4096),
                                 (4096, 12288), (1000, 1000), (7, 33)])
def test_gemv_matches_float64_and_is_deterministic(n, k):
    from kvtool.engine.kernels.gemv import gemv, gemv_fits
    from kvtool.engine.kernels.row_invariant_gemm import linear

    g = torch.Generator(device=DEV).manual_seed(n + k)
    w = torch.randn((n, k), generator=g, device=DEV).to(torch.bfloat16)
    x = torch.randn((1, k), generator=g, device=DEV).to(torch.bfloat16)
    assert gemv_fits(x, w, None)
    y = gemv(x, w)
    ref = x.double() @ w.double().T
    assert y.shape == (1, n) and y.dtype == torch.bfloat16
    assert float((y.double() - ref).norm() / ref.norm()) < 1e-2
    assert torch.equal(gemv(x, w), y)
    assert torch.equal(linear(x, w, row_invariant=False), y)  # decode steps route one row here


def test_gemv_leaves_what_it_does_not_serve_to_cublas():
    from kvtool.engine.kernels.gemv import gemv_fits

    w = torch.zeros((64, 32), device=DEV, dtype=torch.bfloat16)
    assert not gemv_fits(torch.zeros((2, 32), device=DEV, dtype=torch.bfloat16), w, None)
    assert not gemv_fits(torch.zeros((1, 32), device=DEV, dtype=torch.bfloat16), w, torch.zeros(64, device=DEV))
    assert not gemv_fits(torch.zeros((1, 32), device=DEV, dtype=torch.float32), w.float(), None)
    assert not gemv_fits(torch.zeros((1, 32), device=DEV, dtype=torch.bfloat16),
                         torch.zeros((151936, 32), device=DEV, dtype=torch.bfloat16), None)
