"""`kvtool bench throughput`: offline throughput on a fixed random workload, ours against HF's.

The workload (the one nano-vllm's bench.py uses): `num_seqs` sequences whose input and output
lengths are drawn uniformly from the given ranges, random token ids, EOS ignored, so every
sequence produces exactly its output length. The same seed gives the same workload.

    kvtool   every sequence added to one engine at once (continuous batching); timed from the
             first add to the last finish, after an untimed warm-up. The timed pass is cold: the
             prefix cache is reset after the warm-up, the prompt tokens it served from any cache
             anyway are counted, and a count above zero fails the run (the figure would be
             inflated against a baseline that computes every token)
    hf       transformers `generate`, in batches of `hf_batch_size` sequences sorted by output
             length (left-padded); a batch runs to its longest output, and only the tokens each
             sequence asked for are counted
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import msgspec

from kvtool.engine.engine import LLMEngine
from kvtool.engine.errors import ConfigError, KVToolError
from kvtool.engine.kv.identity import resolve_device, resolve_dtype
from kvtool.engine.params import EngineParams, SamplingParams
from kvtool.engine.presets.default_model import resolve_model_path
from kvtool.workloads.figures import rate
from kvtool.workloads.trace_pass import free_device_memory, reset_prefix_cache

Progress = Callable[[str, float], None]
ENGINES: tuple[str, ...] = ("kvtool", "hf")


class WarmTimedPass(KVToolError):
    """The timed pass was served prompt tokens from a cache: its figure would be inflated."""

    exit_code = 1


class ThroughputSettings(msgspec.Struct, kw_only=True):
    num_seqs: int = 256
    input_len: tuple[int, int] = (100, 1024)
    output_len: tuple[int, int] = (100, 1024)
    seed: int = 0
    hf_batch_size: int = 16


class ThroughputResult(msgspec.Struct, kw_only=True):
    engine: str
    num_seqs: int
    num_prompt_tokens: int
    num_output_tokens: int
    elapsed_s: float
    output_tokens_per_s: float | None
    total_tokens_per_s: float | None  # (prompt + output) / elapsed
    # Prompt tokens of the timed pass served from a cache instead of computed (must be 0).
    num_cached_prompt_tokens: int = 0
    note: str | None = None


class ThroughputReport(msgspec.Struct, kw_only=True):
    results: list[ThroughputResult]
    settings: ThroughputSettings
    model: str
    device: str
    dtype: str
    started_at: str


class Sequence(msgspec.Struct, array_like=True):
    prompt_token_ids: list[int]
    output_len: int


def make_workload(settings: ThroughputSettings, vocab_size: int) -> list[Sequence]:
    """The random sequences of `settings` (ids below min(vocab_size, 32000)); raises ConfigError for bad ranges."""
    for name, (lo, hi) in (("--input-len", settings.input_len), ("--output-len", settings.output_len)):
        if not 1 <= lo <= hi:
            raise ConfigError(f"{name} must be LOW,HIGH with 1 <= LOW <= HIGH, got {lo},{hi}")
    if settings.num_seqs < 1:
        raise ConfigError("--num-seqs must be at least 1")
    rng = random.Random(f"throughput:{settings.seed}")
    top = min(vocab_size, 32000)
    seqs = []
    for _ in range(settings.num_seqs):
        n_in = rng.randint(*settings.input_len)
        n_out = rng.randint(*settings.output_len)
        seqs.append(Sequence([rng.randrange(top) for _ in range(n_in)], n_out))
    return seqs


def run_engine_throughput(params: EngineParams, seqs: list[Sequence], progress: Progress | None = None) -> ThroughputResult:
    """Time our engine on `seqs`."""
    with LLMEngine(params) as engine:
        warm_up(engine, seqs)
        # The warm-up's prompts are the timed pass's: without this reset the prefix cache would
        # serve part of every timed prompt.
        reset_prefix_cache(engine)
        t0 = time.perf_counter()
        ids = [
            engine.add_request(s.prompt_token_ids, SamplingParams(max_tokens=s.output_len, temperature=0.0, ignore_eos=True))
            for s in seqs
        ]
        num_done = 0
        while engine.has_unfinished_requests():
            outs = engine.step()
            num_done += sum(1 for o in outs if o.finished)
            if progress is not None:
                progress("kvtool", num_done / len(seqs))
        elapsed = time.perf_counter() - t0
        results = [engine.pop_result(rid) for rid in ids]
    outputs = sum(len(r.output_token_ids) for r in results)
    cached = sum(r.stats.num_cached_tokens + r.stats.num_external_loaded_tokens for r in results)
    prompt = sum(len(s.prompt_token_ids) for s in seqs)
    return ThroughputResult(
        engine="kvtool", num_seqs=len(seqs), num_prompt_tokens=prompt, num_output_tokens=outputs,
        elapsed_s=round(elapsed, 3), output_tokens_per_s=rate(outputs, elapsed),
        total_tokens_per_s=rate(prompt + outputs, elapsed), num_cached_prompt_tokens=cached,
    )


def warm_up(engine: LLMEngine, seqs: list[Sequence]) -> None:
    """The untimed pass before the timed one."""
    if engine.device.type == "cuda":
        # The whole workload: Triton compiles its kernels and the runner captures a decode graph
        # for every batch size the timed pass will meet.
        engine.generate(
            [s.prompt_token_ids for s in seqs],
            [SamplingParams(max_tokens=s.output_len, temperature=0.0, ignore_eos=True) for s in seqs],
        )
    else:
        engine.generate([[32] * 16], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))


def refuse_warm_timed_pass(report: ThroughputReport) -> None:
    """Raise WarmTimedPass (exit 1) when a timed pass was served prompt tokens from a cache."""
    for r in report.results:
        if r.num_cached_prompt_tokens:
            raise WarmTimedPass(
                f"{r.engine}: the timed pass was served {r.num_cached_prompt_tokens} prompt tokens from a cache; "
                "its throughput would not compare with a baseline that computes every token"
            )


def run_hf_throughput(params: EngineParams, seqs: list[Sequence], batch_size: int, progress: Progress | None = None) -> ThroughputResult:
    """Time transformers `generate` on `seqs` in batches sorted by output length."""
    from kvtool.workloads.hf_baseline import HFBaseline

    if batch_size < 1:
        raise ConfigError("--hf-batch-size must be at least 1")
    hf = HFBaseline(resolve_model_path(params.model), params)
    try:
        hf.generate_padded([[32] * 16], 2)
        order = sorted(range(len(seqs)), key=lambda i: -seqs[i].output_len)
        batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
        t0 = time.perf_counter()
        outputs = 0
        for k, batch in enumerate(batches):
            longest = max(seqs[i].output_len for i in batch)
            hf.generate_padded([seqs[i].prompt_token_ids for i in batch], longest)
            outputs += sum(seqs[i].output_len for i in batch)
            if progress is not None:
                progress("hf", (k + 1) / len(batches))
        elapsed = time.perf_counter() - t0
    finally:
        hf.close()
    prompt = sum(len(s.prompt_token_ids) for s in seqs)
    return ThroughputResult(
        engine="hf", num_seqs=len(seqs), num_prompt_tokens=prompt, num_output_tokens=outputs,
        elapsed_s=round(elapsed, 3), output_tokens_per_s=rate(outputs, elapsed),
        total_tokens_per_s=rate(prompt + outputs, elapsed),
        note=f"batches of {batch_size} sorted by output length; tokens past a sequence's own length are not counted",
    )


def run_throughput(params: EngineParams, settings: ThroughputSettings, engines: list[str],
                   progress: Progress | None = None) -> ThroughputReport:
    """The workload through each of `engines` ("kvtool", "hf"), in that order."""
    from kvtool.engine.models.model_dir import open_model_dir

    for name in engines:
        if name not in ENGINES:
            raise ConfigError(f"unknown engine {name!r}; choose from {', '.join(ENGINES)}")
    model_path = resolve_model_path(params.model)
    seqs = make_workload(settings, open_model_dir(model_path).config.vocab_size)
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    results = []
    for name in engines:
        if name == "kvtool":
            results.append(run_engine_throughput(params, seqs, progress))
            free_device_memory()
        else:
            results.append(run_hf_throughput(params, seqs, settings.hf_batch_size, progress))
    dev = resolve_device(params.device)
    device, dtype = dev.type, str(resolve_dtype(params.dtype, dev)).removeprefix("torch.")
    return ThroughputReport(results=results, settings=settings, model=str(model_path), device=device, dtype=dtype,
                            started_at=started)
