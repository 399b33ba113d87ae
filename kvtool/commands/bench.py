"""`kvtool bench ttft`, `kvtool bench throughput` and `kvtool bench serve`: numbers measured
against baselines in the same run."""

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

bench_app = typer.Typer(help="Benchmarks: TTFT of reused prefixes on every axis, offline throughput, and serving a "
                        "trace at offered loads beside vLLM.", no_args_is_help=True)

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


SERVE_ARMS_DEFAULT = "prefix-cache,cpu,disk,lmcache,vllm,vllm-offload"


@bench_app.command("serve")
@with_arm_engine_options
def serve(
    trace: Annotated[Path, typer.Argument(help="The trace: JSON Lines, one request per line (`kvtool replay make-trace` writes one).")],
    preset: PresetOpt = None,
    arms: Annotated[str, typer.Option("--arms", help="Arms, comma-separated: kvtool's prefix-cache, cpu, disk, lmcache (or none, redis, redis-cluster, redis-sentinel), and vLLM's vllm, vllm-offload.")] = SERVE_ARMS_DEFAULT,
    arm: Annotated[Optional[list[str]], typer.Option("--arm", help="A further kvtool arm NAME=JSON (a vLLM KVTransferConfig), or a built-in arm's own config (repeatable).")] = None,
    request_rate: Annotated[str, typer.Option("--request-rate", help="Offered loads, comma-separated: requests/s (Poisson arrivals), inf (all at once) or trace (the trace's arrival_s).")] = "inf",
    max_concurrency: Annotated[Optional[int], typer.Option("--max-concurrency", help="Most requests in flight at once (the rest wait for a slot, in trace order).")] = None,
    arrival_seed: Annotated[int, typer.Option("--arrival-seed", help="Seed of the Poisson arrival times (the same for every arm).")] = 0,
    num_warmups: Annotated[int, typer.Option("--num-warmups", help="Trace requests each arm runs once before its runs, under a salt of their own.")] = 4,
    kv_pressure: Annotated[float, typer.Option("--kv-pressure", help="Size the device KV cache to hold 1/P of the trace's working set (its distinct prompt tokens); --num-gpu-blocks overrides it.")] = 4.0,
    cpu_tier_size: Annotated[str, typer.Option("--cpu-tier-size", help="Bytes of the CPU tier of the cpu, disk and vllm-offload arms (e.g. 32G), or auto: the working set and a quarter more.")] = "auto",
    lmcache_url: Annotated[Optional[str], typer.Option("--lmcache-url", help="lm://HOST:PORT for the lmcache arm (default: start LMCache's server from the peer environment).")] = None,
    vllm_site: Annotated[Optional[str], typer.Option("--vllm-site", envvar="KVTOOL_VLLM_SITE", help="A folder holding vLLM 0.26 and what it needs (an unpacked vLLM pack), put first on the vLLM arms' PYTHONPATH (default: $KVTOOL_VLLM_SITE, else the environment's vllm).")] = None,
    vllm_timeout: Annotated[float, typer.Option("--vllm-timeout", help="Seconds a vLLM arm may take, start-up and every run.")] = 3600.0,
    json_out: JsonOutOpt = None,
    plot: Annotated[Optional[Path], typer.Option("--plot", help="Draw TTFT p50, TTFT p99 and output throughput against the load to this PNG.")] = None,
    *,
    engine: EngineParams,
) -> None:
    """Serve TRACE at each offered load with every arm; per arm and load: TTFT, TPOT and end-to-end
    latency percentiles, output and total tokens/s, whether the queue grew, and the prompt tokens
    each source served (computed, device prefix cache, CPU tier, disk, remote store).

    Every request is greedy with EOS ignored, so it produces exactly its max_tokens. The device
    KV cache holds 1/--kv-pressure of the trace's working set, so that the tiers serve the reuse.
    kvtool's arms run in this process behind the engine loop `kvtool serve` uses; vLLM's arms
    (vllm: prefix caching; vllm-offload: its OffloadingConnector with a CPU tier of the same
    bytes) run vLLM's AsyncLLM in a process of their own, on the same prompts, output lengths and
    arrival times; they need a CUDA device and vLLM (--vllm-site), and are skipped, in one line
    saying why, where they cannot run. Exit status 1 when a request failed, a kvtool arm's output
    differs from the first kvtool arm's, or an arm's hits are not proven.

    Examples:
      kvtool bench serve chat.jsonl --preset tiny --load-format dummy --device cpu --arms prefix-cache,cpu,disk --request-rate 2,4,inf
      kvtool bench serve chat.jsonl --preset qwen3-8b --load-format dummy --request-rate 0.5,1,2,4 --vllm-site DIR --json serve.json --plot serve.png
      kvtool bench serve docs.jsonl --model DIR --arms cpu,lmcache --max-concurrency 16 --lmcache-url lm://127.0.0.1:65432
    """
    from kvtool.engine.connectors.config import parse_human_int
    from kvtool.engine.kv.identity import resolve_device
    from kvtool.workloads.serve_arrivals import parse_request_rates
    from kvtool.workloads.serve_bench import ServeSettings, SkippedArm, run_serve
    from kvtool.workloads.trace import read_trace
    from kvtool.workloads.vllm_serve import VLLM_ARMS, vllm_unavailable

    loads = parse_request_rates(request_rate)
    names = [a.strip() for a in arms.split(",") if a.strip()]
    custom = list(arm or [])
    defined = {spec.partition("=")[0].strip() for spec in custom}
    kvtool_arms = [a for a in BUILTIN_ARMS if a != "hf"]
    for name in names:
        if name == "hf":
            raise ConfigError("arm 'hf' belongs to `bench ttft` and `bench throughput`: it serves no load")
        if name not in kvtool_arms and name not in VLLM_ARMS and name not in defined:
            raise ConfigError(f"unknown arm {name!r} in --arms; built-in arms are "
                              f"{', '.join(kvtool_arms + list(VLLM_ARMS))} (give others with --arm NAME=JSON)")
    if len(set(names)) != len(names):
        raise ConfigError(f"--arms names an arm twice: {arms!r}")
    if cpu_tier_size == "auto":
        cpu_tier_bytes = None
    else:
        try:
            cpu_tier_bytes = parse_human_int(cpu_tier_size)
        except ConfigError as e:
            raise ConfigError(f"--cpu-tier-size: {e}") from None
    vllm_names = [n for n in names if n in VLLM_ARMS]
    specs = [n for n in names if n not in VLLM_ARMS and n not in defined] + custom
    skipped = []
    if vllm_names:
        reason = vllm_unavailable(vllm_site, resolve_device(engine.device).type)
        if reason is not None:
            skipped = [SkippedArm(arm=n, reason=reason) for n in vllm_names]
            vllm_names = []
            render.warn(f"{', '.join(s.arm for s in skipped)} skipped: {reason}")
            if not specs:
                raise ConfigError(f"nothing to run: {reason}")
    if not specs and not vllm_names:
        raise ConfigError("give at least one arm with --arms")
    lines = read_trace(trace)
    settings = ServeSettings(trace=str(trace), loads=loads, max_concurrency=max_concurrency, arrival_seed=arrival_seed,
                             num_warmups=num_warmups, kv_pressure=None if engine.num_gpu_blocks else kv_pressure,
                             cpu_tier_bytes=cpu_tier_bytes)
    with _model_params(engine, preset) as params, open_arms(specs, lmcache_url=lmcache_url) as arm_list:
        with render.progress_bar("bench serve", enabled=json_out != "-") as bar:
            report = run_serve(params, lines, settings, arm_list, vllm_names, skipped=skipped, vllm_site=vllm_site,
                               vllm_timeout_s=vllm_timeout, progress=bar)
    report = _name_preset(report, preset)
    _write_json(report, json_out)
    if plot is not None:
        from kvtool.workloads.serve_plot import plot_serve

        plot_serve(report, plot)
    if json_out != "-":
        _render_serve(report)
    if not report.ok:
        raise typer.Exit(1)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _tiers(s) -> str:
    parts = [f"{label} {value}" for label, value in (("cpu", s.cpu_tier), ("disk", s.disk_tier),
                                                        ("remote", s.remote_store)) if value is not None]
    return ", ".join(parts) or "-"


