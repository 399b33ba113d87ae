"""`kvtool bench ttft` and `kvtool bench throughput`: numbers measured against baselines in the same run."""

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Optional

import msgspec
import typer
from rich.table import Table

from kvtool.commands import render
from kvtool.commands.arm_options import with_arm_engine_options
from kvtool.commands.replay import print_wide
from kvtool.engine.errors import ConfigError
from kvtool.engine.params import EngineParams
from kvtool.workloads.arms import BUILTIN_ARMS, open_arms

bench_app = typer.Typer(help="Benchmarks: TTFT of reused prefixes on every axis, and offline throughput.", no_args_is_help=True)

JsonOutOpt = Annotated[
    Optional[str], typer.Option("--json", help="Write the report as JSON to this file ('-': stdout, instead of the table).")
]
PresetOpt = Annotated[
    Optional[str],
    typer.Option("--preset", help="Run a preset model (tiny, qwen3-0.6b, qwen3-8b, llama-3.1-8b) written to a temporary directory; with --load-format dummy only its config."),
]


def _ints(flag: str, text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{flag} takes comma-separated integers, got {text!r}") from None


def _floats(flag: str, text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{flag} takes comma-separated numbers, got {text!r}") from None


@contextlib.contextmanager
def _model_params(engine: EngineParams, preset: str | None) -> Iterator[EngineParams]:
    """`engine`, pointed at a temporary directory holding `preset` when one is given."""
    if preset is None:
        yield engine
        return
    if engine.model is not None:
        raise ConfigError("give --model or --preset, not both")
    from kvtool.engine.presets.catalog import create_model_dir

    with tempfile.TemporaryDirectory(prefix="kvtool-bench-model-") as tmp:
        path = Path(tmp) / preset
        create_model_dir(path, preset, seed=engine.seed, config_only=engine.load_format == "dummy")
        yield msgspec.structs.replace(engine, model=str(path))


def _name_preset(report, preset: str | None):
    """The report with its model given as `preset:NAME` rather than the run's temporary directory."""
    return report if preset is None else msgspec.structs.replace(report, model=f"preset:{preset}")


def _write_json(report, json_out: str | None) -> None:
    if json_out == "-":
        render.print_json(report)
    elif json_out is not None:
        Path(json_out).write_text(msgspec.json.format(msgspec.json.encode(report), indent=2).decode() + "\n")


@bench_app.command("ttft")
@with_arm_engine_options
def ttft(
    preset: PresetOpt = None,
    prompt_lens: Annotated[str, typer.Option("--prompt-lens", help="Prompt lengths in tokens, comma-separated.")] = "2048,8192,32768",
    hit_fractions: Annotated[str, typer.Option("--hit-fractions", help="Shares of each prompt that a previous request already had, comma-separated.")] = "0,0.5,1",
    arms: Annotated[str, typer.Option("--arms", help=f"Arms, comma-separated: {', '.join(BUILTIN_ARMS)} (none always runs: it is the reference).")] = "none,prefix-cache,cpu,disk,lmcache,hf",
    arm: Annotated[Optional[list[str]], typer.Option("--arm", help="A further arm NAME=JSON (a vLLM KVTransferConfig), or a built-in arm's own config (repeatable).")] = None,
    concurrency: Annotated[str, typer.Option("--concurrency", help="Requests sent at once, comma-separated.")] = "1,8",
    repeats: Annotated[int, typer.Option("--repeats", help="Measured reuse passes per cell.")] = 3,
    max_tokens: Annotated[int, typer.Option("--max-tokens", help="Output tokens per request (greedy, EOS ignored).")] = 8,
    lmcache_url: Annotated[Optional[str], typer.Option("--lmcache-url", help="lm://HOST:PORT for the lmcache arm (default: start LMCache's server from the peer environment).")] = None,
    json_out: JsonOutOpt = None,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="Draw TTFT and speed-up against prompt length to this PNG.")] = None,
    *,
    engine: EngineParams,
) -> None:
    """TTFT of reused prefixes for every arm x prompt length x hit fraction x concurrency.

    Each cell runs a cold fill pass, then --repeats measured reuse passes. A cell is valid when
    every request's output equals the none arm's and every request was served exactly the
    prefix tokens its arm can serve (counted by the engine: prefix-cache hits, tokens loaded
    from the CPU tier, the disk tier or LMCache). An invalid cell is reported with its reason and
    no number, and makes the exit status 1. The hf arm is Hugging Face transformers on the same
    weights, reusing its own cache for the shared prefix.

    Examples:
      kvtool bench ttft --preset tiny --load-format dummy --device cpu --kv-cache-memory 256M --prompt-lens 256,512,1024 --concurrency 1 --json ttft.json --plot ttft.png
      kvtool bench ttft --preset qwen3-8b --load-format dummy --arms none,cpu,lmcache --lmcache-url lm://127.0.0.1:65432
      kvtool bench ttft --model DIR --arm 'cpu={"kv_connector":"OffloadingConnector","kv_role":"kv_both","kv_connector_extra_config":{"cpu_bytes_to_use":"32G"}}'
    """
    from kvtool.workloads.ttft import TTFTSettings, run_ttft_grid

    settings = TTFTSettings(
        prompt_lens=_ints("--prompt-lens", prompt_lens), hit_fractions=_floats("--hit-fractions", hit_fractions),
        concurrency=_ints("--concurrency", concurrency), repeats=repeats, max_tokens=max_tokens,
    )
    names = [a.strip() for a in arms.split(",") if a.strip()]
    custom = list(arm or [])
    defined = {spec.partition("=")[0].strip() for spec in custom}
    for name in names:
        if name not in BUILTIN_ARMS and name not in defined:
            raise ConfigError(f"unknown arm {name!r} in --arms; built-in arms are {', '.join(BUILTIN_ARMS)} (give others with --arm NAME=JSON)")
    specs = [n for n in names if n not in defined] + custom
    show_progress = json_out != "-"
    with _model_params(engine, preset) as params, open_arms(specs, lmcache_url=lmcache_url) as arm_list:
        with render.progress_bar("bench ttft", enabled=show_progress) as bar:
            report = run_ttft_grid(params, arm_list, settings, progress=bar)
    report = _name_preset(report, preset)
    _write_json(report, json_out)
    if plot is not None:
        from kvtool.workloads.plot import plot_ttft

        plot_ttft(report, plot)
    if json_out != "-":
        _render_ttft(report)
    if not all(c.valid for c in report.cells):
        raise typer.Exit(1)


