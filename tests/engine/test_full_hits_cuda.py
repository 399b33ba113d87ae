"""Full hits on CUDA: Qwen3-0.6B's shapes in bf16 with random weights. A prompt whose every
offload block is in the CPU or disk tier loads them all and computes its last token alone,
through the prefill kernels (a prompt row, never the decode path; replayed from the one-token
prefill graphs), so tokens and logprobs are exactly the cold run's. Skipped without CUDA.
"""

import json

import pytest
import torch

from kvtool.engine.connectors.config import parse_kv_transfer_config

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def _offload(**extra):
    return parse_kv_transfer_config(json.dumps({
        "kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_load_failure_policy": "fail",
        "kv_connector_extra_config": extra,
    }))


def _record_steps(engine):
    """Records (request id, start, num_tokens) of every scheduled request, and ("pack", decode
    request ids, prefill request ids) of every eager CUDA step; returns (records, undo)."""
    from kvtool.engine.worker import model_runner as runner_module
    steps = []
    execute_async = engine.executor.execute_async
    pack_step = runner_module.pack_step

    def spy(so):
        steps.extend((s.request_id, s.start, s.num_tokens) for s in so.scheduled)
        return execute_async(so)

    def packed(decode, rows, prefill, *args):
        steps.append(("pack", [s.request_id for s in decode], [s.request_id for s in prefill]))
        return pack_step(decode, rows, prefill, *args)

    engine.executor.execute_async = spy
    runner_module.pack_step = packed
    return steps, lambda: setattr(runner_module, "pack_step", pack_step)


@pytest.mark.parametrize("block_tokens", [16, 256])
def test_full_hit_computes_the_last_token_alone_with_the_cold_bits(tmp_path, block_tokens):
    from kvtool.engine.engine import LLMEngine
    from kvtool.engine.params import EngineParams, SamplingParams
    from kvtool.engine.presets.catalog import create_model_dir

    model = tmp_path / "m"
    create_model_dir(model, preset="qwen3-0.6b", config_only=True)
    base = {"model": str(model), "device": "cuda", "dtype": "bfloat16", "load_format": "dummy", "seed": 5,
            "num_gpu_blocks": 1200, "enable_prefix_caching": False}
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3)
    prompts = [[(i * 131 + 7 * n) % 150000 + 10 for i in range(n)] for n in (256, 2048)]

    def outputs(results):
        return [(r.output_token_ids, r.logprobs) for r in results]

    cold_engine = LLMEngine(EngineParams(**base))
    cold = outputs([cold_engine.generate([p], sp)[0] for p in prompts])
    cold_engine.close()

    ktc = _offload(offload_block_tokens=block_tokens, root_dir=str(tmp_path / "tier"))

    def check_full_hits(engine):
        steps, restore = _record_steps(engine)
        replays = engine.executor.worker.runner.prefill_graphs.replays
        try:
            hits = [engine.generate([p], sp)[0] for p in prompts]
        finally:
            restore()
        assert engine.executor.worker.runner.prefill_graphs.replays == replays + len(prompts)  # the one-token graphs
        assert [r.stats.num_external_tokens for r in hits] == [len(p) - 1 for p in prompts]
        assert [r.stats.num_external_loaded_tokens for r in hits] == [len(p) for p in prompts]
        for r, p in zip(hits, prompts):
            mine = [(s[1], s[2]) for s in steps if s[0] == r.request_id and s[1] < len(p)]
            assert mine == [(len(p) - 1, 1)]
            first_pack = next(s for s in steps if s[0] == "pack" and r.request_id in s[1] + s[2])
            assert first_pack[2] == [r.request_id], "the last prompt token ran as a decode row"
        assert outputs(hits) == cold, block_tokens

    engine = LLMEngine(EngineParams(**base, kv_transfer_config=ktc))
    try:
        assert outputs([engine.generate([p], sp)[0] for p in prompts]) == cold
        engine.executor.worker.connector.flush()
        check_full_hits(engine)  # from the CPU tier
    finally:
        engine.close()
    engine = LLMEngine(EngineParams(**base, kv_transfer_config=ktc))
    try:
        check_full_hits(engine)  # from disk, in a new engine
    finally:
        engine.close()
