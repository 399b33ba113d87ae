"""The figures of one run of `kvtool bench serve`, from what the client saw of each request.

Every engine's run (kvtool's in-process loop, vLLM's AsyncLLM in its subprocess) comes back as
one RequestTiming per request, times in seconds from the run's start, taken by the client as it
receives each output; the figures below are computed the same way for all of them:

    TTFT        first output token received - request sent
    TPOT        (last token - first token) / (output tokens - 1), per request with 2 or more
    E2E         request finished - request sent
    tokens/s    output (or prompt + output) tokens / run duration (start to the last finish)

Queue growth. waiting(t) is the number of requests that have arrived by t and have no first
token yet (queued in the engine, or held by the client under --max-concurrency). Over the
arrival window [0, T] (T the last arrival), the queue grew when waiting averaged over the last
fifth of the window (0.8T..T) exceeds its average over the middle fifth (0.4T..0.6T) by more
than half, and by more than 2 requests, or when it never emptied over the second half of the
window (waiting(t) >= 1 at every point of 0.5T..T: the engine never caught up, which a queue
that filled early and stayed full shows without growing late). A load whose requests all
arrive at once has no window: its `grew` is None. The report keeps both averages, the backlog at the last arrival and the time
the engine took to drain it, so that another rule can be applied to the same run.
"""

from __future__ import annotations

import msgspec

from kvtool.workloads.figures import percentile, rate, to_ms

QUEUE_RULE = ("queue grew: mean of waiting(t) over [0.8T, T] > mean over [0.4T, 0.6T] + max(2, half of it), "
              "or waiting(t) >= 1 at every point of [0.5T, T] (it never emptied); "
              "waiting(t) = requests arrived by t without a first token, T = the last arrival")
_GRID_POINTS = 41


class RequestTiming(msgspec.Struct, kw_only=True):
    """One request of one run, as the client saw it; seconds from the run's start."""

    index: int  # its position in the trace
    arrival_s: float  # when it was due
    send_s: float | None = None  # when the client handed it to the engine
    first_token_s: float | None = None
    finish_s: float | None = None
    num_prompt_tokens: int
    num_output_tokens: int = 0
    # kvtool: prompt tokens from the device prefix cache; vLLM: its num_cached_tokens, device
    # prefix cache and connector together (vLLM's statistics split them per run).
    num_cached_tokens: int = 0
    num_loaded_tokens: int = 0  # kvtool: loaded through the connector
    num_loaded_from_disk: int = 0  # kvtool: of those, read from the connector's disk tier
    error: str | None = None
    output_token_ids: list[int] = []


class Percentiles(msgspec.Struct, kw_only=True):
    """Milliseconds over the run's requests; None where there is no sample."""

    p50_ms: float | None
    p90_ms: float | None
    p99_ms: float | None
    mean_ms: float | None
    num_samples: int


class QueueGrowth(msgspec.Struct, kw_only=True):
    grew: bool | None  # None: every request arrived at once
    waiting_mid: float | None  # mean waiting(t) over [0.4T, 0.6T]
    waiting_end: float | None  # mean waiting(t) over [0.8T, T]
    waiting_min_late: int | None  # least waiting(t) over [0.5T, T] (0: the queue emptied)
    backlog_at_last_arrival: int  # waiting(T)
    max_waiting: int
    last_arrival_s: float  # T
    drain_s: float | None  # the last finish - T
    max_send_lag_ms: float  # how far a send fell behind its arrival (the client's own queue)


class RunFigures(msgspec.Struct, kw_only=True):
    num_requests: int
    num_failed: int
    duration_s: float
    num_prompt_tokens: int
    num_output_tokens: int
    ttft: Percentiles
    tpot: Percentiles
    e2e: Percentiles
    output_tokens_per_s: float | None
    total_tokens_per_s: float | None
    requests_per_s: float | None
    queue: QueueGrowth


def _percentiles(seconds: list[float]) -> Percentiles:
    mean = sum(seconds) / len(seconds) if seconds else None
    return Percentiles(p50_ms=to_ms(percentile(seconds, 50)), p90_ms=to_ms(percentile(seconds, 90)),
                       p99_ms=to_ms(percentile(seconds, 99)), mean_ms=to_ms(mean), num_samples=len(seconds))


def _started_at(r: RequestTiming) -> float:
    """When a request stopped waiting: its first token, or its end if it had none."""
    for t in (r.first_token_s, r.finish_s):
        if t is not None:
            return t
    return float("inf")


def waiting_at(records: list[RequestTiming], t: float) -> int:
    return sum(1 for r in records if r.arrival_s <= t < _started_at(r))


def _max_waiting(records: list[RequestTiming]) -> int:
    # A sweep: at equal times a start is taken before an arrival, as waiting_at counts them.
    events = sorted([(r.arrival_s, 1) for r in records] + [(_started_at(r), -1) for r in records])
    now = peak = 0
    for _, delta in events:
        now += delta
        peak = max(peak, now)
    return peak


def queue_growth(records: list[RequestTiming]) -> QueueGrowth:
    """Whether the queue grew over the run (the rule in the module docstring)."""
    last = max(r.arrival_s for r in records)
    finishes = [r.finish_s for r in records if r.finish_s is not None]
    lags = [r.send_s - r.arrival_s for r in records if r.send_s is not None]
    common = dict(backlog_at_last_arrival=waiting_at(records, last), max_waiting=_max_waiting(records),
                  last_arrival_s=round(last, 6), drain_s=round(max(finishes) - last, 6) if finishes else None,
                  max_send_lag_ms=to_ms(max(lags, default=0.0)))
    if last <= 0:
        return QueueGrowth(grew=None, waiting_mid=None, waiting_end=None, waiting_min_late=None, **common)

    def waiting_over(lo: float, hi: float) -> list[int]:
        return [waiting_at(records, lo + (hi - lo) * k / (_GRID_POINTS - 1)) for k in range(_GRID_POINTS)]

    mid, end = (sum(w) / len(w) for w in (waiting_over(0.4 * last, 0.6 * last), waiting_over(0.8 * last, last)))
    least = min(waiting_over(0.5 * last, last))
    return QueueGrowth(grew=end > mid + max(2.0, 0.5 * mid) or least >= 1, waiting_mid=round(mid, 3),
                       waiting_end=round(end, 3), waiting_min_late=least, **common)


def run_figures(records: list[RequestTiming]) -> RunFigures:
    """Latency percentiles, throughput and queue growth of one run."""
    ok = [r for r in records if r.error is None and r.send_s is not None and r.finish_s is not None]
    ttft = [r.first_token_s - r.send_s for r in ok if r.first_token_s is not None]
    tpot = [(r.finish_s - r.first_token_s) / (r.num_output_tokens - 1) for r in ok
            if r.first_token_s is not None and r.num_output_tokens > 1]
    e2e = [r.finish_s - r.send_s for r in ok]
    duration = max((r.finish_s for r in records if r.finish_s is not None), default=0.0)
    prompt = sum(r.num_prompt_tokens for r in ok)
    output = sum(r.num_output_tokens for r in ok)
    return RunFigures(
        num_requests=len(records), num_failed=len(records) - len(ok), duration_s=round(duration, 6),
        num_prompt_tokens=prompt, num_output_tokens=output, ttft=_percentiles(ttft), tpot=_percentiles(tpot),
        e2e=_percentiles(e2e), output_tokens_per_s=rate(output, duration),
        total_tokens_per_s=rate(prompt + output, duration), requests_per_s=rate(len(ok), duration),
        queue=queue_growth(records),
    )