def _render_ttft(report) -> None:
    table = Table(title=f"bench ttft: {report.device} {report.dtype}, {report.settings.repeats} repeats, {report.wall_s:.0f} s",
                  show_edge=False)
    for col in ("arm", "prompt", "hit", "conc", "TTFT ms median", "min-max", "cold ms", "speed-up", "hits from",
                "hit tokens", "check"):
        table.add_column(col, justify="left" if col in ("arm", "hits from", "check") else "right")
    for c in report.cells:
        t = c.ttft_ms
        table.add_row(
            c.arm, str(c.prompt_len), f"{c.hit_fraction:g}", str(c.concurrency),
            f"{t.median_ms:.1f}" if t else "-", f"{t.min_ms:.1f}-{t.max_ms:.1f}" if t else "-",
            f"{c.cold_ttft_ms:.1f}" if c.cold_ttft_ms is not None else "-",
            f"{c.speedup_vs_none:.2f}x" if c.speedup_vs_none is not None else "-", c.hit_source or "-",
            f"{c.hit_tokens}/{c.expected_hit_tokens}", "valid" if c.valid else f"INVALID: {c.invalid_reason}",
        )
    print_wide(table)


@bench_app.command("throughput")
@with_arm_engine_options
def throughput(
    preset: PresetOpt = None,
    num_seqs: Annotated[int, typer.Option("--num-seqs", help="Sequences in the workload.")] = 256,
    input_len: Annotated[str, typer.Option("--input-len", help="LOW,HIGH: input lengths drawn uniformly in [LOW, HIGH].")] = "100,1024",
    output_len: Annotated[str, typer.Option("--output-len", help="LOW,HIGH: output lengths drawn uniformly in [LOW, HIGH] (EOS ignored).")] = "100,1024",
    workload_seed: Annotated[int, typer.Option("--workload-seed", help="Same seed, same workload.")] = 0,
    engines: Annotated[str, typer.Option("--engines", help="kvtool, hf or both, comma-separated.")] = "kvtool,hf",
    hf_batch_size: Annotated[int, typer.Option("--hf-batch-size", help="Sequences per transformers generate call.")] = 16,
    json_out: JsonOutOpt = None,
    *,
    engine: EngineParams,
) -> None:
    """Offline throughput on a fixed random workload: our engine and transformers, same run.

    Examples:
      kvtool bench throughput --preset qwen3-0.6b --load-format dummy
      kvtool bench throughput --preset tiny --load-format dummy --device cpu --num-seqs 32 --json tp.json
    """
    from kvtool.workloads.throughput import ThroughputSettings, refuse_warm_timed_pass, run_throughput

    lo_in, hi_in = _pair("--input-len", input_len)
    lo_out, hi_out = _pair("--output-len", output_len)
    settings = ThroughputSettings(num_seqs=num_seqs, input_len=(lo_in, hi_in), output_len=(lo_out, hi_out),
                                  seed=workload_seed, hf_batch_size=hf_batch_size)
    names = [e.strip() for e in engines.split(",") if e.strip()]
    with _model_params(engine, preset) as params:
        with render.progress_bar("bench throughput", enabled=json_out != "-") as bar:
            report = run_throughput(params, settings, names, progress=bar)
    report = _name_preset(report, preset)
    _write_json(report, json_out)
    if json_out != "-":
        _throughput_table(report, settings.num_seqs)
    refuse_warm_timed_pass(report)


def _throughput_table(report, num_seqs: int) -> None:
    table = Table(title=f"bench throughput: {report.device} {report.dtype}, {num_seqs} sequences", show_edge=False)
    for col in ("engine", "prompt tok", "cached prompt tok", "output tok", "time s", "output tok/s", "total tok/s"):
        table.add_column(col, justify="left" if col == "engine" else "right")
    for r in report.results:
        table.add_row(r.engine, str(r.num_prompt_tokens), str(r.num_cached_prompt_tokens), str(r.num_output_tokens),
                      f"{r.elapsed_s:.2f}",
                      f"{r.output_tokens_per_s:.1f}" if r.output_tokens_per_s else "-",
                      f"{r.total_tokens_per_s:.1f}" if r.total_tokens_per_s else "-")
    print_wide(table)
    for r in report.results:
        if r.note:
            render.info(f"{r.engine}: {r.note}")


def _pair(flag: str, text: str) -> tuple[int, int]:
    values = _ints(flag, text)
    if len(values) != 2:
        raise ConfigError(f"{flag} takes LOW,HIGH, got {text!r}")
    return values[0], values[1]
