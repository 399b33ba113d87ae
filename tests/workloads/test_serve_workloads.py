"""The workloads of `kvtool bench serve`: make-trace's multi-turn and long-doc-qa shapes, the
arrival times, the working set and cache sizes, and the queue-growth rule."""

import statistics

import pytest
from typer.testing import CliRunner

from kvtool.engine.errors import ConfigError, InputError
from kvtool.workloads.make_trace import TraceShape, make_trace
from kvtool.workloads.serve_arrivals import Load, make_arrivals, parse_request_rates
from kvtool.workloads.serve_metrics import RequestTiming, queue_growth, run_figures
from kvtool.workloads.serve_sizing import size_caches, working_set_tokens
from kvtool.workloads.trace import read_trace

CHAT = dict(kind="multi-turn", num_conversations=5, num_turns=4, system_len=24, history_len=40, turn_len=6,
            answer_len=5)


def test_multi_turn_users_share_the_system_prompt_and_grow_their_own_history():
    trace = make_trace(TraceShape(**CHAT, seed=3))
    assert trace == make_trace(TraceShape(**CHAT, seed=3)) != make_trace(TraceShape(**CHAT, seed=4))
    by_id = {r.id: r.prompt_token_ids for r in trace}
    assert len(by_id) == 5 * 4
    first_turns = [by_id[f"conv{c}-turn0"] for c in range(5)]
    # The system prompt is everyone's; each user's own context follows it and is no one else's.
    assert all(p[:24] == first_turns[0][:24] for p in first_turns)
    assert len({tuple(p[24:64]) for p in first_turns}) == 5
    for c in range(5):
        lengths = [len(by_id[f"conv{c}-turn{t}"]) for t in range(4)]
        assert lengths == [24 + 40 + 6 + t * (5 + 6) for t in range(4)]
        for t in range(1, 4):
            prev, cur = by_id[f"conv{c}-turn{t - 1}"], by_id[f"conv{c}-turn{t}"]
            assert cur[: len(prev)] == prev  # the whole history again, then the answer and a new message


def test_multi_turn_think_time_puts_each_users_turns_on_a_timeline():
    trace = make_trace(TraceShape(**CHAT, think_time_s=10.0, seed=1))
    assert trace == make_trace(TraceShape(**CHAT, think_time_s=10.0, seed=1))
    times = [r.arrival_s for r in trace]
    assert times == sorted(times) and all(t is not None for t in times)
    for c in range(5):
        turns = [(r.arrival_s, r.id) for r in trace if r.id.startswith(f"conv{c}-")]
        assert [i for _, i in turns] == [f"conv{c}-turn{t}" for t in range(4)]  # a user's turns in order
        assert 0 <= turns[0][0] < 10.0
        gaps = [b[0] - a[0] for a, b in zip(turns, turns[1:])]
        assert all(5.0 - 1e-6 <= g <= 15.0 + 1e-6 for g in gaps)
    # The prompts are those of the trace without a timeline, only reordered.
    plain = make_trace(TraceShape(**CHAT, seed=1))
    assert sorted(r.id for r in trace) == sorted(r.id for r in plain)
    assert {r.id: r.prompt_token_ids for r in trace} == {r.id: r.prompt_token_ids for r in plain}
    with pytest.raises(InputError, match="give --think-time or --request-rate, not both"):
        make_trace(TraceShape(**CHAT, think_time_s=1.0, request_rate=2.0))