def _render_serve(report) -> None:
    sizes = report.sizes
    table = Table(
        title=f"bench serve {report.settings.trace}: {report.num_requests} requests on {report.machine} "
              f"({report.dtype}); device KV {sizes.kv_capacity_tokens} tokens, working set "
              f"{sizes.working_set_tokens} tokens ({sizes.kv_pressure:g}x); CPU tier {sizes.cpu_tier_tokens} tokens",
        show_edge=False)
    for col in ("arm", "rate", "TTFT ms p50/p90/p99", "TPOT ms p50/p99", "E2E ms p50/p99", "out tok/s", "total tok/s",
                "queue", "computed", "device", "tiers", "outputs"):
        table.add_column(col, justify="left" if col in ("arm", "queue", "tiers", "outputs") else "right")
    for r in report.runs:
        f = r.figures
        queue = {True: "grew", False: "steady", None: "-"}[f.queue.grew]
        outputs = "-" if r.outputs_equal is None else ("equal" if r.outputs_equal else f"{r.num_outputs_differing} differ")
        table.add_row(
            r.arm, r.load, f"{_ms(f.ttft.p50_ms)}/{_ms(f.ttft.p90_ms)}/{_ms(f.ttft.p99_ms)}",
            f"{_ms(f.tpot.p50_ms)}/{_ms(f.tpot.p99_ms)}", f"{_ms(f.e2e.p50_ms)}/{_ms(f.e2e.p99_ms)}",
            _ms(f.output_tokens_per_s), _ms(f.total_tokens_per_s), queue, str(r.sources.computed),
            str(r.sources.device_cache), _tiers(r.sources), outputs,
        )
    print_wide(table)
    for summary in report.arms:
        if summary.max_sustained_rate is not None:
            render.stdout.print(f"{summary.name}: highest rate sustained (queue steady) {summary.max_sustained_rate:g}/s",
                                highlight=False)
    for s in report.skipped:
        render.stdout.print(f"SKIPPED {s.arm}: {s.reason}", markup=False, highlight=False)
    if report.ok:
        same = (f"kvtool's arms gave the same output token ids as {report.reference_arm} for every request; "
                if report.reference_arm else "")
        render.stdout.print(f"OK: {same}every arm's hits proven", highlight=False)
        return
    for failure in report.failures:
        render.stdout.print(f"FAIL {failure}", markup=False, highlight=False)
    render.stdout.print(f"FAILED: {len(report.failures)} problem(s)", highlight=False)
