"""Batch-invariant mode on CUDA: a request's tokens and logprobs are the same whatever it is
batched with (1 to 64 requests at once, graphs and eager, with and without a CPU-tier hit), and
the fixed-tile decode kernel's rows depend on their context alone. Qwen3-0.6B's shapes in bf16
with random weights, where the top logits are close enough for one rounding difference to flip a
greedy token. Skipped without CUDA.
"""

import json

import numpy as np
import pytest
import torch

from kvtool.engine.connectors.config import parse_kv_transfer_config
from kvtool.engine.params import SamplingParams

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEV = torch.device("cuda")
SP = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3)
SEEDED = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=11, ignore_eos=True, logprobs=2)


def tokens(n, seed):
    return [(i * 131 + 7 * n + 977 * seed) % 150000 + 10 for i in range(n)]


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    from kvtool.engine.presets.catalog import create_model_dir

    d = tmp_path_factory.mktemp("models") / "qwen3-0.6b"
    create_model_dir(d, preset="qwen3-0.6b", config_only=True)
    return d


def engine_for(model, **kw):
    from kvtool.engine.engine import LLMEngine
    from kvtool.engine.params import EngineParams

    params = {"model": str(model), "device": "cuda", "dtype": "bfloat16", "load_format": "dummy", "seed": 5,
              "num_gpu_blocks": 4000, "max_model_len": 4096, "batch_invariant": True}
    params.update(kw)
    return LLMEngine(EngineParams(**params))


def outputs(results):
    return [(r.output_token_ids, r.logprobs) for r in results]


def offload(**extra):
    return parse_kv_transfer_config(json.dumps({
        "kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_load_failure_policy": "fail",
        "kv_connector_extra_config": extra,
    }))


TARGETS = [tokens(300, 1), tokens(1100, 2)]


def others(n):
    """n other requests of lengths 40 to 1500, so the targets share steps with prefill chunks,
    short and long decodes, and batches of every graph bucket."""
    return [tokens(40 + (i * 389) % 1460, 100 + i) for i in range(n)]


@pytest.mark.parametrize("graphs", [True, False])
def test_a_request_gives_the_same_bits_batched_with_0_to_63_others(qwen_dir, graphs):
    engine = engine_for(qwen_dir, enforce_eager=not graphs, enable_prefix_caching=False)
    try:
        alone = outputs(engine.generate(TARGETS, SP))
        alone_seeded = outputs(engine.generate(TARGETS[:1], SEEDED))
        for n in (1, 6, 30, 62):
            batch = engine.generate(TARGETS + others(n), [SP, SP] + [SEEDED] * n)
            assert outputs(batch[:2]) == alone, n
            mixed = engine.generate(others(n) + TARGETS[:1], [SP] * n + [SEEDED])
            assert outputs(mixed[-1:]) == alone_seeded, n
        if graphs:
            assert len(engine.executor.worker.runner.graphs.replays) >= 4
    finally:
        engine.close()


def test_graph_and_eager_decode_give_the_same_bits(qwen_dir):
    prompts = TARGETS + others(20)
    a = engine_for(qwen_dir, enable_prefix_caching=False)
    b = engine_for(qwen_dir, enable_prefix_caching=False, enforce_eager=True)
    try:
        assert outputs(a.generate(prompts, SP)) == outputs(b.generate(prompts, SP))
    finally:
        a.close()
        b.close()


