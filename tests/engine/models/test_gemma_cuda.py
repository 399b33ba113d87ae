"""Gemma 2 and Gemma 3 on CUDA: the soft-capped attention kernels, Gemma's fused ops, and the two
tiny presets with a window that binds (32 keys) through the fused forwards.

- the soft-capped split-KV decode (1 and 5 splits) and fixed-tile decode (1 to 3 programs, the
  same bits), heads of 64 and 256, each against float64 attention with the cap (and a window);
  a row computed alone has the bits it has in the batch;
- the soft-capped prefill kernel (heads of 64 and 128, which take the Triton kernel on Hopper
  too, and 256) against float64 attention; the last rows of a prompt computed alone (after a KV
  hit) and a prompt packed with another have the bits of the whole prompt's;
- Gemma's norm, norm-add-norm, GeGLU and q/k norm + RoPE kernels against the eager modules;
- each preset in bf16 with its fast paths (every projection through `row_invariant_gemm`), fed
  as the runner feeds it (chunked prefill and decode steps through the CUDA attention kernels),
  against transformers (bf16, eager attention: Gemma 2's soft cap) on the same random weights:
  logits within test_architectures_cuda's LOGIT_ATOL at every position, and transformers'
  greedy choice equal to ours wherever its top two logits are more than twice that apart;
- each preset batch-invariant with decode graphs captured (a request alone equals it batched);
- with prefix caching, prompts computed again (alone, after a batched cold run) hit the cache,
  one of them down to its last token (the one-token prefill graphs), and give the cold run's
  tokens and logprobs.
Skipped without CUDA.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.support.batch_invariance import tokens

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEV = torch.device("cuda")
DTYPE = torch.bfloat16
TOL = 1e-2  # relative error of bf16 operands against float64 (test_attention_kernels_cuda's)
LOGIT_ATOL = 0.08  # test_architectures_cuda's
PRESETS = ["tiny-gemma2", "tiny-gemma3"]
WINDOW = 32


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    assert not torch.isnan(out).any(), "output has NaN (an element was never written?)"
    return float((out - ref).norm() / ref.norm())


def capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, softcap: float,
                     allowed: torch.Tensor) -> torch.Tensor:
    """float64 attention of q [Hq, R, D] over k, v [Hkv, N, D], scores scale * q.k capped as
    transformers' eager attention caps them (tanh(s / c) * c), then `allowed` [R, N]."""
    group = q.shape[0] // k.shape[0]
    k, v = k.double().repeat_interleave(group, 0), v.double().repeat_interleave(group, 0)
    s = torch.matmul(q.double(), k.transpose(1, 2)) * scale
    s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~allowed, float("-inf"))
    return torch.matmul(s.softmax(-1), v)


# Scores of q scaled by 4 spread about 4: a cap of 5 bends most of them, one of 50 the largest.
CAPS = [(50.0, None), (5.0, None), (5.0, 48)]


