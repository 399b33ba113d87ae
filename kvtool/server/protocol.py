"""Request and response bodies of the OpenAI-compatible API (pydantic models, validated both ways).

Requests refuse unknown fields, as OpenAI's API does. Besides OpenAI's fields (chat's tools,
tool_choice and parallel_tool_calls among them) they take the vLLM extras kvtool supports:
top_k, min_p, repetition_penalty, min_tokens, bad_words, ignore_eos, stop_token_ids,
structured_outputs and the guided_* fields, cache_salt, kv_transfer_params, return_token_ids,
and chat_template_kwargs / add_generation_prompt for chat. Every numeric field is bounded here,
so a value the engine could not run is a 400 before it gets there, and so is every free-form
field (any JSON: json_bounds.py says how deep and how large). Fields kvtool accepts but cannot
honour (suffix, best_of > 1) are refused by name; which tool_choice a request may use is
tool_choice.py's.

Fields that a model's generation config may default (temperature, top_p, top_k, min_p,
repetition_penalty) are None when the request leaves them out.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, field_validator,
    model_validator,
)

from kvtool.engine.errors import InputError
from kvtool.engine.params import SamplingParams
from kvtool.server.json_bounds import refuse_deep_json, refuse_large_value

MAX_SEED = 2**64 - 1
MAX_INT = 2**31 - 1
TokenId = Annotated[int, Field(ge=0, le=MAX_INT)]
TokenIds = Annotated[list[Annotated[StrictInt, Field(ge=0, le=MAX_INT)]], Field(max_length=1 << 20)]
# kv_transfer_params values: JSON scalars, or short lists of them.
_Scalar = StrictStr | StrictBool | StrictInt | StrictFloat | None
KVParamValue = _Scalar | Annotated[list[_Scalar], Field(max_length=1024)]


def bounded_json(value: Any) -> Any:
    """A free-form field's value, refused (ValueError: a 400 naming the field) when it is too large
    or too deep; a string is JSON text, refused when it nests too deep."""
    if isinstance(value, str):
        refuse_deep_json(value, "the JSON text")
    elif value is not None:
        refuse_large_value(value, "the value")
    return value


# Any JSON object, bounded in depth and size.
FreeForm = Annotated[dict[str, Any], AfterValidator(bounded_json)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class _GenerationRequest(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: Annotated[int, Field(ge=1, le=MAX_INT)] | None = None
    # (0, 0.01) is raised to 0.01 as vLLM does: smaller temperatures overflow the logits.
    temperature: Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=-1, le=MAX_INT)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    seed: Annotated[int, Field(ge=0, le=MAX_SEED)] | None = None
    stop: str | Annotated[list[str], Field(max_length=64)] | None = None
    n: Annotated[int, Field(ge=1, le=64)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0, le=100.0)] | None = None
    logit_bias: Annotated[dict[str, Annotated[float, Field(allow_inf_nan=False)]], Field(max_length=4096)] | None = None
    user: str | None = None
    # vLLM's extras.
    min_tokens: Annotated[int, Field(ge=0, le=MAX_INT)] = 0
    bad_words: Annotated[list[str], Field(max_length=256)] | None = None
    ignore_eos: bool = False
    stop_token_ids: Annotated[TokenIds, Field(max_length=64)] | None = None
    structured_outputs: FreeForm | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1, max_length=1024)] | None = None
    guided_grammar: str | None = None
    response_format: FreeForm | None = None
    cache_salt: Annotated[str, Field(max_length=1024)] | None = None
    kv_transfer_params: Annotated[dict[Annotated[str, Field(max_length=256)], KVParamValue], Field(max_length=64)] | None = None
    return_token_ids: bool = False

    @field_validator("guided_json")
    @classmethod
    def _schema_is_bounded(cls, value: dict | str | None) -> dict | str | None:
        return bounded_json(value)

    @field_validator("structured_outputs")
    @classmethod
    def _schema_text_is_bounded(cls, value: dict | None) -> dict | None:
        if value is not None and isinstance(value.get("json"), str):
            bounded_json(value["json"])
        return value

    @field_validator("kv_transfer_params")
    @classmethod
    def _tags_are_strings(cls, value: dict | None) -> dict | None:
        for key, v in (value or {}).items():
            if key.startswith("lmcache.tag.") and not isinstance(v, str):
                raise ValueError(f"{key} must be a string")
            if isinstance(v, str) and len(v) > 4096:
                raise ValueError(f"{key} is longer than 4096 characters")
        return value

    def refuse_unsupported(self) -> None:
        """Raise InvalidField for a field kvtool does not support, or a combination it refuses."""
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
    # A string, a list of token ids, or a batch (list) of either: one choice per prompt.
    prompt: str | TokenIds | Annotated[list[str], Field(max_length=256)] | Annotated[list[TokenIds], Field(max_length=256)]
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Annotated[int, Field(ge=1, le=64)] | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.suffix:
            raise InvalidField("suffix", "suffix is not supported")
        if self.best_of not in (None, 1):
            raise InvalidField("best_of", f"best_of must be 1, got {self.best_of}")
        if self.echo and self.logprobs is not None:
            raise InvalidField("echo", "echo with logprobs is not supported (kvtool returns no prompt logprobs)")

    def prompts(self) -> list[str | list[int]]:
        """The prompts of this request, in order (one, or a batch)."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            return list(p)
        if isinstance(p, list) and not p:
            raise InvalidField("prompt", "the prompt is empty")
        return [p]


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class MessageFunctionCall(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    # JSON text, as OpenAI's API carries it (an object is taken too).
    arguments: str | dict[str, Any] | None = None

    @field_validator("arguments")
    @classmethod
    def _arguments_are_bounded(cls, value: str | dict | None) -> str | dict | None:
        return bounded_json(value)


class MessageToolCall(BaseModel):
    """A call an earlier assistant turn made, as the client sends it back."""

    # Extra keys (a streamed call's index, ...) pass through to the chat template.
    model_config = ConfigDict(extra="allow")

    id: str | None = None
    type: Literal["function"] = "function"
    function: MessageFunctionCall

    def to_template(self) -> dict[str, Any]:
        """The call with its arguments as an object (transformers' convention for chat templates:
        they write `arguments | tojson`). Arguments that are no JSON object become {}, as vLLM
        does, so that one bad call in the history does not fail every later turn."""
        doc = self.model_dump(exclude_none=True)
        args = self.function.arguments
        if isinstance(args, str):
            try:
                args = json.loads(args)  # its depth is bounded (bounded_json)
            except ValueError:
                args = None
        doc["function"]["arguments"] = args if isinstance(args, dict) else {}
        return doc


class ChatMessage(BaseModel):
    # Extra keys (name, ...) reach the chat template, as transformers passes them.
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    # An assistant turn's calls, and the call a tool message answers.
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None

    @field_validator("tool_calls", mode="before")
    @classmethod
    def _calls_are_bounded(cls, value: Any) -> Any:
        # Before validation: the calls' extra keys count too.
        return bounded_json(value) if isinstance(value, list) else value

    @model_validator(mode="after")
    def _extras_are_bounded(self) -> ChatMessage:
        for value in (self.model_extra or {}).values():
            refuse_large_value(value, "an extra key of a message")
        return self

    def to_template(self) -> dict[str, Any]:
        doc = self.model_dump(exclude_none=True, exclude={"tool_calls"})
        if isinstance(self.content, list):
            doc["content"] = "".join(part.text for part in self.content)
        elif self.content is None:
            doc["content"] = ""
        # An empty list of calls is no call: templates would take the calls path.
        if self.tool_calls:
            doc["tool_calls"] = [call.to_template() for call in self.tool_calls]
        return doc


class FunctionDefinition(_Strict):
    name: str
    description: str | None = None
    # The arguments' JSON schema.
    parameters: FreeForm | None = None
    strict: bool | None = None


class ChatTool(_Strict):
    type: Literal["function"] = "function"
    function: FunctionDefinition

    def to_template(self) -> dict[str, Any]:
        """The tool as the chat template's `tools` variable holds it (the fields the client set)."""
        return {"type": "function", "function": self.function.model_dump(exclude_none=True)}


class ChatCompletionRequest(_GenerationRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1, le=MAX_INT)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    tools: list[ChatTool] | None = None
    # "none", "auto", "required" or {"type": "function", "function": {"name": ...}} (tool_choice.py).
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's extras.
    add_generation_prompt: bool = True
    chat_template_kwargs: FreeForm | None = None

    @field_validator("tools", mode="before")
    @classmethod
    def _tools_are_bounded(cls, value: Any) -> Any:
        # Before validation: the whole list counts, not each tool's parameters alone.
        return bounded_json(value) if isinstance(value, list) else value

    @field_validator("tool_choice")
    @classmethod
    def _named_choice_is_bounded(cls, value: str | dict | None) -> str | dict | None:
        return bounded_json(value) if isinstance(value, dict) else value

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidField("top_logprobs", "top_logprobs needs logprobs: true")

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


class FunctionCall(BaseModel):
    name: str
    # JSON text.
    arguments: str


class ToolCall(BaseModel):
    # "chatcmpl-tool-" and 16 hex digits, as vLLM's.
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


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


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """A piece of one call: the first carries its id, type and name; later ones more arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


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