def test_batched_hits_give_the_bits_of_the_request_alone_and_cold(qwen_dir):
    """With the CPU tier: the targets computed alone and cold, then their hits (full and partial)
    batched with 1 to 63 others, equal them bit for bit."""
    cold_engine = engine_for(qwen_dir, enable_prefix_caching=False)
    cold = outputs(cold_engine.generate(TARGETS, SP))
    cold_engine.close()
    # 8 GiB of CPU tier: every prompt of the test fits, so LRU never evicts the targets.
    tier = offload(offload_block_tokens=256, cpu_bytes_to_use=8 << 30)
    engine = engine_for(qwen_dir, enable_prefix_caching=False, kv_transfer_config=tier)
    try:
        assert outputs(engine.generate(TARGETS, SP)) == cold  # stores them
        for n in (1, 15, 63):
            batch = engine.generate(others(n)[: n // 2] + TARGETS + others(n)[n // 2 :], SP)
            hits = batch[n // 2 : n // 2 + 2]
            assert [r.stats.num_external_loaded_tokens for r in hits] == [256, 1024]
            assert outputs(hits) == cold, n
        # A prompt that extends a target: a partial hit, decoded among others.
        longer = TARGETS[1] + tokens(200, 9)
        alone = outputs(engine_for_cold(qwen_dir, longer))
        batch = engine.generate([longer] + others(31), SP)
        assert batch[0].stats.num_external_loaded_tokens == 1024
        assert outputs(batch[:1]) == alone
    finally:
        engine.close()


def engine_for_cold(model, prompt):
    engine = engine_for(model, enable_prefix_caching=False)
    try:
        return engine.generate([prompt], SP)
    finally:
        engine.close()


@pytest.mark.parametrize("hq,hkv,d,bs", [(16, 8, 128, 16), (32, 8, 128, 256), (8, 8, 64, 16), (8, 2, 96, 16)])
def test_tile_kernel_rows_depend_on_their_context_alone(hq, hkv, d, bs):
    """Against float64 attention, and the same bits for a row alone, inside any batch, with any
    number of programs per sequence and any slot numbering; a row of context 0 is zero."""
    from kvtool.engine.kernels.attention.context import longest_first, tile_bases
    from kvtool.engine.kernels.attention.triton_tiles import paged_decode_tiles

    g = torch.Generator(device=DEV).manual_seed(hq + bs)
    ctx = np.array([1, 17, 255, 256, 257, 600, 0, 1000, 4097], dtype=np.int32)
    width = -(-int(ctx.max()) // bs)
    nb = width * len(ctx) + 2
    pages = torch.randn((nb, 2, 2, bs, hkv, d), generator=g, device=DEV).to(torch.bfloat16)
    tables = torch.randperm(nb - 1, generator=g, device=DEV)[: width * len(ctx)].view(len(ctx), width).int()
    q = torch.randn((len(ctx), hq, d), generator=g, device=DEV).to(torch.bfloat16)

    def run(rows, programs, spare=0):
        c = ctx[rows]
        base, n = tile_bases(c)
        out = torch.full((len(rows), hq, d), float("nan"), device=DEV, dtype=torch.bfloat16)
        paged_decode_tiles(q[rows], pages, 1, tables[rows], torch.from_numpy(c).to(DEV),
                           torch.from_numpy(base + spare).to(DEV), n + spare, 0.1, programs, out,
                           torch.from_numpy(longest_first(c)).to(DEV))
        return out

    every = list(range(len(ctx)))
    whole = run(every, 1)
    for programs in (2, 5, 64):
        assert torch.equal(run(every, programs), whole), programs
    for b in every:
        assert torch.equal(run([b], 3, spare=7)[0], whole[b]), b
    assert torch.equal(run([8, 2, 5], 4), whole[[8, 2, 5]])
    for b, c in enumerate(ctx):
        if c == 0:
            assert torch.all(whole[b] == 0)
            continue
        blocks = tables[b][: -(-int(c) // bs)].long()
        k = pages[blocks, 0, 1].reshape(-1, hkv, d)[:c].double().repeat_interleave(hq // hkv, 1)
        v = pages[blocks, 1, 1].reshape(-1, hkv, d)[:c].double().repeat_interleave(hq // hkv, 1)
        ref = torch.einsum("ht,thd->hd", (torch.einsum("hd,thd->ht", q[b].double(), k) * 0.1).softmax(-1), v)
        assert float((whole[b].double() - ref).norm() / ref.norm()) < 1e-2, b


def test_without_the_mode_decode_still_runs_and_stays_close(qwen_dir):
    """--no-batch-invariant keeps the batch-sized splits and cuBLAS/GEMV decode: log-probabilities
    within bf16 rounding of the invariant mode's."""
    a = engine_for(qwen_dir, enable_prefix_caching=False, batch_invariant=False)
    b = engine_for(qwen_dir, enable_prefix_caching=False)
    try:
        assert a.executor.worker.runner.batch_invariant is False and b.executor.worker.runner.batch_invariant is True
        for rx, ry in zip(a.generate(TARGETS, SP), b.generate(TARGETS, SP)):
            lx, ly = rx.logprobs[0], ry.logprobs[0]
            common = set(lx) & set(ly)
            assert common and max(abs(lx[t] - ly[t]) for t in common) < 0.05
    finally:
        a.close()
        b.close()
