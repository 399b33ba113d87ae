"""`kvtool bench serve`: a trace replayed at offered loads against every arm, kvtool's and vLLM's.

For each arm, one engine serves every load in turn (each run under its own cache_salt, so that
no run hits what another stored): kvtool's arms in this process (serve_pass.py), vLLM's in a
process of their own (vllm_serve.py), all on the same prompt token ids, output lengths and
arrival times (serve_arrivals.py), with the device cache sized from the trace's working set
(serve_sizing.py). The figures of each run come from the client's own timestamps
(serve_metrics.py).

Prompt tokens by source, as each engine counts them. kvtool, per request: computed, the device
prefix cache (num_cached_tokens) and the connector (num_external_loaded_tokens), the latter
named by the arm's connector: its CPU tier, its CPU tier and its disk tier (the engine counts
the loads read from disk, num_external_loaded_from_disk), or its remote store. vLLM, per run: its own breakdown of the prompt tokens into
computed, local cache hits and external KV transfer (IterationStats.prompt_token_stats), the
last being its CPU tier's; where a vLLM lacks it, num_cached_tokens summed over the requests
less the connector's external hits (its scheduler statistics).

The run fails (report `ok` false, exit status 1) when a request fails; when a kvtool arm's
output token ids differ from the first kvtool arm's for any request at any load; or when an
arm's hits are not proven: a trace with reuse in it, and an arm whose cache served no prompt
token at any load (its connector for a connector arm, its device cache for the others, vLLM's
external hits for vllm-offload). vLLM's outputs are not compared with kvtool's: with dummy
weights the two engines' weights differ.
"""

from __future__ import annotations

import json
import os
import platform
import time
import uuid
from collections.abc import Callable

import msgspec

from kvtool.engine.engine import LLMEngine
from kvtool.engine.errors import ConfigError
from kvtool.engine.kv.identity import resolve_device, resolve_dtype
from kvtool.engine.outputs import StepTimes
from kvtool.engine.params import EngineParams
from kvtool.engine.presets.default_model import resolve_model_path
from kvtool.workloads.arms import Arm, hit_source
from kvtool.workloads.figures import to_ms
from kvtool.workloads.replay import arm_params
from kvtool.workloads.serve_arrivals import Load, make_arrivals
from kvtool.workloads.serve_metrics import QUEUE_RULE, RequestTiming, RunFigures, run_figures
from kvtool.workloads.serve_pass import EngineRuns, ServeRequest
from kvtool.workloads.serve_sizing import CacheSizes, kv_bytes_per_token, size_caches
from kvtool.workloads.trace import TraceLine
from kvtool.workloads.trace_pass import free_device_memory
from kvtool.workloads.vllm_serve import VLLMArmFailed, run_vllm_arm, vllm_engine_args

Progress = Callable[[str, float], None]


class ServeSettings(msgspec.Struct, kw_only=True):
    trace: str
    loads: list[Load]
    max_concurrency: int | None
    arrival_seed: int
    num_warmups: int  # trace requests run once per arm before the runs, under a salt of their own
    kv_pressure: float | None  # as asked; None when --num-gpu-blocks sized the device cache
    cpu_tier_bytes: int | None  # as asked; None = auto


class PromptSources(msgspec.Struct, kw_only=True):
    """Prompt tokens of a run by where they came from, as the engine counts them."""

    num_prompt_tokens: int
    computed: int
    device_cache: int
    cpu_tier: int | None = None
    disk_tier: int | None = None  # read from the disk tier on the way (the engine's count)
    remote_store: int | None = None
    connector: int = 0  # everything loaded through the connector (external hits, for vLLM)


class RequestRow(msgspec.Struct, kw_only=True):
    index: int
    arrival_s: float
    send_s: float | None
    ttft_ms: float | None
    tpot_ms: float | None
    e2e_ms: float | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    num_loaded_tokens: int
    error: str | None = None


