"""Engine core on the tiny model: batching, prefix caching and preemption never change greedy output."""

import random

import pytest

from kvtool.engine.errors import ConfigError, InputError
from kvtool.engine.params import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def prompts(n, seed=0, lo=5, hi=120):
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def test_alone_equals_batched(make_engine):
    ps = prompts(8)
    alone = []
    for p in ps:
        engine = make_engine(enable_prefix_caching=False)
        alone.append(engine.generate([p], GREEDY)[0].output_token_ids)
    batched = make_engine(enable_prefix_caching=False).generate(ps, GREEDY)
    assert [r.output_token_ids for r in batched] == alone


def test_chunked_prefill_equals_one_shot(make_engine):
    ps = prompts(3, seed=1, lo=200, hi=300)
    whole = make_engine(max_num_batched_tokens=2048).generate(ps, GREEDY)
    chunked = make_engine(max_num_batched_tokens=37).generate(ps, GREEDY)
    assert [r.output_token_ids for r in whole] == [r.output_token_ids for r in chunked]


def test_prefix_hit_equals_no_prefix_caching(make_engine):
    p = prompts(1, seed=2, lo=100, hi=101)[0]
    assert len(p) == 100
    engine = make_engine()
    first = engine.generate([p], GREEDY)[0]
    second = engine.generate([p], GREEDY)[0]
    assert first.stats.num_cached_tokens == 0
    assert second.stats.num_cached_tokens == 96  # 6 full blocks of 16; the 4-token tail is computed
    off = make_engine(enable_prefix_caching=False).generate([p], GREEDY)[0]
    assert first.output_token_ids == second.output_token_ids == off.output_token_ids
    assert off.stats.num_cached_tokens == 0


def test_shared_prefix_in_one_batch(make_engine):
    base = prompts(1, seed=3, lo=64, hi=65)[0]
    ps = [base + [7, 8, 9], base + [10, 11]]
    engine = make_engine()
    engine.generate([base + [1]], GREEDY)
    results = engine.generate(ps, GREEDY)
    assert all(r.stats.num_cached_tokens == 64 for r in results)
    ref = make_engine(enable_prefix_caching=False).generate(ps, GREEDY)
    assert [r.output_token_ids for r in results] == [r.output_token_ids for r in ref]


def test_preemption_keeps_output(make_engine):
    ps = prompts(6, seed=4, lo=20, hi=60)
    sp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    ref = make_engine(enable_prefix_caching=False).generate(ps, sp)
    # 10 blocks of 16 tokens cannot hold six requests of up to 100 tokens at once.
    small = make_engine(num_gpu_blocks=10, enable_prefix_caching=False)
    out = small.generate(ps, sp)
    assert small.stats().num_preemptions > 0
    assert [r.output_token_ids for r in out] == [r.output_token_ids for r in ref]


def test_seeded_sampling_is_reproducible(make_engine):
    p = prompts(1, seed=5)[0]
    sp = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, top_k=40, seed=1234, ignore_eos=True)
    a = make_engine().generate([p], sp)[0].output_token_ids
    b = make_engine().generate([p, prompts(1, seed=6)[0]], [sp, GREEDY])[0].output_token_ids
    assert a == b
    c = make_engine().generate([p], SamplingParams(max_tokens=16, temperature=0.9, seed=99, ignore_eos=True))[0]
    assert c.output_token_ids != a


def test_max_tokens_ends_with_length(make_engine):
    engine = make_engine()
    text_prompt = engine.tokenizer.encode("hello world", add_special_tokens=False)
    r = engine.generate([text_prompt], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))[0]
    assert len(r.output_token_ids) == 5 and r.finish_reason == "length"


def test_stop_string_ends_and_is_cut_from_the_text():
    """On the embedded model, whose greedy answer is known: stop at "Paris"."""
    from kvtool.engine.engine import LLMEngine
    from kvtool.engine.params import EngineParams

    with LLMEngine(EngineParams(device="cpu", kv_cache_memory=256 << 20)) as engine:
        p = engine.encode_prompt("What is the capital of France?", chat=True)
        full = engine.generate([p], SamplingParams(max_tokens=20, temperature=0.0))[0]
        cut = engine.generate([p], SamplingParams(max_tokens=20, temperature=0.0, stop=["Paris"]))[0]
    assert full.text == "The capital of France is Paris." and full.finish_reason == "stop"
    assert cut.text == "The capital of France is " and cut.finish_reason == "stop"
    assert len(cut.output_token_ids) < len(full.output_token_ids)


def test_bad_requests_are_refused(make_engine):
    engine = make_engine(max_model_len=128)
    with pytest.raises(InputError, match="empty"):
        engine.add_request([], GREEDY)
    with pytest.raises(InputError, match="maximum model length"):
        engine.add_request(list(range(3, 200)), GREEDY)
    vocab = engine.model_config.vocab_size
    for bad in (-1, vocab, vocab + 7):
        with pytest.raises(InputError, match=rf"^token id {bad} is out of range for a vocabulary of {vocab}$"):
            engine.add_request([5, 6, bad, -2 if bad != -1 else 7], GREEDY)
    assert not engine.has_unfinished_requests()
    engine.add_request([0, vocab - 1], GREEDY)  # both ends of the range are token ids
    with pytest.raises(InputError, match="at least 1"):
        SamplingParams(max_tokens=-1)
    tiny = make_engine(num_gpu_blocks=2)
    with pytest.raises(InputError, match="KV blocks"):
        tiny.add_request(list(range(3, 60)), GREEDY)
    with pytest.raises(ConfigError, match="max_position_embeddings"):
        make_engine(max_model_len=10**7)


def test_stats_are_a_snapshot(make_engine):
    """Two `stats()` calls around work can be subtracted: the first keeps its values."""
    engine = make_engine()
    before = engine.stats()
    engine.generate(prompts(2, seed=7), GREEDY)
    after = engine.stats()
    assert after is not before
    assert (before.num_requests, before.num_generation_tokens) == (0, 0)
    assert (after.num_requests, after.num_generation_tokens) == (2, 24)
    assert after.num_free_blocks == after.num_blocks and after.num_running == after.num_waiting == 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_step_times_count_every_step_by_phase(make_engine, async_scheduling):
    """`step_times`: the host's seconds of the steps so far by phase, each step counted once,
    the phases within the wall time they were taken in; `minus` gives a stretch's share."""
    import time

    engine = make_engine(async_scheduling=async_scheduling)
    start = engine.step_times()
    assert start.steps == 0 and start.launch_s == 0.0
    t0 = time.perf_counter()
    steps = 0
    engine.add_request(prompts(1, lo=40, hi=41)[0], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    wall = time.perf_counter() - t0
    got = engine.step_times().minus(start)
    assert got.steps == steps
    phases = (got.schedule_s, got.launch_s, got.wait_s, got.update_s, got.outputs_s)
    assert all(p >= 0 for p in phases) and got.launch_s > 0 and sum(phases) <= wall
    assert (got.wait_s > 0) is async_scheduling  # without async scheduling the wait is inside the launch
    # The prompt's one chunk is the one step that computed more than a token of a request.
    assert got.mixed_steps == 1 and 0 < got.mixed_launch_s <= got.launch_s
