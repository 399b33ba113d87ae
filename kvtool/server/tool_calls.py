"""A chat choice's tool calls in the reply: OpenAI's `tool_calls`, whole or as streamed deltas.

How the output is read depends on the request's ToolChoice (tool_choice.py):

- none: the output is content, as without tools;
- auto: the server's `--tool-call-parser` finds the calls; the text around them is content;
- required: the output is the forced JSON array, one call per element; content is "";
- named: the output is the forced function's arguments; content is "".

Each call gets an id `chatcmpl-tool-<16 hex digits>`. The finish reason becomes "tool_calls" when
the choice made calls and stopped by itself; a named function keeps "stop" (OpenAI's answer for
a forced function), and "length" stays "length", so a call cut short can be told from a whole
one. With `parallel_tool_calls: false` only the first call is kept.

Streamed, a call is sent in one delta (index, id, type, name, arguments) once it is complete,
except a named function's arguments, which stream as they come (the grammar makes the whole
output that one call). Content made only of whitespace is held back until other text follows,
so the streamed reply carries exactly the content and calls of the unstreamed one.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from kvtool.server.protocol import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall
from kvtool.server.tool_choice import ToolChoice
from kvtool.server.tool_parsers import TOOL_CALL_PARSERS, ParsedToolCall, Piece, ToolCallParser, extract_tool_calls
from kvtool.server.tool_parsers.required import RequiredToolCallsParser


def new_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().int & (2**64 - 1):016x}"


@dataclass(slots=True)
class ChoiceMessage:
    """The assistant message of one choice: its content and calls."""

    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


def read_message(choice: ToolChoice, parser_name: str | None, text: str) -> ChoiceMessage:
    """The content and calls of a whole output (a choice of a reply that is not streamed)."""
    if choice.mode == "none":
        return ChoiceMessage(text)
    if choice.mode == "named":
        if not text.strip():
            return ChoiceMessage("")
        return ChoiceMessage("", [_tool_call(ParsedToolCall(choice.function_name or "", text))])
    found = extract_tool_calls(_parser(choice, parser_name), text)
    calls = found.calls if choice.parallel else found.calls[:1]
    return ChoiceMessage("" if choice.forces_calls else found.content, [_tool_call(c) for c in calls])


def finish_reason(choice: ToolChoice, engine_reason: str | None, made_calls: bool) -> str | None:
    """The chat finish reason of a choice that ended with `engine_reason` (vLLM's rule)."""
    if made_calls and engine_reason == "stop" and choice.mode != "named":
        return "tool_calls"
    return engine_reason


class ToolCallStream:
    """One streamed choice's output as content and tool-call deltas, in order.

    `push` takes each text delta and `finish` the last one; each returns the content to send (or
    None) and the call deltas to send (possibly none).
    """

    def __init__(self, choice: ToolChoice, parser_name: str | None) -> None:
        self.choice = choice
        self._parser = None if choice.mode == "named" else _parser(choice, parser_name)
        self._num_calls = 0
        # Whitespace-only content not sent yet; `_sent_text`: some content other than whitespace went.
        self._held = ""
        self._sent_text = False

    @property
    def made_calls(self) -> bool:
        return self._num_calls > 0

    def push(self, text: str) -> tuple[str | None, list[DeltaToolCall]]:
        if self.choice.mode == "named":
            return None, self._named_arguments(text)
        assert self._parser is not None
        return self._deltas(self._parser.push(text) if text else [])

    def finish(self, text: str) -> tuple[str | None, list[DeltaToolCall]]:
        if self.choice.mode == "named":
            return None, self._named_arguments(text)
        assert self._parser is not None
        return self._deltas(self._parser.push(text) + self._parser.finish())

    def _named_arguments(self, text: str) -> list[DeltaToolCall]:
        if not text:
            return []
        if self._num_calls:
            return [DeltaToolCall(index=0, function=DeltaFunctionCall(arguments=text))]
        self._num_calls = 1
        return [DeltaToolCall(index=0, id=new_tool_call_id(), type="function",
                              function=DeltaFunctionCall(name=self.choice.function_name, arguments=text))]

    def _deltas(self, pieces: list[Piece]) -> tuple[str | None, list[DeltaToolCall]]:
        content: list[str] = []
        calls: list[DeltaToolCall] = []
        for piece in pieces:
            if isinstance(piece, ParsedToolCall):
                if self.choice.parallel or not self._num_calls:
                    calls.append(DeltaToolCall(index=self._num_calls, id=new_tool_call_id(), type="function",
                                               function=DeltaFunctionCall(name=piece.name, arguments=piece.arguments)))
                    self._num_calls += 1
            elif not self.choice.forces_calls:
                content.append(piece)
        return self._gate("".join(content)), calls

    def _gate(self, text: str) -> str | None:
        if not self._sent_text:
            self._held += text
            if not self._held.strip():
                return None
            text, self._held, self._sent_text = self._held, "", True
        return text or None


def _parser(choice: ToolChoice, parser_name: str | None) -> ToolCallParser:
    if choice.mode == "required":
        return RequiredToolCallsParser()
    if parser_name is None:
        raise ValueError("auto tool choice needs a tool call parser")  # resolve_tool_choice refuses it first
    return TOOL_CALL_PARSERS[parser_name]()


def _tool_call(call: ParsedToolCall) -> ToolCall:
    return ToolCall(id=new_tool_call_id(), type="function", function=FunctionCall(name=call.name, arguments=call.arguments))
