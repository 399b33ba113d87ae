"""`kvtool replay TRACE`: prove that KV reuse gives the same output and really hits.
`kvtool replay make-trace`: write a trace of a common shape.

Both live under one `replay` group. A group cannot take a positional TRACE and also have
subcommands, so the group's callback only dispatches: `make-trace` as its first argument runs
the generator, anything else runs the replay. Each has its own `--help`.
"""

import sys
from pathlib import Path
from typing import Annotated, Optional

import msgspec
import typer
from rich.table import Table

from kvtool.commands import render
from kvtool.commands.arm_options import with_arm_engine_options
from kvtool.engine.connectors.config import parse_kv_transfer_config
from kvtool.engine.errors import ConfigError
from kvtool.engine.params import EngineParams
from kvtool.workloads.arms import BUILTIN_ARMS, Arm, arm_from_config, open_arms
from kvtool.workloads.make_trace import REPEAT_MODES, TRACE_KINDS, TraceShape, make_trace
from kvtool.workloads.replay import PASSES, RESTARTS, ReplayReport, refuse_duplicate_names
from kvtool.workloads.trace import encode_trace, read_trace

JsonOutOpt = Annotated[
    Optional[str], typer.Option("--json", help="Write the report as JSON to this file ('-': stdout, instead of the table).")
]


@with_arm_engine_options
def replay(
    trace: Annotated[Path, typer.Argument(help="The trace: JSON Lines, one request per line (see examples/README.md).")],
    kv_transfer_config: Annotated[
        Optional[list[str]],
        typer.Option("--kv-transfer-config", help="An arm running this vLLM KVTransferConfig JSON, named after its connector (repeatable)."),
    ] = None,
    arms: Annotated[
        Optional[list[str]],
        typer.Option("--arms", help=f"An arm: a built-in name ({', '.join(a for a in BUILTIN_ARMS if a not in ('none', 'hf'))}) or NAME=JSON (repeatable)."),
    ] = None,
    restart: Annotated[str, typer.Option("--restart", help="Between fill and reuse: none (same engine, prefix cache emptied), engine (new engine), process (cold subprocess).")] = "none",
    passes: Annotated[str, typer.Option("--passes", help="both; fill (leave the KV behind); reuse (use KV a previous run left).")] = "both",
    server: Annotated[Optional[str], typer.Option("--server", help="Replay against this running OpenAI-compatible server (http://HOST:PORT) instead of in-process arms.")] = None,
    lmcache_url: Annotated[Optional[str], typer.Option("--lmcache-url", help="lm://HOST:PORT for the lmcache arm (default: start LMCache's server from the peer environment).")] = None,
    json_out: JsonOutOpt = None,
    *,
    engine: EngineParams,
) -> None:
    """Replay TRACE through each arm and the reference arm (no connector, nothing reused).

    Each arm runs a fill pass, the restart, then a reuse pass. Every request's output token ids
    must equal the reference arm's in every pass, and in the reuse pass each request must have
    been served from the arm's cache (tokens loaded through the connector) wherever its prompt
    has a whole block the cache could serve. Exit status 0 only when all of that holds; 1 names
    every request that broke it. Write a trace with `kvtool replay make-trace`.

    Examples:
      kvtool replay examples/traces/multi-turn.jsonl --model DIR --arms cpu --arms disk
      kvtool replay trace.jsonl --model DIR --arms disk --arms lmcache --restart process --json report.json
      kvtool replay trace.jsonl --model DIR --kv-transfer-config '{"kv_connector":"OffloadingConnector","kv_role":"kv_both"}'
      kvtool replay trace.jsonl --model DIR --server http://127.0.0.1:8000
    """
    from kvtool.workloads.replay import run_replay, run_server_replay

    if restart not in RESTARTS:
        raise ConfigError(f"--restart must be one of {', '.join(RESTARTS)}, got {restart!r}")
    if passes not in PASSES:
        raise ConfigError(f"--passes must be one of {', '.join(PASSES)}, got {passes!r}")
    lines = read_trace(trace)
    show_progress = json_out != "-"
    if server is not None:
        if arms or kv_transfer_config or restart != "none" or passes != "both":
            raise ConfigError("--server replays against the server as it runs: no --arms, --kv-transfer-config, --restart or --passes")
        with render.progress_bar("replay", enabled=show_progress) as bar:
            report = run_server_replay(lines, engine, url=server, trace_name=str(trace), progress=bar)
        _finish(report, json_out)
        return
    specs = list(arms or [])
    if not specs and not kv_transfer_config:
        raise ConfigError("give at least one arm: --arms NAME[=JSON], --kv-transfer-config JSON, or --server URL")
    if passes != "both" and "disk" in specs:
        raise ConfigError(
            "the built-in disk arm's tier is a temporary directory; with --passes fill or reuse give it one: "
            "--arms 'disk={\"kv_connector\":\"OffloadingConnector\",\"kv_role\":\"kv_both\",\"kv_connector_extra_config\":{\"root_dir\":\"DIR\"}}'"
        )
    for spec in specs:
        if spec in ("none", "hf"):
            raise ConfigError(f"arm {spec!r}: the reference arm always runs, and hf belongs to `kvtool bench`")
    with open_arms(specs, lmcache_url=lmcache_url) as arm_list:
        arm_list += _config_arms(kv_transfer_config or [])
        refuse_duplicate_names(arm_list)
        with render.progress_bar("replay", enabled=show_progress) as bar:
            report = run_replay(lines, engine, arm_list, trace_name=str(trace), restart=restart, passes=passes, progress=bar)
    _finish(report, json_out)


