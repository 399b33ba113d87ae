"""`LLMEngine.reset_prefix_cache`, the call behind vLLM's `POST /reset_prefix_cache`: it empties
the device prefix cache when nothing holds a block, refuses (changing nothing) while requests
run, and with `reset_running_requests` preempts them, whose output stays what it would have been."""

import pytest

from kvtool.engine.params import SamplingParams

PROMPT = [(7 * j) % 400 + 3 for j in range(80)]
OTHER = [(5 * j) % 300 + 9 for j in range(70)]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def cached_tokens(engine, prompt=PROMPT) -> int:
    return engine.generate([prompt], GREEDY)[0].stats.num_cached_tokens


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_idle_reset_forgets_every_cached_block(make_engine, async_scheduling):
    engine = make_engine(async_scheduling=async_scheduling)
    assert cached_tokens(engine) == 0
    assert cached_tokens(engine) == 64  # the repeat hits its 4 full prompt blocks
    assert engine.reset_prefix_cache() is True
    assert cached_tokens(engine) == 0
    assert engine.scheduler.pool.cached  # the run after the reset cached its blocks again


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_reset_while_requests_run(make_engine, async_scheduling):
    reference = make_engine().generate([OTHER], GREEDY)[0].output_token_ids
    engine = make_engine(async_scheduling=async_scheduling)
    engine.generate([PROMPT], GREEDY)
    rid = engine.add_request(OTHER, GREEDY)
    for _ in range(3):
        engine.step()
    assert not engine.is_finished(rid)

    # A running request holds blocks: the reset fails and forgets nothing.
    assert engine.reset_prefix_cache() is False
    assert engine.reset_prefix_cache(reset_external=True) is False
    before = engine.stats().num_preemptions
    # Preempting it first makes room for the reset; it is then computed again from its prompt.
    assert engine.reset_prefix_cache(reset_running_requests=True) is True
    assert engine.stats().num_preemptions == before + 1
    assert engine.scheduler.pool.cached == {}
    while engine.has_unfinished_requests():
        engine.step()
    result = engine.pop_result(rid)
    assert result.output_token_ids == reference
    assert result.stats.num_preemptions == 1
    assert cached_tokens(engine) == 0  # PROMPT's blocks were forgotten by the reset
