"""CUDA attention kernels against the reference: split-KV paged decode, K/V store and gather, the
CUDA backend on mixed batches, the fused elementwise ops, and the pinned-pool layer copy.

Each check draws fresh random inputs, poisons outputs first, and measures ||out - ref|| / ||ref||
against a float32/float64 reference; bf16 operands land between 1e-3 and 1e-2. Skipped without CUDA.
"""

import math

import numpy as np
import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEV = torch.device("cuda")
BF16_TOL = 1e-2


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    assert not torch.isnan(out).any(), "output has NaN (an element was never written?)"
    return float((out - ref).norm() / ref.norm())


def random_pages(num_blocks, layers, bs, hkv, d, dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randn((num_blocks, 2, layers, bs, hkv, d), generator=g, device=DEV, dtype=torch.float32).to(dtype)


def decode_reference(q, pages, layer, tables, ctx_lens, scale):
    """float64 attention of one query per sequence over its pages: [B, Hq, D]."""
    bs, hkv = pages.shape[3], pages.shape[4]
    out = []
    for b in range(q.shape[0]):
        n = int(ctx_lens[b])
        blocks = tables[b][: -(-n // bs)].long()
        k = pages[blocks, 0, layer].reshape(-1, hkv, pages.shape[5])[:n].double()
        v = pages[blocks, 1, layer].reshape(-1, hkv, pages.shape[5])[:n].double()
        group = q.shape[1] // hkv
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        s = torch.einsum("hd,thd->ht", q[b].double(), k) * scale
        out.append(torch.einsum("ht,thd->hd", s.softmax(-1), v))
    return torch.stack(out)


@pytest.mark.parametrize("bs", [16, 256])
@pytest.mark.parametrize("hq,hkv,d", [(32, 8, 128), (16, 8, 128), (4, 2, 64), (8, 8, 128), (8, 2, 96)])
@pytest.mark.parametrize("num_splits", [1, 5, 33])
def test_paged_decode_matches_reference(bs, hq, hkv, d, num_splits):
    from kvtool.engine.kernels.attention.triton_ops import paged_decode

    torch.manual_seed(bs + hq + num_splits)
    layers, layer = 3, 2
    ctx = torch.tensor([1, 17, bs, bs + 1, 1000, 3000], dtype=torch.int32)
    width = -(-int(ctx.max()) // bs)
    num_blocks = width * len(ctx) + 3
    pages = random_pages(num_blocks, layers, bs, hkv, d, seed=bs + hq)
    tables = torch.stack([torch.randperm(num_blocks)[:width] for _ in ctx]).to(torch.int32)
    q = torch.randn((len(ctx), hq, d), device=DEV).to(torch.bfloat16)
    out = torch.full_like(q, float("nan"))
    scale = d**-0.5
    paged_decode(q, pages, layer, tables.to(DEV), ctx.to(DEV), scale, num_splits, out)
    ref = decode_reference(q.cpu(), pages.cpu(), layer, tables, ctx, scale)
    assert rel_err(out.cpu(), ref) < BF16_TOL


def test_paged_decode_long_context_and_empty_rows():
    """B = 1 at 32k (many splits), plus a context-0 row (CUDA-graph padding) that must read as zeros."""
    from kvtool.engine.kernels.attention.triton_ops import choose_num_splits, paged_decode

    bs, hq, hkv, d = 16, 32, 8, 128
    ctx = torch.tensor([32768, 0], dtype=torch.int32)
    width = 32768 // bs
    pages = random_pages(width + 8, 2, bs, hkv, d, seed=3)
    tables = torch.stack([torch.randperm(width + 8)[:width], torch.zeros(width, dtype=torch.long)]).to(torch.int32)
    q = torch.randn((2, hq, d), device=DEV).to(torch.bfloat16)
    out = torch.full_like(q, float("nan"))
    splits = choose_num_splits(1, hkv, 32768, torch.cuda.get_device_properties(DEV).multi_processor_count)
    assert splits > 8
    paged_decode(q, pages, 1, tables.to(DEV), ctx.to(DEV), d**-0.5, splits, out)
    ref = decode_reference(q[:1].cpu(), pages.cpu(), 1, tables[:1], ctx[:1], d**-0.5)
    assert rel_err(out[:1].cpu(), ref) < BF16_TOL
    assert torch.equal(out[1], torch.zeros_like(out[1]))


def test_store_and_gather_kv():
    from kvtool.engine.kernels.attention.triton_ops import gather_kv, store_kv

    bs, hkv, d, layers = 16, 8, 128, 4
    pages = random_pages(64, layers, bs, hkv, d, seed=5)
    before = pages.clone()
    k = torch.randn((6, hkv, d), device=DEV).to(torch.bfloat16)
    v = torch.randn((6, hkv, d), device=DEV).to(torch.bfloat16)
    slots = torch.tensor([0, 17, -1, 511, 1023, 40], dtype=torch.int32, device=DEV)
    store_kv(pages, 2, k, v, slots)
    expect = before.clone()
    for i, s in enumerate(slots.tolist()):
        if s >= 0:
            expect[s // bs, 0, 2, s % bs] = k[i]
            expect[s // bs, 1, 2, s % bs] = v[i]
    assert torch.equal(pages, expect)
    keep = torch.tensor([0, 1, 3, 4, 5])
    kk, vv = gather_kv(pages, 2, slots[keep].contiguous())
    assert torch.equal(kk, k[keep.to(DEV)]) and torch.equal(vv, v[keep.to(DEV)])


def _scheduled(rid, tokens, start, blocks, sample=True):
    from kvtool.engine.core.messages import ScheduledRequest

    return ScheduledRequest(request_id=rid, token_ids=tokens, start=start, new_block_ids=list(blocks), sample=sample)


@pytest.mark.parametrize(
    "case", ["decode", "single_prefill", "varlen", "prefix", "mixed", "long_prefix", "short_tail", "prefill_with_decode"]
)
@pytest.mark.parametrize("d", [128, 96])  # 96 (Phi-3): the kernels pad the head to 128
def test_cuda_backend_matches_reference(case, d):
    """A step through `attend` with the CUDA backend's metadata against the reference backend
    (float32 pages, float32 SDPA) on the same inputs; the pages must also end up the same."""
    from kvtool.engine.kernels.attention import AttentionMetadata, SeqSpan, attend, attention_context, select_backend
    from kvtool.engine.kv.pages import KVGeometry, KVPages
    from kvtool.engine.worker.model_runner import decode_rows, pack_step

    assert select_backend(DEV, torch.bfloat16, d) == "cuda"
    bs, hq, hkv, layers = 16, 32, 8, 2
    geo = KVGeometry(num_layers=layers, num_kv_heads=hkv, head_dim=d, block_size=bs, dtype="bfloat16")
    pages = KVPages(geo, 400, DEV)
    pages.tensor.copy_(random_pages(400, layers, bs, hkv, d, seed=11))
    geo32 = KVGeometry(num_layers=layers, num_kv_heads=hkv, head_dim=d, block_size=bs, dtype="float32")
    pages32 = KVPages(geo32, 400, DEV)
    pages32.tensor.copy_(pages.tensor.float())

    perm = torch.randperm(400).tolist()
    spans = {  # (start, q_len) per sequence
        "decode": [(40, 1), (0, 1), (700, 1)],
        "single_prefill": [(0, 300)],
        "varlen": [(0, 33), (0, 200), (0, 2)],
        "prefix": [(160, 50), (32, 7)],
        "mixed": [(90, 1), (0, 120), (48, 17), (300, 1)],
        "long_prefix": [(100, 400)],
        "short_tail": [(1000, 9)],  # rows that start mid key tile, fewer than one query block
        "prefill_with_decode": [(40, 1), (0, 500), (7, 1)],
    }[case]
    seqs, at = [], 0
    for i, (start, q_len) in enumerate(spans):
        n_blocks = -(-(start + q_len) // bs)
        blocks, at = perm[at : at + n_blocks], at + n_blocks
        seqs.append(_scheduled(f"r{i}", list(range(q_len)), start, blocks))
    decode = [s for s in seqs if s.num_tokens == 1]
    prefill = [s for s in seqs if s.num_tokens > 1]
    order = decode + prefill
    t = sum(s.num_tokens for s in order)
    q = torch.randn((t, hq, d), device=DEV).to(torch.bfloat16)
    k = torch.randn((t, hkv, d), device=DEV).to(torch.bfloat16)
    v = torch.randn((t, hkv, d), device=DEV).to(torch.bfloat16)
    scale = d**-0.5

    tables = [np.asarray(s.new_block_ids, dtype=np.int32) for s in order]
    rows = decode_rows(decode, tables[: len(decode)], bs)
    step = pack_step(decode, rows, prefill, tables[len(decode) :], bs, DEV, num_splits=4)
    meta = AttentionMetadata(kv_pages=pages, seqs=[], slot_block_ids=None, slot_offsets=None, device_batch=step.batch)
    with torch.inference_mode(), attention_context(meta):
        out = attend(1, q, k, v, scale)

    spans_ref, blocks, offsets, row = [], [], [], 0
    for s in order:
        ctx = s.start + s.num_tokens
        table = torch.tensor(s.new_block_ids[: -(-ctx // bs)], dtype=torch.long, device=DEV)
        spans_ref.append(SeqSpan(q_start=row, q_len=s.num_tokens, ctx_len=ctx, block_ids=table))
        blocks += [s.new_block_ids[p // bs] for p in range(s.start, ctx)]
        offsets += [p % bs for p in range(s.start, ctx)]
        row += s.num_tokens
    meta_ref = AttentionMetadata(
        kv_pages=pages32, seqs=spans_ref,
        slot_block_ids=torch.tensor(blocks, device=DEV), slot_offsets=torch.tensor(offsets, device=DEV),
    )
    with torch.inference_mode(), attention_context(meta_ref):
        ref = attend(1, q.float(), k.float(), v.float(), scale)
    assert rel_err(out.float(), ref) < BF16_TOL
    assert torch.equal(pages.tensor.float(), pages32.tensor)


@pytest.mark.parametrize("d", [128, 96])
def test_fused_ops_match_eager(d):
    import torch.nn.functional as F

    from kvtool.engine.models.fused_ops import qkv_norm_rope, rms_norm, silu_mul
    from kvtool.engine.models.layers import apply_rotary

    x = torch.randn((37, 4096), device=DEV).to(torch.bfloat16) * 3
    w = (1 + 0.1 * torch.randn(4096, device=DEV)).to(torch.bfloat16)
    ref = w * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    assert rel_err(rms_norm(x, w, 1e-6), ref) < 4e-3
    gu = torch.randn((37, 2 * 12288), device=DEV).to(torch.bfloat16)
    assert rel_err(silu_mul(gu), F.silu(gu[:, :12288]) * gu[:, 12288:]) < 4e-3

    t, hq, hkv = 29, 32, 8
    qkv = torch.randn((t, (hq + 2 * hkv) * d), device=DEV).to(torch.bfloat16)
    pos = torch.arange(100, 100 + t, device=DEV).float()
    inv = 1.0 / (1e6 ** (torch.arange(0, d, 2, device=DEV).float() / d))
    emb = torch.cat([pos[:, None] * inv[None, :]] * 2, dim=-1)
    cos, sin = emb.cos().to(torch.bfloat16), emb.sin().to(torch.bfloat16)
    qw = (1 + 0.1 * torch.randn(d, device=DEV)).to(torch.bfloat16)
    kw = (1 + 0.1 * torch.randn(d, device=DEV)).to(torch.bfloat16)

    def norm(x, wt):
        return wt * (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)

    q0 = qkv[:, : hq * d].view(t, hq, d)
    k0 = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
    v0 = qkv[:, (hq + hkv) * d :].view(t, hkv, d)
    for weights in ((qw, kw), (None, None)):
        q, k, v = qkv_norm_rope(qkv, cos, sin, hq, hkv, d, *weights, 1e-6)
        qr = norm(q0, qw) if weights[0] is not None else q0
        kr = norm(k0, kw) if weights[0] is not None else k0
        assert rel_err(q, apply_rotary(qr, cos, sin)) < 4e-3
        assert rel_err(k, apply_rotary(kr, cos, sin)) < 4e-3
        assert torch.equal(v, v0)


TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0, "max_position_embeddings": 2048, "tie_word_embeddings": False, "attention_bias": True,
    "torch_dtype": "bfloat16",
}


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_fused_model_matches_plain_model(arch):
    """The same weights with and without the fused ops: logits and the stored K/V agree within bf16."""
    from kvtool.engine.kernels.attention import AttentionMetadata, attention_context
    from kvtool.engine.kv.pages import KVGeometry, KVPages
    from kvtool.engine.models import build_model
    from kvtool.engine.models.fast_paths import apply_fast_paths
    from kvtool.engine.models.model_dir import parse_config
    from kvtool.engine.presets.catalog import PRESETS
    from kvtool.engine.worker.model_runner import decode_rows, pack_step

    cfg = parse_config(PRESETS["tiny"].hf_config if arch == "qwen3" else TINY_LLAMA)
    bs = 16
    geo = KVGeometry(num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                     block_size=bs, dtype="bfloat16")
    seq = _scheduled("r", [(i * 7) % 500 for i in range(70)], 0, list(range(5)))
    results = []
    for fused in (False, True):
        model = build_model(cfg, DEV, torch.bfloat16, "dummy", seed=3)
        assert apply_fast_paths(model, DEV, torch.bfloat16, fused=fused).kernels == ("triton" if fused else "reference")
        pages = KVPages(geo, 8, DEV)
        step = pack_step([], decode_rows([], [], bs), [seq], [np.arange(5, dtype=np.int32)], bs, DEV, 1)
        meta = AttentionMetadata(kv_pages=pages, seqs=[], slot_block_ids=None, slot_offsets=None,
                                 device_batch=step.batch)
        with torch.inference_mode(), attention_context(meta):
            hidden = model(step.input_ids, step.positions)
            results.append((model.compute_logits(hidden[-1:]), pages.tensor.clone()))
    (lp, kp), (lf, kf) = results
    assert rel_err(lf, lp) < 2e-2
    assert rel_err(kf.float(), kp.float()) < 1e-2


def test_layer_copy_reads_and_writes_the_pinned_pool():
    from kvtool.engine.connectors.offloading.copy.layer_copy import copy_layer, probe_pinned_access

    pool = torch.randn((6, 2, 3, 16, 8, 128)).to(torch.bfloat16).pin_memory()
    before = pool.clone()
    pages = torch.zeros((10, 2, 3, 16, 8, 128), dtype=torch.bfloat16, device=DEV)
    assert probe_pinned_access(pool, pages)
    assert torch.equal(pool, before)  # the probe writes only its own scratch block
    pairs = torch.tensor([[1, 7], [4, 2], [5, 3]], device=DEV)
    for layer in range(3):
        copy_layer(pool, pages, pairs, layer)
    torch.cuda.synchronize()
    for src, dst in pairs.tolist():
        assert torch.equal(pages[dst].cpu(), pool[src])
    assert not pages[0].any()
    # the other way: page blocks into pool blocks, one layer at a time
    back = torch.zeros_like(pool).pin_memory()
    for layer in range(3):
        copy_layer(pages, back, pairs.flip(1).contiguous(), layer)
    torch.cuda.synchronize()
    for src, dst in pairs.tolist():
        assert torch.equal(back[src], pool[src])
    assert not back[0].any()


def test_choose_num_splits_covers_the_gpu():
    from kvtool.engine.kernels.attention.triton_ops import choose_num_splits

    assert choose_num_splits(256, 8, 40960, 132) == 1
    assert choose_num_splits(1, 8, 100, 132) == 1
    assert choose_num_splits(1, 8, 40960, 132) == math.ceil(264 / 8)


@pytest.mark.parametrize("rows, n", [(1, 1024), (7, 4096), (300, 896)])
def test_add_rms_norm_equals_the_add_then_the_norm(rows, n):
    """The fused residual add + RMSNorm keeps the eager rounding: the add in the activation dtype,
    then the same norm kernel's result, bit for bit."""
    from kvtool.engine.models.fused_ops import add_rms_norm, rms_norm

    g = torch.Generator(device=DEV).manual_seed(rows * n)
    x, d = (torch.randn((rows, n), generator=g, device=DEV).to(torch.bfloat16) for _ in range(2))
    w = torch.randn(n, generator=g, device=DEV).to(torch.bfloat16)
    h, y = add_rms_norm(x, d, w, 1e-6)
    assert torch.equal(h, x + d)
    assert torch.equal(y, rms_norm(x + d, w, 1e-6))


@pytest.mark.parametrize("hq,hkv,d,norm", [(16, 8, 128, True), (9, 3, 64, False), (4, 2, 96, True), (4, 4, 96, False)])
def test_rope_kernel_writes_the_pages_exactly_as_the_store_kernel(hq, hkv, d, norm):
    """The fused rope kernel's page write (decode graphs use it) equals rope, then store_kv: bit
    for bit, padding slots (-1) untouched, a strided slot view as the graphs pass it."""
    from kvtool.engine.kernels.attention.triton_ops import store_kv
    from kvtool.engine.models.fused_ops import qkv_norm_rope

    g = torch.Generator(device=DEV).manual_seed(3)
    t, layers, bs, nb = 5, 3, 16, 8
    rnd = lambda *shape: torch.randn(shape, generator=g, device=DEV).to(torch.bfloat16)
    qkv, cos, sin = rnd(t, (hq + 2 * hkv) * d), rnd(t, d), rnd(t, d)
    qw, kw = (rnd(d), rnd(d)) if norm else (None, None)
    rows = torch.zeros((t, 4), dtype=torch.int32, device=DEV)
    rows[:, 2] = torch.tensor([3, 17, -1, 40, 127], dtype=torch.int32, device=DEV)
    slots = rows[:, 2]
    separate = random_pages(nb, layers, bs, hkv, d, seed=4)
    fused = separate.clone()
    q1, k1, v1 = qkv_norm_rope(qkv, cos, sin, hq, hkv, d, qw, kw, 1e-6)
    store_kv(separate, 1, k1, v1, slots.contiguous())
    q2, k2, v2 = qkv_norm_rope(qkv, cos, sin, hq, hkv, d, qw, kw, 1e-6, pages=fused, layer=1, slots=slots)
    assert torch.equal(q1, q2) and torch.equal(k1, k2) and torch.equal(v1, v2)
    assert torch.equal(separate, fused)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_decode_launch_order_changes_no_bit(num_splits):
    """Giving the GPU the rows longest first (as the runner and the graphs do) computes exactly
    what row order computes, empty rows included."""
    from kvtool.engine.kernels.attention.context import longest_first
    from kvtool.engine.kernels.attention.triton_ops import paged_decode

    bs, hkv, hq, d, width = 16, 8, 16, 128, 40
    pages = random_pages(7 * width + 1, 2, bs, hkv, d, seed=5)
    tables = torch.randperm(7 * width, device=DEV)[: 7 * width].view(7, width).to(torch.int32)
    ctx = torch.tensor([5, 600, 0, 130, 640, 17, 300], dtype=torch.int32, device=DEV)
    q = torch.randn((7, hq, d), device=DEV).to(torch.bfloat16)
    plain, ordered = torch.full_like(q, 7.0), torch.full_like(q, -7.0)
    paged_decode(q, pages, 1, tables, ctx, d**-0.5, num_splits, plain)
    order = torch.from_numpy(longest_first(ctx.cpu().numpy())).to(DEV)
    assert order.tolist() == [4, 1, 6, 3, 5, 0, 2]
    paged_decode(q, pages, 1, tables, ctx, d**-0.5, num_splits, ordered, order)
    assert torch.equal(plain, ordered)
    assert not plain[2].any()


@pytest.mark.parametrize("window", [5, 64, 100, 700])
def test_sliding_window_kernels_match_the_reference_and_keep_row_bits(window):
    """Each row over its last `window` keys: the split-KV decode (1 and 5 splits), the fixed-tile
    decode (its rows the same for 1 to 3 programs), and the prefill kernel (its tail rows the bits
    of the whole prefill's), each against float64 attention over the window."""
    import torch.nn.functional as F

    from kvtool.engine.kernels.attention.context import TILE
    from kvtool.engine.kernels.attention.prefill import prefill_attention
    from kvtool.engine.kernels.attention.triton_ops import paged_decode
    from kvtool.engine.kernels.attention.triton_tiles import paged_decode_tiles

    bs, hq, hkv, d = 16, 8, 2, 128
    ctx = torch.tensor([1, 17, 70, 300, 1000], dtype=torch.int32)
    width = -(-int(ctx.max()) // bs)
    nb = width * len(ctx) + 2
    pages = random_pages(nb, 2, bs, hkv, d, seed=window)
    tables = torch.stack([torch.randperm(nb)[:width] for _ in ctx]).to(torch.int32)
    q = torch.randn((len(ctx), hq, d), device=DEV).to(torch.bfloat16)
    scale = d**-0.5
    ref = []
    for b, n in enumerate(ctx.tolist()):
        lo = max(0, n - window)
        blocks = tables[b][: -(-n // bs)].long()
        k = pages.cpu()[blocks, 0, 1].reshape(-1, hkv, d)[lo:n].double().repeat_interleave(hq // hkv, 1)
        v = pages.cpu()[blocks, 1, 1].reshape(-1, hkv, d)[lo:n].double().repeat_interleave(hq // hkv, 1)
        s = torch.einsum("hd,thd->ht", q[b].cpu().double(), k) * scale
        ref.append(torch.einsum("ht,thd->hd", s.softmax(-1), v))
    ref = torch.stack(ref)
    for splits in (1, 5):
        out = torch.full_like(q, float("nan"))
        paged_decode(q, pages, 1, tables.to(DEV), ctx.to(DEV), scale, splits, out, window=window)
        assert rel_err(out.cpu(), ref) < BF16_TOL
    tiles = [-(-n // TILE) for n in ctx.tolist()]
    base = torch.tensor(np.cumsum([0] + tiles[:-1]), dtype=torch.int32, device=DEV)
    outs = []
    for programs in (1, 2, 3):
        out = torch.full_like(q, float("nan"))
        paged_decode_tiles(q, pages, 1, tables.to(DEV), ctx.to(DEV), base, sum(tiles), scale, programs, out,
                           torch.arange(len(ctx), dtype=torch.int32, device=DEV), window=window)
        outs.append(out)
    assert rel_err(outs[0].cpu(), ref) < BF16_TOL
    assert all(torch.equal(outs[0], o) for o in outs[1:])

    n = 1000
    g = torch.Generator(device=DEV).manual_seed(window)
    qq, kk, vv = (torch.randn((n, h, d), generator=g, device=DEV).to(torch.bfloat16) for h in (hq, hkv, hkv))
    cu = torch.tensor([0, n], dtype=torch.int32, device=DEV)
    whole = prefill_attention(qq, kk, vv, cu, cu, n, scale, window=window)
    pos = torch.arange(n, device=DEV)
    mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
    sdpa = F.scaled_dot_product_attention(*(x.double().transpose(0, 1)[None] for x in (qq, kk, vv)), attn_mask=mask,
                                          scale=scale, enable_gqa=True)[0].transpose(0, 1)
    assert float((whole.double() - sdpa).norm() / sdpa.norm()) < BF16_TOL
    for rows in (1, 7, 64, 65, 300):
        tail = prefill_attention(qq[-rows:], kk, vv, torch.tensor([0, rows], dtype=torch.int32, device=DEV), cu,
                                 rows, scale, window=window)
        assert torch.equal(tail, whole[-rows:]), rows
