"""On CPU a request's tokens and logprobs are bit-identical however it is computed: alone or
batched with requests of other lengths, whole or in chunks, after a prefix-cache hit or after an
OffloadingConnector hit, with one thread or two. Checked on the tiny preset and on the embedded
default model, each with the model's KV dtype and with an fp8 KV cache (`/fp8`), with prompts on
both sides of the attention's 512-key blocks.

Logprobs are compared with ==, not within a tolerance.
"""

from __future__ import annotations

import json
import random

import pytest
import torch

from kvtool.engine.connectors.config import parse_kv_transfer_config
from kvtool.engine.engine import LLMEngine
from kvtool.engine.params import EngineParams, SamplingParams

# (prompt lengths, tokens to generate) per model: the default model is ~40x the tiny one.
CASES = {
    "tiny": ([5, 38, 300, 530, 1030], 20),
    "default": ([7, 90, 530], 6),
    "tiny/fp8": ([5, 38, 530, 1030], 12),
    "default/fp8": ([7, 530], 6),
}


def _prompts(lengths, seed):
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(n)] for n in lengths]


def _sampling(num_tokens):
    return SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True, logprobs=3)


def _outputs(results):
    return [(r.output_token_ids, r.logprobs) for r in results]


@pytest.fixture(scope="module", params=sorted(CASES))
def model(request, tmp_path_factory):
    """(case, model directory, KV cache dtype) of the tiny preset with saved weights, or the
    embedded model."""
    name, _, kv_cache_dtype = request.param.partition("/")
    if name == "default":
        from kvtool.engine.presets.default_model import ensure_default_model

        return request.param, str(ensure_default_model()), kv_cache_dtype or "auto"
    from kvtool.engine.presets.catalog import create_model_dir

    d = tmp_path_factory.mktemp("models") / "tiny"
    create_model_dir(d, preset="tiny", seed=0)
    return request.param, str(d), kv_cache_dtype or "auto"


@pytest.fixture
def engines(model):
    name, path, kv_cache_dtype = model
    made = []

    def factory(**overrides):
        params = {"model": path, "device": "cpu", "kv_cache_memory": 256 << 20, "kv_cache_dtype": kv_cache_dtype,
                  **overrides}
        engine = LLMEngine(EngineParams(**params))
        made.append(engine)
        return engine

    yield name, factory
    for engine in made:
        engine.close()


def _alone(factory, prompts, sampling):
    """Each prompt in an engine of its own, no prefix caching."""
    out = []
    for p in prompts:
        with factory(enable_prefix_caching=False) as engine:
            out += _outputs(engine.generate([p], sampling))
    return out


def test_batched_and_chunked_equal_alone(engines):
    name, factory = engines
    lengths, num_tokens = CASES[name]
    prompts, sampling = _prompts(lengths, seed=1), _sampling(num_tokens)
    alone = _alone(factory, prompts, sampling)
    assert all(lp is not None and len(lp) == num_tokens for _, lp in alone)
    batched = factory(enable_prefix_caching=False).generate(prompts, sampling)
    assert _outputs(batched) == alone
    # Prompts split over steps (and batched with each other's chunks) at an odd token budget.
    chunked = factory(enable_prefix_caching=False, max_num_batched_tokens=197).generate(prompts, sampling)
    assert _outputs(chunked) == alone


def test_two_threads_batched_equal_alone(tiny_model_dir):
    """With threads BLAS splits rows differently (5 to 7 and 9 to 11 rows took other kernels)."""
    lengths, num_tokens = [5, 38, 530], 8

    def factory(**overrides):
        return LLMEngine(EngineParams(model=str(tiny_model_dir), device="cpu", kv_cache_memory=256 << 20, **overrides))

    prompts, sampling = _prompts(lengths, seed=2), _sampling(num_tokens)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        alone = _alone(factory, prompts, sampling)
        with factory(enable_prefix_caching=False) as engine:
            batched = engine.generate(prompts, sampling)
    finally:
        torch.set_num_threads(threads)
    assert _outputs(batched) == alone


def test_prefix_cache_hits_equal_misses(engines):
    name, factory = engines
    lengths, num_tokens = CASES[name]
    sampling = _sampling(num_tokens)
    base = _prompts([max(lengths)], seed=3)[0]
    # The same prompt again (a full hit), and prompts sharing its first 16 to 512+ tokens.
    prompts = [base, base[:16] + [9, 8, 7], base[:520] + [11] * 30, base[: len(base) // 2] + [5, 6]]
    off = _alone(factory, prompts, sampling)
    engine = factory()
    engine.generate([base], sampling)
    results = [engine.generate([p], sampling)[0] for p in prompts]
    assert [r.stats.num_cached_tokens > 0 for r in results] == [True, True, True, True]
    assert _outputs(results) == off


def test_offloading_hits_equal_misses(engines, tmp_path):
    name, factory = engines
    lengths, num_tokens = CASES[name]
    sampling = _sampling(num_tokens)
    base = _prompts([max(lengths)], seed=4)[0]
    prompts = [base, base[:540] + [3, 4, 5]]
    off = _alone(factory, prompts, sampling)
    ktc = parse_kv_transfer_config(json.dumps({
        "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"root_dir": str(tmp_path / "tier")},
    }))
    engine = factory(kv_transfer_config=ktc, enable_prefix_caching=False)
    engine.generate([base], sampling)
    results = [engine.generate([p], sampling)[0] for p in prompts]
    assert all(r.stats.num_external_loaded_tokens >= 512 for r in results)
    assert _outputs(results) == off
