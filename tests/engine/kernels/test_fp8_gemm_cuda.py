"""`kernels.fp8_gemm` on the GPU: FP8 checkpoint weights (block, per-channel and per-tensor scales)
multiplied on the FP8 tensor cores.

- a row's bits are the same at every row count (1 to 2048), under every tile configuration, and
  inside a CUDA graph;
- the result is the quantised product, computed exactly in float64 from the same FP8 operands
  and scales, within float32 accumulation error;
- stacked weights (q/k/v, gate/up; block scales kept or spread per row) give each part's product.
Skipped without CUDA or without FP8 tensor cores.
"""

from __future__ import annotations

import math

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                       reason="needs a CUDA device with FP8 tensor cores"),
]

DEV = torch.device("cuda")
ROW_COUNTS = (1, 2, 3, 8, 17, 64, 65, 256, 257, 1024, 2048)
CONFIGS = ((64, 32, 4, 4), (64, 64, 4, 4), (64, 128, 4, 4), (128, 128, 8, 3), (128, 128, 8, 4), (128, 64, 4, 3))


def weight(n: int, k: int, strategy: str, seed: int = 0):
    from kvtool.engine.kernels.fp8_weight import GROUP, Fp8Weight
    from kvtool.engine.models.quantization import WeightQuantization, quantize

    g = torch.Generator(device=DEV).manual_seed(seed)
    dense = torch.randn(n, k, device=DEV, generator=g) / math.sqrt(k)
    if strategy == "block":
        q = WeightQuantization(method="fp8", weight_strategy="block", weight_block_size=(128, 128))
        data, scale = quantize(dense, q)
        return Fp8Weight(data, scale, 128, 128)
    q = WeightQuantization(method="fp8", weight_strategy="channel" if strategy == "channel" else "tensor")
    data, scale = quantize(dense, q)
    return Fp8Weight(data, scale.reshape(-1, 1).expand(n, 1).contiguous(), 1, GROUP)