def test_long_doc_qa_draws_document_lengths_and_orders_the_questions():
    shape = dict(kind="long-doc-qa", num_docs=6, doc_len=80, doc_len_max=320, num_questions=3, question_len=5)
    tile = make_trace(TraceShape(**shape, seed=2))
    assert tile == make_trace(TraceShape(**shape, seed=2)) != make_trace(TraceShape(**shape, seed=5))
    docs = {r.id: r.prompt_token_ids for r in tile}
    lengths = [len(docs[f"doc{d}-q0"]) - 5 for d in range(6)]
    assert all(80 <= n <= 320 for n in lengths) and len(set(lengths)) > 1
    for d in range(6):
        n = lengths[d]
        assert docs[f"doc{d}-q0"][:n] == docs[f"doc{d}-q1"][:n] == docs[f"doc{d}-q2"][:n]
        assert docs[f"doc{d}-q0"][n:] != docs[f"doc{d}-q1"][n:]
    # tile: every document once, then again; interleave: a document's questions back to back.
    assert [r.id for r in tile][:6] == [f"doc{d}-q0" for d in range(6)]
    inter = make_trace(TraceShape(**shape, seed=2, repeat_mode="interleave"))
    assert [r.id for r in inter][:4] == ["doc0-q0", "doc0-q1", "doc0-q2", "doc1-q0"]
    shuffled = make_trace(TraceShape(**shape, seed=2, repeat_mode="random"))
    assert sorted(r.id for r in shuffled) == sorted(docs) and [r.id for r in shuffled] != [r.id for r in tile]
    assert {r.id: r.prompt_token_ids for r in inter} == {r.id: r.prompt_token_ids for r in shuffled} == docs
    with pytest.raises(InputError, match="--doc-len LOW,HIGH needs LOW <= HIGH"):
        make_trace(TraceShape(kind="long-doc-qa", doc_len=50, doc_len_max=10))


def test_make_trace_command_writes_both_workloads(tmp_path):
    from kvtool.cli import app

    runner = CliRunner()
    chat, docs = tmp_path / "chat.jsonl", tmp_path / "docs.jsonl"
    result = runner.invoke(app, ["replay", "make-trace", "--kind", "multi-turn", "--num-conversations", "3",
                                 "--num-turns", "2", "--system-len", "8", "--history-len", "12", "--turn-len", "4",
                                 "--answer-len", "3", "--think-time", "2.5", "--seed", "9", "--out", str(chat)])
    assert result.exit_code == 0, result.output
    lines = read_trace(chat)
    assert len(lines) == 6 and all(e.request.arrival_s is not None for e in lines)
    result = runner.invoke(app, ["replay", "make-trace", "--kind", "long-doc-qa", "--num-docs", "3", "--doc-len",
                                 "20,40", "--num-questions", "2", "--repeat-mode", "interleave", "--out", str(docs)])
    assert result.exit_code == 0, result.output
    assert [e.name for e in read_trace(docs)][:2] == ["doc0-q0", "doc0-q1"]
    for args, message in ((["--doc-len", "8k"], "--doc-len takes a length or LOW,HIGH"),
                          (["--repeat-mode", "zigzag"], "--repeat-mode must be one of tile, interleave, random")):
        bad = runner.invoke(app, ["replay", "make-trace", "--kind", "long-doc-qa", *args])
        assert bad.exit_code != 0 and message in str(bad.exception)


def test_poisson_arrivals_are_seeded_and_at_the_rate():
    loads = parse_request_rates("4,0.5,inf,trace")
    assert [x.label for x in loads] == ["4", "0.5", "inf", "trace"]
    assert [x.rate for x in loads] == [4.0, 0.5, None, None]
    four = make_arrivals(loads[0], 2000, seed=0, trace_arrivals=[])
    assert four == make_arrivals(Load(label="4.0", rate=4.0), 2000, seed=0, trace_arrivals=[])
    assert four != make_arrivals(loads[0], 2000, seed=1, trace_arrivals=[])
    assert four[0] == 0.0 and four == sorted(four)
    assert statistics.mean(b - a for a, b in zip(four, four[1:])) == pytest.approx(0.25, rel=0.1)
    assert make_arrivals(loads[2], 3, seed=0, trace_arrivals=[]) == [0.0, 0.0, 0.0]
    assert make_arrivals(loads[3], 2, seed=0, trace_arrivals=[0.5, 1.5]) == [0.5, 1.5]
    for bad in ("0", "nan", "1,1", "", "x"):
        with pytest.raises(ConfigError, match="--request-rate"):
            parse_request_rates(bad)


