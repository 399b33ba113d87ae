"""Prefix invariance on CUDA: a prompt's rows come out bit-identical whether computed in one
prefill or after a KV hit of any size. Checked at the kernels (the row-invariant GEMM against
itself and cuBLAS, the prefill attention kernel over cached prefixes, chunks and batches) and
end to end on Qwen3-0.6B's shapes with random weights (tokens and logprobs equal, not close).
Skipped without CUDA.
"""

import json

import numpy as np
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
    from kvtool.engine.kernels.row_invariant_gemm import CONFIGS, config_for, row_count_tiles, triton_mm

    configs = {cfg for _, cfg in CONFIGS}
    # and the narrowed tiles of decode-sized steps
    rows_seen = (1, 2, 3, 8, 16, 32, 64, 128, 160, 192, 256, 512)
    configs |= {config_for(rows, n, 132, k) for rows in rows_seen for n, k in SHAPES[model] + [(151936, 1024)]}
    configs |= {row_count_tiles(rows, n, 132) for rows in rows_seen for n, _ in SHAPES[model]}
    assert any(cfg[1] == 32 and cfg[0] >= 64 for cfg in configs)
    for n, k in SHAPES[model]:
        a, w = _operands(n, k, 1100)
        whole = triton_mm(a, w)
        for rows in (1, 2, 3, 5, 8, 16, 33, 64, 200, 256, 1023):
            assert torch.equal(triton_mm(a[-rows:], w), whole[-rows:]), (n, k, rows)
        for cfg in configs:
            assert torch.equal(triton_mm(a[:300], w, cfg), whole[:300]), (n, k, cfg)
        # A weight whose K is split runs its parts in programs of their own for few rows.
        for cfg in {config_for(rows, n, 132, k) for rows in (1, 8, 64)}:
            for rows in (1, 5, 64):
                assert torch.equal(triton_mm(a[:rows], w, cfg), whole[:rows]), (n, k, cfg, rows)
        ref = a.float() @ w.float().T
        assert float((whole.float() - ref).norm() / ref.norm()) < 5e-3


@pytest.mark.parametrize("model", sorted(SHAPES))
def test_cublas_rows_match_from_the_threshold(model):
    """`linear` switches to cuBLAS at CUBLAS_MIN_ROWS rows for a weight whose K is not split; that
    is only sound where cuBLAS's rows are the Triton kernel's bits, on this GPU, for row counts a
    prefill step reaches. A split weight stays on the Triton kernel at every row count."""
    from kvtool.engine.kernels.row_invariant_gemm import CUBLAS_MIN_ROWS, k_split, linear, triton_mm

    for n, k in SHAPES[model]:
        a, w = _operands(n, k, 32768, seed=1)
        whole = triton_mm(a, w)
        for rows in (CUBLAS_MIN_ROWS, 1500, 2048, 2049, 4133, 8192, 32768):
            if k_split(n, k) == 1:
                assert torch.equal(F.linear(a[:rows], w), whole[:rows]), (n, k, rows)
            assert torch.equal(linear(a[:rows], w, row_invariant=True), whole[:rows]), (n, k, rows)


def test_split_products_replay_from_cuda_graphs():
    """The parts of a split K in programs of their own, captured in a CUDA graph as a decode step
    is: every replay over new rows gives the eager product's bits, and leaves every tile counter
    at zero for the next product."""
    from kvtool.engine.kernels import row_invariant_gemm as rig
    from kvtool.engine.kernels import tiles

    for n, k in SHAPES["0.6b"]:
        for rows in (1, 8, 64):
            if rig.k_split(n, k) == 1:
                continue
            a, w = _operands(n, k, rows * 4, seed=rows)
            x = a[:rows].clone()
            rig.triton_mm(x, w)  # compiles outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                y = rig.triton_mm(x, w)
            for i in range(4):
                x.copy_(a[i * rows : (i + 1) * rows])
                graph.replay()
                torch.cuda.synchronize()
                assert torch.equal(y, rig.triton_mm(a[i * rows : (i + 1) * rows], w)), (n, k, rows, i)
                assert torch.equal(y, rig.triton_mm(a, w)[i * rows : (i + 1) * rows]), (n, k, rows, i)
            assert all(int(counters.abs().sum()) == 0 for counters in tiles._counters.values())


