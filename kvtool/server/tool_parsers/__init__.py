"""Tool-call parsers by their `--tool-call-parser` name (vLLM's names for the same formats)."""

from __future__ import annotations

from kvtool.server.tool_parsers.base import (
    ExtractedToolCalls, ParsedToolCall, Piece, ToolCallParser, extract_tool_calls,
)
from kvtool.server.tool_parsers.hermes import HermesToolParser
from kvtool.server.tool_parsers.llama3_json import Llama3JsonToolParser

TOOL_CALL_PARSERS: dict[str, type[ToolCallParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "llama4_json": Llama3JsonToolParser,
}

__all__ = ["TOOL_CALL_PARSERS", "ExtractedToolCalls", "ParsedToolCall", "Piece", "ToolCallParser",
           "extract_tool_calls"]
