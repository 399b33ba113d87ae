"""Tensor parallelism on CPU: 2 ranks in 2 real worker processes over gloo.

TP=2 gives TP=1's greedy tokens and (within float32 tolerance) logprobs on the tiny preset and
on the embedded default model; every rank's connector half gets its rank's identity; a worker
that is killed, or fails in a step or at start-up, ends in one typed line naming the rank (or
the same error as in-process), and no worker process is left behind.
"""

from __future__ import annotations

import json
import os
import shutil
import signal

import msgspec
import pytest

from kvtool.engine.connectors.config import parse_kv_transfer_config
from kvtool.engine.engine import LLMEngine
from kvtool.engine.errors import ModelError, WorkerError
from kvtool.engine.params import EngineParams, SamplingParams, StructuredOutputsParams
from tests.support.process_tree import running, wait_gone

TEXT_PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, logprobs=2)
LOGPROB_TOLERANCE = 1e-4


def _params(model, **overrides) -> EngineParams:
    base = {"model": str(model) if model is not None else None, "device": "cpu", "kv_cache_memory": 64 << 20,
            "max_model_len": 512}
    base.update(overrides)
    return EngineParams(**base)


def _run(params: EngineParams, prompts, sampling=GREEDY):
    with LLMEngine(params) as engine:
        token_prompts = [engine.encode_prompt(p) if isinstance(p, str) else p for p in prompts]
        results = engine.generate(token_prompts, sampling)
        engine.check_integrity()
        pids = getattr(engine.executor, "pids", [])
    assert wait_gone(pids) == [], "a worker outlived the engine"
    return results


def _assert_same(tp1, tp2) -> None:
    for a, b in zip(tp1, tp2, strict=True):
        assert b.output_token_ids == a.output_token_ids
        assert b.text == a.text
        for lp_a, lp_b in zip(a.logprobs, b.logprobs, strict=True):
            assert lp_b.keys() == lp_a.keys()
            for token, value in lp_a.items():
                assert lp_b[token] == pytest.approx(value, abs=LOGPROB_TOLERANCE)


def test_tp2_equals_tp1_on_the_tiny_preset(tiny_model_dir):
    prompts = [[1, 2, 3, 4, 5, 6, 7], [40, 41, 42], list(range(100, 140)), [9, 8, 7], [3, 1, 4, 1, 5]]
    # Greedy, a seeded draw (every rank draws the same from the same logits), and a grammar
    # (its token masks travel in the step's message).
    sampling = [GREEDY, GREEDY, GREEDY, SamplingParams(max_tokens=8, temperature=0.8, seed=7, logprobs=2),
                SamplingParams(max_tokens=8, temperature=0.0, logprobs=2,
                               structured_outputs=StructuredOutputsParams(regex="[a-z]{2,6}"))]
    tp1 = _run(_params(tiny_model_dir), prompts, sampling)
    # Async scheduling too: the ranks take their in-flight samples from their own last step.
    tp2 = _run(_params(tiny_model_dir, tensor_parallel_size=2, async_scheduling=True), prompts, sampling)
    _assert_same(tp1, tp2)


def test_tp2_equals_tp1_on_the_embedded_default_model():
    # SmolLM2-135M: 9 query heads, 3 KV heads, split 2 + 1 over the two ranks.
    tp1 = _run(_params(None), TEXT_PROMPTS)
    tp2 = _run(_params(None, tensor_parallel_size=2), TEXT_PROMPTS)
    _assert_same(tp1, tp2)


