"""`kvtool bench ttft`: TTFT of reused prefixes on every axis, against a baseline in the same run.

A cell is (arm, prompt length N, hit fraction f, concurrency c). Its prompts:

    documents   c random prompts of N tokens (one per concurrent slot)
    reuse r     for each repeat r and slot s: document s's first P = round(f * N) tokens, then
                N - P fresh random tokens (fresh per repeat, so a repeat hits only the prefix)

The cold fill pass runs the documents (all c at once); then each measured pass runs one
repeat's prompts (all c at once), after the arm's restart: the `cpu` and `lmcache` arms empty
the local prefix cache, `disk` rebuilds the engine (an empty CPU tier, so loads come from disk),
`prefix-cache` keeps its cache, `none` has none. Prompts are the same for every arm, and every
request of a run carries the run's own cache_salt, so nothing a previous run stored can hit.

A cell is valid when every request finished, its output equals the `none` arm's for the same
prompt, and every measured request was served exactly the tokens its arm can serve from the
shared prefix (`arms.served_prefix_tokens`): a connector arm loads min(P, N) // unit * unit (a full
hit's last unit too, then computes the last token alone), the prefix-cache arm serves
min(P, N - 1) // unit * unit, where unit is the arm's block or chunk size (and 0 for `none`). An
invalid cell carries its reason and no TTFT figures.

The `hf` arm (hf_baseline.py) reuses min(P, N - 1) tokens through transformers' own cache; its
output must equal the `none` arm's in float32, and below float32 a difference is only noted
(two implementations round differently there).
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Callable

import msgspec

from kvtool.engine.engine import LLMEngine
from kvtool.engine.errors import ConfigError
from kvtool.engine.params import EngineParams, SamplingParams
from kvtool.engine.presets.default_model import resolve_model_path
from kvtool.workloads.arms import (
    REFERENCE_ARM,
    Arm,
    hit_source,
    hit_unit_tokens,
    served_prefix_tokens,
    with_whole_stores,
)
from kvtool.workloads.figures import percentile, to_ms
from kvtool.workloads.replay import arm_params
from kvtool.workloads.trace_pass import flush_connector, free_device_memory, reset_prefix_cache

Progress = Callable[[str, float], None]


class TTFTSettings(msgspec.Struct, kw_only=True):
    prompt_lens: list[int]
    hit_fractions: list[float]
    concurrency: list[int]
    repeats: int
    max_tokens: int
    seed: int = 0


class TTFTFigures(msgspec.Struct, kw_only=True):
    """TTFT over every measured request of a cell (c requests x repeats)."""

    median_ms: float
    min_ms: float
    max_ms: float
    num_samples: int


class TTFTCell(msgspec.Struct, kw_only=True):
    arm: str
    prompt_len: int
    hit_fraction: float
    concurrency: int
    repeats: int
    valid: bool
    invalid_reason: str | None = None
    ttft_ms: TTFTFigures | None = None
    # Median TTFT of the cold fill pass (the documents, nothing to reuse yet).
    cold_ttft_ms: float | None = None
    # The `none` arm's median TTFT over this arm's, for the same prompts.
    speedup_vs_none: float | None = None
    # Where the hits come from: prefix-cache, cpu, disk, lmcache, hf; None for `none`.
    hit_source: str | None = None
    shared_prefix_tokens: int = 0  # P, per request
    # Over every measured request of the cell:
    expected_hit_tokens: int = 0
    hit_tokens: int = 0
    local_cached_tokens: int = 0  # from the engine's prefix cache
    loaded_tokens: int = 0  # through the connector
    bytes_loaded: int | None = None
    output_equal: bool | None = None
    note: str | None = None


class TTFTReport(msgspec.Struct, kw_only=True):
    cells: list[TTFTCell]
    settings: TTFTSettings
    arms: dict[str, str | None]  # name -> KV transfer config JSON
    model: str
    device: str
    dtype: str
    started_at: str
    wall_s: float


class _CellPrompts(msgspec.Struct):
    documents: list[list[int]]
    reuse: list[list[list[int]]]  # [repeat][slot]
    shared: int  # P


def _cell_prompts(n: int, f: float, c: int, repeats: int, seed: int) -> _CellPrompts:
    rng = random.Random(f"ttft:{seed}:{n}:{f}:{c}")
    shared = min(n, round(f * n))

    def tokens(k: int) -> list[int]:
        # Printable ASCII codes: ordinary tokens in any vocabulary of 127 ids or more.
        return [rng.randrange(32, 127) for _ in range(k)]

    docs = [tokens(n) for _ in range(c)]
    reuse = [[doc[:shared] + tokens(n - shared) for doc in docs] for _ in range(repeats)]
    return _CellPrompts(documents=docs, reuse=reuse, shared=shared)


def refuse_bad_settings(s: TTFTSettings) -> None:
    if not s.prompt_lens or any(n < 2 for n in s.prompt_lens):
        raise ConfigError("--prompt-lens needs lengths of at least 2 tokens")
    if not s.hit_fractions or any(not 0.0 <= f <= 1.0 for f in s.hit_fractions):
        raise ConfigError("--hit-fractions needs fractions between 0 and 1")
    if not s.concurrency or any(c < 1 for c in s.concurrency):
        raise ConfigError("--concurrency needs values of at least 1")
    if s.repeats < 1:
        raise ConfigError("--repeats must be at least 1")
    if s.max_tokens < 1:
        raise ConfigError("--max-tokens must be at least 1")


class _Measured:
    """What the measured passes of one cell produced."""

    def __init__(self) -> None:
        self.ttfts: list[float] = []
        self.outputs: list[list[list[int]]] = []  # [repeat][slot]
        self.cached = 0
        self.loaded = 0
        self.hit = 0
        self.bytes_loaded: int | None = 0
        self.problem: str | None = None


def run_ttft_grid(
    base: EngineParams, arms: list[Arm], settings: TTFTSettings, *, progress: Progress | None = None
) -> TTFTReport:
    """Run every cell of every arm; the `none` arm runs first (it is the reference) even if absent.

    Raises ConfigError for bad settings, and engine errors (a prompt longer than the model takes,
    an unreachable LMCache server) as they come.
    """
    refuse_bad_settings(settings)
    if not any(a.name == REFERENCE_ARM for a in arms):
        from kvtool.workloads.arms import make_builtin_arm

        arms = [make_builtin_arm(REFERENCE_ARM), *arms]
    # The fill pass must leave every chunk in the store for the measured passes to hit.
    arms = sorted((with_whole_stores(a) for a in arms), key=lambda a: a.name != REFERENCE_ARM)
    axes = [(n, f, c) for n in settings.prompt_lens for f in settings.hit_fractions for c in settings.concurrency]
    prompts = {ax: _cell_prompts(*ax, settings.repeats, settings.seed) for ax in axes}
    salt = f"kvtool-bench-{uuid.uuid4().hex[:16]}"
    sampling = SamplingParams(max_tokens=settings.max_tokens, temperature=0.0, ignore_eos=True)
    total = len(arms) * len(axes) * (1 + settings.repeats)
    done = [0]

    def tick(stage: str) -> None:
        done[0] += 1
        if progress is not None:
            progress(stage, done[0] / total)

    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    t0 = time.perf_counter()
    reference: dict[tuple, list[list[list[int]]]] = {}
    cells: list[TTFTCell] = []
    model_path = resolve_model_path(base.model)
    device, dtype = "", ""
    for arm in arms:
        if arm.reuse == "hf":
            from kvtool.workloads.hf_baseline import HFBaseline

            hf = HFBaseline(model_path, base)
            try:
                for ax in axes:
                    cells.append(_hf_cell(hf, arm, ax, prompts[ax], settings, reference.get(ax), tick))
            finally:
                hf.close()
            continue
        held = _HeldEngine(arm_params(base, arm))
        try:
            device, dtype = held.engine.device.type, str(held.engine.dtype).removeprefix("torch.")
            unit = hit_unit_tokens(arm, held.engine.params.block_size)
            for ax in axes:
                cells.append(_engine_cell(held, arm, unit, ax, prompts[ax], settings, sampling, salt, reference, tick))
        finally:
            held.close()
    _add_speedups(cells)
    return TTFTReport(
        cells=cells, settings=settings, arms={a.name: a.kv_transfer_config for a in arms}, model=str(model_path),
        device=device, dtype=dtype, started_at=started, wall_s=round(time.perf_counter() - t0, 2),
    )


class _HeldEngine:
    """The one engine of an arm, rebuilt in place: the old one is closed and dropped first, so
    that two never share the device's memory."""

    def __init__(self, params: EngineParams) -> None:
        self.params = params
        self.engine: LLMEngine | None = LLMEngine(params)

    def rebuild(self) -> LLMEngine:
        self.close()
        self.engine = LLMEngine(self.params)
        return self.engine

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None
            free_device_memory()


