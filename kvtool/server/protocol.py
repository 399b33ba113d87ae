"""Request and response bodies of the OpenAI-compatible API (pydantic models, validated both ways).

Requests refuse unknown fields, as OpenAI's API does. Besides OpenAI's fields they take the vLLM
extras kvtool supports: top_k, ignore_eos, stop_token_ids, cache_salt, kv_transfer_params,
return_token_ids, and chat_template_kwargs / add_generation_prompt for chat. Fields kvtool
accepts but cannot honour (penalties, logit_bias, n > 1, ...) are accepted only at their neutral
value, so that a request never silently means something else.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from kvtool.engine.errors import InputError
from kvtool.engine.params import SamplingParams

TokenIds = list[StrictInt]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class _GenerationRequest(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM's extras.
    ignore_eos: bool = False
    stop_token_ids: TokenIds | None = None
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    return_token_ids: bool = False

    def refuse_unsupported(self) -> None:
        """Raise InvalidField for a field kvtool accepts only at its neutral value."""
        if self.n != 1:
            raise InvalidField("n", f"n must be 1 (one choice per request), got {self.n}")
        if self.presence_penalty != 0.0:
            raise InvalidField("presence_penalty", "presence_penalty is not supported (only 0)")
        if self.frequency_penalty != 0.0:
            raise InvalidField("frequency_penalty", "frequency_penalty is not supported (only 0)")
        if self.logit_bias:
            raise InvalidField("logit_bias", "logit_bias is not supported")
        if self.stream_options is not None and not self.stream:
            raise InvalidField("stream_options", "stream_options is only allowed with stream: true")
        if self.cache_salt is not None and not self.cache_salt:
            raise InvalidField("cache_salt", "cache_salt must be a non-empty string")

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def make_sampling(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """The engine's SamplingParams; raises InputError for values the engine refuses."""
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            seed=self.seed,
            stop=self.stop_strings,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
        )


class CompletionRequest(_GenerationRequest):
    # A string, a list of token ids, or a batch of exactly one of either.
    prompt: str | TokenIds | list[str] | list[TokenIds]
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.echo:
            raise InvalidField("echo", "echo is not supported")
        if self.suffix:
            raise InvalidField("suffix", "suffix is not supported")
        if self.best_of not in (None, 1):
            raise InvalidField("best_of", f"best_of must be 1, got {self.best_of}")

    def single_prompt(self) -> str | list[int]:
        """The one prompt of this request; raises InvalidField for a batch of several."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise InvalidField("prompt", f"one prompt per request is supported, got a batch of {len(p)}")
            return p[0]
        return p


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    # Extra keys (name, tool_calls, ...) reach the chat template, as transformers passes them.
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def to_template(self) -> dict[str, Any]:
        doc = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            doc["content"] = "".join(part.text for part in self.content)
        elif self.content is None:
            doc["content"] = ""
        return doc


class ChatCompletionRequest(_GenerationRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's extras.
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidField("top_logprobs", "top_logprobs needs logprobs: true")
        if self.response_format is not None and self.response_format.get("type") != "text":
            raise InvalidField("response_format", "only response_format {\"type\": \"text\"} is supported")
        if self.tools:
            raise InvalidField("tools", "tools are not supported")
        if self.tool_choice not in (None, "none"):
            raise InvalidField("tool_choice", "tool_choice is not supported")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class InvalidField(InputError):
    """An InputError that names the request field at fault (the error's `param`)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


# ---- responses -------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    # Prompt tokens served from the local prefix cache plus those loaded through a connector.
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = []
    token_logprobs: list[float | None] = []
    tokens: list[str] = []
    top_logprobs: list[dict[str, float] | None] = []


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    # vLLM's: the stop string or token id that ended the choice.
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    """A completion, or one chunk of a streamed one (same object type, as OpenAI sends them)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    kv_transfer_params: dict[str, Any] | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = None
    kv_transfer_params: dict[str, Any] | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatStreamChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None
    kv_transfer_params: dict[str, Any] | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvtool"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
