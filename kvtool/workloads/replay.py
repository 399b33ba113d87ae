"""Replay a trace through arms: a fill pass, a restart, a reuse pass; then prove what happened.

For every arm the trace runs twice. The fill pass leaves the arm's KV wherever the arm keeps it;
between the passes the arm is restarted as asked:

    none      the same engine; its local prefix cache is emptied first when the arm has a
              connector, so the reuse pass's hits must come through the connector
    engine    the engine is closed (its stores waited for) and a new one built in this process
    process   the reuse pass runs in a cold subprocess (cold_pass.py): only a disk tier or an
              LMCache server is shared

The reference arm (no connector, no prefix cache: every token computed) runs the trace once.
Then, per request: the output token ids of every pass of every arm must equal the reference's
(the trace is greedy or seeded, trace.py refuses anything else); and in the reuse pass an arm
must have served the request's prefix from its cache (tokens loaded through the connector, or
local prefix-cache tokens for the prefix-cache arm) wherever the prompt has at least one whole
unit (block or chunk; for a connector its last unit counts too, loaded whole on a full hit) that
the local prefix cache did not already serve.
Each violation is a Failure naming the request; the report is ok only when there are none.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import msgspec

from kvtool.engine.engine import LLMEngine
from kvtool.engine.errors import ConfigError
from kvtool.engine.params import EngineParams
from kvtool.workloads.arms import Arm, hit_source, hit_unit_tokens, served_prefix_tokens
from kvtool.workloads.cold_pass import run_cold_pass
from kvtool.workloads.figures import percentile, rate, to_ms
from kvtool.workloads.trace import TraceLine
from kvtool.workloads.trace_pass import (
    PassRequest,
    PassResult,
    RequestRecord,
    flush_connector,
    free_device_memory,
    reset_prefix_cache,
    run_pass,
)

Restart = Literal["none", "engine", "process"]
RESTARTS: tuple[str, ...] = ("none", "engine", "process")
Passes = Literal["both", "fill", "reuse"]
PASSES: tuple[str, ...] = ("both", "fill", "reuse")
Progress = Callable[[str, float], None]


class PassSummary(msgspec.Struct, kw_only=True):
    """The figures of one pass of one arm."""

    num_requests: int
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int  # served from the local prefix cache
    num_loaded_tokens: int  # loaded through the connector
    tokens_saved: int  # prompt tokens not computed: cached + loaded
    hit_rate: float  # tokens_saved / num_prompt_tokens
    bytes_loaded: int | None
    bytes_stored: int | None
    ttft_p50_ms: float | None
    ttft_p90_ms: float | None
    ttft_p99_ms: float | None
    wall_s: float
    output_tokens_per_s: float | None
    total_tokens_per_s: float | None  # (prompt + output tokens) / wall time


class ArmReport(msgspec.Struct, kw_only=True):
    name: str
    kv_transfer_config: str | None
    # What happened between the passes; "reference" for the reference arm.
    restart: str
    # Where the reuse pass's hits come from (cpu, disk, lmcache, prefix-cache, server), if anywhere.
    hit_source: str | None
    passes: dict[str, PassSummary]


class RequestRow(msgspec.Struct, kw_only=True):
    """One request of one pass of one arm, as checked."""

    arm: str
    pass_name: str
    request: str
    line: int
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    num_loaded_tokens: int
    # Tokens the pass had to serve from the arm's cache for the hit check (0: nothing required).
    required_hit_tokens: int
    ttft_ms: float | None
    finish_reason: str
    output_equal: bool
    error: str | None = None


class Failure(msgspec.Struct, kw_only=True):
    arm: str
    pass_name: str
    request: str
    line: int
    kind: Literal["error", "mismatch", "missing-hit"]
    message: str

    def describe(self) -> str:
        return f"request {self.request!r} (line {self.line}), arm {self.arm}, {self.pass_name} pass: {self.message}"


class ReplayReport(msgspec.Struct, kw_only=True):
    trace: str
    restart: str
    passes: str
    # How outputs were compared: token ids, or text where a server returns no ids.
    compared: Literal["token_ids", "text"]
    ok: bool
    arms: list[ArmReport]
    failures: list[Failure]
    requests: list[RequestRow]


def resolve_requests(lines: list[TraceLine], engine: LLMEngine) -> list[PassRequest]:
    """Token ids for every trace line (text prompts through the engine's tokenizer)."""
    out = []
    for entry in lines:
        r = entry.request
        ids = list(r.prompt_token_ids) if r.prompt_token_ids is not None else engine.encode_prompt(r.prompt or "")
        out.append(PassRequest(name=entry.name, line=entry.line, prompt_token_ids=ids, sampling=r.sampling(),
                               cache_salt=r.cache_salt, arrival_s=r.arrival_s))
    return out


def reference_params(base: EngineParams) -> EngineParams:
    return msgspec.structs.replace(base, kv_transfer_config=None, enable_prefix_caching=False)


def arm_params(base: EngineParams, arm: Arm) -> EngineParams:
    prefix = base.enable_prefix_caching if arm.enable_prefix_caching is None else arm.enable_prefix_caching
    return msgspec.structs.replace(base, kv_transfer_config=arm.parsed_config(), enable_prefix_caching=prefix)


def refuse_unreplayable(arms: list[Arm], restart: str, passes: str) -> None:
    """Raise ConfigError for an arm whose KV cannot outlive the restart its reuse pass follows."""
    cold = restart != "none" or passes == "reuse"
    for arm in arms:
        if arm.reuse == "hf":
            raise ConfigError("the hf arm belongs to `kvtool bench`; replay compares engine arms")
        if cold and arm.reuse != "none" and not arm.survives_restart:
            when = "a reuse pass on its own" if passes == "reuse" else f"--restart {restart}"
            raise ConfigError(
                f"arm {arm.name!r} keeps its KV inside the engine (prefix cache or CPU tier), so {when} "
                "finds nothing; use --restart none, or give it a disk tier (root_dir) or an LMCache server"
            )


def summarize_pass(result: PassResult, from_server: bool = False) -> PassSummary:
    """Totals and TTFT percentiles of a pass. A server's cached tokens already include the
    connector's (its /metrics, when present, gives the loaded tokens separately)."""
    recs = result.records
    prompt = sum(r.num_prompt_tokens for r in recs)
    output = sum(_num_output_tokens(r) for r in recs)
    cached = sum(r.num_cached_tokens for r in recs)
    if from_server:
        loaded = result.external_tokens_loaded or 0
        saved = cached
    else:
        loaded = sum(r.num_external_loaded_tokens for r in recs)
        saved = cached + loaded
    ttfts = [r.ttft_s for r in recs if r.ttft_s is not None]
    return PassSummary(
        num_requests=len(recs), num_prompt_tokens=prompt, num_output_tokens=output, num_cached_tokens=cached,
        num_loaded_tokens=loaded, tokens_saved=saved, hit_rate=round(saved / prompt, 4) if prompt else 0.0,
        bytes_loaded=result.bytes_loaded, bytes_stored=result.bytes_stored,
        ttft_p50_ms=to_ms(percentile(ttfts, 50)), ttft_p90_ms=to_ms(percentile(ttfts, 90)),
        ttft_p99_ms=to_ms(percentile(ttfts, 99)), wall_s=round(result.wall_s, 4),
        output_tokens_per_s=rate(output, result.wall_s), total_tokens_per_s=rate(prompt + output, result.wall_s),
    )


def _num_output_tokens(record: RequestRecord) -> int:
    return record.num_output_tokens if record.num_output_tokens is not None else len(record.output_token_ids)


def required_hit_tokens(arm: Arm, record: RequestRecord, unit: int) -> int:
    """Prompt tokens the reuse pass must have served from the arm's cache (0: none required).

    The prompt's whole units the arm serves (`arms.served_prefix_tokens`: a connector's include
    a full hit's last unit), less, for a connector, what the local prefix cache already served
    (a connector is only asked for what lies beyond the local hit).
    """
    n = record.num_prompt_tokens
    servable = served_prefix_tokens(arm, n, n, unit)
    if arm.reuse == "connector":
        return max(0, servable - record.num_cached_tokens)
    return servable


def served_tokens(arm: Arm, record: RequestRecord) -> int:
    """The tokens that prove an arm's hit: loaded through its connector, or from the local cache."""
    if arm.reuse == "connector":
        return record.num_external_loaded_tokens
    return record.num_cached_tokens


def _first_difference(a: list[int], b: list[int]) -> str:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"output token {i} is {y}, the reference arm's is {x}"
    return f"{len(b)} output tokens, the reference arm's has {len(a)}"


def check_pass(
    arm: Arm, pass_name: str, result: PassResult, reference: PassResult, *, unit: int, require_hits: bool,
    reference_texts: list[str] | None = None,
) -> tuple[list[RequestRow], list[Failure]]:
    """Compare one pass with the reference, request by request; rows for the report and failures."""
    rows, failures = [], []
    for rec, ref in zip(result.records, reference.records):
        def fail(kind: str, message: str) -> None:
            failures.append(Failure(arm=arm.name, pass_name=pass_name, request=rec.name, line=rec.line,
                                    kind=kind, message=message))

        required = required_hit_tokens(arm, rec, unit) if require_hits else 0
        if rec.output_text is not None and reference_texts is not None:
            equal = rec.output_text == reference_texts[len(rows)]
        else:
            equal = rec.output_token_ids == ref.output_token_ids
        if rec.finish_reason == "error" or rec.error is not None:
            fail("error", f"finished with an error: {rec.error}")
        elif not equal:
            detail = ("the output text differs from the reference arm's" if rec.output_text is not None
                      else _first_difference(ref.output_token_ids, rec.output_token_ids))
            fail("mismatch", f"output differs from the reference arm: {detail}")
        elif required > 0 and served_tokens(arm, rec) == 0:
            what = "loaded through the connector" if arm.reuse == "connector" else "served from the cache"
            fail("missing-hit", f"no prompt tokens were {what}, though {required} could have been")
        rows.append(RequestRow(
            arm=arm.name, pass_name=pass_name, request=rec.name, line=rec.line,
            num_prompt_tokens=rec.num_prompt_tokens, num_output_tokens=_num_output_tokens(rec),
            num_cached_tokens=rec.num_cached_tokens, num_loaded_tokens=rec.num_external_loaded_tokens,
            required_hit_tokens=required, ttft_ms=to_ms(rec.ttft_s), finish_reason=rec.finish_reason,
            output_equal=equal, error=rec.error,
        ))
    return rows, failures


def _run_arm_passes(arm: Arm, params: EngineParams, requests: list[PassRequest], restart: str, passes: str,
                    step: Callable[[str], Progress]) -> dict[str, PassResult]:
    results: dict[str, PassResult] = {}
    if passes == "reuse":
        with LLMEngine(params) as engine:
            results["reuse"] = run_pass(engine, requests, step(f"{arm.name}: reuse"))
        del engine
        free_device_memory()
        return results
    with LLMEngine(params) as engine:
        results["fill"] = run_pass(engine, requests, step(f"{arm.name}: fill"))
        flush_connector(engine)
        if passes == "both" and restart == "none":
            if arm.reuse == "connector":
                reset_prefix_cache(engine)
            results["reuse"] = run_pass(engine, requests, step(f"{arm.name}: reuse"))
    del engine
    free_device_memory()
    if passes == "both" and restart == "engine":
        with LLMEngine(params) as engine:
            results["reuse"] = run_pass(engine, requests, step(f"{arm.name}: reuse (new engine)"))
        del engine
        free_device_memory()
    elif passes == "both" and restart == "process":
        step(f"{arm.name}: reuse (cold process)")("", 0.0)
        results["reuse"] = run_cold_pass(params, requests)
    return results


def run_replay(
    lines: list[TraceLine],
    base: EngineParams,
    arms: list[Arm],
    *,
    trace_name: str,
    restart: Restart = "none",
    passes: Passes = "both",
    progress: Progress | None = None,
) -> ReplayReport:
    """Run the trace through the reference arm and every arm of `arms`; check and report.

    Raises ConfigError for an arm that cannot be replayed this way (see refuse_unreplayable),
    InputError for a request the engine refuses, and engine errors as they come.
    """
    if restart not in RESTARTS:
        raise ConfigError(f"--restart must be one of {', '.join(RESTARTS)}, got {restart!r}")
    if passes not in PASSES:
        raise ConfigError(f"--passes must be one of {', '.join(PASSES)}, got {passes!r}")
    refuse_unreplayable(arms, restart, passes)
    num_passes = 1 + len(arms) * (2 if passes == "both" else 1)
    done = [0]

    def step(stage: str) -> Progress:
        base_fraction = done[0] / num_passes
        done[0] += 1
        if progress is None:
            return lambda _stage, _f: None
        return lambda _s, f: progress(stage, base_fraction + f / num_passes)

    with LLMEngine(reference_params(base)) as engine:
        requests = resolve_requests(lines, engine)
        reference = run_pass(engine, requests, step("reference"))
        block_size = engine.params.block_size
    del engine
    free_device_memory()
    rows, failures = check_pass(_REFERENCE, "reference", reference, reference, unit=block_size, require_hits=False)
    reports = [ArmReport(name=_REFERENCE.name, kv_transfer_config=None, restart="reference", hit_source=None,
                         passes={"reference": summarize_pass(reference)})]
    for arm in arms:
        results = _run_arm_passes(arm, arm_params(base, arm), requests, restart, passes, step)
        unit = hit_unit_tokens(arm, block_size)
        summaries = {}
        for name, result in results.items():
            r, f = check_pass(arm, name, result, reference, unit=unit, require_hits=name == "reuse")
            rows += r
            failures += f
            summaries[name] = summarize_pass(result)
        cold = restart != "none" or passes == "reuse"
        reports.append(ArmReport(
            name=arm.name, kv_transfer_config=arm.kv_transfer_config,
            restart="separate run" if passes == "reuse" else restart,
            hit_source=hit_source(arm, rebuilt=cold), passes=summaries,
        ))
    if progress is not None:
        progress("done", 1.0)
    return ReplayReport(trace=trace_name, restart=restart, passes=passes, compared="token_ids", ok=not failures,
                        arms=reports, failures=failures, requests=rows)


_REFERENCE = Arm(name="none", enable_prefix_caching=False, reuse="none")


def refuse_duplicate_names(arms: list[Arm]) -> None:
    seen = {"none"}
    for arm in arms:
        if arm.name in seen:
            raise ConfigError(f"arm name {arm.name!r} is used twice (the reference arm is called 'none')")
        seen.add(arm.name)


def run_server_replay(
    lines: list[TraceLine],
    base: EngineParams,
    *,
    url: str,
    trace_name: str,
    progress: Progress | None = None,
) -> ReplayReport:
    """Replay against a running server: the reference arm in-process on `base`'s model, then a
    fill pass and a reuse pass against `url` (which cannot be restarted from here).

    The reuse pass must show cached prompt tokens wherever a whole block before the last prompt
    token could have been cached. Raises PeerError when the server cannot be reached.
    """
    from kvtool.workloads.server_pass import ServerTarget

    def stage(name: str, offset: float) -> Progress:
        if progress is None:
            return lambda _s, _f: None
        return lambda _s, f: progress(name, (offset + f) / 3)

    with LLMEngine(reference_params(base)) as engine:
        requests = resolve_requests(lines, engine)
        reference = run_pass(engine, requests, stage("reference", 0))
        block_size = engine.params.block_size
        reference_texts = [engine.tokenizer.decode(r.output_token_ids) for r in reference.records]
    del engine
    free_device_memory()
    target = ServerTarget.connect(url, requests[0].prompt_token_ids[0])
    arm = Arm(name="server", reuse="server", survives_restart=True)
    rows, failures = check_pass(_REFERENCE, "reference", reference, reference, unit=block_size, require_hits=False)
    reports = [ArmReport(name=_REFERENCE.name, kv_transfer_config=None, restart="reference", hit_source=None,
                         passes={"reference": summarize_pass(reference)})]
    summaries = {}
    texts = None if target.returns_token_ids else reference_texts
    for i, name in enumerate(("fill", "reuse")):
        result = target.run_pass(requests, stage(f"server: {name}", 1 + i))
        r, f = check_pass(arm, name, result, reference, unit=block_size, require_hits=name == "reuse",
                          reference_texts=texts)
        rows += r
        failures += f
        summaries[name] = summarize_pass(result, from_server=True)
    reports.append(ArmReport(name=arm.name, kv_transfer_config=None, restart="none", hit_source="server",
                             passes=summaries))
    if progress is not None:
        progress("done", 1.0)
    return ReplayReport(trace=trace_name, restart="none", passes="both",
                        compared="token_ids" if target.returns_token_ids else "text", ok=not failures,
                        arms=reports, failures=failures, requests=rows)