def test_linear_route_argument_and_bias():
    from kvtool.engine.kernels.row_invariant_gemm import CUBLAS_MIN_ROWS, linear

    a, w = _operands(512, 256, CUBLAS_MIN_ROWS + 50)
    bias = torch.randn(512, device=DEV).to(torch.bfloat16)
    plain = linear(a[-10:], w, bias, row_invariant=False)
    assert torch.equal(plain, F.linear(a[-10:], w, bias))
    big = linear(a, w, bias, row_invariant=True)
    small = linear(a[-10:], w, bias, row_invariant=True)
    assert torch.equal(small, big[-10:])
    assert float((small.float() - plain.float()).norm() / plain.float().norm()) < 1e-2
    assert torch.equal(linear(a[-10:], w, bias, row_invariant=False), plain)  # no call leaves state behind


@pytest.mark.parametrize("length", [700, 3000])
def test_prefill_rows_do_not_depend_on_the_cached_prefix_or_the_batch(length):
    """One sequence's attention rows through `attend`: computed from position 0, then again with
    prefixes of several sizes already in the pages, in chunks, and beside another sequence:
    every row the same bits."""
    from kvtool.engine.core.messages import ScheduledRequest
    from kvtool.engine.kernels.attention import AttentionMetadata, attend, attention_context, select_backend
    from kvtool.engine.kv.pages import KVGeometry, KVPages
    from kvtool.engine.worker.model_runner import decode_rows, pack_step

    assert select_backend(DEV, torch.bfloat16, 128) == "cuda"
    bs, hq, hkv, d = 16, 16, 8, 128
    n_blocks = -(-length // bs)
    geo = KVGeometry(num_layers=1, num_kv_heads=hkv, head_dim=d, block_size=bs, dtype="bfloat16")
    g = torch.Generator(device=DEV).manual_seed(length)
    q, k, v = (torch.randn((2 * length, h, d), generator=g, device=DEV).to(torch.bfloat16) for h in (hq, hkv, hkv))

    def run(chunks, other=None):
        """chunks: (start, end) steps of sequence 0; other: (start, end) of a sequence 1 run beside the last."""
        pages = KVPages(geo, 2 * n_blocks + 1, DEV)
        blocks = [list(range(n_blocks)), list(range(n_blocks, 2 * n_blocks))]
        outs = []
        for i, (start, end) in enumerate(chunks):
            spans = [(0, start, end)] + ([(1, *other)] if other and i == len(chunks) - 1 else [])
            seqs = [ScheduledRequest(request_id=f"r{j}", token_ids=list(range(b - a)), start=a, new_block_ids=[],
                                     sample=True) for j, a, b in spans]
            tables = [np.asarray(blocks[j], dtype=np.int32) for j, _, _ in spans]
            step = pack_step([], decode_rows([], [], bs), seqs, tables, bs, DEV, 1)
            meta = AttentionMetadata(kv_pages=pages, seqs=[], slot_block_ids=None, slot_offsets=None,
                                     device_batch=step.batch)
            rows = [j * length + r for j, a, b in spans for r in range(a, b)]
            with torch.inference_mode(), attention_context(meta):
                outs.append(attend(0, q[rows], k[rows], v[rows], d**-0.5)[: end - start])
        return torch.cat(outs)

    whole = run([(0, length)])
    for split in (16, 100, length // 2, length - 64, length - 16, length - 1):
        again = run([(0, split), (split, length)])
        assert torch.equal(again[split:], whole[split:]), split
    thirds = run([(0, length // 3), (length // 3, 2 * length // 3), (2 * length // 3, length)])
    assert torch.equal(thirds, whole)
    assert torch.equal(run([(0, length)], other=(0, length // 2 + 3)), whole)
    assert torch.equal(run([(0, 50), (50, length)], other=(0, 77))[50:], whole[50:])


@pytest.mark.parametrize("hq,hkv,d", [(8, 2, 64), (32, 8, 128), (8, 4, 256), (8, 2, 96)])
def test_prefill_kernel_against_sdpa_and_its_own_tails(hq, hkv, d):
    from kvtool.engine.kernels.attention.prefill import prefill_attention

    g = torch.Generator(device=DEV).manual_seed(d)
    n = 1000
    q, k, v = (torch.randn((n, h, d), generator=g, device=DEV).to(torch.bfloat16) for h in (hq, hkv, hkv))
    cu = torch.tensor([0, n], dtype=torch.int32, device=DEV)
    whole = prefill_attention(q, k, v, cu, cu, n, d**-0.5)
    ref = F.scaled_dot_product_attention(*(x.double().transpose(0, 1)[None] for x in (q, k, v)), is_causal=True,
                                         scale=d**-0.5, enable_gqa=True)[0].transpose(0, 1)
    assert float((whole.double() - ref).norm() / ref.norm()) < 1e-2
    for rows in (1, 7, 64, 65, 300):
        tail = prefill_attention(q[-rows:], k, v, torch.tensor([0, rows], dtype=torch.int32, device=DEV), cu, rows,
                                 d**-0.5)
        assert torch.equal(tail, whole[-rows:]), rows


def test_prefill_kernel_reads_the_same_bits_through_tma_and_pointers(monkeypatch):
    """From Hopper on, the Triton kernel (which runs where the Hopper kernel does not) loads its
    tiles through TMA descriptors, whose tiles run past a sequence's keys into the next one's; its
    rows must be the pointer loads' bits."""
    from kvtool.engine.kernels.attention import triton_prefill as tp

    if torch.cuda.get_device_capability(DEV)[0] < 9:
        pytest.skip("TMA descriptors need compute capability 9.0")
    hq, hkv, d = 32, 8, 128
    q_lens, k_lens = (300, 1, 129, 77), (700, 513, 129, 1000)
    g = torch.Generator(device=DEV).manual_seed(3)
    # q as a slice of one fused projection, as the model hands it over
    qkv = torch.randn((sum(q_lens), hq + 2 * hkv, d), generator=g, device=DEV).to(torch.bfloat16)
    q = qkv[:, :hq]
    k, v = (torch.randn((sum(k_lens), hkv, d), generator=g, device=DEV).to(torch.bfloat16) for _ in range(2))
    cu_q, cu_k = (torch.tensor(np.cumsum((0,) + lens), dtype=torch.int32, device=DEV) for lens in (q_lens, k_lens))
    assert all(tp.rows_view(x) is not None for x in (q, k, v))
    index = torch.cuda.current_device()
    outs = {}
    for tma in (True, False):
        monkeypatch.setitem(tp._tma_devices, index, tma)
        outs[tma] = tp.triton_prefill_attention(q, k, v, cu_q, cu_k, max(q_lens), d**-0.5, torch.empty_like(q))
    assert torch.equal(outs[True], outs[False])
    # A full hit's one computed row, over its sequence's keys alone, either way.
    last = slice(sum(k_lens[:-1]), sum(k_lens))
    cu_one, cu_keys = (torch.tensor([0, n], dtype=torch.int32, device=DEV) for n in (1, k_lens[-1]))
    for tma in (True, False):
        monkeypatch.setitem(tp._tma_devices, index, tma)
        row = tp.triton_prefill_attention(q[-1:], k[last], v[last], cu_one, cu_keys, 1, d**-0.5,
                                          torch.empty_like(q[-1:]))
        assert torch.equal(row, outs[True][-1:]), tma


@pytest.mark.parametrize("d,window,softcap", [(256, None, None), (256, 300, None), (256, None, 50.0), (128, 300, None)])
def test_prefill_launch_configs_give_the_same_bits(d, window, softcap):
    """The Triton prefill kernel's row blocks, warps and K / V tiles in flight move work, never a
    row's arithmetic: every launch `gpu-bench.py prefill-tiles` may pick gives the default's bits
    (packed sequences, a sliding window and a soft cap included)."""
    from kvtool.engine.kernels.attention import triton_prefill as tp

    q_lens, k_lens = (700, 1, 129, 64), (700, 2000, 1000, 64)
    g = torch.Generator(device=DEV).manual_seed(d)
    q = torch.randn((sum(q_lens), 8, d), generator=g, device=DEV).to(torch.bfloat16)
    k, v = (torch.randn((sum(k_lens), 4, d), generator=g, device=DEV).to(torch.bfloat16) for _ in range(2))
    cu_q, cu_k = (torch.tensor(np.cumsum((0,) + lens), dtype=torch.int32, device=DEV) for lens in (q_lens, k_lens))

    def run(config):
        return tp.triton_prefill_attention(q, k, v, cu_q, cu_k, max(q_lens), d**-0.5, torch.empty_like(q), window,
                                           softcap, config)

    default = run(None)
    for config in tp.launch_candidates(d):
        assert torch.equal(run(config), default), config


def _attention_f64(q, k, v, window, softcap, scale):
    """Bottom-right causal attention of one sequence in float64 (q [Tq, Hq, D], k/v [Tk, Hkv, D]),
    each row over its last `window` keys when given, its scores soft-capped when given."""
    group = q.shape[1] // k.shape[1]
    qd, kd, vd = q.double(), k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    s = torch.einsum("qhd,khd->hqk", qd, kd) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    pos = torch.arange(k.shape[0] - q.shape[0], k.shape[0], device=q.device)[:, None]
    keys = torch.arange(k.shape[0], device=q.device)[None, :]
    seen = keys <= pos
    if window is not None:
        seen &= keys > pos - window
    return torch.einsum("hqk,khd->qhd", s.masked_fill(~seen, float("-inf")).softmax(-1), vd)


@pytest.mark.parametrize("d,window,softcap", [(64, None, None), (128, None, None), (256, None, None),
                                              (128, 300, None), (256, 1024, None), (256, None, 50.0),
                                              (256, 300, 30.0)])
def test_hopper_prefill_kernel_on_packed_sequences(d, window, softcap):
    """The Gluon kernel that runs prefill rows on Hopper: close to float64 attention on every
    packed sequence (lengths around its 64-row halves and its key tiles, q a slice of a fused
    projection, a full hit's one row over 5000 keys), with a sliding window and a soft cap as
    Gemma's layers have them, and each row's bits those of the same row computed alone, with one
    consumer warpgroup (64 rows or fewer) or two."""
    from kvtool.engine.kernels.attention import prefill as tp

    if not tp.uses_hopper_kernel(torch.empty((1, 1, d), dtype=torch.bfloat16, device=DEV)):
        pytest.skip("the Hopper kernel needs compute capability 9.0 and Triton 3.6")
    hq, hkv = (32, 8) if d < 256 else (8, 4)
    q_lens, k_lens = (300, 1, 65, 129, 64, 1000, 7, 2048), (300, 5000, 1000, 4096, 64, 3000, 7, 2048)
    g = torch.Generator(device=DEV).manual_seed(d)
    qkv = torch.randn((sum(q_lens), hq + 2 * hkv, d), generator=g, device=DEV).to(torch.bfloat16)
    q = qkv[:, :hq]
    k, v = (torch.randn((sum(k_lens), hkv, d), generator=g, device=DEV).to(torch.bfloat16) for _ in range(2))
    cu_q, cu_k = (torch.tensor(np.cumsum((0,) + lens), dtype=torch.int32, device=DEV) for lens in (q_lens, k_lens))
    packed = tp.prefill_attention(q, k, v, cu_q, cu_k, max(q_lens), d**-0.5, window=window, softcap=softcap)
    for i, (n_q, n_k) in enumerate(zip(q_lens, k_lens)):
        rows, keys = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
        ref = _attention_f64(q[rows], k[keys], v[keys], window, softcap, d**-0.5)
        assert float((packed[rows].double() - ref).norm() / ref.norm()) < 1e-2, (n_q, n_k)
        for tail in sorted({1, min(64, n_q), n_q}):
            cu_tail = torch.tensor([0, tail], dtype=torch.int32, device=DEV)
            cu_keys = torch.tensor([0, n_k], dtype=torch.int32, device=DEV)
            alone = tp.prefill_attention(q[rows][-tail:], k[keys], v[keys], cu_tail, cu_keys, tail, d**-0.5,
                                         window=window, softcap=softcap)
            assert torch.equal(alone, packed[rows][-tail:]), (n_q, n_k, tail)


def test_hopper_prefill_bits_do_not_depend_on_its_schedule(monkeypatch):
    """The Gluon kernel's schedule knobs (consumers taking turns, 2 or 3 K/V slots) move work in
    time, never the arithmetic: every setting gives the shipped setting's bits."""
    from kvtool.engine.kernels.attention import hopper_prefill as hp
    from kvtool.engine.kernels.attention import prefill as tp

    if not tp.uses_hopper_kernel(torch.empty((1, 1, 128), dtype=torch.bfloat16, device=DEV)):
        pytest.skip("the Hopper kernel needs compute capability 9.0 and Triton 3.6")
    q_lens, k_lens = (300, 1, 129, 2048), (300, 5000, 4096, 2048)
    g = torch.Generator(device=DEV).manual_seed(3)
    q = torch.randn((sum(q_lens), 32, 128), generator=g, device=DEV).to(torch.bfloat16)
    k, v = (torch.randn((sum(k_lens), 8, 128), generator=g, device=DEV).to(torch.bfloat16) for _ in range(2))
    cu_q, cu_k = (torch.tensor(np.cumsum((0,) + lens), dtype=torch.int32, device=DEV) for lens in (q_lens, k_lens))
    shipped = tp.prefill_attention(q, k, v, cu_q, cu_k, max(q_lens), 128**-0.5)
    for stages in (2, 3):
        for turns in (False, True):
            monkeypatch.setattr(hp, "STAGES", stages)
            monkeypatch.setattr(hp, "PINGPONG", turns)
            out = tp.prefill_attention(q, k, v, cu_q, cu_k, max(q_lens), 128**-0.5)
            assert torch.equal(out, shipped), (stages, turns)


def test_the_last_layer_of_the_sampled_rows_alone_gives_their_bits(tmp_path):
    """The fused forward with a step's sample rows computes the last layer (past storing every
    row's K/V) for those rows only: their final hidden states equal the full forward's bit for
    bit, and the pages hold the same K/V, for prompts alone, beside a chunk that samples nothing,
    over a cached prefix, beside decode rows (both decode kernels), and for a step that samples
    nothing at all. Qwen3-0.6B's shapes with random weights."""
    from kvtool.engine.core.messages import ScheduledRequest
    from kvtool.engine.kernels.attention import AttentionMetadata, attention_context, select_backend
    from kvtool.engine.kv.pages import KVGeometry, KVPages
    from kvtool.engine.models import build_model
    from kvtool.engine.models.fast_paths import apply_fast_paths
    from kvtool.engine.models.model_dir import open_model_dir
    from kvtool.engine.presets.catalog import create_model_dir
    from kvtool.engine.worker.model_runner import decode_rows, pack_step

    create_model_dir(tmp_path / "m", preset="qwen3-0.6b", config_only=True)
    cfg = open_model_dir(tmp_path / "m").config
    model = build_model(cfg, DEV, torch.bfloat16, "dummy", 3)
    assert apply_fast_paths(model, DEV, torch.bfloat16).sampled_rows_only
    assert select_backend(DEV, torch.bfloat16, cfg.head_dim) == "cuda"
    bs = 16
    geo = KVGeometry(num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                     block_size=bs, dtype="bfloat16")
    pages = KVPages(geo, 512, DEV)
    g = torch.Generator(device=DEV).manual_seed(0)
    before = (torch.randn(pages.tensor.shape, generator=g, device=DEV) * 0.5).to(pages.tensor.dtype)
    rng = np.random.default_rng(0)

    def req(rid, n, start, sample):
        ids = [int(x) for x in rng.integers(1, cfg.vocab_size, n)]
        return ScheduledRequest(request_id=rid, token_ids=ids, start=start, new_block_ids=[], sample=sample)

    def run(decode, prefill, tiles, rows):
        pages.tensor.copy_(before)
        d_tables = [np.arange(20 * i, 20 * i + 20, dtype=np.int32) for i in range(len(decode))]
        p_tables = [np.arange(200 + 100 * j, 300 + 100 * j, dtype=np.int32) for j in range(len(prefill))]
        step = pack_step(decode, decode_rows(decode, d_tables, bs), prefill, p_tables, bs, DEV, 4, tiles)
        meta = AttentionMetadata(kv_pages=pages, seqs=[], slot_block_ids=None, slot_offsets=None,
                                 device_batch=step.batch, row_invariant=True)
        with torch.inference_mode(), attention_context(meta):
            if rows:
                assert step.batch.sampled is not None
                hidden = model(step.input_ids, step.positions, step.sample_rows)
            else:
                hidden = model(step.input_ids, step.positions).index_select(0, step.sample_rows)
        return hidden, pages.tensor.clone()

    cases = {
        "one prompt": ([], [req("a", 1500, 0, True)]),
        "beside a chunk": ([], [req("a", 700, 0, True), req("b", 300, 0, False)]),
        "over a prefix": ([], [req("b", 300, 100, False), req("a", 900, 555, True)]),
        "beside decode rows": ([req("d0", 1, 40, True), req("d1", 1, 300, True), req("d2", 1, 7, True)],
                               [req("a", 1100, 0, True), req("c", 60, 0, False)]),
        "nothing sampled": ([], [req("b", 400, 0, False)]),
    }
    for name, (decode, prefill) in cases.items():
        for tiles in (False, True):
            full, full_pages = run(decode, prefill, tiles, rows=False)
            part, part_pages = run(decode, prefill, tiles, rows=True)
            assert part.shape == full.shape and torch.equal(part, full), (name, tiles)
            assert torch.equal(part_pages, full_pages), (name, tiles)


def _offload(**extra):
    from kvtool.engine.connectors.config import parse_kv_transfer_config

    return parse_kv_transfer_config(json.dumps({
        "kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra,
    }))


def test_hits_of_every_size_give_the_cold_run_bits(tmp_path):
    """Qwen3-0.6B's shapes in bf16 with random weights, where the top logits are close enough for
    one rounding difference to flip a greedy token: full hits from the CPU tier (16- and 256-token
    offload blocks) and partial local prefix hits return exactly the cold run's tokens and logprobs."""
    from kvtool.engine.engine import LLMEngine
    from kvtool.engine.params import EngineParams, SamplingParams
    from kvtool.engine.presets.catalog import create_model_dir

    model = tmp_path / "m"
    create_model_dir(model, preset="qwen3-0.6b", config_only=True)
    base = {"model": str(model), "device": "cuda", "dtype": "bfloat16", "load_format": "dummy", "seed": 5,
            "num_gpu_blocks": 1200}
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3)
    prompts = [[(i * 131 + 7 * n) % 150000 + 10 for i in range(n)] for n in (200, 1100, 2048)]

    def outputs(results):
        return [(r.output_token_ids, r.logprobs) for r in results]

    # One request at a time in every engine: a step's other requests change how it is computed.
    cold_engine = LLMEngine(EngineParams(**base, enable_prefix_caching=False))
    cold = outputs([cold_engine.generate([p], sp)[0] for p in prompts])
    cold_engine.close()

    for block_tokens in (16, 256):
        engine = LLMEngine(EngineParams(**base, enable_prefix_caching=False,
                                        kv_transfer_config=_offload(offload_block_tokens=block_tokens)))
        try:
            first = [engine.generate([p], sp)[0] for p in prompts]
            assert outputs(first) == cold
            hits = [engine.generate([p], sp)[0] for p in prompts]
            # Whole offload blocks, a full hit's last one too (2048 tokens: only the last is computed).
            assert [r.stats.num_external_loaded_tokens for r in hits] == [len(p) // block_tokens * block_tokens
                                                                         for p in prompts]
            assert outputs(hits) == cold, block_tokens
        finally:
            engine.close()

    engine = LLMEngine(EngineParams(**base, enable_prefix_caching=True))
    try:
        for p, expected in zip(prompts, cold):
            cut = len(p) // 2
            engine.generate([p[:cut] + [3] * 40], sp)  # caches the first half's full blocks
            partial = engine.generate([p], sp)[0]
            assert partial.stats.num_cached_tokens == cut // 16 * 16
            assert (partial.output_token_ids, partial.logprobs) == expected
    finally:
        engine.close()
