"""fp8 KV pages on CUDA (`--kv-cache-dtype fp8*`): the kernels store torch's quantisation
fp8(clamp(x / scale)) bit for bit (the store kernel and the fused rope kernel alike), read back
fp8 * scale rounded to the model's dtype, and attend over fp8 pages as over pages of q's dtype
that hold the dequantised values (to rounding), the fixed-tile decode keeping each row's bits at
any batch; a prompt's rows after a KV hit are the bits of the prompt computed whole. Skipped without CUDA (and below compute capability 8.9, which has no fp8
conversions).
"""

import numpy as np
import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                       reason="needs a CUDA device with fp8 conversions"),
]

DEV = torch.device("cuda")
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
LIMIT = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
# Per-layer scales of 1.0 and of other values, some small enough that large values saturate.
K_SCALES = [1.0, 0.01, 2.5, 1 / 3]
V_SCALES = [1.0, 3.0, 0.002, 0.7]


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8)


def _quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """torch's fp8 cache write. `scale` is a 0-d CUDA tensor, which torch divides by exactly (a
    Python float would be multiplied by its reciprocal)."""
    return (x.float() / scale).clamp(-LIMIT[dtype], LIMIT[dtype]).to(dtype)


def _dequantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (x.float() * scale).to(dtype)


