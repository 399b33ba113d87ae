"""From a request body to the engine's SamplingParams: generation-config defaults, token budgets,
bad words, logit_bias and structured outputs.

Defaults follow `--generation-config`: with `auto` the model's generation_config.json supplies
temperature, top_p, top_k, min_p, repetition_penalty and the default max tokens
(max_new_tokens); a field the request sets wins. Requests whose max_tokens cannot fit the
context get vLLM's 400, never a silent clamp.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtool.engine.errors import ConfigError, InputError
from kvtool.engine.params import SamplingParams, StructuredOutputsParams
from kvtool.server.protocol import ChatCompletionRequest, CompletionRequest, InvalidField

# The keys of generation_config.json that become request defaults (vLLM's list).
GENERATION_CONFIG_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")
# OpenAI's default for /v1/completions; chat defaults to the rest of the context.
DEFAULT_COMPLETION_MAX_TOKENS = 16


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    """Request defaults from a generation config (only the keys it has)."""

    values: dict[str, Any] = field(default_factory=dict)

    @property
    def max_tokens(self) -> int | None:
        v = self.values.get("max_new_tokens")
        return v if isinstance(v, int) and v > 0 else None

    def get(self, name: str, request_value, fallback):
        if request_value is not None:
            return request_value
        v = self.values.get(name)
        return fallback if v is None else v


def load_generation_defaults(source: str, model_generation_config: dict) -> SamplingDefaults:
    """vLLM's --generation-config: "auto" (the model's), "vllm" (none), or a directory holding a
    generation_config.json. Raises ConfigError for a directory without a readable one."""
    if source == "vllm":
        return SamplingDefaults()
    if source == "auto":
        doc = model_generation_config
    else:
        path = Path(source) / "generation_config.json"
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(f"--generation-config {source}: no generation_config.json there "
                              "(use auto, vllm, or a directory holding one)") from None
        except (OSError, ValueError) as e:
            raise ConfigError(f"{path}: cannot be read as JSON ({e})") from None
        if not isinstance(doc, dict):
            raise ConfigError(f"{path}: expected a JSON object")
    values = {k: doc[k] for k in GENERATION_CONFIG_KEYS if isinstance(doc.get(k), (int, float)) and not isinstance(doc.get(k), bool)}
    # A config that says do_sample: false means greedy, as transformers reads it.
    if doc.get("do_sample") is False and "temperature" in values:
        values["temperature"] = 0.0
    return SamplingDefaults(values)


def resolve_max_tokens(requested: int | None, param: str, num_prompt_tokens: int, max_model_len: int,
                       default: int | None) -> int:
    """The request's output budget; raises InvalidField with vLLM's wording when it cannot fit."""
    if requested is not None and requested > max_model_len:
        raise InvalidField(param, f"{param}={requested} cannot be greater than max_model_len={max_model_len}. "
                                  "Please request fewer output tokens.")
    room = max_model_len - num_prompt_tokens
    if room < 1:
        raise InvalidField("prompt", f"This model's maximum context length is {max_model_len} tokens. However, your "
                                     f"prompt contains {num_prompt_tokens} input tokens, which exceeds this limit even "
                                     "without any output tokens. Please reduce the length of the input prompt.")
    if requested is None:
        return min(default, room) if default is not None else room
    if requested > room:
        raise InvalidField(param, f"This model's maximum context length is {max_model_len} tokens. However, you "
                                  f"requested {num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the "
                                  f"messages, {requested} in the completion). Please reduce the length of the "
                                  "messages or completion.")
    return requested


def structured_outputs_of(body: CompletionRequest | ChatCompletionRequest) -> StructuredOutputsParams | None:
    """The request's constrained decoding: response_format, structured_outputs or guided_* (one of them)."""
    given = []
    if body.response_format is not None and body.response_format.get("type") != "text":
        given.append(("response_format", _from_response_format(body.response_format)))
    if body.structured_outputs is not None:
        given.append(("structured_outputs", _struct("structured_outputs", body.structured_outputs)))
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                      ("guided_grammar", "grammar")):
        value = getattr(body, name)
        if value is not None:
            given.append((name, _struct(name, {key: value})))
    if len(given) > 1:
        raise InvalidField(given[1][0], f"only one structured-output field per request, got {', '.join(n for n, _ in given)}")
    return given[0][1] if given else None


def _from_response_format(rf: dict[str, Any]) -> StructuredOutputsParams:
    kind = rf.get("type")
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = rf.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise InvalidField("response_format", "response_format json_schema needs json_schema.schema, a JSON object")
        return StructuredOutputsParams(json=schema)
    raise InvalidField("response_format", f"response_format type must be text, json_object or json_schema, got {kind!r}")


def _struct(param: str, doc: dict[str, Any]) -> StructuredOutputsParams:
    import msgspec

    try:
        return msgspec.convert(doc, StructuredOutputsParams)
    except InputError as e:
        raise InvalidField(param, str(e)) from None
    except msgspec.ValidationError as e:
        raise InvalidField(param, f"{param}: {e}") from None


def bad_words_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """vLLM's bad_words: each word as tokenized alone and after a space (both are banned)."""
    out: list[list[int]] = []
    for word in words:
        for text in (word, " " + word.lstrip()):
            ids = tokenizer.encode(text, add_special_tokens=False)
            if ids and ids not in out:
                out.append(ids)
    return out


def logit_bias_ids(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias (token id strings) as ints; InvalidField for a key that is no id."""
    if not bias:
        return None
    out = {}
    for key, value in bias.items():
        try:
            out[int(key)] = value
        except ValueError:
            raise InvalidField("logit_bias", f"logit_bias keys must be token ids, got {key!r}") from None
    return out


def make_sampling(
    body: CompletionRequest | ChatCompletionRequest, *, max_tokens: int, logprobs: int | None,
    defaults: SamplingDefaults, tokenizer, seed_offset: int = 0, tool_call_schema: dict[str, Any] | None = None,
) -> SamplingParams:
    """The engine's SamplingParams of one choice (choice i of n gets seed + i, as vLLM does).

    tool_call_schema: the JSON schema that forces a chat request's tool calls; it replaces the
    request's own structured-output fields, as in vLLM.
    """
    structured = (StructuredOutputsParams(json=tool_call_schema) if tool_call_schema is not None
                  else structured_outputs_of(body))
    seed = None if body.seed is None else (body.seed + seed_offset) % 2**64
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=defaults.get("temperature", body.temperature, 1.0),
            top_p=defaults.get("top_p", body.top_p, 1.0),
            top_k=defaults.get("top_k", body.top_k, 0),
            min_p=defaults.get("min_p", body.min_p, 0.0),
            repetition_penalty=defaults.get("repetition_penalty", body.repetition_penalty, 1.0),
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            logit_bias=logit_bias_ids(body.logit_bias),
            min_tokens=body.min_tokens,
            bad_words_token_ids=bad_words_token_ids(tokenizer, body.bad_words or []),
            structured_outputs=structured,
            seed=seed,
            stop=body.stop_strings,
            stop_token_ids=list(body.stop_token_ids or []),
            ignore_eos=body.ignore_eos,
            logprobs=logprobs,
        )
    except InvalidField:
        raise
    except InputError as e:
        raise InvalidField(_param_of(str(e)), str(e)) from None


def _param_of(message: str) -> str | None:
    word = message.split(" ", 1)[0]
    return word if word.replace("_", "").isalpha() else None
