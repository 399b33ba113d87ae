"""`--tool-call-parser hermes`: calls as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

The format of Hermes 2 Pro, Qwen2.5 and Qwen3 chat templates. Each region between the two tags
(or from the last opening tag to the end of the output, when the model stopped before closing
it) that holds a JSON object with a string `name` and an `arguments` key is one call; a region
that does not is text, tags included. Text around the calls is the reply's content, in order.

vLLM's parser differs where the output is not a clean list of calls: it returns only the text
before the first call, and one malformed region turns the whole output into content. Here every
region is decided alone and no text is dropped, which is what lets a region be streamed as soon
as it closes.
"""

from __future__ import annotations

from kvtool.server.tool_parsers.base import Piece, ToolCallParser, parse_call_object, partial_suffix

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"


class HermesToolParser(ToolCallParser):
    def __init__(self) -> None:
        super().__init__()
        self._in_call = False

    def _take(self, final: bool) -> list[Piece]:
        out: list[Piece] = []
        while True:
            if not self._in_call:
                start = self._buffer.find(OPEN_TAG)
                if start == -1:
                    keep = 0 if final else partial_suffix(self._buffer, OPEN_TAG)
                    out.append(self._buffer[: len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep:]
                    return out
                out.append(self._buffer[:start])
                self._buffer = self._buffer[start + len(OPEN_TAG):]
                self._in_call = True
            end = self._buffer.find(CLOSE_TAG)
            if end == -1 and not final:
                return out
            body = self._buffer if end == -1 else self._buffer[:end]
            self._buffer = "" if end == -1 else self._buffer[end + len(CLOSE_TAG):]
            self._in_call = False
            call = parse_call_object(body.strip(), ("arguments",))
            out.append(call if call is not None else OPEN_TAG + body + ("" if end == -1 else CLOSE_TAG))
            if end == -1:
                return out
