"""When the requests of `kvtool bench serve` arrive: an offered load, the same for every arm.

A load is a request rate, written as `--request-rate` takes it:

    R       Poisson arrivals at R requests per second: the first request at 0, then gaps drawn
            from an exponential distribution of mean 1/R (vLLM's `benchmark_serving` with
            burstiness 1), seeded, so the same seed and rate give the same times
    inf     every request at 0 (the engine's queue holds them; with `--max-concurrency` this is
            a closed loop of that many clients)
    trace   the trace's own `arrival_s` (e.g. a multi-turn trace written with a think time)

Arrival times are computed once per rate and handed to every arm, kvtool's and vLLM's alike.
"""

from __future__ import annotations

import math
import random

import msgspec

from kvtool.engine.errors import ConfigError

TRACE_RATE = "trace"


class Load(msgspec.Struct, frozen=True, kw_only=True):
    """One offered load: its label as given, and the rate it stands for."""

    label: str  # "2", "0.5", "inf", "trace"
    # Requests per second; None for `inf` and `trace` (JSON has no infinity).
    rate: float | None


def parse_request_rates(text: str) -> list[Load]:
    """`1,2,4,inf` -> loads in the order given; ConfigError for anything else."""
    loads = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        if item in ("inf", TRACE_RATE):
            loads.append(Load(label=item, rate=None))
            continue
        try:
            rate = float(item)
        except ValueError:
            rate = float("nan")
        if not (rate > 0 and math.isfinite(rate)):
            raise ConfigError(f"--request-rate takes comma-separated positive numbers, inf or trace, got {item!r}")
        loads.append(Load(label=item, rate=rate))
    if not loads:
        raise ConfigError("--request-rate needs at least one rate (a number, inf or trace)")
    labels = [x.label for x in loads]
    if len(set(labels)) != len(labels):
        raise ConfigError(f"--request-rate names a rate twice: {text!r}")
    return loads


def make_arrivals(load: Load, num_requests: int, seed: int, trace_arrivals: list[float | None]) -> list[float]:
    """Seconds from the start of a run at which each request arrives, in trace order.

    Raises ConfigError for `trace` when a request of the trace has no `arrival_s`.
    """
    if load.label == TRACE_RATE:
        if any(a is None for a in trace_arrivals):
            raise ConfigError("--request-rate trace needs a trace whose every request has arrival_s "
                              "(`kvtool replay make-trace --think-time S` or `--request-rate R` writes them)")
        return [float(a) for a in trace_arrivals]
    if load.rate is None:
        return [0.0] * num_requests
    rng = random.Random(f"serve-arrivals:{seed}:{load.rate!r}")
    times, now = [], 0.0
    for i in range(num_requests):
        if i > 0:
            now += rng.expovariate(load.rate)
        times.append(round(now, 6))
    return times
