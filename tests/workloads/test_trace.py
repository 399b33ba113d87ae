"""The trace format, its reader's one-line errors, the generators and `kvtool replay make-trace`."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtool.engine.errors import InputError
from kvtool.workloads.make_trace import TRACE_KINDS, TraceShape, make_trace
from kvtool.workloads.trace import TraceRequest, encode_trace, read_trace

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "traces"


def write(tmp_path, *lines: str) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_reads_prompts_ids_and_defaults(tmp_path):
    path = write(
        tmp_path,
        "# a comment",
        '{"prompt": "hello", "id": "greeting"}',
        "",
        '{"prompt_token_ids": [5, 6, 7], "arrival_s": 0.5, "max_tokens": 4, "temperature": 0.7, "seed": 3, '
        '"cache_salt": "tenant-a", "ignore_eos": true}',
    )
    lines = read_trace(path)
    assert [entry.line for entry in lines] == [2, 4]
    assert [entry.name for entry in lines] == ["greeting", "line 4"]
    first, second = (entry.request for entry in lines)
    assert first.prompt == "hello" and first.temperature == 0.0 and first.sampling().is_greedy
    assert second.prompt_token_ids == [5, 6, 7] and second.arrival_s == 0.5 and second.cache_salt == "tenant-a"
    sp = second.sampling()
    assert (sp.max_tokens, sp.temperature, sp.seed, sp.ignore_eos) == (4, 0.7, 3, True)


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"prompt": "a", "prompt_token_ids": [1]}', "exactly one of `prompt` or `prompt_token_ids`"),
        ('{"max_tokens": 3}', "exactly one of `prompt` or `prompt_token_ids`"),
        ('{"prompt": "a", "colour": "red"}', "unknown field `colour`"),
        ('{"prompt": "a", "max_tokens": "many"}', "Expected `int`, got `str` - at `$.max_tokens`"),
        ('{"prompt": "a",', "malformed JSON"),
        ('{"prompt": ""}', "`prompt` is empty"),
        ('{"prompt_token_ids": []}', "`prompt_token_ids` is empty"),
        ('{"prompt_token_ids": [3, -1]}', "token id -1 is negative"),
        ('{"prompt": "a", "arrival_s": -1}', "arrival_s must be >= 0"),
        ('{"prompt": "a", "temperature": 0.8}', "without a seed"),
        ('{"prompt": "a", "max_tokens": 0}', "max_tokens must be at least 1"),
    ],
)
def test_bad_line_is_one_error_naming_file_and_line(tmp_path, line, message):
    path = write(tmp_path, '{"prompt": "fine"}', line)
    with pytest.raises(InputError) as info:
        read_trace(path)
    text = str(info.value)
    assert text.startswith(f"{path}:2: ") and message in text and "\n" not in text


def test_duplicate_ids_and_backwards_arrivals_are_refused(tmp_path):
    with pytest.raises(InputError, match=r":2: request id 'q' is used twice"):
        read_trace(write(tmp_path, '{"prompt": "a", "id": "q"}', '{"prompt": "b", "id": "q"}'))
    with pytest.raises(InputError, match=r":2: arrival_s 1.0 is earlier"):
        read_trace(write(tmp_path, '{"prompt": "a", "arrival_s": 2}', '{"prompt": "b", "arrival_s": 1}'))


def test_missing_and_empty_files_are_refused(tmp_path):
    with pytest.raises(InputError, match="trace file not found"):
        read_trace(tmp_path / "absent.jsonl")
    with pytest.raises(InputError, match="holds no requests"):
        read_trace(write(tmp_path, "# nothing", ""))


def test_encode_then_read_round_trips(tmp_path):
    requests = [TraceRequest(id="a", prompt="x y"), TraceRequest(prompt_token_ids=[1, 2], arrival_s=1.5, seed=2)]
    path = tmp_path / "t.jsonl"
    path.write_text(encode_trace(requests))
    assert [entry.request for entry in read_trace(path)] == requests
    # Defaults are left out of the file.
    assert json.loads(path.read_text().splitlines()[0]) == {"id": "a", "prompt": "x y"}


@pytest.mark.parametrize("kind", TRACE_KINDS)
def test_generators_are_deterministic_and_readable(tmp_path, kind):
    shape = TraceShape(kind=kind, seed=7)
    first, again, other = make_trace(shape), make_trace(shape), make_trace(TraceShape(kind=kind, seed=8))
    assert first == again and first != other
    path = tmp_path / "t.jsonl"
    path.write_text(encode_trace(first))
    assert [entry.request for entry in read_trace(path)] == first
    assert all(r.arrival_s is None and r.max_tokens == 16 for r in first)
    assert all(32 <= t < 127 for r in first for t in r.prompt_token_ids)


def test_multi_turn_repeats_history_and_shares_the_system_prompt():
    shape = TraceShape(kind="multi-turn", num_conversations=2, num_turns=3, system_len=10, turn_len=5, answer_len=3)
    trace = make_trace(shape)
    assert [r.id for r in trace] == ["conv0-turn0", "conv1-turn0", "conv0-turn1", "conv1-turn1", "conv0-turn2", "conv1-turn2"]
    by_id = {r.id: r.prompt_token_ids for r in trace}
    assert by_id["conv0-turn0"][:10] == by_id["conv1-turn0"][:10]
    assert len(by_id["conv0-turn0"]) == 15 and len(by_id["conv0-turn2"]) == 15 + 2 * (3 + 5)
    for t in (1, 2):
        prev, cur = by_id[f"conv0-turn{t - 1}"], by_id[f"conv0-turn{t}"]
        assert cur[: len(prev)] == prev


def test_long_doc_qa_and_shared_prefix_shapes():
    docs = make_trace(TraceShape(kind="long-doc-qa", num_docs=2, doc_len=20, num_questions=2, question_len=4))
    assert [r.id for r in docs] == ["doc0-q0", "doc1-q0", "doc0-q1", "doc1-q1"]
    ids = {r.id: r.prompt_token_ids for r in docs}
    assert ids["doc0-q0"][:20] == ids["doc0-q1"][:20] != ids["doc1-q0"][:20]
    assert ids["doc0-q0"][20:] != ids["doc0-q1"][20:] and len(ids["doc1-q1"]) == 24
    shared = make_trace(TraceShape(kind="shared-prefix", num_prefixes=2, prefix_len=8, num_requests=5, suffix_len=3))
    prefix = {r.id: r.prompt_token_ids[:8] for r in shared}
    assert prefix["p0-r0"] == prefix["p0-r2"] == prefix["p0-r4"] != prefix["p1-r1"] == prefix["p1-r3"]


def test_text_format_and_request_rate():
    trace = make_trace(TraceShape(kind="long-doc-qa", fmt="text", num_docs=1, doc_len=6, num_questions=2,
                                  question_len=2, request_rate=4.0))
    assert all(r.prompt_token_ids is None and r.prompt.startswith("Document: ") for r in trace)
    assert trace[0].prompt.split("\n\n")[0] == trace[1].prompt.split("\n\n")[0]
    assert len(trace[0].prompt.split("\n\n")[0].split()) == 1 + 6
    assert [r.arrival_s for r in trace] == [0.0, 0.25]


@pytest.mark.parametrize("knob", ["num_requests", "doc_len", "max_tokens"])
def test_bad_knobs_are_refused(knob):
    with pytest.raises(InputError, match=f"--{knob.replace('_', '-')} must be at least 1"):
        make_trace(TraceShape(kind="shared-prefix", **{knob: 0}))


def test_shipped_examples_are_valid_traces():
    paths = sorted(EXAMPLES.glob("*.jsonl"))
    assert {p.stem for p in paths} == set(TRACE_KINDS)
    for path in paths:
        assert len(read_trace(path)) >= 4


def test_make_trace_command_and_dispatch(tmp_path):
    from kvtool.cli import app

    runner = CliRunner()
    out = tmp_path / "t.jsonl"
    result = runner.invoke(app, ["replay", "make-trace", "--kind", "shared-prefix", "--num-requests", "3",
                                 "--prefix-len", "4", "--suffix-len", "2", "--seed", "5", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert [e.name for e in read_trace(out)] == ["p0-r0", "p1-r1", "p0-r2"]
    to_stdout = runner.invoke(app, ["replay", "make-trace", "--kind", "shared-prefix", "--num-requests", "3",
                                    "--prefix-len", "4", "--suffix-len", "2", "--seed", "5"])
    assert to_stdout.exit_code == 0 and to_stdout.stdout == out.read_text()
    assert "--kind" in runner.invoke(app, ["replay", "make-trace", "--help"]).stdout
    replay_help = runner.invoke(app, ["replay", "--help"]).stdout
    assert "TRACE" in replay_help.upper() and "--restart" in replay_help and "make-trace" in replay_help
    bad = runner.invoke(app, ["replay", "make-trace", "--kind", "chat"])
    assert bad.exit_code != 0 and "--kind must be one of" in str(bad.exception)
