"""What the engine tells its callers: per-step request outputs, finished results, totals, and
the host's time per step by phase.

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


class StepTimes(msgspec.Struct, kw_only=True):
    """Host seconds of the engine's steps by phase, since the engine started (`step_times()`).

    Under async scheduling a step schedules and queues the next batch, then waits for the batch
    already on the device and takes its results; the device idles whenever the host's phases of
    a step take longer than the device's batch. `wait_s` is the time the host spent blocked on
    the device: a host that keeps the device busy spends most of a step there; one that does not
    spends little, and the other phases say where its time went instead. Five clock readings a
    step; no profiler needed.
    """

    steps: int = 0
    schedule_s: float = 0.0  # the scheduler's message for the step (the connector's metadata with it)
    launch_s: float = 0.0  # the executor: the step's inputs to the device, its forward queued
    wait_s: float = 0.0  # blocked until the device had finished the step before
    update_s: float = 0.0  # the scheduler taking that step's results
    outputs_s: float = 0.0  # the output processor (detokenisation, stop strings), KV events
    # Of those steps, the ones that computed more than one token of some request (a prompt's
    # chunk, a hit's tail) and their launch seconds: a decode step replays a CUDA graph, such
    # a step queues every kernel from the host (the rest of launch_s is the decode steps').
    mixed_steps: int = 0
    mixed_launch_s: float = 0.0

    def add_launch(self, seconds: float, mixed: bool) -> None:
        self.launch_s += seconds
        if mixed:
            self.mixed_steps += 1
            self.mixed_launch_s += seconds

    def minus(self, earlier: StepTimes) -> StepTimes:
        """The times between `earlier` and this one (a run's share of an engine's totals)."""
        return StepTimes(**{f: getattr(self, f) - getattr(earlier, f) for f in self.__struct_fields__})
