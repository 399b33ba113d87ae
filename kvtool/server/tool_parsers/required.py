"""The output of `tool_choice: "required"`: `[{"name": ..., "parameters": {...}}, ...]`.

The request's grammar (tool_choice.py) makes the output this JSON array, whatever the model's
own format, so every parser reads it the same way. Each element is a call as soon as its object
closes, so calls stream one by one. An element left open at the end (max_tokens reached) is
dropped; no text of this output is content. vLLM reads the array only whole, and finds no call
at all in one cut short.
"""

from __future__ import annotations

from kvtool.server.tool_parsers.base import Piece, ToolCallParser, complete_object_end, parse_call_object


class RequiredToolCallsParser(ToolCallParser):
    def __init__(self) -> None:
        super().__init__()
        self._opened = False
        self._closed = False

    def _take(self, final: bool) -> list[Piece]:
        out: list[Piece] = []
        while not self._closed:
            rest = self._buffer.lstrip(" \t\r\n,")
            if not self._opened:
                if not rest.startswith("["):
                    break
                self._opened, rest = True, rest[1:]
                self._buffer = rest
                continue
            if not rest.startswith("{"):
                self._closed = rest.startswith("]")
                break
            end = complete_object_end(rest, 0)
            if end is None:
                break
            call = parse_call_object(rest[:end], ("parameters",))
            if call is None:
                self._closed = True
                break
            out.append(call)
            self._buffer = rest[end:]
        if final or self._closed:
            self._buffer = ""
        return out