@pytest.mark.parametrize("d", [64, 256])
@pytest.mark.parametrize("softcap,window", CAPS)
def test_soft_capped_decode_kernels_match_the_reference_and_keep_row_bits(d, softcap, window):
    from kvtool.engine.kernels.attention.context import tile_bases
    from kvtool.engine.kernels.attention.triton_ops import paged_decode
    from kvtool.engine.kernels.attention.triton_tiles import paged_decode_tiles

    g = torch.Generator(device=DEV).manual_seed(d + int(softcap))
    bs, hq, hkv = 16, 8, 4
    ctx = torch.tensor([1, 17, 70, 300, 1000], dtype=torch.int32, device=DEV)
    width = -(-int(ctx.max()) // bs)
    nb = width * len(ctx) + 2
    pages = torch.randn((nb, 2, 2, bs, hkv, d), generator=g, device=DEV).to(DTYPE)
    tables = torch.stack([torch.randperm(nb, generator=g, device=DEV)[:width] for _ in range(len(ctx))]).to(torch.int32)
    q = (4 * torch.randn((len(ctx), hq, d), generator=g, device=DEV)).to(DTYPE)
    scale = d**-0.5
    ref = []
    for b, n in enumerate(ctx.tolist()):
        blocks = tables[b][: -(-n // bs)].long()
        k = pages[blocks, 0, 1].reshape(-1, hkv, d)[:n].transpose(0, 1)
        v = pages[blocks, 1, 1].reshape(-1, hkv, d)[:n].transpose(0, 1)
        allowed = torch.ones((1, n), dtype=torch.bool, device=DEV)
        if window is not None:
            allowed[:, : max(0, n - window)] = False
        ref.append(capped_attention(q[b][:, None], k, v, scale, softcap, allowed)[:, 0])
    ref = torch.stack(ref)

    def split_kv(rows: list[int], splits: int) -> torch.Tensor:
        out = torch.full((len(rows), hq, d), float("nan"), dtype=DTYPE, device=DEV)
        paged_decode(q[rows], pages, 1, tables[rows], ctx[rows], scale, splits, out, window=window, softcap=softcap)
        return out

    def tiles(rows: list[int], programs: int) -> torch.Tensor:
        base, num_tiles = tile_bases(ctx[rows].cpu().numpy())
        out = torch.full((len(rows), hq, d), float("nan"), dtype=DTYPE, device=DEV)
        paged_decode_tiles(q[rows], pages, 1, tables[rows], ctx[rows], torch.from_numpy(base).to(DEV), num_tiles,
                           scale, programs, out, torch.arange(len(rows), dtype=torch.int32, device=DEV),
                           window=window, softcap=softcap)
        return out

    every = list(range(len(ctx)))
    for splits in (1, 5):
        whole = split_kv(every, splits)
        assert rel_err(whole, ref) < TOL, splits
        for b in every:  # a row alone: the bits it has in the batch (the split count fixed)
            assert torch.equal(split_kv([b], splits)[0], whole[b]), (splits, b)
    outs = [tiles(every, programs) for programs in (1, 2, 3)]
    assert rel_err(outs[0], ref) < TOL
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    for b in every:
        assert torch.equal(tiles([b], 2)[0], outs[0][b]), b
    assert torch.equal(tiles(every[::-1], 1), outs[0].flip(0))


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("softcap,window", CAPS)
def test_soft_capped_prefill_matches_the_reference_and_keeps_row_bits(d, softcap, window):
    from kvtool.engine.kernels.attention.prefill import prefill_attention

    g = torch.Generator(device=DEV).manual_seed(d + int(softcap))
    hq, hkv, n, m = 8, 4, 600, 150
    scale = d**-0.5

    def rnd(rows: int, heads: int, factor: float = 1.0) -> torch.Tensor:
        return (factor * torch.randn((rows, heads, d), generator=g, device=DEV)).to(DTYPE)

    qq, kk, vv = rnd(n, hq, 4.0), rnd(n, hkv), rnd(n, hkv)
    cu = torch.tensor([0, n], dtype=torch.int32, device=DEV)
    whole = prefill_attention(qq, kk, vv, cu, cu, n, scale, window=window, softcap=softcap)
    pos = torch.arange(n, device=DEV)
    allowed = pos[None, :] <= pos[:, None]
    if window is not None:
        allowed &= pos[None, :] > pos[:, None] - window
    ref = capped_attention(qq.transpose(0, 1), kk.transpose(0, 1), vv.transpose(0, 1), scale, softcap, allowed)
    assert rel_err(whole, ref.transpose(0, 1)) < TOL
    for rows in (1, 7, 64, 65, 300):  # the last rows alone, over the whole prompt's keys (a KV hit)
        tail = prefill_attention(qq[-rows:], kk, vv, torch.tensor([0, rows], dtype=torch.int32, device=DEV), cu,
                                 rows, scale, window=window, softcap=softcap)
        assert torch.equal(tail, whole[-rows:]), rows
    # Packed after another prompt: the same bits.
    q2, k2, v2 = rnd(m, hq, 4.0), rnd(m, hkv), rnd(m, hkv)
    cu2 = torch.tensor([0, m, m + n], dtype=torch.int32, device=DEV)
    both = prefill_attention(torch.cat([q2, qq]), torch.cat([k2, kk]), torch.cat([v2, vv]), cu2, cu2, n, scale,
                             window=window, softcap=softcap)
    assert torch.equal(both[m:], whole)


@pytest.mark.parametrize("d", [64, 256])
def test_gemma_fused_ops_match_the_eager_modules(d):
    from kvtool.engine.kernels.attention.triton_ops import store_kv
    from kvtool.engine.models.fused_ops import gelu_tanh_mul, gemma_add_norms, gemma_rms_norm, qkv_norm_rope
    from kvtool.engine.models.gemma import GemmaRMSNorm
    from kvtool.engine.models.layers import apply_rotary

    g = torch.Generator(device=DEV).manual_seed(d)

    def rnd(*shape: int, factor: float = 1.0) -> torch.Tensor:
        return (factor * torch.randn(shape, generator=g, device=DEV)).to(DTYPE)

    def eager_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        norm = GemmaRMSNorm(x.shape[-1], 1e-6).to(DEV, DTYPE).requires_grad_(False)
        norm.weight.copy_(w)
        return norm(x)

    hidden = 2304
    x, delta = rnd(37, hidden, factor=3.0), rnd(37, hidden, factor=20.0)
    w, wd = rnd(hidden, factor=0.5), rnd(hidden, factor=0.5)
    assert rel_err(gemma_rms_norm(x, w, 1e-6), eager_norm(x, w)) < 4e-3
    h, y = gemma_add_norms(x, delta, wd, 1e-6, w, 1e-6)
    # The add between the norms in the activation dtype, then the same norm kernel's bits.
    assert torch.equal(h, x + gemma_rms_norm(delta, wd, 1e-6))
    assert torch.equal(y, gemma_rms_norm(h, w, 1e-6))
    assert rel_err(h, x + eager_norm(delta, wd)) < 4e-3
    gu = rnd(37, 2 * 1536, factor=2.0)
    assert rel_err(gelu_tanh_mul(gu), F.gelu(gu[:, :1536], approximate="tanh") * gu[:, 1536:]) < 4e-3

    t, hq, hkv = 29, 8, 4
    qkv = rnd(t, (hq + 2 * hkv) * d)
    pos = torch.arange(100, 100 + t, device=DEV).float()
    inv = 1.0 / (1e4 ** (torch.arange(0, d, 2, device=DEV).float() / d))
    emb = torch.cat([pos[:, None] * inv[None, :]] * 2, dim=-1)
    cos, sin = emb.cos().to(DTYPE), emb.sin().to(DTYPE)
    qw, kw = rnd(d, factor=0.5), rnd(d, factor=0.5)
    q, k, v = qkv_norm_rope(qkv, cos, sin, hq, hkv, d, qw, kw, 1e-6, gemma_norm=True)
    q0 = qkv[:, : hq * d].view(t, hq, d)
    k0 = qkv[:, hq * d : (hq + hkv) * d].view(t, hkv, d)
    assert rel_err(q, apply_rotary(eager_norm(q0, qw), cos, sin)) < 4e-3
    assert rel_err(k, apply_rotary(eager_norm(k0, kw), cos, sin)) < 4e-3
    assert torch.equal(v, qkv[:, (hq + hkv) * d :].view(t, hkv, d))
    # Into the pages as the store kernel writes them (a padding slot: nothing).
    slots = torch.tensor([3, 17, -1, 40] + list(range(60, 60 + t - 4)), dtype=torch.int32, device=DEV)
    separate = torch.randn((8, 2, 3, 16, hkv, d), generator=g, device=DEV).to(DTYPE)
    fused = separate.clone()
    store_kv(separate, 1, k, v, slots)
    q2, k2, v2 = qkv_norm_rope(qkv, cos, sin, hq, hkv, d, qw, kw, 1e-6, pages=fused, layer=1, slots=slots,
                               gemma_norm=True)
    assert torch.equal(q, q2) and torch.equal(k, k2) and torch.equal(v, v2)
    assert torch.equal(separate, fused)


# ---- the models ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    from kvtool.engine.presets.catalog import PRESETS as CATALOG, write_random_model_dir

    root = tmp_path_factory.mktemp("gemma")
    dirs = {}
    for name in PRESETS:
        preset = CATALOG[name]
        write_random_model_dir(root / name, {**preset.hf_config, "sliding_window": WINDOW}, seed=3,
                               tokenizer=preset.tokenizer)
        dirs[name] = root / name
    return dirs


def kernel_greedy_run(model, config, prompt: list[int], num_steps: int, chunk: int = 48):
    """The prompt in chunks of `chunk` tokens, then greedy decode steps, each step packed as the
    runner packs it (`pack_step`: the prefill kernel over the pages' prefix, the split-KV decode)
    over pages whose blocks run backwards. Returns (logits at every fed position [P + S, V],
    float32 on the CPU, generated ids [S])."""
    from kvtool.engine.core.messages import ScheduledRequest
    from kvtool.engine.kernels.attention import AttentionMetadata, attention_context
    from kvtool.engine.kv.pages import KVGeometry, KVPages
    from kvtool.engine.worker.model_runner import decode_rows, pack_step

    bs = 16
    num_blocks = math.ceil((len(prompt) + num_steps) / bs)
    geometry = KVGeometry(num_layers=config.num_layers, num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                          block_size=bs, dtype="bfloat16")
    pages = KVPages(geometry, num_blocks + 1, DEV)
    table = np.arange(num_blocks, 0, -1, dtype=np.int32)
    logits: list[torch.Tensor] = []
    generated: list[int] = []
    start = 0
    feeds = [prompt[i : i + chunk] for i in range(0, len(prompt), chunk)]
    while len(generated) < num_steps:
        ids = feeds.pop(0) if feeds else [generated[-1]]
        s = ScheduledRequest(request_id="r", token_ids=ids, start=start, new_block_ids=[], sample=True)
        if start >= len(prompt):
            step = pack_step([s], decode_rows([s], [table], bs), [], [], bs, DEV, 3)
        else:
            step = pack_step([], decode_rows([], [], bs), [s], [table], bs, DEV, 1)
        meta = AttentionMetadata(kv_pages=pages, seqs=[], slot_block_ids=None, slot_offsets=None,
                                 device_batch=step.batch, row_invariant=True)
        with torch.inference_mode(), attention_context(meta):
            hidden = model(step.input_ids, step.positions)
            logits.append(model.compute_logits(hidden).cpu())
        start += len(ids)
        if start >= len(prompt):
            generated.append(int(logits[-1][-1].argmax()))
    return torch.cat(logits), generated


@pytest.mark.parametrize("name", PRESETS)
def test_logits_and_greedy_tokens_against_transformers_on_the_gpu(model_dirs, name):
    from transformers import AutoModelForCausalLM

    from kvtool.engine.models import build_model
    from kvtool.engine.models.fast_paths import apply_fast_paths
    from kvtool.engine.models.model_dir import open_model_dir

    md = open_model_dir(model_dirs[name])
    assert md.config.sliding_window == WINDOW and md.config.gemma.sliding_layers
    ours = build_model(md, DEV, DTYPE, "auto")
    paths = apply_fast_paths(ours, DEV, DTYPE)
    assert paths.kernels == "triton" and paths.fused_qkv and paths.fused_gate_up and paths.residual_in_norm
    assert paths.gemm.qkv == paths.gemm.gate_up == paths.gemm.lm_head == "cuda" and paths.cuda_graphs
    prompt = tokens(100, 1)
    logits, generated = kernel_greedy_run(ours, md.config, prompt, 32)
    del ours
    hf = AutoModelForCausalLM.from_pretrained(model_dirs[name], dtype=DTYPE, attn_implementation="eager")
    hf = hf.to(DEV).eval()
    with torch.inference_mode():
        ref = hf(torch.tensor([prompt + generated[:-1]], device=DEV)).logits[0].float().cpu()
    assert logits.shape == ref.shape
    diff = (logits - ref).abs().amax(-1)
    far = diff > LOGIT_ATOL
    assert not far.any(), f"{int(far.sum())} positions past {LOGIT_ATOL}: {diff[far].tolist()}"
    top2 = ref[len(prompt) - 1 :].topk(2, -1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * LOGIT_ATOL
    assert clear.sum() >= len(generated) // 4
    hf_choice = ref[len(prompt) - 1 :].argmax(-1)
    assert all(int(h) == g for h, g, c in zip(hf_choice, generated, clear) if c)


@pytest.mark.parametrize("name", PRESETS)
def test_gemma_is_batch_invariant_with_graphs(model_dirs, name):
    from tests.support.batch_invariance import cuda_model_is_batch_invariant

    def fused(engine):
        assert engine.executor.worker.runner.fast_paths.kernels == "triton"

    cuda_model_is_batch_invariant(model_dirs[name], fused)


@pytest.mark.parametrize("name", PRESETS)
def test_prefix_hits_give_the_cold_tokens_and_logprobs(model_dirs, name):
    from kvtool.engine.engine import LLMEngine
    from kvtool.engine.params import EngineParams, SamplingParams

    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3)
    prefix = tokens(80, 4)
    # 97 tokens: 96 of them in cached blocks, the last computed alone (the one-token prefill graphs).
    prompts = [prefix + tokens(n, 5 + n) for n in (17, 41, 150)]
    engine = LLMEngine(EngineParams(model=str(model_dirs[name]), device="cuda", dtype="bfloat16", num_gpu_blocks=400,
                                    max_model_len=2000, batch_invariant=True))
    try:
        runner = engine.executor.worker.runner
        assert runner.prefill_graphs is not None
        cold = engine.generate(prompts, sp)
        replays = runner.prefill_graphs.replays
        hits = [engine.generate([p], sp)[0] for p in prompts]
        assert [r.stats.num_cached_tokens for r in hits] == [(len(p) - 1) // 16 * 16 for p in prompts]
        assert runner.prefill_graphs.replays == replays + 1
        assert [(r.output_token_ids, r.logprobs) for r in hits] == [(r.output_token_ids, r.logprobs) for r in cold]
    finally:
        engine.close()
