"""Bounds on the JSON a request may carry: how deep it nests, and how much a free-form field holds.

Free-form fields take any JSON value: kv_transfer_params, structured_outputs, response_format,
guided_json, chat_template_kwargs, the parameters of tools, the extra keys of a message, and
the JSON text inside some of them (a schema given as a string, a tool call's arguments). What
reads JSON recursively (the json module, pydantic, llguidance, Jinja's tojson) fails on a value
nested a few thousand levels deep, so depth is measured here by a scan that never recurses,
before anything parses the text:

- a JSON document (a request body, or JSON text inside a field) nests at most MAX_JSON_DEPTH
  levels of objects and arrays, counting from its root;
- a free-form field holds at most MAX_FREE_FORM_VALUES JSON values (every object, array, string,
  number, boolean and null counts one).

Both raise JSONTooBig, a ValueError that names the top-level field where the limit was crossed
(None when it was crossed before any field began, e.g. a body that is a bare array). The same
scan finds where a JSON object ends in text that is still growing (`object_end`), which is how
tool calls are cut out of a model's output as it streams.
"""

from __future__ import annotations

import json
import re
from typing import Any

from kvtool.engine.config.json_document import json_value_excess

# Deep enough for any real JSON schema, tool list or template argument, far from the recursion
# limits of the parsers behind it.
MAX_JSON_DEPTH = 64
MAX_FREE_FORM_VALUES = 1 << 16

# A string (with its escapes), followed by a colon when it is an object key; one bracket; or a
# quote that opens a string never closed (the rest of the text is inside it). Everything else
# (numbers, literals, commas, whitespace) never changes the depth.
_STRUCTURE = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"(\s*:)?|[\[\]{}]|"', re.S)


class JSONTooBig(ValueError):
    """JSON deeper than MAX_JSON_DEPTH, or a free-form value larger than MAX_FREE_FORM_VALUES."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


def refuse_deep_json(text: str, what: str = "the request body") -> None:
    """Raise JSONTooBig when `text` nests objects and arrays deeper than MAX_JSON_DEPTH.

    The scan reads only strings and brackets, so its cost grows with their number, not with the
    text's length, and it stops at the first level too deep. Text that is not valid JSON is
    measured as far as its brackets go; the parser that reads it later reports what is wrong.
    The error names the key of the root object whose value went too deep.
    """
    depth = 0
    field: str | None = None
    for m in _STRUCTURE.finditer(text):
        token = m.group()
        if token in ("[", "{"):
            depth += 1
            if depth > MAX_JSON_DEPTH:
                where = f"`{field}` in {what}" if field is not None else what
                raise JSONTooBig(f"{where} nests JSON objects and arrays more than {MAX_JSON_DEPTH} levels deep", field)
        elif token in ("]", "}"):
            depth -= 1
        elif token == '"':
            return
        elif depth == 1 and m.group(1) is not None:
            field = _key_text(token[: token.rindex('"') + 1])


def object_end(text: str, start: int) -> int | None:
    """Where the JSON object or array opening at text[start] ends (the index past its closing
    bracket), or None while it is still open. The same scan as refuse_deep_json, so it raises
    JSONTooBig once the value nests deeper than MAX_JSON_DEPTH."""
    depth = 0
    for m in _STRUCTURE.finditer(text, start):
        token = m.group()
        if token in ("[", "{"):
            depth += 1
            if depth > MAX_JSON_DEPTH:
                raise JSONTooBig(f"JSON nested more than {MAX_JSON_DEPTH} levels deep")
        elif token in ("]", "}"):
            depth -= 1
            if depth == 0:
                return m.end()
        elif token == '"':
            return None
    return None


def loads_bounded(text: str, what: str) -> Any:
    """json.loads after refuse_deep_json (JSONTooBig when too deep; json's ValueError when malformed)."""
    refuse_deep_json(text, what)
    return json.loads(text)


def refuse_large_value(value: Any, what: str) -> None:
    """Raise JSONTooBig when a parsed free-form value holds more than MAX_FREE_FORM_VALUES JSON
    values or nests deeper than MAX_JSON_DEPTH (config_json.json_value_excess)."""
    excess = json_value_excess(value, MAX_JSON_DEPTH, MAX_FREE_FORM_VALUES)
    if excess is not None:
        raise JSONTooBig(f"{what} {excess}")


def _key_text(quoted: str) -> str:
    try:
        return json.loads(quoted)
    except ValueError:
        return quoted[1:-1]
