"""Per-step and per-request result types shared by scheduler, runner and engine.

The scheduler and the runner never import each other: they exchange these.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec
import torch

from kvtool.engine.connectors.base import KVConnectorMetadata, KVConnectorOutput
from kvtool.engine.params import SamplingParams


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step."""

    request_id: str
    token_ids: list[int]  # the tokens computed this step
    start: int  # absolute position of token_ids[0] (= num_computed_tokens before the step)
    block_ids: list[int]  # the request's whole block table
    sample: bool  # True when this step reaches the end of the known tokens
    sampling: SamplingParams
    num_output_tokens: int  # output tokens so far (for logprob bookkeeping)
    # ---- sampling inputs (see sampler.SampleRow) ----
    seed: int = 0  # the request's sampling seed (its own or the engine's pick)
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    eos_token_ids: frozenset[int] = frozenset()
    allowed_token_bitmask: torch.Tensor | None = None  # structured outputs, set by the engine

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    connector_meta: KVConnectorMetadata | None = None

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class RunnerOutput:
    sampled: dict[str, int]  # request id -> sampled token id
    logprobs: dict[str, dict[int, float]]  # request id -> {token id: logprob} (sampled + top-n)
    connector_output: KVConnectorOutput | None = None


class RequestOutput(msgspec.Struct, kw_only=True):
    """What one engine step tells about one request (incremental)."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    error: str | None = None


class RequestStats(msgspec.Struct, kw_only=True):
    num_prompt_tokens: int
    num_cached_tokens: int  # served from the local prefix cache
    num_external_tokens: int  # matched and loaded through a connector
    num_external_loaded_tokens: int
    num_external_stored_tokens: int
    num_preemptions: int
    ttft_s: float | None
    decode_s: float | None
    queue_s: float | None = None  # arrival to first admission


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
    external_tokens_stored: int = 0
    bytes_loaded: int = 0
    bytes_stored: int = 0
    load_s: float = 0.0
    store_s: float = 0.0
    load_failures: int = 0
    num_blocks: int = 0
    num_free_blocks: int = 0
