"""What every tool-call parser shares: the pieces it cuts a model's output into, and one way to
read an output whole or as it streams.

A parser reads text pushed to it in order and hands back, in the same order, the pieces it has
decided on: text that is no tool call (a `str`) and complete tool calls (`ParsedToolCall`).
Text it cannot decide on yet (the first characters of a tag, a call whose JSON is still open)
stays in its buffer until more text comes or `finish` says there is no more. A call is handed
back whole, once its JSON is complete; JSON that turns out malformed is handed back as text.

The whole output goes through the same `push` and `finish` (`extract_tool_calls`), so a streamed
reply carries exactly the calls and text of the same output unstreamed.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

from kvtool.server.json_bounds import JSONTooBig, loads_bounded, object_end


@dataclass(frozen=True, slots=True)
class ParsedToolCall:
    name: str
    # The arguments as JSON text, as OpenAI's API carries them.
    arguments: str


Piece = str | ParsedToolCall


@dataclass(frozen=True, slots=True)
class ExtractedToolCalls:
    calls: list[ParsedToolCall]
    # The text that is no tool call, in order; None when it is only whitespace.
    content: str | None


class ToolCallParser(ABC):
    """Cuts one model output into text and tool calls. One instance per output: it keeps the
    text it has not decided on yet."""

    def __init__(self) -> None:
        self._buffer = ""

    def push(self, text: str) -> list[Piece]:
        """The pieces decided once `text` follows what was pushed before."""
        self._buffer += text
        return [p for p in self._take(final=False) if p != ""]

    def finish(self) -> list[Piece]:
        """The pieces left at the end of the output (what was held back is decided now)."""
        return [p for p in self._take(final=True) if p != ""]

    @abstractmethod
    def _take(self, final: bool) -> list[Piece]:
        """Remove from self._buffer the text that is decided, and return it as pieces. With
        final, everything is decided: the buffer is left empty."""


def extract_tool_calls(parser: ToolCallParser, text: str) -> ExtractedToolCalls:
    """The calls and the remaining text of a whole output."""
    pieces = parser.push(text) + parser.finish()
    content = "".join(p for p in pieces if isinstance(p, str))
    return ExtractedToolCalls([p for p in pieces if isinstance(p, ParsedToolCall)],
                              content if content.strip() else None)


def parse_call_object(text: str, arguments_keys: tuple[str, ...]) -> ParsedToolCall | None:
    """A call from JSON text `{"name": ..., <an arguments key>: ...}`; None when the text is not
    such an object (malformed, nested too deep, no string name, no arguments)."""
    try:
        doc = loads_bounded(text, "a tool call")
    except ValueError:  # malformed, or JSONTooBig
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("name"), str):
        return None
    key = next((k for k in arguments_keys if k in doc), None)
    if key is None:
        return None
    return ParsedToolCall(doc["name"], _arguments_text(doc[key]))


def complete_object_end(text: str, start: int) -> int | None:
    """object_end, with JSON nested too deep ending at once (the parser then finds it malformed)."""
    try:
        return object_end(text, start)
    except JSONTooBig:
        return len(text)


def partial_suffix(text: str, tag: str) -> int:
    """How many characters at the end of `text` could begin `tag` (held back until known)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _arguments_text(arguments: Any) -> str:
    return json.dumps(arguments, ensure_ascii=False)
