"""Merging the ranks' connector outputs: a job is done once every rank has reported it, across steps."""

import pytest

from kvtool.engine.connectors.offloading.jobs import OffloadingCompletions
from kvtool.engine.core.messages import KVConnectorOutput, TransferStats
from kvtool.engine.executor.kv_output_aggregator import KVOutputAggregator


def test_a_request_finishes_sending_once_every_rank_has_reported_it():
    agg = KVOutputAggregator(2)
    first = agg.aggregate([KVConnectorOutput(finished_sending={"a", "b"}), KVConnectorOutput(finished_sending={"b"})])
    assert first.finished_sending == {"b"}
    later = agg.aggregate([KVConnectorOutput(), KVConnectorOutput(finished_sending={"a"}, finished_recving={"c"})])
    assert later.finished_sending == {"a"} and later.finished_recving == set()
    assert agg.aggregate([KVConnectorOutput(finished_recving={"c"}), KVConnectorOutput()]).finished_recving == {"c"}


def test_completions_hold_a_job_until_every_rank_is_done_with_it():
    agg = KVOutputAggregator(2)
    out = agg.aggregate([
        KVConnectorOutput(completions=OffloadingCompletions(finished_job_ids=[1, 2], written=[b"h1"])),
        KVConnectorOutput(completions=OffloadingCompletions(finished_job_ids=[2])),
    ])
    assert out.completions == OffloadingCompletions(finished_job_ids=[2], written=[], evicted=[])
    out = agg.aggregate([
        KVConnectorOutput(),
        KVConnectorOutput(completions=OffloadingCompletions(finished_job_ids=[1], written=[b"h1"])),
    ])
    assert out.completions == OffloadingCompletions(finished_job_ids=[1], written=[b"h1"], evicted=[])
    # Nothing new is complete: no completions at all.
    assert agg.aggregate([KVConnectorOutput(completions=OffloadingCompletions(finished_job_ids=[3])),
                          KVConnectorOutput()]).completions is None


def test_a_job_id_reused_later_needs_every_rank_again():
    agg = KVOutputAggregator(2)
    parts = [KVConnectorOutput(completions=OffloadingCompletions(written=[b"h"])) for _ in range(2)]
    assert agg.aggregate(parts).completions.written == [b"h"]
    once = agg.aggregate([parts[0], KVConnectorOutput()])
    assert once.completions is None


def test_load_errors_are_the_union_and_stats_count_tokens_once():
    agg = KVOutputAggregator(2)
    out = agg.aggregate([
        KVConnectorOutput(invalid_block_ids={3}, invalid_reasons={3: "gone"},
                          stats=TransferStats(bytes_loaded=100, load_s=0.5, load_failures=1, tokens_loaded={"r": 16})),
        KVConnectorOutput(invalid_block_ids={3, 4}, invalid_reasons={3: "torn", 4: "refused"},
                          stats=TransferStats(bytes_loaded=60, load_s=0.25, load_failures=2, tokens_loaded={"r": 16})),
    ])
    assert out.invalid_block_ids == {3, 4}
    assert out.invalid_reasons == {3: "gone", 4: "refused"}
    assert out.stats == TransferStats(bytes_loaded=160, load_s=0.75, load_failures=2, tokens_loaded={"r": 16})


def test_no_rank_reporting_is_no_output():
    assert KVOutputAggregator(2).aggregate([None, None]) is None


def test_the_merged_output_answers_the_ranks_step_and_ranks_of_different_steps_are_an_error():
    agg = KVOutputAggregator(2)
    assert agg.aggregate([KVConnectorOutput(step_id=7), KVConnectorOutput(step_id=7)]).step_id == 7
    with pytest.raises(RuntimeError, match="different steps"):
        agg.aggregate([KVConnectorOutput(step_id=7), KVConnectorOutput(step_id=8)])