def _run_batch(engine: LLMEngine, prompts: list[list[int]], sampling: SamplingParams, salt: str):
    return engine.generate(prompts, sampling, cache_salts=[salt] * len(prompts))


def _warm_up(engine: LLMEngine, salt: str) -> None:
    # A rebuilt engine's first forward pays one-off costs that are not the tier's.
    engine.generate([[32] * 8], SamplingParams(max_tokens=1, temperature=0.0), cache_salts=[salt + "-warm-up"])


def _engine_cell(held: _HeldEngine, arm, unit, ax, cp: _CellPrompts, settings, sampling, salt, reference, tick):
    n, f, c = ax
    stage = f"{arm.name} N={n} hit={f:g} c={c}"
    engine = held.engine
    fill = _run_batch(engine, cp.documents, sampling, salt)
    flush_connector(engine)
    tick(stage)
    m = _Measured()
    expected_each = served_prefix_tokens(arm, n, cp.shared, unit) if arm.reuse in ("prefix-cache", "connector") else 0
    for r in range(settings.repeats):
        if arm.rebuild_before_reuse:
            del engine
            engine = held.rebuild()
            _warm_up(engine, salt)
        elif arm.reuse == "connector":
            reset_prefix_cache(engine)
        bytes_before = engine.stats().bytes_loaded
        results = _run_batch(engine, cp.reuse[r], sampling, salt)
        m.bytes_loaded += engine.stats().bytes_loaded - bytes_before
        flush_connector(engine)
        tick(stage)
        m.outputs.append([res.output_token_ids for res in results])
        for slot, res in enumerate(results):
            st = res.stats
            if res.finish_reason == "error" and m.problem is None:
                m.problem = f"a request failed: {res.error}"
            if st.ttft_s is not None:
                m.ttfts.append(st.ttft_s)
            m.cached += st.num_cached_tokens
            m.loaded += st.num_external_loaded_tokens
            # The counter that proves this arm's hits; `none` must show no hit of any kind.
            got = {
                "connector": st.num_external_loaded_tokens,
                "prefix-cache": st.num_cached_tokens,
                "none": st.num_cached_tokens + st.num_external_loaded_tokens,
            }[arm.reuse]
            m.hit += got
            if got != expected_each and m.problem is None:
                m.problem = (f"hits not proven: repeat {r + 1}, request {slot + 1} was served {got} prompt tokens "
                             f"from {hit_source(arm, arm.rebuild_before_reuse) or 'a cache'}, expected {expected_each}")
    if arm.name == REFERENCE_ARM:
        reference[ax] = m.outputs
    fill_ttfts = [res.stats.ttft_s for res in fill if res.stats.ttft_s is not None]
    return _finish_cell(arm, ax, cp, settings, m, expected_each, reference.get(ax), fill_ttfts=fill_ttfts,
                        source=hit_source(arm, arm.rebuild_before_reuse))


