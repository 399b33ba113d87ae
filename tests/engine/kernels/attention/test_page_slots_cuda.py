"""The CUDA kernels address a layer's K/V by its slot in a block (`page_slot`, a KV cache group
layout: `kv.groups`) and its scales by the layer: bit for bit what they compute over a one-group
layout's pages, where the slot is the layer. Store, gather, split-KV and fixed-tile decode, and
the fused q/k norm + RoPE kernel writing into the pages; bf16 pages, and fp8 pages with per-layer
scales. Skipped without CUDA."""

import pytest
import torch

from kvtool.engine.kernels.attention.context import longest_first, tile_bases

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEV = torch.device("cuda")
NUM_BLOCKS, SLOTS, LAYERS, BS, HKV, D, HQ = 24, 2, 4, 16, 2, 128, 8
LAYER, SLOT = 3, 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_a_layer_in_its_slot_computes_what_it_does_in_its_own_layer(dtype):
    from kvtool.engine.kernels.attention import triton_ops
    from kvtool.engine.kernels.attention.triton_tiles import paged_decode_tiles

    if dtype == torch.float8_e4m3fn and torch.cuda.get_device_capability(DEV) < (8, 9):
        pytest.skip("fp8 pages need compute capability 8.9")
    g = torch.Generator(device=DEV).manual_seed(3)
    t = 100
    k, v = (torch.randn((t, HKV, D), generator=g, device=DEV).bfloat16() for _ in range(2))
    scales = {"k_scale": torch.rand(LAYERS, device=DEV) + 0.5, "v_scale": torch.rand(LAYERS, device=DEV) + 0.5}
    grouped = torch.zeros((NUM_BLOCKS, 2, SLOTS, BS, HKV, D), dtype=dtype, device=DEV)
    whole = torch.zeros((NUM_BLOCKS, 2, LAYERS, BS, HKV, D), dtype=dtype, device=DEV)
    table = torch.tensor([[7, 3, 11, 20, 5, 9, 1]], dtype=torch.int32, device=DEV)
    pos = torch.arange(t, device=DEV)
    slots = (table[0, pos // BS].long() * BS + pos % BS).int()
    triton_ops.store_kv(grouped, LAYER, k, v, slots, page_slot=SLOT, **scales)
    triton_ops.store_kv(whole, LAYER, k, v, slots, **scales)
    assert torch.equal(grouped[:, :, SLOT].view(torch.uint8), whole[:, :, LAYER].view(torch.uint8))
    assert not grouped[:, :, 0].view(torch.uint8).any()

    kk, vv = triton_ops.gather_kv(grouped, LAYER, slots, torch.bfloat16, page_slot=SLOT, **scales)
    rk, rv = triton_ops.gather_kv(whole, LAYER, slots, torch.bfloat16, **scales)
    assert torch.equal(kk, rk) and torch.equal(vv, rv)

    q = torch.randn((3, HQ, D), generator=g, device=DEV).bfloat16()
    tables = table.expand(3, -1).contiguous()
    ctx = torch.tensor([t, 61, 17], dtype=torch.int32, device=DEV)
    for window in (None, 40):
        a, b = torch.empty_like(q), torch.empty_like(q)
        triton_ops.paged_decode(q, grouped, LAYER, tables, ctx, 0.09, 2, a, window=window, page_slot=SLOT, **scales)
        triton_ops.paged_decode(q, whole, LAYER, tables, ctx, 0.09, 2, b, window=window, **scales)
        assert torch.equal(a, b)
        bases, num_tiles = tile_bases(ctx.cpu().numpy())
        order = torch.tensor(longest_first(ctx.cpu().numpy()), device=DEV)
        base = torch.tensor(bases, device=DEV)
        a, b = torch.empty_like(q), torch.empty_like(q)
        paged_decode_tiles(q, grouped, LAYER, tables, ctx, base, num_tiles, 0.09, 2, a, order, window,
                           page_slot=SLOT, **scales)
        paged_decode_tiles(q, whole, LAYER, tables, ctx, base, num_tiles, 0.09, 2, b, order, window, **scales)
        assert torch.equal(a, b)


def test_the_fused_rope_kernel_writes_a_layer_into_its_slot():
    from kvtool.engine.models.fused_ops import qkv_norm_rope

    g = torch.Generator(device=DEV).manual_seed(5)
    t = 40
    qkv = torch.randn((t, (HQ + 2 * HKV) * D), generator=g, device=DEV).bfloat16()
    angles = torch.rand((t, D), generator=g, device=DEV)
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    slots = torch.arange(5 * BS, 5 * BS + t, dtype=torch.int32, device=DEV)
    grouped = torch.zeros((NUM_BLOCKS, 2, SLOTS, BS, HKV, D), dtype=torch.bfloat16, device=DEV)
    whole = torch.zeros((NUM_BLOCKS, 2, LAYERS, BS, HKV, D), dtype=torch.bfloat16, device=DEV)
    a = qkv_norm_rope(qkv, cos, sin, HQ, HKV, D, None, None, 0.0, pages=grouped, layer=LAYER, slots=slots,
                      page_slot=SLOT)
    b = qkv_norm_rope(qkv, cos, sin, HQ, HKV, D, None, None, 0.0, pages=whole, layer=LAYER, slots=slots)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert torch.equal(grouped[:, :, SLOT], whole[:, :, LAYER]) and not grouped[:, :, 0].any()