class ServeRun(msgspec.Struct, kw_only=True):
    arm: str
    engine: str  # kvtool or vllm
    load: str  # the rate as given: a number, inf or trace
    request_rate: float | None  # None for inf and trace
    max_concurrency: int | None
    figures: RunFigures
    sources: PromptSources
    # kvtool's arms: every request's output token ids equal the reference arm's (None for vLLM).
    outputs_equal: bool | None
    num_outputs_differing: int = 0
    vllm_stats: dict[str, int] | None = None
    # kvtool's arms: the engine's host seconds by phase over the run (`outputs.StepTimes`).
    host: StepTimes | None = None
    requests: list[RequestRow] = []


class ArmSummary(msgspec.Struct, kw_only=True):
    name: str
    engine: str
    kv_transfer_config: str | None
    hits_from: str | None  # where its reuse comes from beyond the device cache: cpu, cpu+disk, lmcache, ...
    # The highest numeric rate at which its queue did not grow and no request failed.
    max_sustained_rate: float | None = None
    vllm: dict | None = None  # vLLM's start-up row: version, GPU, device blocks, engine arguments
    log_path: str | None = None


class SkippedArm(msgspec.Struct, kw_only=True):
    arm: str
    reason: str


class ServeReport(msgspec.Struct, kw_only=True):
    ok: bool
    failures: list[str]
    model: str
    machine: str
    device: str
    dtype: str
    started_at: str
    wall_s: float
    num_requests: int
    max_model_len: int
    sizes: CacheSizes
    settings: ServeSettings
    reference_arm: str | None  # the kvtool arm every other kvtool arm's outputs are compared with
    queue_rule: str
    arms: list[ArmSummary]
    runs: list[ServeRun]
    skipped: list[SkippedArm] = []


def resolve_prompts(lines: list[TraceLine], tokenizer) -> tuple[list[ServeRequest], list[float | None]]:
    """Token ids and output lengths of every trace line (text through the model's tokenizer), and
    the trace's own arrival times. Sampling is the benchmark's: greedy, EOS ignored."""
    requests, arrivals = [], []
    for entry in lines:
        r = entry.request
        ids = list(r.prompt_token_ids) if r.prompt_token_ids is not None else tokenizer.encode(
            r.prompt or "", add_special_tokens=True)
        requests.append(ServeRequest(ids, r.max_tokens))
        arrivals.append(r.arrival_s)
    return requests, arrivals


def with_tier_sizes(arm: Arm, cpu_bytes: int, disk_bytes: int) -> Arm:
    """An OffloadingConnector arm given `cpu_bytes` of CPU tier and, with a disk tier (root_dir),
    `disk_bytes` of it, where its own config does not size them."""
    if arm.kv_transfer_config is None:
        return arm
    doc = json.loads(arm.kv_transfer_config)
    if doc.get("kv_connector") != "OffloadingConnector":
        return arm
    extra = doc.setdefault("kv_connector_extra_config", {})
    if "cpu_bytes_to_use" not in extra and "num_cpu_blocks" not in extra:
        extra["cpu_bytes_to_use"] = cpu_bytes
    if "root_dir" in extra and "fs_capacity_bytes" not in extra:
        extra["fs_capacity_bytes"] = disk_bytes
    return msgspec.structs.replace(arm, kv_transfer_config=json.dumps(doc))


def connector_source(arm: Arm) -> str | None:
    """cpu, cpu+disk, or the remote store's name; None for an arm without a connector."""
    if arm.reuse != "connector":
        return None
    source = hit_source(arm, rebuilt=False)
    return "cpu+disk" if source == "cpu" and arm.survives_restart else source


def _kvtool_sources(records: list[RequestTiming], source: str | None) -> PromptSources:
    prompt = sum(r.num_prompt_tokens for r in records)
    device = sum(r.num_cached_tokens for r in records)
    loaded = sum(r.num_loaded_tokens for r in records)
    tiers = {}
    if source == "cpu":
        tiers["cpu_tier"] = loaded
    elif source == "cpu+disk":
        disk = sum(r.num_loaded_from_disk for r in records)
        tiers["cpu_tier"], tiers["disk_tier"] = loaded - disk, disk
    elif source is not None:
        tiers["remote_store"] = loaded
    return PromptSources(num_prompt_tokens=prompt, computed=prompt - device - loaded, device_cache=device,
                         connector=loaded, **tiers)