def _hf_cell(hf, arm, ax, cp: _CellPrompts, settings, ref_outputs, tick) -> TTFTCell:
    n, f, c = ax
    stage = f"{arm.name} N={n} hit={f:g} c={c}"
    cold_ttft, _ = hf.generate(cp.documents, settings.max_tokens)
    tick(stage)
    shared = min(cp.shared, n - 1)
    cache = hf.prefill_cache([p[:shared] for p in cp.reuse[0]]) if shared else None
    m = _Measured()
    m.bytes_loaded = None
    for r in range(settings.repeats):
        ttft, outputs = hf.generate(cp.reuse[r], settings.max_tokens, cache)
        tick(stage)
        m.ttfts += [ttft] * c  # one batch: every request gets its first token at once
        m.outputs.append(outputs)
        m.hit += shared * c
    return _finish_cell(arm, ax, cp, settings, m, shared, ref_outputs, fill_ttfts=[cold_ttft], source="hf",
                        require_equal=hf.is_float32)


def _finish_cell(arm, ax, cp, settings, m: _Measured, expected_each: int, ref_outputs, *, fill_ttfts, source,
                 require_equal: bool = True) -> TTFTCell:
    n, f, c = ax
    expected = expected_each * c * settings.repeats
    equal = None if ref_outputs is None else m.outputs == ref_outputs
    if arm.name == REFERENCE_ARM:
        equal = True
    problem = m.problem
    note = None
    if problem is None and equal is False:
        if require_equal:
            problem = "output differs from the none arm's for the same prompts"
        else:
            note = "output differs from the none arm's: a different implementation rounds differently below float32"
    if problem is None and f > 0 and arm.reuse != "none" and expected_each == 0:
        problem = (f"hits not proven: the shared prefix ({cp.shared} tokens) is shorter than one unit this arm "
                   "can serve, so no hit can happen")
    valid = problem is None
    cold = percentile(fill_ttfts, 50)
    return TTFTCell(
        arm=arm.name, prompt_len=n, hit_fraction=f, concurrency=c, repeats=settings.repeats, valid=valid,
        invalid_reason=problem,
        ttft_ms=TTFTFigures(median_ms=to_ms(percentile(m.ttfts, 50)), min_ms=to_ms(min(m.ttfts)),
                            max_ms=to_ms(max(m.ttfts)), num_samples=len(m.ttfts)) if valid and m.ttfts else None,
        cold_ttft_ms=to_ms(cold) if valid else None,
        hit_source=source, shared_prefix_tokens=cp.shared, expected_hit_tokens=expected, hit_tokens=m.hit,
        local_cached_tokens=m.cached, loaded_tokens=m.loaded, bytes_loaded=m.bytes_loaded, output_equal=equal,
        note=note,
    )


def _add_speedups(cells: list[TTFTCell]) -> None:
    baseline = {(x.prompt_len, x.hit_fraction, x.concurrency): x for x in cells if x.arm == REFERENCE_ARM}
    for cell in cells:
        ref = baseline.get((cell.prompt_len, cell.hit_fraction, cell.concurrency))
        if cell.ttft_ms is not None and ref is not None and ref.ttft_ms is not None and cell.ttft_ms.median_ms > 0:
            cell.speedup_vs_none = round(ref.ttft_ms.median_ms / cell.ttft_ms.median_ms, 3)