def test_working_set_counts_each_prefix_block_once():
    system = list(range(16))
    prompts = [system + [100 + i] * 16 for i in range(3)] + [system + [100] * 16 + [7] * 4]
    # The system block once, three user blocks, and one partial block of 4.
    assert working_set_tokens(prompts, 16) == 16 + 3 * 16 + 4
    # The same tokens after a different prefix are other blocks.
    assert working_set_tokens([[1] * 16 + [2] * 16, [3] * 16 + [2] * 16], 16) == 64
    sizes = size_caches(prompts, [4] * 4, block_size=16, kv_pressure=1.0, num_gpu_blocks=None, bytes_per_token=10,
                        cpu_tier_bytes=None)
    assert sizes.num_gpu_blocks == 4 and sizes.kv_capacity_tokens == 64 and sizes.longest_request_tokens == 40
    assert sizes.cpu_tier_tokens == 85 and sizes.cpu_tier_bytes == 850  # 68 tokens and a quarter more
    with pytest.raises(ConfigError, match="--kv-pressure 4 leaves the device cache 1 blocks"):
        size_caches(prompts, [4] * 4, block_size=16, kv_pressure=4.0, num_gpu_blocks=None, bytes_per_token=10,
                    cpu_tier_bytes=None)


def _record(i, arrival, first, finish, n=4) -> RequestTiming:
    return RequestTiming(index=i, arrival_s=arrival, send_s=arrival, first_token_s=first, finish_s=finish,
                         num_prompt_tokens=10, num_output_tokens=n)


def test_queue_growth_rule():
    # Served as they come: one request waits 0.05 s for its first token.
    steady = [_record(i, i * 0.1, i * 0.1 + 0.05, i * 0.1 + 0.08) for i in range(100)]
    growth = queue_growth(steady)
    assert growth.grew is False and growth.max_waiting == 1 and growth.backlog_at_last_arrival == 1
    # Served at half the arrival rate: the backlog grows linearly over the run.
    falling_behind = [_record(i, i * 0.1, i * 0.2 + 0.05, i * 0.2 + 0.08) for i in range(100)]
    growth = queue_growth(falling_behind)
    assert growth.grew is True and growth.waiting_end > growth.waiting_mid > 10
    assert growth.backlog_at_last_arrival == 50 and growth.drain_s == pytest.approx(9.98)
    # A burst of 10 at the start, then arrivals at the rate they are served (one per 0.2 s): the
    # queue is full early and never empties, though no longer at the end than in the middle.
    arrivals = [0.01 * i for i in range(10)] + [0.1 + 0.2 * (i - 9) for i in range(10, 40)]
    full_early = [_record(i, a, 0.2 * (i + 1), 0.2 * (i + 1) + 0.03) for i, a in enumerate(arrivals)]
    growth = queue_growth(full_early)
    assert growth.grew is True and growth.waiting_min_late >= 1
    assert growth.waiting_end <= growth.waiting_mid + max(2.0, 0.5 * growth.waiting_mid)
    assert queue_growth(steady).waiting_min_late == 0
    # All at once: no window to compare.
    assert queue_growth([_record(i, 0.0, 0.1 * i + 0.05, 0.1 * i + 0.08) for i in range(5)]).grew is None


def test_run_figures():
    records = [_record(0, 0.0, 0.1, 0.4, n=4), _record(1, 0.5, 0.7, 1.0, n=1),
               RequestTiming(index=2, arrival_s=0.6, send_s=0.6, finish_s=0.61, num_prompt_tokens=10, error="boom")]
    f = run_figures(records)
    assert f.num_requests == 3 and f.num_failed == 1 and f.duration_s == 1.0
    assert f.ttft.num_samples == 2 and f.ttft.p50_ms == pytest.approx(150.0)
    assert f.tpot.num_samples == 1 and f.tpot.p50_ms == pytest.approx(100.0)  # (0.4 - 0.1) / 3
    assert f.e2e.p99_ms == pytest.approx(499.0, abs=0.5)
    assert f.output_tokens_per_s == 5.0 and f.total_tokens_per_s == 25.0
