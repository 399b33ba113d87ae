"""Tensor parallelism on CUDA: NCCL ranks, one GPU each. The TP=2 runs need 2 CUDA devices and
skip with "needs 2 CUDA devices" on a one-GPU machine; the refusal of a size larger than the
devices runs on any CUDA machine with fewer than 4."""

import pytest
import torch

from kvtool.engine.errors import ConfigError
from kvtool.engine.params import EngineParams, SamplingParams

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

needs_two = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1)
PROMPTS = [[(i * 31 + s * 17) % 500 + 5 for i in range(n)] for s, n in ((0, 7), (1, 40), (2, 130))]


def _generate(model_dir, **overrides):
    from kvtool.engine.engine import LLMEngine

    params = EngineParams(**{"model": str(model_dir), "device": "cuda", "dtype": "float32", "num_gpu_blocks": 256,
                             **overrides})
    with LLMEngine(params) as engine:
        results = engine.generate(PROMPTS, GREEDY)
        engine.check_integrity()
    return results


@needs_two
@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
def test_tp2_equals_tp1_on_two_gpus(tiny_model_dir, eager):
    tp1 = _generate(tiny_model_dir, enforce_eager=eager)
    tp2 = _generate(tiny_model_dir, enforce_eager=eager, tensor_parallel_size=2)
    for a, b in zip(tp1, tp2, strict=True):
        assert b.output_token_ids == a.output_token_ids
        for lp_a, lp_b in zip(a.logprobs, b.logprobs, strict=True):
            for token, value in lp_a.items():
                assert lp_b[token] == pytest.approx(value, abs=1e-3)


@needs_two
def test_tp2_decode_graphs_captured_at_start_up_equal_eager_in_bf16(tiny_model_dir):
    """bf16 runs the Triton kernels: each rank runs the start-up prefills and captures its decode
    graphs (all-reduces inside) in step with the other; greedy tokens then follow eager decode."""
    graphs = _generate(tiny_model_dir, dtype="bfloat16", tensor_parallel_size=2, max_num_seqs=8)
    eager = _generate(tiny_model_dir, dtype="bfloat16", tensor_parallel_size=2, max_num_seqs=8, enforce_eager=True)
    assert [r.output_token_ids for r in graphs] == [r.output_token_ids for r in eager]


def test_a_size_larger_than_the_devices_is_refused_in_one_line(tiny_model_dir):
    from kvtool.engine.engine import LLMEngine

    count = torch.cuda.device_count()
    if count >= 4:
        pytest.skip("needs fewer than 4 CUDA devices (the tiny preset splits into at most 4 ranks)")
    size = 2 if count < 2 else 4
    with pytest.raises(ConfigError) as refused:
        LLMEngine(EngineParams(model=str(tiny_model_dir), device="cuda", tensor_parallel_size=size))
    assert str(refused.value) == f"--tensor-parallel-size {size} needs {size} CUDA devices, found {count}"
