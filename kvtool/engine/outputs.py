"""What the engine tells its callers: per-step request outputs, finished results, totals.

Callers (the server's engine loop, `generate`, the workloads) read only these; none of them
reads the engine's own `Request` objects.
"""

from __future__ import annotations

import msgspec


class RequestOutput(msgspec.Struct, kw_only=True):
    """What one engine step tells about one request (incremental)."""

    request_id: str
    new_token_ids: list[int]
    # One {token id: logprob} per new token when the request asked for logprobs.
    new_logprobs: list[dict[int, float]] | None = None
    finished: bool = False
    finish_reason: str | None = None
    # The stop string or stop token id that ended the request (None for EOS or length).
    stop_reason: str | int | None = None
    error: str | None = None
    num_output_tokens: int = 0  # output tokens so far, these included
    num_cached_tokens: int = 0  # prompt tokens served from the local prefix cache
    num_external_tokens: int = 0  # prompt tokens matched through a connector
    # The connector's answer for this request, set when it finishes (vLLM's kv_transfer_params).
    kv_transfer_params: dict | None = None


class RequestStats(msgspec.Struct, kw_only=True):
    num_prompt_tokens: int
    num_cached_tokens: int  # served from the local prefix cache
    num_external_tokens: int  # matched and loaded through a connector
    num_external_loaded_tokens: int
    num_external_stored_tokens: int
    num_preemptions: int
    # Of num_external_loaded_tokens, those the connector read from its disk tier (the rest came
    # from its CPU tier or its remote store).
    num_external_loaded_from_disk: int = 0
    ttft_s: float | None
    decode_s: float | None
    queue_s: float | None = None  # arrival to first scheduling
    prefill_s: float | None = None  # first scheduling to first token


class RequestResult(msgspec.Struct, kw_only=True):
    """A finished request, as `generate` returns it."""

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    text: str
    finish_reason: str
    stats: RequestStats
    error: str | None = None
    logprobs: list[dict[int, float]] | None = None
    stop_reason: str | int | None = None
    kv_transfer_params: dict | None = None


class CPUTierUsage(msgspec.Struct, frozen=True, kw_only=True):
    """How a connector's CPU tier is used right now, in its own slots (one offload block each)."""

    num_slots: int
    num_filled: int  # slots holding a block (evictable ones included)
    num_pinned: int  # slots a load or store in flight holds (never evicted until it ends)


class EngineStats(msgspec.Struct, kw_only=True):
    """Engine totals since start."""

    num_requests: int = 0
    num_finished: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_prefix_cache_queries: int = 0  # tokens looked up in the local prefix cache
    num_prefix_cache_hits: int = 0  # tokens served from it
    num_preemptions: int = 0
    external_tokens_matched: int = 0
    external_tokens_loaded: int = 0
    external_tokens_loaded_from_disk: int = 0  # of external_tokens_loaded, read from a disk tier
    external_tokens_stored: int = 0
    bytes_loaded: int = 0
    bytes_stored: int = 0
    load_s: float = 0.0
    store_s: float = 0.0
    load_failures: int = 0
    store_skipped_chunks: int = 0  # chunks not stored: the store's backlog held every staging buffer
    num_blocks: int = 0
    num_free_blocks: int = 0
    num_running: int = 0
    num_waiting: int = 0
    # The connector's CPU tier, when it has one (SchedulerHalf.cpu_tier_usage()).
    cpu_tier: CPUTierUsage | None = None
