"""The engine's per-request state: one mutable Request, whose num_computed_tokens catches up with num_tokens."""

from __future__ import annotations

import enum
import time

import numpy as np

from kvtool.engine.core.messages import PLACEHOLDER_TOKEN
from kvtool.engine.params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"

    @property
    def is_finished(self) -> bool:
        return self not in (RequestStatus.WAITING, RequestStatus.RUNNING)


class Request:
    """There is no prefill or decode phase: each step computes tokens [num_computed_tokens, num_tokens).

    A local prefix-cache hit, a connector load, a preemption and a load failure all just move
    num_computed_tokens.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        *,
        max_tokens: int,
        eos_token_ids: frozenset[int],
        seed: int = 0,
        cache_salt: str | None = None,
        prompt_ids: np.ndarray | None = None,
        kv_transfer_params: dict | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.sampling = sampling
        self.max_tokens = max_tokens  # sampling.max_tokens capped by the model length
        self.eos_token_ids = eos_token_ids
        # The request's sampling stream: its own seed, or one the engine drew for it.
        self.seed = seed
        self.cache_salt = cache_salt
        # The prompt's ids as one uint32 array when the engine built one (the block-hash memo reads it).
        self.prompt_ids = prompt_ids
        self.kv_transfer_params = kv_transfer_params or {}
        self.status = RequestStatus.WAITING
        # Advanced when a step is scheduled (vLLM's rule), so the next step can be scheduled
        # before this one's result is back; a preemption or a load failure moves it back.
        self.num_computed_tokens = 0
        # Tokens sampled by steps still in flight (async scheduling): known to the device only.
        self.num_output_placeholders = 0
        # The step that loads this request's external KV is in flight: nothing more is scheduled
        # for it until that step's result (a failed load moves num_computed_tokens back).
        self.has_load_in_flight = False
        # Tokens of the prompt served from the local prefix cache / loaded through a connector
        # at this request's first admission (what the user is told; preemption does not reset them).
        self.num_cached_tokens: int | None = None
        self.num_external_tokens = 0
        self.num_external_loaded_tokens = 0
        self.num_external_loaded_from_disk = 0  # of those, read from a disk tier on the way
        self.num_external_stored_tokens = 0
        self.block_hashes: list[bytes] = []
        # The request's block table of each KV cache group (`core.kv_blocks`); `block_ids` is
        # group 0's, the only one of a model whose layers attend alike.
        self.group_block_ids: list[list[int]] = [[]]
        self.num_preemptions = 0
        self.logprobs: list[dict[int, float]] = []
        self.stop_reason: str | int | None = None
        self.error: str | None = None
        self.arrival_time = time.perf_counter()
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finish_time: float | None = None

    @property
    def block_ids(self) -> list[int]:
        return self.group_block_ids[0]

    @block_ids.setter
    def block_ids(self, block_ids: list[int]) -> None:
        self.group_block_ids[0] = block_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_scheduled_tokens_total(self) -> int:
        """Known tokens plus the samples of steps still in flight."""
        return self.num_tokens + self.num_output_placeholders

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without copying the whole sequence (a decode step reads one token).

        Positions past the known tokens (samples still in flight) read as PLACEHOLDER_TOKEN.
        """
        n = len(self.prompt_token_ids)
        known = self.num_tokens
        if end > known:
            return self.token_ids_slice(start, known) + [PLACEHOLDER_TOKEN] * (end - max(start, known))
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        if end <= n:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
            f"status={self.status.value})"
        )