def test_each_rank_s_connector_half_gets_its_rank_identity_and_the_stats_add_up(tiny_model_dir, tmp_path):
    def ktc(probe_dir):
        probe_dir.mkdir()
        return parse_kv_transfer_config(json.dumps({
            "kv_connector": "RankProbeConnector", "kv_connector_module_path": "tests.support.connectors.rank_probe_connector",
            "kv_role": "kv_producer", "kv_connector_extra_config": {"probe_dir": str(probe_dir)}}))

    prompt = list(range(200, 240))  # 2 full blocks of 16 stored
    stats = {}
    for tp in (1, 2):
        params = _params(tiny_model_dir, tensor_parallel_size=tp, kv_transfer_config=ktc(tmp_path / f"tp{tp}"))
        with LLMEngine(params) as engine:
            engine.generate([prompt], GREEDY)
            engine.flush_connector()
            stats[tp] = msgspec.structs.replace(engine.stats())
            if tp == 2:
                engine.add_request([5, 6, 7], GREEDY, kv_transfer_params={"explode_rank": 1})
                with pytest.raises(WorkerError) as failed:
                    while engine.has_unfinished_requests():
                        engine.step()
                pids = engine.executor.pids
        docs = [json.loads(p.read_text()) for p in sorted((tmp_path / f"tp{tp}").iterdir())]
        by_role = {(d["role"], d["tp_rank"]): d for d in docs}
        if tp == 1:
            assert {k: (d["tp_size"], d["num_kv_heads"]) for k, d in by_role.items()} == {
                ("scheduler", 0): (1, 2), ("worker", 0): (1, 2)}
    assert wait_gone(pids) == []
    message = str(failed.value)
    assert message.startswith("tensor-parallel worker rank 1 failed: RuntimeError: rank 1's load blew up")
    assert "\n" not in message
    # The tiny preset has 2 KV heads: one per rank.
    assert {k: (d["tp_size"], d["num_kv_heads"]) for k, d in by_role.items()} == {
        ("scheduler", 0): (2, 1), ("worker", 0): (2, 1), ("worker", 1): (2, 1)}
    assert all(d["pages_kv_heads"] == 1 for d in docs if d["role"] == "worker")
    # Tokens count once (every rank stores the same ones); bytes are every rank's: two halves.
    assert stats[2].external_tokens_stored == stats[1].external_tokens_stored == 32
    assert stats[2].bytes_stored == stats[1].bytes_stored


def test_a_killed_worker_ends_the_engine_in_one_line_naming_its_rank(tiny_model_dir):
    engine = LLMEngine(_params(tiny_model_dir, tensor_parallel_size=2))
    try:
        pids = engine.executor.pids
        engine.generate([[1, 2, 3]], GREEDY)
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(WorkerError) as died:
            engine.generate([[4, 5, 6]], GREEDY)
        assert str(died.value) == "tensor-parallel worker rank 1 died (signal 9, SIGKILL)"
        with pytest.raises(WorkerError):  # the group stays broken: every later step says so
            engine.step()
    finally:
        engine.close()
    assert running(pids) == []


def test_a_worker_s_start_up_error_reads_as_in_process(tiny_model_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ModelError) as in_process:
        LLMEngine(_params(broken))
    with pytest.raises(ModelError) as in_workers:
        LLMEngine(_params(broken, tensor_parallel_size=2))
    assert str(in_workers.value) == str(in_process.value)


def test_a_size_the_heads_cannot_split_into_is_refused_in_one_line(run_kvtool, tiny_model_dir):
    code, out, err = run_kvtool(["generate", "--model", tiny_model_dir, "--device", "cpu", "-tp", "3", "--prompt", "hello"])
    assert code == 2
    assert err.strip().splitlines() == [
        "error: --tensor-parallel-size 3 does not fit the model: with 2 KV heads (fewer than the ranks) "
        "the size must be a multiple of 2 dividing the 4 query heads"]
    code, out, err = run_kvtool(["generate", "--model", tiny_model_dir, "--tensor-parallel-size", "0", "--prompt", "hello"])
    assert code == 2
    assert err.strip() == "error: --tensor-parallel-size must be between 1 and 1024, got 0"


@pytest.mark.parametrize("command", [["serve"], ["generate"], ["bench", "ttft"], ["bench", "throughput"], ["replay"]])
def test_every_command_that_runs_a_model_takes_the_flag(run_kvtool, command, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    code, out, _ = run_kvtool([*command, "--help"])
    assert code == 0
    assert "-tp, --tensor-parallel-size" in out


def test_tp2_with_the_cpu_tier_loads_each_rank_s_shard_and_gives_the_same_tokens(tiny_model_dir):
    # Each rank's worker half keeps its own KV shard in its own CPU pool, at the slots the one
    # scheduler half assigns; a slot is free again only once every rank has finished its job.
    prompt = [(i * 31) % 240 + 5 for i in range(80)]
    sampling = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2)
    (ref,) = _run(_params(tiny_model_dir), [prompt], sampling)
    ktc = parse_kv_transfer_config(json.dumps({"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                                               "kv_load_failure_policy": "fail"}))
    params = _params(tiny_model_dir, tensor_parallel_size=2, kv_transfer_config=ktc, enable_prefix_caching=False)
    with LLMEngine(params) as engine:
        first = engine.generate([prompt], sampling)[0]
        engine.flush_connector()
        second = engine.generate([prompt], sampling)[0]
        engine.flush_connector()
        engine.check_integrity()
        assert engine.scheduler.connector.slots.num_pinned == 0
    assert first.stats.num_external_stored_tokens == 80
    # A full hit loads every block (the last one whole) and computes the last token alone.
    assert second.stats.num_external_loaded_tokens == 80
    assert second.stats.num_external_tokens == 79
    _assert_same([ref, ref], [first, second])
