"""One pass of a trace through an in-process engine, honouring arrival times.

A request with `arrival_s` is added once that many seconds have passed since the pass began; a
request without it is added as soon as the request before it has finished (so a trace without
arrival times runs one request at a time, in order). The engine steps whenever it has work.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import msgspec

from kvtool.engine.engine import LLMEngine
from kvtool.engine.errors import InputError
from kvtool.engine.params import SamplingParams

Progress = Callable[[str, float], None]


class PassRequest(msgspec.Struct, kw_only=True):
    """A trace request resolved to token ids: exactly what every arm runs."""

    name: str
    line: int
    prompt_token_ids: list[int]
    sampling: SamplingParams
    cache_salt: str | None = None
    arrival_s: float | None = None


class RequestRecord(msgspec.Struct, kw_only=True):
    """What one request of one pass produced and what it was served from."""

    name: str
    line: int
    num_prompt_tokens: int
    output_token_ids: list[int]
    finish_reason: str
    error: str | None = None
    num_cached_tokens: int = 0  # served from the local prefix cache
    num_external_tokens: int = 0  # matched by the connector
    num_external_loaded_tokens: int = 0  # actually loaded through the connector
    ttft_s: float | None = None
    # Set by passes against a server: the text when it returns no token ids, and its count.
    output_text: str | None = None
    num_output_tokens: int | None = None


class PassResult(msgspec.Struct, kw_only=True):
    records: list[RequestRecord]
    wall_s: float
    # Engine totals over the pass (None when a server does not expose them).
    bytes_loaded: int | None = None
    bytes_stored: int | None = None
    external_tokens_loaded: int | None = None


def _stats_snapshot(engine: LLMEngine) -> tuple[int, int, int]:
    s = engine.stats()
    return s.bytes_loaded, s.bytes_stored, s.external_tokens_loaded


def run_pass(engine: LLMEngine, requests: list[PassRequest], progress: Progress | None = None) -> PassResult:
    """Run every request of `requests` to completion on `engine`; records in input order.

    The engine must be idle. Raises InputError naming the request when the engine refuses it
    (too long for the model, more blocks than the cache holds).
    """
    before = _stats_snapshot(engine)
    ids: list[str | None] = [None] * len(requests)
    finished: set[str] = set()
    next_i = 0
    t0 = time.perf_counter()
    while next_i < len(requests) or engine.has_unfinished_requests():
        now = time.perf_counter() - t0
        while next_i < len(requests):
            req = requests[next_i]
            if req.arrival_s is None:
                ready = next_i == 0 or _is_finished(engine, ids[next_i - 1])
            else:
                ready = now >= req.arrival_s
            if not ready:
                break
            try:
                ids[next_i] = engine.add_request(req.prompt_token_ids, req.sampling, cache_salt=req.cache_salt)
            except InputError as e:
                raise InputError(f"request {req.name!r} (line {req.line}): {e}") from None
            next_i += 1
        if engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished.add(out.request_id)
                    if progress is not None:
                        progress("", len(finished) / len(requests))
        elif next_i < len(requests):
            wait = (requests[next_i].arrival_s or 0.0) - (time.perf_counter() - t0)
            time.sleep(max(0.0, min(wait, 0.05)))
    wall_s = time.perf_counter() - t0
    after = _stats_snapshot(engine)
    records = []
    for req, rid in zip(requests, ids):
        r = engine.pop_result(rid)
        records.append(
            RequestRecord(
                name=req.name, line=req.line, num_prompt_tokens=r.stats.num_prompt_tokens,
                output_token_ids=list(r.output_token_ids), finish_reason=r.finish_reason, error=r.error,
                num_cached_tokens=r.stats.num_cached_tokens, num_external_tokens=r.stats.num_external_tokens,
                num_external_loaded_tokens=r.stats.num_external_loaded_tokens, ttft_s=r.stats.ttft_s,
            )
        )
    return PassResult(
        records=records, wall_s=wall_s, bytes_loaded=after[0] - before[0], bytes_stored=after[1] - before[1],
        external_tokens_loaded=after[2] - before[2],
    )


def _is_finished(engine: LLMEngine, request_id: str | None) -> bool:
    return request_id is None or engine.is_finished(request_id)


def free_device_memory() -> None:
    """Return the memory of engines nobody references any more, so the next one can size its KV
    cache from what is really free (a CUDA engine sizes it from the free device memory)."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def flush_connector(engine: LLMEngine) -> None:
    """Wait until the engine's background KV stores have landed (disk writes, remote PUTs)."""
    engine.flush_connector()


def reset_prefix_cache(engine: LLMEngine) -> None:
    """Empty the engine's device prefix cache between passes, with the call behind vLLM's
    `POST /reset_prefix_cache`, so that what follows is served by the connector or computed.

    Raises RuntimeError if the engine still held blocks (a pass is only reset once it is idle).
    """
    if not engine.reset_prefix_cache():
        raise RuntimeError("the prefix cache could not be reset: blocks are still in use")