def _values(shape, seed, dtype=torch.bfloat16):
    """Random values over many magnitudes (down to fp8 subnormals, up past saturation), with
    zeros of both signs."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(shape, generator=g, device=DEV) * 10 ** (torch.rand(shape, generator=g, device=DEV) * 8 - 4)
    x.view(-1)[:4] = torch.tensor([0.0, -0.0, 1e-6, -1e5], device=DEV)
    return x.to(dtype)


def _pages(dtype, num_blocks, layers, bs, hkv, d, k_scales=None, v_scales=None):
    from kvtool.engine.kv.pages import DTYPE_NAMES, KVGeometry, KVPages

    geo = KVGeometry(num_layers=layers, num_kv_heads=hkv, head_dim=d, block_size=bs, dtype=DTYPE_NAMES[dtype])
    return KVPages(geo, num_blocks, DEV, k_scales, v_scales)


def _fp8_and_dequantised(dtype, model_dtype, num_blocks, layers, bs, hkv, d, seed):
    """fp8 pages of quantised random values, and pages of model_dtype holding their dequantised values."""
    kv = _pages(dtype, num_blocks, layers, bs, hkv, d, [0.05, 0.02, 0.3], [0.01, 0.04, 0.2])
    x = _values((num_blocks, 2, layers, bs, hkv, d), seed, torch.float32) / 100
    deq = torch.empty(kv.tensor.shape, dtype=model_dtype, device=DEV)
    for layer in range(layers):
        for i, scales in enumerate((kv.k_scale, kv.v_scale)):
            kv.tensor[:, i, layer] = _quantize(x[:, i, layer], scales[layer], dtype)
            deq[:, i, layer] = _dequantize(kv.tensor[:, i, layer], scales[layer], model_dtype)
    return kv, deq


@pytest.mark.parametrize("dtype", FP8)
def test_store_kv_quantises_as_torch_and_gather_kv_dequantises(dtype):
    from kvtool.engine.kernels.attention.triton_ops import gather_kv, store_kv

    bs, hkv, d, layers, nb = 16, 8, 128, 4, 64
    kv = _pages(dtype, nb, layers, bs, hkv, d, K_SCALES, V_SCALES)
    k, v = _values((6, hkv, d), 1), _values((6, hkv, d), 2)
    slots = torch.tensor([0, 17, -1, 511, 1023, 40], dtype=torch.int32, device=DEV)
    keep = torch.tensor([0, 1, 3, 4, 5], device=DEV)
    expect = torch.zeros_like(kv.tensor)
    for layer in range(layers):
        store_kv(kv.tensor, layer, k, v, slots, k_scale=kv.k_scale, v_scale=kv.v_scale)
        for i, s in enumerate(slots.tolist()):
            if s >= 0:
                expect[s // bs, 0, layer, s % bs] = _quantize(k[i], kv.k_scale[layer], dtype)
                expect[s // bs, 1, layer, s % bs] = _quantize(v[i], kv.v_scale[layer], dtype)
    assert torch.equal(_bits(kv.tensor), _bits(expect))
    assert (kv.tensor.float().abs() == LIMIT[dtype]).any()  # some values saturated

    kept = slots[keep].long()
    for layer in range(layers):
        # The stored values at the kept slots, exactly (fp8 -> float32 is exact).
        stored_k = kv.tensor[:, 0, layer].float()[kept // bs, kept % bs]
        stored_v = kv.tensor[:, 1, layer].float()[kept // bs, kept % bs]
        for out_dtype in (torch.bfloat16, torch.float16):
            kk, vv = gather_kv(kv.tensor, layer, slots[keep].contiguous(), out_dtype,
                               k_scale=kv.k_scale, v_scale=kv.v_scale)
            assert kk.dtype == vv.dtype == out_dtype
            assert torch.equal(kk, _dequantize(stored_k, kv.k_scale[layer], out_dtype))
            assert torch.equal(vv, _dequantize(stored_v, kv.v_scale[layer], out_dtype))


@pytest.mark.parametrize("dtype", FP8)
def test_kernels_store_what_kv_pages_write_stores(dtype):
    """The CUDA store and the pages' own write (the CPU backend's) agree bit for bit."""
    from kvtool.engine.kernels.attention.triton_ops import store_kv

    bs, hkv, d, layers, nb = 16, 2, 64, 4, 8
    ours, theirs = (_pages(dtype, nb, layers, bs, hkv, d, K_SCALES, V_SCALES) for _ in range(2))
    k, v = _values((20, hkv, d), 3), _values((20, hkv, d), 4)
    slots = torch.randperm(nb * bs, device=DEV)[:20]
    for layer in range(layers):
        store_kv(ours.tensor, layer, k, v, slots.to(torch.int32), k_scale=ours.k_scale, v_scale=ours.v_scale)
        theirs.write(layer, k, v, slots // bs, slots % bs)
    assert torch.equal(_bits(ours.tensor), _bits(theirs.tensor))


def _close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal to rounding: an output element is a weighted sum of values up to max |ref|, whose
    products may round a few units of their last place otherwise, so the absolute tolerance
    follows the largest output (two bf16 units there); a scale left out would be off by factors."""
    out, ref = out.float(), ref.float()
    torch.testing.assert_close(out, ref, atol=2**-6 * float(ref.abs().amax()), rtol=1.6e-2)


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("model_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window", [None, 100])
def test_decode_over_fp8_pages_matches_the_dequantised_values_and_keeps_its_rows(dtype, model_dtype, window):
    """Both decode kernels dequantise each K/V tile after its load: their rows agree with the same
    kernels over pages of q's dtype holding the dequantised values (the products may round
    otherwise: fp8 tiles reach the tensor cores from registers, not from shared memory), and the
    fixed-tile kernel's rows keep their bits over fp8 pages at any program count and batch."""
    from kvtool.engine.kernels.attention.context import TILE
    from kvtool.engine.kernels.attention.triton_ops import paged_decode
    from kvtool.engine.kernels.attention.triton_tiles import paged_decode_tiles

    bs, hq, hkv, d, layers = 16, 16, 4, 128, 3
    ctx = torch.tensor([1, 17, 300, 1000, 0], dtype=torch.int32)
    width = -(-int(ctx.max()) // bs)
    nb = width * len(ctx) + 2
    kv, deq = _fp8_and_dequantised(dtype, model_dtype, nb, layers, bs, hkv, d, seed=5)
    tables = torch.stack([torch.randperm(nb)[:width] for _ in ctx]).to(torch.int32).to(DEV)
    ctx = ctx.to(DEV)
    q = torch.randn((len(ctx), hq, d), device=DEV).to(model_dtype)
    scales = {"k_scale": kv.k_scale, "v_scale": kv.v_scale}
    order = torch.arange(len(ctx), dtype=torch.int32, device=DEV)

    def tiles_decode(pages, rows, programs, **kw):
        c = ctx[rows]
        tiles = [-(-n // TILE) for n in c.tolist()]
        base = torch.tensor(np.cumsum([0] + tiles[:-1]), dtype=torch.int32, device=DEV)
        out = torch.full_like(q[rows], float("nan"))
        paged_decode_tiles(q[rows], pages, layer, tables[rows], c, base, max(1, sum(tiles)), d**-0.5, programs, out,
                           order[: len(rows)], window, **kw)
        return out

    every = list(range(len(ctx)))
    for layer in range(layers):
        for splits in (1, 5):
            out, ref = torch.full_like(q, float("nan")), torch.full_like(q, float("nan"))
            paged_decode(q, kv.tensor, layer, tables, ctx, d**-0.5, splits, out, order, window, **scales)
            paged_decode(q, deq, layer, tables, ctx, d**-0.5, splits, ref, order, window)
            _close(out, ref)
        batched = tiles_decode(kv.tensor, every, 1, **scales)
        _close(batched, tiles_decode(deq, every, 1))
        assert torch.equal(tiles_decode(kv.tensor, every, 2, **scales), batched), layer
        for row in every:
            assert torch.equal(tiles_decode(kv.tensor, [row], 1, **scales), batched[row : row + 1]), (layer, row)


@pytest.mark.parametrize("dtype", FP8)
@pytest.mark.parametrize("hq,hkv,d,norm", [(16, 8, 128, True), (9, 3, 64, False), (4, 2, 96, True)])
def test_rope_kernel_stores_into_fp8_pages_what_store_kv_stores(dtype, hq, hkv, d, norm):
    """The fused rope kernel quantises its k/v into fp8 pages as the store kernel quantises the
    k/v it returns: bit for bit, padding slots (-1) untouched, at a layer of non-1 scales."""
    from kvtool.engine.kernels.attention.triton_ops import store_kv
    from kvtool.engine.models.fused_ops import qkv_norm_rope

    g = torch.Generator(device=DEV).manual_seed(3)
    t, layers, bs, nb = 5, 4, 16, 8
    rnd = lambda *shape: (torch.randn(shape, generator=g, device=DEV) * 30).to(torch.bfloat16)
    qkv, cos, sin = rnd(t, (hq + 2 * hkv) * d), rnd(t, d) / 30, rnd(t, d) / 30
    qw, kw = (rnd(d) / 30, rnd(d) / 30) if norm else (None, None)
    rows = torch.zeros((t, 4), dtype=torch.int32, device=DEV)
    rows[:, 2] = torch.tensor([3, 17, -1, 40, 127], dtype=torch.int32, device=DEV)
    slots = rows[:, 2]
    separate = _pages(dtype, nb, layers, bs, hkv, d, K_SCALES, V_SCALES)
    separate.tensor.copy_(_quantize(_values(separate.tensor.shape, 9), torch.tensor(1.0, device=DEV), dtype))
    fused = separate.tensor.clone()
    scales = {"k_scale": separate.k_scale, "v_scale": separate.v_scale}
    for layer in (1, 2):
        q1, k1, v1 = qkv_norm_rope(qkv, cos, sin, hq, hkv, d, qw, kw, 1e-6)
        store_kv(separate.tensor, layer, k1, v1, slots.contiguous(), **scales)
        q2, k2, v2 = qkv_norm_rope(qkv, cos, sin, hq, hkv, d, qw, kw, 1e-6, pages=fused, layer=layer, slots=slots,
                                   **scales)
        assert torch.equal(q1, q2) and torch.equal(k1, k2) and torch.equal(v1, v2)
    assert torch.equal(_bits(separate.tensor), _bits(fused))


@pytest.mark.parametrize("dtype", FP8)
def test_rows_after_a_hit_are_the_rows_of_the_whole_prompt(dtype):
    """With fp8 pages the prefill rows attend over the stored, rounded K/V, the new tokens' too:
    a prompt computed in two steps (the second after the first's K/V, as after a KV hit) gives
    its rows the bits they have when the prompt is computed in one."""
    from kvtool.engine.core.messages import ScheduledRequest
    from kvtool.engine.kernels.attention import AttentionMetadata, attend, attention_context, select_backend
    from kvtool.engine.worker.model_runner import decode_rows, pack_step

    bs, hq, hkv, d, n, cut = 16, 8, 2, 128, 300, 131
    assert select_backend(DEV, dtype, d, torch.bfloat16) == "cuda"
    blocks = np.arange(-(-n // bs), dtype=np.int32)
    q = torch.randn((n, hq, d), device=DEV).to(torch.bfloat16)
    k = (torch.randn((n, hkv, d), device=DEV) * 4).to(torch.bfloat16)
    v = (torch.randn((n, hkv, d), device=DEV) * 4).to(torch.bfloat16)

    def run(kv, start, stop):
        s = ScheduledRequest(request_id="r", token_ids=list(range(stop - start)), start=start,
                             new_block_ids=blocks.tolist(), sample=True)
        step = pack_step([], decode_rows([], [], bs), [s], [blocks], bs, DEV, 1)
        meta = AttentionMetadata(kv_pages=kv, seqs=[], slot_block_ids=None, slot_offsets=None,
                                 device_batch=step.batch)
        with torch.inference_mode(), attention_context(meta):
            return attend(1, q[start:stop], k[start:stop], v[start:stop], d**-0.5)

    whole, parts = (_pages(dtype, len(blocks), 2, bs, hkv, d, [1.0, 0.03], [1.0, 0.02]) for _ in range(2))
    out = run(whole, 0, n)
    head, tail = run(parts, 0, cut), run(parts, cut, n)
    assert torch.equal(_bits(whole.tensor), _bits(parts.tensor))
    assert torch.equal(head, out[:cut]) and torch.equal(tail, out[cut:])