def exact(x: torch.Tensor, w) -> torch.Tensor:
    """The quantised product in float64: activations quantised per row and 128-group as the kernel
    does, each group's FP8 dot exact, scaled and summed in K order."""
    xf = x.float()
    out = torch.zeros(x.shape[0], w.data.shape[0], dtype=torch.float64, device=DEV)
    wd = w.data.double()
    for g0 in range(0, x.shape[1], 128):
        a = xf[:, g0 : g0 + 128]
        a_s = a.abs().amax(1).clamp(min=1e-10) / 448.0
        a_q = (a / a_s[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn).double()
        col = g0 // w.scale_cols if w.scale.shape[1] > 1 else 0
        w_s = w.scale[:, col].double().repeat_interleave(w.scale_rows)[: wd.shape[0]]
        out += (a_q @ wd[:, g0 : g0 + 128].T) * a_s.double()[:, None] * w_s[None, :]
    return out


@pytest.mark.parametrize("n,k,strategy", [
    (6144, 4096, "block"),  # Qwen3-8B's q/k/v
    (1000, 640, "channel"),  # ragged: N past a 128 block, K a multiple of the group
    (384, 200, "block"),  # K ragged inside its last group
    (512, 1024, "tensor"),
])
def test_rows_are_the_same_at_every_row_count_and_tile(n, k, strategy):
    from kvtool.engine.kernels.fp8_gemm import fp8_mm

    w = weight(n, k, strategy)
    g = torch.Generator(device=DEV).manual_seed(5)
    x = torch.randn(max(ROW_COUNTS), k, device=DEV, generator=g).bfloat16()
    full = fp8_mm(x, w)
    ref = exact(x, w)
    err = (full.double() - ref).abs().max().item()
    # bf16 output rounding (2^-8 relative) and float32 sums, nothing like FP8 error (2^-4)
    assert err <= 2**-7 * ref.abs().max().item(), err
    for m in ROW_COUNTS:
        assert torch.equal(fp8_mm(x[:m], w), full[:m]), m
        assert torch.equal(fp8_mm(x[-m:], w), full[-m:]), m
    for config in CONFIGS:
        assert torch.equal(fp8_mm(x[:300], w, config), full[:300]), config


def test_captured_in_a_cuda_graph_it_gives_the_eager_bits():
    from kvtool.engine.kernels.fp8_gemm import fp8_mm

    w = weight(2048, 1024, "block")
    x = torch.randn(64, 1024, device=DEV).bfloat16()
    full = fp8_mm(x, w)
    xs = x[:4].clone()
    fp8_mm(xs, w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_mm(xs, w)
    xs.copy_(x[40:44])
    graph.replay()
    assert torch.equal(out, full[40:44])


@pytest.mark.parametrize("shapes", [
    [(512, 256, "block"), (128, 256, "block"), (128, 256, "block")],  # whole blocks: block scales kept
    [(320, 256, "block"), (64, 256, "block")],  # a part ends inside a block: spread per row
    [(256, 512, "channel"), (256, 512, "block")],  # one scale over K beside K groups
])
def test_stacked_weights_give_each_parts_product(shapes):
    from kvtool.engine.kernels.fp8_gemm import fp8_mm
    from kvtool.engine.kernels.fp8_weight import concat

    parts = [weight(n, k, s, seed=i) for i, (n, k, s) in enumerate(shapes)]
    whole = concat(parts)
    x = torch.randn(33, shapes[0][1], device=DEV).bfloat16()
    y = fp8_mm(x, whole)
    at = 0
    for w in parts:
        n = w.data.shape[0]
        assert torch.equal(y[:, at : at + n], fp8_mm(x, w))
        at += n


@pytest.mark.parametrize("n,k,strategy", [
    (24576, 4096, "block"),  # Qwen3-8B's gate/up: K whole
    (4096, 12288, "block"),  # its down_proj: a long K
    (1000, 640, "channel"),  # ragged N, one scale per column
    (6144, 4096, "tensor"),  # one scale per column
])
def test_the_hopper_kernel_gives_the_triton_kernels_bits(monkeypatch, n, k, strategy):
    """From HOPPER_MIN_ROWS rows on Hopper `fp8_mm` runs the warp-specialised Gluon kernel (cuBLAS
    kept out here): its rows are the Triton kernel's bits (the tiles of `config_for`, and another),
    ragged row counts included, and a row's bits are the same at every row count above and below
    the switch."""
    from kvtool.engine.kernels import fp8_gemm
    from kvtool.engine.kernels.gluon import gluon_module
    from kvtool.engine.kernels.tiles import sm_count

    monkeypatch.setattr(fp8_gemm, "CUBLAS_MIN_ROWS", 1 << 30)
    hopper = gluon_module(fp8_gemm.HOPPER_FP8_GEMM)
    w = weight(n, k, strategy, seed=n)
    if hopper is None or not hopper.usable(torch.empty(1, k, device=DEV), w):
        pytest.skip("the Hopper FP8 kernel needs compute capability 9.0 and Triton 3.6")
    g = torch.Generator(device=DEV).manual_seed(k)
    x = torch.randn(3000, k, device=DEV, generator=g).bfloat16()
    full = fp8_gemm.fp8_mm(x, w)
    for m in (fp8_gemm.HOPPER_MIN_ROWS, 300, 1000, 3000):
        triton_tiles = fp8_gemm.config_for(m, n, sm_count(DEV), k)
        assert torch.equal(fp8_gemm.fp8_mm(x[:m], w, triton_tiles), full[:m]), m
        assert torch.equal(fp8_gemm.fp8_mm(x[-m:], w), full[-m:]), m
    assert torch.equal(fp8_gemm.fp8_mm(x[:300], w, (64, 64, 4, 4)), full[:300])
    for m in (1, 65, fp8_gemm.HOPPER_MIN_ROWS - 1):
        assert torch.equal(fp8_gemm.fp8_mm(x[:m], w), full[:m]), m


@pytest.mark.parametrize("n,k", [(2048, 4096), (16384, 1024)])
def test_the_hopper_kernels_schedule_moves_work_in_time_never_its_bits(monkeypatch, n, k):
    """The Gluon FP8 kernel's K groups in flight are a schedule, never the bits."""
    from kvtool.engine.kernels import fp8_gemm
    from kvtool.engine.kernels.gluon import gluon_module

    monkeypatch.setattr(fp8_gemm, "CUBLAS_MIN_ROWS", 1 << 30)
    hopper = gluon_module(fp8_gemm.HOPPER_FP8_GEMM)
    w = weight(n, k, "block", seed=3)
    if hopper is None or not hopper.usable(torch.empty(1, k, device=DEV), w):
        pytest.skip("the Hopper FP8 kernel needs compute capability 9.0 and Triton 3.6")
    x = torch.randn(fp8_gemm.HOPPER_MIN_ROWS + 100, k, device=DEV).bfloat16()
    shipped = fp8_gemm.fp8_mm(x, w)
    for stages in (2, 3, 6):
        monkeypatch.setattr(hopper, "STAGES", stages)
        assert torch.equal(fp8_gemm.fp8_mm(x, w), shipped), stages


@pytest.mark.parametrize("n,k", [(24576, 4096), (6144, 4096), (4096, 12288), (16384, 1024), (3072, 1024)])
def test_cublas_gives_the_kernels_bits_where_fp8_mm_runs_it(monkeypatch, n, k):
    """From CUBLAS_MIN_ROWS rows on Hopper a block-scaled weight runs cuBLAS's block-scaled FP8
    product (`torch._scaled_mm`): its rows are the Triton and the Gluon kernel's bits at every row
    count from there, ragged ones included, and fewer rows give the same rows."""
    from kvtool.engine.kernels import fp8_gemm
    from kvtool.engine.kernels.gluon import gluon_module
    from kvtool.engine.kernels.tiles import sm_count

    w = weight(n, k, "block", seed=n + k)
    if not fp8_gemm.cublas_usable(torch.empty(1, k, device=DEV, dtype=torch.bfloat16), w):
        pytest.skip("cuBLAS's FP8 product is routed to on Hopper only")
    calls = []
    scaled_mm = torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **kw: calls.append(a[0].shape[0]) or scaled_mm(*a, **kw))
    g = torch.Generator(device=DEV).manual_seed(n)
    x = torch.randn(8192, k, device=DEV, generator=g).bfloat16()
    full = fp8_gemm.fp8_mm(x, w)
    assert calls == [8192]
    for m in (fp8_gemm.CUBLAS_MIN_ROWS, 1025, 1026, 1027, 1500, 2048, 4097, 8192):
        triton_tiles = fp8_gemm.config_for(m, n, sm_count(DEV), k)
        assert torch.equal(fp8_gemm.fp8_mm(x[:m], w, triton_tiles), full[:m]), m
        assert torch.equal(fp8_gemm.fp8_mm(x[-m:], w), full[-m:]), m
    hopper = gluon_module(fp8_gemm.HOPPER_FP8_GEMM)
    if hopper is not None and hopper.usable(x, w):
        q, q_scale = fp8_gemm.quantize_rows(x[:3000])
        out = torch.empty(3000, n, device=DEV, dtype=torch.bfloat16)
        assert torch.equal(hopper.hopper_fp8_mm(q, q_scale, w, out), full[:3000])
    calls.clear()
    for m in (1, 8, 9, 65, fp8_gemm.CUBLAS_MIN_ROWS - 1):
        assert torch.equal(fp8_gemm.fp8_mm(x[:m], w), full[:m]), m
    assert calls == []


@pytest.mark.parametrize("n,k", [(512, 256), (1024, 384), (256, 768)])
def test_weights_whose_scales_cublas_misreads_keep_the_kernels_bits(n, k):
    """cuBLAS misreads weight scales whose K / 128 is not a multiple of CUBLAS_SCALE_MULTIPLE (no
    error, other bits): such weights run kvtool's kernels at every row count."""
    from kvtool.engine.kernels import fp8_gemm
    from kvtool.engine.kernels.tiles import sm_count

    w = weight(n, k, "block", seed=5)
    assert not fp8_gemm.cublas_usable(torch.empty(1, k, device=DEV, dtype=torch.bfloat16), w)
    x = torch.randn(2050, k, device=DEV).bfloat16()
    for m in (fp8_gemm.CUBLAS_MIN_ROWS, 2050):
        tiles = fp8_gemm.config_for(m, n, sm_count(DEV), k)
        assert torch.equal(fp8_gemm.fp8_mm(x[:m], w), fp8_gemm.fp8_mm(x[:m], w, tiles)), m


@pytest.mark.parametrize("n,k", [(24576, 4096), (1000, 640)])
def test_quantising_inside_the_product_gives_the_same_bits(monkeypatch, n, k):
    """`FUSED_QUANTIZE_ROWS` (a speed knob): activations quantised inside the product's programs
    give the bits of those quantised apart first, at every row count it covers."""
    from kvtool.engine.kernels import fp8_gemm

    w = weight(n, k, "block", seed=7)
    x = torch.randn(64, k, device=DEV).bfloat16()
    apart = {m: fp8_gemm.fp8_mm(x[:m], w) for m in (1, 9, 33, 64)}
    monkeypatch.setattr(fp8_gemm, "FUSED_QUANTIZE_ROWS", 64)
    for m, expected in apart.items():
        assert torch.equal(fp8_gemm.fp8_mm(x[:m], w), expected), m


@pytest.mark.parametrize("n,k", [(4096, 4096), (4096, 12288)])  # Qwen3-8B's o_proj and down_proj: K in 4 parts
def test_a_split_k_gives_one_programs_bits_at_every_call(monkeypatch, n, k):
    """A decode step's product whose K is spread over parts (SPLIT_PROGRAMS on), called again and
    again (fresh partials buffers, the shared tile counters), gives every time the bits of the
    same rows in a product of one program per tile, all finite; so do replays of it captured in
    a CUDA graph, and eager calls after them (the counters are back at zero)."""
    from kvtool.engine.kernels import fp8_gemm

    monkeypatch.setattr(fp8_gemm, "SPLIT_PROGRAMS", 512)
    assert fp8_gemm.k_split(n, k) == 4
    w = weight(n, k, "block", seed=11)
    x = torch.randn(64, k, device=DEV).bfloat16()
    whole = fp8_gemm.fp8_mm(x, w)  # 64 rows: one program per tile, K never in parts
    assert torch.isfinite(whole).all()
    for _ in range(5):
        for m in (1, 2, 3, 8):
            assert torch.equal(fp8_gemm.fp8_mm(x[:m], w), whole[:m]), m
    xs = x[:1].clone()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(3):  # several products in one graph, as a benchmark's replays run them
            out = fp8_gemm.fp8_mm(xs, w)
    for row in (0, 5, 63, 0):
        xs.copy_(x[row : row + 1])
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, whole[row : row + 1]), row
    for m in (1, 8):
        assert torch.equal(fp8_gemm.fp8_mm(x[:m], w), whole[:m]), m
