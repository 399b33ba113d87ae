"""The real Scheduler and BlockPool at toy geometry, fed hand-made runner outputs."""

import pytest

from kvtool.engine.core.hashing import make_none_hash
from kvtool.engine.core.messages import ModelRunnerOutput
from kvtool.engine.core.request import Request, RequestStatus
from kvtool.engine.core.scheduler import Scheduler
from kvtool.engine.params import SamplingParams


def make_scheduler(num_blocks=64, block_size=4, budget=64, max_seqs=8, prefix=True):
    return Scheduler(
        num_blocks=num_blocks,
        block_size=block_size,
        max_num_batched_tokens=budget,
        max_num_seqs=max_seqs,
        enable_prefix_caching=prefix,
        none_hash=make_none_hash("test"),
    )


def make_request(rid, tokens, max_tokens=4, eos=frozenset({999})):
    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens, temperature=0.0),
                   max_tokens=max_tokens, eos_token_ids=eos)


def run_step(sched, token=7):
    so = sched.schedule()
    sampled = {s.request_id: token for s in so.scheduled if s.sample}
    outs = sched.update_from_output(so, ModelRunnerOutput(sampled=sampled, logprobs={}))
    return so, outs


def run_to_end(sched, token=7, limit=500):
    steps = []
    for _ in range(limit):
        if not sched.has_unfinished_requests():
            return steps
        steps.append(run_step(sched, token))
    raise AssertionError("did not finish")


@pytest.mark.parametrize("block_size", [4, 16])
def test_chunked_prefill_then_decode(block_size):
    sched = make_scheduler(block_size=block_size, budget=10)
    req = make_request("a", list(range(25)), max_tokens=3)
    sched.add_request(req)
    steps = run_to_end(sched)
    # 25 prompt tokens in chunks of 10, then two decode steps.
    assert [so.num_scheduled_tokens for so, _ in steps] == [10, 10, 5, 1, 1]
    assert req.output_token_ids == [7, 7, 7] and req.status == RequestStatus.FINISHED_LENGTH
    sched.check_integrity()
    assert sched.pool.num_free_blocks == sched.pool.num_blocks


def test_prefix_hit_leaves_one_token_and_counts_blocks():
    sched = make_scheduler(block_size=16)
    a = make_request("a", list(range(100)))
    sched.add_request(a)
    run_to_end(sched)
    b = make_request("b", list(range(100)))
    sched.add_request(b)
    so, _ = run_step(sched)
    assert b.num_cached_tokens == 96 and so.scheduled[0].start == 96
    run_to_end(sched)
    # A prompt of exactly 2 full blocks hits one block only: one token must be computed.
    c = make_request("c", list(range(32)))
    sched.add_request(c)
    run_to_end(sched)
    d = make_request("d", list(range(32)))
    sched.add_request(d)
    run_step(sched)
    assert d.num_cached_tokens == 16
    run_to_end(sched)
    sched.check_integrity()


def test_no_prefix_caching_never_hits():
    sched = make_scheduler(prefix=False)
    for rid in ("a", "b"):
        r = make_request(rid, list(range(40)))
        sched.add_request(r)
        run_to_end(sched)
        assert r.num_cached_tokens == 0


def test_preemption_recomputes_and_finishes():
    # 6 blocks of 4 tokens: two requests of 8 prompt + 8 output tokens cannot both fit.
    sched = make_scheduler(num_blocks=6, block_size=4, budget=64)
    a = make_request("a", list(range(8)), max_tokens=8)
    b = make_request("b", list(range(100, 108)), max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    run_to_end(sched)
    assert sched.stats.num_preemptions >= 1
    assert b.num_preemptions >= 1 or a.num_preemptions >= 1
    assert a.output_token_ids == [7] * 8 and b.output_token_ids == [7] * 8
    sched.check_integrity()
    assert sched.pool.num_free_blocks == 6


def test_eos_and_stop_token_ids():
    sched = make_scheduler()
    r = make_request("a", list(range(5)), max_tokens=10)
    sched.add_request(r)
    run_step(sched, token=999)
    assert r.status == RequestStatus.FINISHED_STOPPED and r.output_token_ids == [999]
    r2 = Request("b", [1, 2], SamplingParams(max_tokens=10, stop_token_ids=[5]), max_tokens=10,
                 eos_token_ids=frozenset())
    sched.add_request(r2)
    run_step(sched, token=5)
    assert r2.status == RequestStatus.FINISHED_STOPPED and r2.stop_reason == 5


def test_ignore_eos():
    sched = make_scheduler()
    r = Request("a", [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True), max_tokens=3,
                eos_token_ids=frozenset({7}))
    sched.add_request(r)
    run_to_end(sched, token=7)
    assert r.output_token_ids == [7, 7, 7] and r.status == RequestStatus.FINISHED_LENGTH


def test_abort_frees_blocks():
    sched = make_scheduler()
    r = make_request("a", list(range(30)), max_tokens=50)
    sched.add_request(r)
    run_step(sched)
    sched.abort_request("a")
    assert r.status == RequestStatus.FINISHED_ABORTED
    assert not sched.has_unfinished_requests()
    sched.check_integrity()
    assert sched.pool.num_free_blocks == sched.pool.num_blocks


def test_max_num_seqs_limits_running():
    sched = make_scheduler(max_seqs=2)
    for i in range(4):
        sched.add_request(make_request(str(i), [i, i + 1, i + 2]))
    so, _ = run_step(sched)
    assert len(so.scheduled) == 2
    run_to_end(sched)
    sched.check_integrity()


def test_the_registry_keeps_a_finished_request_until_its_result_is_taken():
    sched = make_scheduler()
    req = make_request("a", list(range(6)), max_tokens=2)
    sched.add_request(req)
    run_to_end(sched)
    assert req.is_finished and sched.requests["a"] is req  # the engine's one registry
    assert sched.abort_request("a") is None  # a finished request stays finished
    assert sched.pop_request("a") is req and "a" not in sched.requests


class _Grammars:
    """Stands in for StructuredOutputs: one request with a grammar, a mask per ask."""

    def __init__(self, rids):
        self.rids, self.asked = set(rids), []

    def __bool__(self):
        return bool(self.rids)

    def __contains__(self, rid):
        return rid in self.rids

    def bitmask(self, rid):
        self.asked.append(rid)
        return f"mask-{rid}"


def test_the_step_carries_the_grammar_masks_of_its_samples_only():
    grammars = _Grammars({"g"})
    sched = Scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=8, max_num_seqs=8,
                      enable_prefix_caching=True, none_hash=make_none_hash("test"), structured_outputs=grammars)
    sched.add_request(make_request("g", list(range(12)), max_tokens=2))
    sched.add_request(make_request("p", list(range(3)), max_tokens=2))
    first, _ = run_step(sched)
    assert first.allowed_token_bitmasks == {}  # "g" is mid-prefill: no sample, no mask
    second, _ = run_step(sched)
    assert second.allowed_token_bitmasks == {"g": "mask-g"} and grammars.asked == ["g"]