def _config_arms(configs: list[str]) -> list[Arm]:
    """Arms for bare --kv-transfer-config documents, named after their connector."""
    arms = []
    counts: dict[str, int] = {}
    for doc in configs:
        ktc = parse_kv_transfer_config(doc)
        base = ktc.kv_connector if ktc is not None and ktc.kv_connector else "connector"
        counts[base] = counts.get(base, 0) + 1
        arms.append(arm_from_config(base if counts[base] == 1 else f"{base}-{counts[base]}", doc))
    return arms


def _finish(report: ReplayReport, json_out: str | None) -> None:
    if json_out == "-":
        render.print_json(report)
    else:
        if json_out is not None:
            Path(json_out).write_text(msgspec.json.format(msgspec.json.encode(report), indent=2).decode() + "\n")
        _render_table(report)
    if not report.ok:
        raise typer.Exit(1)


def _fmt(value, digits: int = 1) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def _fmt_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, size in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def print_wide(table: Table) -> None:
    """A table on stdout: the terminal's width, or room for every column when piped to a file."""
    if render.stdout.is_terminal:
        render.stdout.print(table)
        return
    width = render.stdout.width
    render.stdout.width = max(width, 160)
    try:
        render.stdout.print(table)
    finally:
        render.stdout.width = width


def _render_table(report: ReplayReport) -> None:
    num_requests = len({(r.request, r.line) for r in report.requests})
    passes = "" if report.passes == "both" else f", {report.passes} pass only"
    table = Table(title=f"replay {report.trace}: {num_requests} requests, restart {report.restart}{passes}", show_edge=False)
    for col in ("arm", "pass", "hits from", "hit rate", "saved tok", "loaded/stored", "TTFT ms p50/p90/p99", "out tok/s"):
        table.add_column(col, justify="left" if col in ("arm", "pass", "hits from") else "right")
    for arm in report.arms:
        for name, s in arm.passes.items():
            table.add_row(
                arm.name, name, arm.hit_source if name == "reuse" and arm.hit_source else "-", f"{s.hit_rate:.0%}",
                str(s.tokens_saved), f"{_fmt_bytes(s.bytes_loaded)}/{_fmt_bytes(s.bytes_stored)}",
                f"{_fmt(s.ttft_p50_ms)}/{_fmt(s.ttft_p90_ms)}/{_fmt(s.ttft_p99_ms)}", _fmt(s.output_tokens_per_s),
            )
    print_wide(table)
    compared = "token ids" if report.compared == "token_ids" else "text (the server returns no token ids)"
    if report.ok:
        render.stdout.print(
            f"OK: {num_requests} requests, outputs identical to the reference arm ({compared}) in every pass; "
            "hits proven in every reuse pass", highlight=False,
        )
        return
    for f in report.failures:
        render.stdout.print(f"FAIL {f.describe()}", markup=False, highlight=False)
    render.stdout.print(f"FAILED: {len(report.failures)} problem(s); outputs compared on {compared}", highlight=False)


