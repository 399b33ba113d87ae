"""Structured outputs: a grammar per request (llguidance), advanced with each sampled token.

The engine owns one StructuredOutputs. `add` compiles a request's StructuredOutputsParams into an
llguidance matcher (a JSON schema, any JSON object, a regex, a list of choices or a Lark grammar)
and refuses one that does not compile with an InputError. Before each step, `bitmask` gives the
ids the grammar allows next (an int32 bitmask the sampler applies on the logits' device); after
it, `advance` feeds the sampled token. Once the grammar is complete it allows only EOS, so the
request ends there, even before `min_tokens` (the sampler then does not ban EOS: the grammar's
end outranks min_tokens). Under `ignore_eos` EOS does not end it: it goes on to `max_tokens`
(which always fits the context) sampling EOS, the one token the grammar still allows, so its
text stays the grammar's. vLLM 0.33 leaves the grammar there: under min_tokens it samples from a
row with every token banned, and once the grammar has ended it no longer constrains the output.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch

from kvtool.engine.errors import InputError
from kvtool.engine.params import StructuredOutputsParams

# Compact JSON: flexible whitespace lets a small model pad an object with newlines for ever.
_JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False}


def grammar_for(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar text of a structured-output request; InputError when malformed."""
    import llguidance

    matcher = llguidance.LLMatcher
    try:
        if spec.json is not None:
            schema = json.loads(spec.json) if isinstance(spec.json, str) else spec.json
            if not isinstance(schema, dict):
                raise InputError("a structured-output JSON schema must be a JSON object")
            return matcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
        if spec.json_object:
            return matcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
        if spec.regex is not None:
            return matcher.grammar_from_regex(spec.regex)
        if spec.choice is not None:
            return matcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
        assert spec.grammar is not None
        return matcher.grammar_from_lark(spec.grammar)
    except (ValueError, TypeError, RecursionError) as e:
        # RecursionError: a schema given as JSON text nested too deep for the json module.
        raise InputError(f"invalid structured-output request: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


class StructuredOutputs:
    """The grammar state of every structured-output request of one engine."""

    def __init__(self, tokenizer_json: Callable[[], str], vocab_size: int, eos_token_ids: list[int]) -> None:
        # tokenizer.json's text, asked for only when the first structured request arrives.
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._tokenizer = None  # llguidance's tokenizer, built on first use (about a second)
        self._matchers: dict[str, Any] = {}

    def _ll_tokenizer(self):
        if self._tokenizer is None:
            import llguidance

            self._tokenizer = llguidance.LLTokenizer(
                self._tokenizer_json(), n_vocab=self.vocab_size, eos_token=self._eos or None
            )
        return self._tokenizer

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def __len__(self) -> int:
        return len(self._matchers)

    def add(self, request_id: str, spec: StructuredOutputsParams) -> None:
        """Compile the request's grammar; raises InputError when it does not compile."""
        import llguidance

        grammar = grammar_for(spec)
        tokenizer = self._ll_tokenizer()
        error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
        if error and not error.startswith("WARNING"):
            raise InputError(f"invalid structured-output request: {error.splitlines()[0]}")
        m = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if m.is_error():
            raise InputError(f"invalid structured-output request: {m.get_error().splitlines()[0]}")
        self._matchers[request_id] = m

    def bitmask(self, request_id: str) -> torch.Tensor:
        """The ids allowed next, int32 [ceil(vocab / 32)] on the CPU."""
        words = (self.vocab_size + 31) // 32
        mask = torch.full((words,), -1, dtype=torch.int32)
        # The matcher writes one bit per token id into the buffer (llguidance's own fill does this).
        self._matchers[request_id].unsafe_compute_mask_ptr(mask.data_ptr(), words * 4)
        return mask

    def advance(self, request_id: str, token_ids: list[int]) -> None:
        """Feed sampled tokens (a token the grammar refuses leaves the matcher stopped: EOS only)."""
        m = self._matchers.get(request_id)
        if m is not None and not m.is_stopped():
            m.consume_tokens(token_ids)

    def remove(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)
