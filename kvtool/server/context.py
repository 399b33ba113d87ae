"""What every route handler shares: the engine loop, the tokenizer, the settings, and the steps
that turn a call's prompts and choices into engine jobs."""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field

from kvtool.engine.outputs import RequestResult
from kvtool.server.engine_loop import EngineLoop, GenerationJob
from kvtool.server.errors import APIError
from kvtool.server.protocol import InvalidField, PromptTokensDetails, Usage
from kvtool.server.sampling import SamplingDefaults

logger = logging.getLogger("kvtool.server.requests")


@dataclass(frozen=True, slots=True)
class ServerSettings:
    # The names clients may put in `model`; the first is the one metrics carry.
    served_model_names: list[str]
    # What /v1/models reports as each model's root (the --model directory or the default's name).
    model_root: str
    # When set, every /v1 route needs `Authorization: Bearer <api_key>`.
    api_key: str | None = None
    # Request defaults from --generation-config.
    generation_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    # --enable-log-requests: one log line per request (its id, prompt length and sampling).
    log_requests: bool = False
    # --tool-call-parser: how tool calls are read from a model's output (a tool_parsers name);
    # active only with --enable-auto-tool-choice, as in vLLM.
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False


class ServerContext:
    def __init__(self, engine_loop: EngineLoop, tokenizer, settings: ServerSettings) -> None:
        self.engine_loop = engine_loop
        self.tokenizer = tokenizer
        self.settings = settings
        self.started = int(time.time())
        self._token_strings: dict[int, str] = {}
        # The longest token's length: a text longer than max_model_len of them cannot fit (vLLM's bound).
        vocab = tokenizer.backend.get_vocab(with_added_tokens=True)
        self.max_chars_per_token = max((len(t) for t in vocab), default=1)

    @property
    def defaults(self) -> SamplingDefaults:
        return self.settings.generation_defaults

    @property
    def max_model_len(self) -> int:
        return self.engine_loop.max_model_len

    def check_model(self, model: str | None) -> str:
        names = self.settings.served_model_names
        if model is None:
            return names[0]
        if model not in names:
            raise APIError(400, f"The model `{model}` does not exist; this server serves {', '.join(names)}.",
                           param="model", code="model_not_found")
        return model

    def check_text_length(self, text: str, param: str = "prompt") -> None:
        """Refuse, before tokenizing, a text too long for the context whatever its tokens (vLLM's check)."""
        limit = self.max_model_len * self.max_chars_per_token
        if len(text) > limit:
            raise InvalidField(param, f"This model's maximum context length is {self.max_model_len} tokens. However, "
                                      f"your prompt contains {len(text)} characters (more than {limit} characters, "
                                      f"which is the upper bound for {self.max_model_len} input tokens). Please "
                                      "reduce the length of the input prompt.")

    def token_string(self, token_id: int) -> str:
        s = self._token_strings.get(token_id)
        if s is None:
            s = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_strings[token_id] = s
        return s

    def job(self, id_prefix: str, prompt_ids: list[int], sampling, body, index: int,
            share_prefix_with: int | None = None) -> GenerationJob:
        """One engine request of a call; `share_prefix_with` is the index of the call's request
        whose prompt this one repeats (choice 0 of its prompt)."""
        job = GenerationJob(
            request_id=f"{id_prefix}-{index}", prompt_token_ids=prompt_ids, sampling=sampling,
            cache_salt=body.cache_salt, kv_transfer_params=body.kv_transfer_params, stream=body.stream,
            share_prefix_with=None if share_prefix_with is None else f"{id_prefix}-{share_prefix_with}",
        )
        if self.settings.log_requests:
            logger.info("request %s: %d prompt tokens, sampling %s", job.request_id, len(prompt_ids), sampling)
        return job


def new_call_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage_of(results: list[RequestResult], first_of_prompt: list[bool]) -> Usage:
    """Usage of a call: each prompt counted once, every choice's output tokens."""
    prompt = sum(r.stats.num_prompt_tokens for r, first in zip(results, first_of_prompt) if first)
    cached = sum(r.stats.num_cached_tokens + r.stats.num_external_tokens for r, first in zip(results, first_of_prompt) if first)
    out = sum(len(r.output_token_ids) for r in results)
    return Usage(prompt_tokens=prompt, completion_tokens=out, total_tokens=prompt + out,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def by_logprob(entry: dict[int, float]) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda kv: -kv[1])