def _vllm_sources(records: list[RequestTiming], stats: dict[str, int], offload: bool) -> PromptSources:
    prompt = sum(r.num_prompt_tokens for r in records)
    if stats.get("prompt_tokens") == prompt:
        # vLLM's own breakdown of the run's prompt tokens, one count per request.
        local, external = stats["prompt_tokens_local_cache_hit"], stats["prompt_tokens_external_kv_transfer"]
    else:
        # A vLLM without it: the requests' cached tokens, less the connector's external hits.
        reused = sum(r.num_cached_tokens for r in records)
        external = min(stats.get("connector_hits", 0), reused)
        local = reused - external
    return PromptSources(num_prompt_tokens=prompt, computed=prompt - local - external, device_cache=local,
                         cpu_tier=external if offload else None, connector=external)


def _rows(records: list[RequestTiming]) -> list[RequestRow]:
    rows = []
    for r in records:
        sent = r.send_s is not None and r.error is None
        ttft = r.first_token_s - r.send_s if sent and r.first_token_s is not None else None
        tpot = ((r.finish_s - r.first_token_s) / (r.num_output_tokens - 1)
                if ttft is not None and r.finish_s is not None and r.num_output_tokens > 1 else None)
        e2e = r.finish_s - r.send_s if sent and r.finish_s is not None else None
        rows.append(RequestRow(index=r.index, arrival_s=r.arrival_s, send_s=None if r.send_s is None else round(
            r.send_s, 6), ttft_ms=to_ms(ttft), tpot_ms=to_ms(tpot), e2e_ms=to_ms(e2e),
            num_prompt_tokens=r.num_prompt_tokens, num_output_tokens=r.num_output_tokens,
            num_cached_tokens=r.num_cached_tokens, num_loaded_tokens=r.num_loaded_tokens, error=r.error))
    return rows


def _machine(device_type: str) -> str:
    if device_type == "cuda":
        import torch

        return f"{torch.cuda.get_device_name()} (CUDA {torch.version.cuda})"
    return f"{platform.machine()} CPU, {os.cpu_count()} cores"


