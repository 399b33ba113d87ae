"""How vLLM 0.33 reads a config flag's JSON (`--kv-transfer-config`, `--kv-events-config`).

vLLM's argparse type for such a flag (`parse_dataclass` in `vllm/engine/arg_utils.py`, wrapped
in `optional_type`) does three things, and `read_config_document` does them in the same order:

1. `""` and `"None"` mean no config at all (nothing else does: `"null"` and blank text are
   refused, as pydantic refuses them).
2. Unquoted human-readable numbers outside string literals are expanded (`80m`, `8G`; sizes.py).
3. The JSON is validated by pydantic in lax mode, so a few typed fields also take strings and
   numbers of another kind: `lax_int` and `lax_bool` are pydantic's rules for them.

A document nested too deeply for the parser is refused in one line, like malformed JSON.
`json_value_excess` bounds a parsed free-form value (kv_connector_extra_config here, a request's
free-form fields in the server) without recursion.
"""

from __future__ import annotations

import math
import re
from typing import Any, TypeVar

import msgspec

from kvtool.engine.config.sizes import expand_json_human_readable_numbers
from kvtool.engine.errors import ConfigError

T = TypeVar("T")

# pydantic's lax string forms: an integer (whitespace, sign, underscores between digits and a
# zero fraction allowed), and the words it reads as booleans (any case, no whitespace).
_LAX_INT = re.compile(r"\s*[+-]?[0-9]+(?:_[0-9]+)*(?:\.0*)?\s*")
_TRUE_WORDS = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE_WORDS = frozenset({"0", "off", "f", "false", "n", "no"})
_MAX_INT_TEXT = 64


class _NotCoercible(Exception):
    pass


def read_config_document(flag: str, text: str | None) -> dict[str, Any] | None:
    """The flag's JSON object after vLLM's expansion of sizes, or None for no config.

    Raises ConfigError (`invalid {flag}: ...`) for malformed JSON, a document that is not an
    object, nesting past the parser's depth, or a decimal with a binary suffix.
    """
    if text is None or text in ("", "None"):
        return None
    try:
        doc = msgspec.json.decode(expand_json_human_readable_numbers(text).encode())
    except ConfigError as e:
        raise ConfigError(f"invalid {flag}: {e}") from None
    except msgspec.DecodeError as e:
        raise ConfigError(f"invalid {flag}: malformed JSON ({e})") from None
    except RecursionError:
        raise ConfigError(f"invalid {flag}: the JSON is nested too deeply") from None
    if not isinstance(doc, dict):
        raise ConfigError(f"invalid {flag}: Expected `object`, got `{_json_type(doc)}`")
    return doc


def convert_config(flag: str, doc: dict[str, Any], cls: type[T], *, ints: tuple[str, ...] = (),
                   bools: tuple[str, ...] = ()) -> T:
    """`doc` as the msgspec Struct `cls` (strict, unknown keys refused), after pydantic's lax
    coercion of the named int and bool fields. Raises ConfigError naming the field."""
    doc = dict(doc)
    for name, coerce in [(n, lax_int) for n in ints] + [(n, lax_bool) for n in bools]:
        if name in doc:
            try:
                doc[name] = coerce(doc[name])
            except _NotCoercible:
                kind = "an integer" if coerce is lax_int else "a boolean"
                raise ConfigError(f"invalid {flag}: {name} must be {kind}, got {_shown(doc[name])}") from None
    try:
        return msgspec.convert(doc, type=cls)
    except msgspec.ValidationError as e:
        raise ConfigError(f"invalid {flag}: {e}") from None


def json_value_excess(value: Any, max_depth: int, max_values: int) -> str | None:
    """What makes a parsed JSON value too large ("holds more than N JSON values", or "nests JSON
    objects and arrays more than N levels deep", the root object or array at level 1), or None.

    A walk with its own stack, never recursion; every object, array, string, number, boolean and
    null counts one value.
    """
    count = 0
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        count += 1
        if count > max_values:
            return f"holds more than {max_values} JSON values"
        if isinstance(item, (dict, list)):
            if depth > max_depth:
                return f"nests JSON objects and arrays more than {max_depth} levels deep"
            children = item.values() if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
    return None


def lax_int(value: Any) -> int:
    """pydantic's lax int: an int, a bool, a float without fraction, or a string of an integer."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    if isinstance(value, str) and len(value) <= _MAX_INT_TEXT and _LAX_INT.fullmatch(value):
        return int(value.strip().split(".")[0].replace("_", ""))
    raise _NotCoercible


def lax_bool(value: Any) -> bool:
    """pydantic's lax bool: a bool, 0 or 1 (int or float), or one of its words in any case."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        word = value.lower()
        if word in _TRUE_WORDS:
            return True
        if word in _FALSE_WORDS:
            return False
    raise _NotCoercible


def _json_type(value: Any) -> str:
    return {list: "array", str: "str", int: "int", float: "float", bool: "bool"}.get(type(value), "null")


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
