"""`--tool-call-parser llama3_json` (and `llama4_json`): calls as bare JSON objects.

Llama 3.1+ and Llama 4 chat templates ask for a reply that is only the call:
`{"name": ..., "parameters": {...}}` (`arguments` is read too), optionally after
`<|python_tag|>`, several of them separated by `;`. An output is read as calls only when it
starts with one (leading whitespace aside): from its first `{`, each JSON object with a string
`name` and its arguments is a call; at the first thing that is not (text, a malformed object,
one left unfinished at the end) the rest of the output is content. An output that does not start
with `{` is content, as vLLM streams it.

vLLM's non-streamed reply also finds objects after free text and drops that text; here the
streamed and the unstreamed reply agree, and no text is dropped.
"""

from __future__ import annotations

from kvtool.server.tool_parsers.base import Piece, ToolCallParser, complete_object_end, parse_call_object

PYTHON_TAG = "<|python_tag|>"
ARGUMENT_KEYS = ("parameters", "arguments")


class Llama3JsonToolParser(ToolCallParser):
    def __init__(self) -> None:
        super().__init__()
        # None until the output's start is known; then True (calls first) or False (all content).
        self._calls: bool | None = None
        self._num_calls = 0

    def _take(self, final: bool) -> list[Piece]:
        if self._calls is None:
            head = self._buffer.lstrip()
            if head.startswith(PYTHON_TAG):
                head = head[len(PYTHON_TAG):].lstrip()
            if head.startswith("{"):
                self._calls = True
                self._buffer = head
            elif not final and (not head or PYTHON_TAG.startswith(head)):
                return []
            else:
                self._calls = False
        if not self._calls:
            out, self._buffer = [self._buffer], ""
            return out
        return self._take_calls(final)

    def _take_calls(self, final: bool) -> list[Piece]:
        out: list[Piece] = []
        while True:
            # Between calls, whitespace and `;` separate them.
            rest = self._buffer.lstrip(" \t\r\n;") if self._num_calls else self._buffer
            if not rest:
                if final:
                    self._buffer = ""
                return out
            if not rest.startswith("{"):
                break
            end = complete_object_end(rest, 0)
            if end is None:
                if not final:
                    return out
                break
            call = parse_call_object(rest[:end], ARGUMENT_KEYS)
            if call is None:
                break
            out.append(call)
            self._num_calls += 1
            self._buffer = rest[end:]
        self._calls = False
        out.append(rest)
        self._buffer = ""
        return out