def make_trace_command(
    kind: Annotated[str, typer.Option("--kind", help=f"The shape: {', '.join(TRACE_KINDS)}.")],
    out: Annotated[str, typer.Option("--out", help="The trace file to write ('-': stdout).")] = "-",
    fmt: Annotated[str, typer.Option("--format", help="ids (exact token counts) or text (lengths in words).")] = "ids",
    seed: Annotated[int, typer.Option("--seed", help="Same seed, same trace.")] = 0,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Output tokens per request (greedy).")] = 16,
    request_rate: Annotated[Optional[float], typer.Option("--request-rate", help="Requests per second (sets arrival_s); default one after another.")] = None,
    num_conversations: Annotated[int, typer.Option("--num-conversations", help="multi-turn: conversations.")] = 4,
    num_turns: Annotated[int, typer.Option("--num-turns", help="multi-turn: turns per conversation.")] = 3,
    system_len: Annotated[int, typer.Option("--system-len", help="multi-turn: shared system prompt length.")] = 64,
    history_len: Annotated[int, typer.Option("--history-len", help="multi-turn: each user's own context after the system prompt.")] = 0,
    turn_len: Annotated[int, typer.Option("--turn-len", help="multi-turn: user message length.")] = 32,
    answer_len: Annotated[int, typer.Option("--answer-len", help="multi-turn: stand-in answer length between turns.")] = 16,
    think_time: Annotated[float, typer.Option("--think-time", help="multi-turn: mean seconds between a user's turns (sets arrival_s; 0: turn by turn, no times).")] = 0.0,
    num_docs: Annotated[int, typer.Option("--num-docs", help="long-doc-qa: documents.")] = 2,
    doc_len: Annotated[str, typer.Option("--doc-len", help="long-doc-qa: document length, or LOW,HIGH to draw each uniformly.")] = "256",
    num_questions: Annotated[int, typer.Option("--num-questions", help="long-doc-qa: questions per document.")] = 3,
    question_len: Annotated[int, typer.Option("--question-len", help="long-doc-qa: question length.")] = 16,
    repeat_mode: Annotated[str, typer.Option("--repeat-mode", help=f"long-doc-qa: question order, {', '.join(REPEAT_MODES)}.")] = "tile",
    num_prefixes: Annotated[int, typer.Option("--num-prefixes", help="shared-prefix: distinct prefixes.")] = 2,
    prefix_len: Annotated[int, typer.Option("--prefix-len", help="shared-prefix: prefix length.")] = 128,
    num_requests: Annotated[int, typer.Option("--num-requests", help="shared-prefix: requests.")] = 8,
    suffix_len: Annotated[int, typer.Option("--suffix-len", help="shared-prefix: suffix length.")] = 32,
) -> None:
    """Write a trace of a common shape (JSON Lines) for `kvtool replay`.

    Lengths are tokens with --format ids and words with --format text.

    Examples:
      kvtool replay make-trace --kind multi-turn --num-conversations 8 --num-turns 4 --out chat.jsonl
      kvtool replay make-trace --kind multi-turn --num-conversations 64 --num-turns 8 --system-len 1024 --history-len 4096 --think-time 20 --out chat.jsonl
      kvtool replay make-trace --kind long-doc-qa --doc-len 8192,32768 --num-docs 16 --num-questions 4 --out docs.jsonl
      kvtool replay make-trace --kind long-doc-qa --doc-len 8000 --num-docs 4 --format text --out docs.jsonl
      kvtool replay make-trace --kind shared-prefix --prefix-len 1024 --num-requests 32 --request-rate 4
    """
    if kind not in TRACE_KINDS:
        raise ConfigError(f"--kind must be one of {', '.join(TRACE_KINDS)}, got {kind!r}")
    if fmt not in ("ids", "text"):
        raise ConfigError(f"--format must be ids or text, got {fmt!r}")
    if repeat_mode not in REPEAT_MODES:
        raise ConfigError(f"--repeat-mode must be one of {', '.join(REPEAT_MODES)}, got {repeat_mode!r}")
    doc_lo, doc_hi = _length_range("--doc-len", doc_len)
    shape = TraceShape(
        kind=kind, fmt=fmt, seed=seed, max_tokens=max_tokens, request_rate=request_rate,
        num_conversations=num_conversations, num_turns=num_turns, system_len=system_len, history_len=history_len,
        turn_len=turn_len, answer_len=answer_len, think_time_s=think_time, num_docs=num_docs, doc_len=doc_lo,
        doc_len_max=doc_hi, num_questions=num_questions, question_len=question_len, repeat_mode=repeat_mode,
        num_prefixes=num_prefixes, prefix_len=prefix_len, num_requests=num_requests, suffix_len=suffix_len,
    )
    requests = make_trace(shape)
    text = encode_trace(requests)
    if out == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
    else:
        Path(out).write_text(text)
        render.info(f"wrote {len(requests)} requests to {out}")


def _length_range(flag: str, text: str) -> tuple[int, int | None]:
    """N -> (N, None); LOW,HIGH -> (LOW, HIGH). ConfigError naming the flag otherwise."""
    parts = [p.strip() for p in text.split(",")]
    try:
        values = [int(p) for p in parts]
    except ValueError:
        values = []
    if len(values) not in (1, 2):
        raise ConfigError(f"{flag} takes a length or LOW,HIGH, got {text!r}")
    return values[0], values[1] if len(values) == 2 else None


_run_app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
_run_app.command()(replay)
_make_trace_app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
_make_trace_app.command()(make_trace_command)

replay_app = typer.Typer(
    help="Replay a trace through KV arms and prove identical output and real hits (`kvtool replay TRACE --help`); "
    "`kvtool replay make-trace` writes a trace.",
    invoke_without_command=True,
    add_completion=False,
    context_settings={
        # Everything after `replay` reaches the dispatcher untouched, `--help` included.
        "ignore_unknown_options": True,
        "allow_extra_args": True,
        "allow_interspersed_args": False,
        "help_option_names": [],
    },
)


@replay_app.callback()
def _dispatch(args: Annotated[Optional[list[str]], typer.Argument(help="TRACE [OPTIONS], or make-trace [OPTIONS].")] = None) -> None:
    args = list(args or [])
    if args and args[0] == "make-trace":
        typer.main.get_command(_make_trace_app).main(args[1:], prog_name="kvtool replay make-trace")
    typer.main.get_command(_run_app).main(args or ["--help"], prog_name="kvtool replay")
