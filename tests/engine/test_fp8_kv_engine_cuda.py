"""An fp8 KV cache on CUDA, through the whole engine: Qwen3-0.6B's shapes in bf16 with random
weights. A request's tokens and logprobs are the same alone, batched with others, after a
prefix-cache hit, after full hits from the CPU tier and from disk in a new engine; with
--calculate-kv-scales the scales come from the first step and hold. Skipped without CUDA (the
kernels' own checks are in kernels/test_fp8_kv_cuda.py).
"""

import json

import pytest
import torch

from kvtool.engine.connectors.config import parse_kv_transfer_config

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SAMPLING = dict(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3)


def _engine(model, **overrides):
    from kvtool.engine.engine import LLMEngine
    from kvtool.engine.params import EngineParams

    params = {"model": str(model), "device": "cuda", "dtype": "bfloat16", "load_format": "dummy", "seed": 5,
              "num_gpu_blocks": 1200, "kv_cache_dtype": "fp8", **overrides}
    return LLMEngine(EngineParams(**params))


def _outputs(results):
    return [(r.output_token_ids, r.logprobs) for r in results]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from kvtool.engine.presets.catalog import create_model_dir

    d = tmp_path_factory.mktemp("models") / "qwen3-0.6b"
    create_model_dir(d, preset="qwen3-0.6b", config_only=True)
    return d


PROMPTS = [[(i * 131 + 7 * n) % 150000 + 10 for i in range(n)] for n in (37, 256, 700, 2048)]


def test_fp8_cache_output_is_the_same_alone_batched_and_after_hits(model, tmp_path):
    from kvtool.engine.params import SamplingParams

    sp = SamplingParams(**SAMPLING)
    engine = _engine(model, enable_prefix_caching=False)
    try:
        assert engine.executor.worker.kv_pages.tensor.dtype == torch.float8_e4m3fn
        alone = _outputs([engine.generate([p], sp)[0] for p in PROMPTS])
        assert _outputs(engine.generate(PROMPTS, sp)) == alone
    finally:
        engine.close()
    engine = _engine(model)
    try:
        engine.generate([p[: len(p) // 2 + 1] for p in PROMPTS], sp)
        hits = engine.generate(PROMPTS, sp)
        assert all(r.stats.num_cached_tokens > 0 for r in hits[1:])
        assert _outputs(hits) == alone
    finally:
        engine.close()
    ktc = parse_kv_transfer_config(json.dumps({
        "kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_load_failure_policy": "fail",
        "kv_connector_extra_config": {"root_dir": str(tmp_path / "tier")}}))
    engine = _engine(model, kv_transfer_config=ktc, enable_prefix_caching=False)
    try:
        assert _outputs([engine.generate([p], sp)[0] for p in PROMPTS]) == alone
        engine.executor.worker.connector.flush()
        hits = [engine.generate([p], sp)[0] for p in PROMPTS]  # from the CPU tier
        assert all(r.stats.num_external_loaded_tokens >= 16 * (len(p) // 16) for r, p in zip(hits, PROMPTS))
        assert _outputs(hits) == alone
    finally:
        engine.close()
    engine = _engine(model, kv_transfer_config=ktc, enable_prefix_caching=False)
    try:
        hits = [engine.generate([p], sp)[0] for p in PROMPTS]  # from disk, in a new engine
        assert all(r.stats.num_external_loaded_tokens >= 16 * (len(p) // 16) for r, p in zip(hits, PROMPTS))
        assert _outputs(hits) == alone
    finally:
        engine.close()


def test_calculated_scales_come_from_the_first_step_and_hold(model):
    from kvtool.engine.params import SamplingParams

    sp = SamplingParams(**SAMPLING)
    engine = _engine(model, calculate_kv_scales=True)
    try:
        pages = engine.executor.worker.kv_pages
        assert pages.scales_pending
        first = _outputs(engine.generate(PROMPTS[1:2], sp))
        k_scale = pages.k_scale.clone()
        assert not pages.scales_pending and bool((k_scale != 1.0).all()) and bool((k_scale > 0).all())
        again = engine.generate(PROMPTS[1:2], sp)
        assert again[0].stats.num_cached_tokens > 0 and _outputs(again) == first
        assert torch.equal(pages.k_scale, k_scale)
    finally:
        engine.close()