class ServeBench:
    """The state of one `bench serve`: what every arm runs, and what the runs gave."""

    def __init__(self, base: EngineParams, lines: list[TraceLine], settings: ServeSettings,
                 progress: Progress | None) -> None:
        from kvtool.engine.models.model_dir import open_model_dir

        self.model_path = resolve_model_path(base.model)
        model_dir = open_model_dir(self.model_path)
        self.requests, trace_arrivals = resolve_prompts(lines, model_dir.tokenizer)
        self.device = resolve_device(base.device)
        torch_dtype = resolve_dtype(base.dtype, self.device)
        self.dtype = str(torch_dtype).removeprefix("torch.")
        prompts = [r.prompt_token_ids for r in self.requests]
        max_tokens = [r.max_tokens for r in self.requests]
        self.sizes = size_caches(prompts, max_tokens, block_size=base.block_size, kv_pressure=settings.kv_pressure,
                                 num_gpu_blocks=base.num_gpu_blocks,
                                 bytes_per_token=kv_bytes_per_token(model_dir.config, torch_dtype),
                                 cpu_tier_bytes=settings.cpu_tier_bytes)
        whole_blocks = -(-self.sizes.longest_request_tokens // base.block_size) * base.block_size
        self.max_model_len = base.max_model_len or whole_blocks
        limit = model_dir.config.max_position_embeddings
        if self.max_model_len > limit or self.max_model_len < self.sizes.longest_request_tokens:
            raise ConfigError(f"the trace's longest request takes {self.sizes.longest_request_tokens} tokens with its "
                              f"output; the model takes {limit} and --max-model-len {self.max_model_len}")
        self.base = msgspec.structs.replace(base, num_gpu_blocks=self.sizes.num_gpu_blocks,
                                            max_model_len=self.max_model_len)
        self.settings = settings
        self.arrivals = {load.label: make_arrivals(load, len(self.requests), settings.arrival_seed, trace_arrivals)
                         for load in settings.loads}
        self.reusable = sum(len(p) for p in prompts) > self.sizes.working_set_tokens
        self.progress = progress
        self.run_id = uuid.uuid4().hex[:12]
        self.runs: list[ServeRun] = []
        self.arms: list[ArmSummary] = []
        self.failures: list[str] = []
        self.reference: tuple[str, list[list[int]]] | None = None

    # ---- kvtool's arms ----------------------------------------------------------------------

    def run_kvtool_arm(self, arm: Arm, tick: Callable[[], None]) -> None:
        arm = with_tier_sizes(arm, self.sizes.cpu_tier_bytes, self.sizes.disk_tier_bytes)
        source = connector_source(arm)
        runs = EngineRuns(LLMEngine(arm_params(self.base, arm)))
        try:
            warm = self.requests[: self.settings.num_warmups]
            if warm:
                runs.run(warm, [0.0] * len(warm), max_concurrency=None, salt=self._salt(arm.name, "warm-up"))
            for load in self.settings.loads:
                records = runs.run(self.requests, self.arrivals[load.label],
                                   max_concurrency=self.settings.max_concurrency, salt=self._salt(arm.name, load.label),
                                   tick=tick)
                self._add_run(arm.name, "kvtool", load, records, _kvtool_sources(records, source), host=runs.last_host)
        finally:
            runs.close()
            # The engine's weights and pages must be unreferenced before the allocator can give
            # them back: the next arm, or vLLM's process, sizes itself from what is free.
            runs = None
            free_device_memory()
        self.arms.append(ArmSummary(name=arm.name, engine="kvtool", kv_transfer_config=arm.kv_transfer_config,
                                    hits_from=source))
        if arm.reuse != "none":
            self._check_hits(arm.name, "connector" if source else "device_cache",
                             "its connector" if source else "its device prefix cache")

    # ---- vLLM's arms ------------------------------------------------------------------------

    def run_vllm_arm(self, name: str, site: str | None, timeout_s: float, tick_runs: Callable[[int], None]) -> None:
        offload = name == "vllm-offload"
        args = vllm_engine_args(self.base, self.dtype, self.sizes, self.max_model_len, cpu_tier=offload)
        runs = [{"name": load.label, "arrivals": self.arrivals[load.label],
                 "max_concurrency": self.settings.max_concurrency, "salt": self._salt(name, load.label)}
                for load in self.settings.loads]
        try:
            result = run_vllm_arm(name, self.model_path, args, [r.prompt_token_ids for r in self.requests],
                                  [r.max_tokens for r in self.requests], runs, site=site,
                                  num_warmups=self.settings.num_warmups, timeout_s=timeout_s, progress=tick_runs)
        except VLLMArmFailed as e:
            self.failures.append(str(e))
            return
        for load, run in zip(self.settings.loads, result.runs):
            self._add_run(name, "vllm", load, run.records, _vllm_sources(run.records, run.stats, offload), run.stats)
        ktc = json.dumps(args["kv_transfer_config"]) if offload else None
        self.arms.append(ArmSummary(name=name, engine="vllm", kv_transfer_config=ktc,
                                    hits_from="cpu" if offload else None, vllm=result.startup,
                                    log_path=result.log_path))
        self._check_hits(name, "connector" if offload else "reused",
                         "its connector (external hits)" if offload else "its prefix cache")

    # ---- results ----------------------------------------------------------------------------

    def _salt(self, arm: str, load: str) -> str:
        return f"kvtool-bench-serve-{self.run_id}-{arm}-{load}"

    def _add_run(self, arm: str, engine: str, load: Load, records: list[RequestTiming], sources: PromptSources,
                 vllm_stats: dict[str, int] | None = None, host: StepTimes | None = None) -> None:
        figures = run_figures(records)
        run = ServeRun(arm=arm, engine=engine, load=load.label, request_rate=load.rate,
                       max_concurrency=self.settings.max_concurrency, figures=figures, sources=sources,
                       outputs_equal=None, vllm_stats=vllm_stats, host=host, requests=_rows(records))
        failed = [r for r in records if r.error is not None]
        if failed:
            self.failures.append(f"arm {arm} at rate {load.label}: {len(failed)} request(s) failed; request "
                                 f"{failed[0].index}: {failed[0].error}")
        if engine == "kvtool":
            outputs = [r.output_token_ids for r in records]
            if self.reference is None:
                self.reference = (arm, outputs)
            ref_arm, ref = self.reference
            differing = [i for i, (a, b) in enumerate(zip(outputs, ref)) if a != b]
            run.outputs_equal, run.num_outputs_differing = not differing, len(differing)
            if differing:
                self.failures.append(
                    f"arm {arm} at rate {load.label}: the output token ids of {len(differing)} request(s) differ from "
                    f"arm {ref_arm}'s (first: request {differing[0]}); reuse must not change greedy output")
        self.runs.append(run)

    def _check_hits(self, arm: str, counter: str, what: str) -> None:
        if not self.reusable:
            return
        runs = [r for r in self.runs if r.arm == arm]
        if counter == "reused":
            served = sum(r.sources.num_prompt_tokens - r.sources.computed for r in runs)
        else:
            served = sum(getattr(r.sources, counter) for r in runs)
        if runs and served == 0:
            self.failures.append(f"arm {arm}: hits not proven: {what} served no prompt token at any rate, though "
                                 "the trace reuses prefixes")

    def report(self, started_at: str, wall_s: float, skipped: list[SkippedArm]) -> ServeReport:
        for summary in self.arms:
            sustained = [r.request_rate for r in self.runs if r.arm == summary.name and r.request_rate is not None
                         and r.figures.queue.grew is False and r.figures.num_failed == 0]
            summary.max_sustained_rate = max(sustained, default=None)
        return ServeReport(
            ok=not self.failures, failures=self.failures, model=str(self.model_path),
            machine=_machine(self.device.type), device=self.device.type, dtype=self.dtype, started_at=started_at,
            wall_s=round(wall_s, 2),
            num_requests=len(self.requests), max_model_len=self.max_model_len, sizes=self.sizes,
            settings=self.settings, reference_arm=self.reference[0] if self.reference else None,
            queue_rule=QUEUE_RULE, arms=self.arms, runs=self.runs, skipped=skipped,
        )


def run_serve(base: EngineParams, lines: list[TraceLine], settings: ServeSettings, kvtool_arms: list[Arm],
              vllm_arms: list[str], *, skipped: list[SkippedArm], vllm_site: str | None = None,
              vllm_timeout_s: float = 3600.0, progress: Progress | None = None) -> ServeReport:
    """Every kvtool arm, then every vLLM arm, at every load. Raises ConfigError for a trace the
    sizes cannot serve, and engine errors (an unreachable LMCache server) as they come."""
    if settings.max_concurrency is not None and settings.max_concurrency < 1:
        raise ConfigError(f"--max-concurrency must be at least 1, got {settings.max_concurrency}")
    if settings.num_warmups < 0:
        raise ConfigError(f"--num-warmups must be >= 0, got {settings.num_warmups}")
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    t0 = time.perf_counter()
    bench = ServeBench(base, lines, settings, progress)
    n, num_loads = len(bench.requests), len(settings.loads)
    total = max(1, (len(kvtool_arms) + len(vllm_arms)) * num_loads * n)
    done = [0]

    def report_progress(stage: str) -> None:
        if progress is not None:
            progress(stage, min(1.0, done[0] / total))

    for arm in kvtool_arms:
        def tick(stage: str = arm.name) -> None:
            done[0] += 1
            report_progress(stage)

        bench.run_kvtool_arm(arm, tick)
    for name in vllm_arms:
        first = done[0]
        report_progress(f"{name} (starting vLLM)")

        def tick_runs(num_runs: int, stage: str = name, first: int = first) -> None:
            done[0] = first + num_runs * n
            report_progress(stage)

        bench.run_vllm_arm(name, vllm_site, vllm_timeout_s, tick_runs)
        done[0] = first + num_loads * n
    return bench.report(started, time.perf_counter() - t0, skipped)
