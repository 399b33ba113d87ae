"""Declared `kv_connector_extra_config` keys: each with a type, a default, aliases and a range.

A connector lists its keys once (`ExtraKey`); `parse_extra` turns the user's dict into values
or refuses it with one line: an unknown key names itself and the closest known one ("did you
mean root_dir?"), or every known key when none is close; a value of the wrong type or outside its range names the key and
the range. Sizes take an integer or a string with vLLM's suffixes (sizes.py). A key declared
with `refused` is one kvtool knows (a vLLM key) but cannot honour: giving it at all is refused
with that reason, before any value is checked, rather than silently ignored.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping, Sequence
from typing import Literal

import msgspec

from kvtool.engine.config.sizes import format_bytes, parse_size
from kvtool.engine.errors import ConfigError

KeyKind = Literal["int", "float", "str", "bool", "size", "choice", "list", "object"]


class ExtraKey(msgspec.Struct, frozen=True, kw_only=True):
    """One key a connector accepts in kv_connector_extra_config."""

    name: str
    kind: KeyKind
    default: object = None
    aliases: tuple[str, ...] = ()  # other spellings (vLLM's, LMCache's); mapped to `name`
    # int, float, size: inclusive bounds; `low_open` makes the lower one exclusive (a timeout > 0).
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    # str: length bounds in characters; control characters are always refused.
    min_len: int = 1
    max_len: int = 4096
    choices: tuple[str, ...] = ()  # choice
    # list, object: a JSON array or object, whose items the connector checks itself.
    doc: str = ""
    # Why kvtool cannot honour this key: set, the key is refused whenever it is given.
    refused: str = ""

    def range_text(self) -> str:
        """The accepted values, in words, for messages and docs."""
        if self.refused:
            return f"refused ({self.refused})"
        if self.kind == "bool":
            return "true or false"
        if self.kind in ("list", "object"):
            return "a JSON array" if self.kind == "list" else "a JSON object"
        if self.kind == "choice":
            return "one of " + ", ".join(repr(c) for c in self.choices)
        if self.kind == "str":
            return f"a string of {self.min_len} to {self.max_len} characters without control characters"
        fmt = format_bytes if self.kind == "size" else _plain
        lo = "" if self.low is None else f"{'>' if self.low_open else '>='} {fmt(self.low)}"
        hi = "" if self.high is None else f"<= {fmt(self.high)}"
        kind = {"int": "an integer", "float": "a number", "size": "a size (bytes, or a string like \"2G\")"}[self.kind]
        return f"{kind} {' and '.join(p for p in (lo, hi) if p)}".strip()


def _plain(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(value)


def parse_extra(connector: str, keys: Sequence[ExtraKey], extra: Mapping[str, object]) -> dict[str, object]:
    """The values of `extra` by canonical key name, defaults filled in; refuses anything else.

    Raises ConfigError (one line, prefixed with `invalid {connector} config:`) for an unknown
    key (with a suggestion), a refused key (with the reason), a key given twice under two
    spellings, a value of the wrong type or outside its declared range. Refused keys have no
    entry in the result.
    """
    by_name = {k.name: k for k in keys}
    spelling = {alias: k.name for k in keys for alias in k.aliases} | {k.name: k.name for k in keys}
    where = f"invalid {connector} config"
    # Names first: a key kvtool cannot honour is the thing to fix, whatever its value.
    for raw_key in extra:
        name = spelling.get(raw_key)
        if name is None:
            known = sorted(k.name for k in keys if not k.refused)
            raise ConfigError(f"{where}: {unknown_key_message(raw_key, known, list(spelling))}")
        if by_name[name].refused:
            raise ConfigError(f"{where}: {raw_key} is not supported: {by_name[name].refused}")
    given: dict[str, object] = {}
    for raw_key, value in extra.items():
        name = spelling[raw_key]
        if name in given:
            raise ConfigError(f"{where}: {name} is given twice (as {raw_key!r} too)")
        given[name] = check_value(by_name[name], value, where)
    return {k.name: given.get(k.name, k.default) for k in keys if not k.refused}


def unknown_key_message(key: str, known: Sequence[str], spellings: Sequence[str] | None = None) -> str:
    """`unknown key 'root_dri' (did you mean root_dir?)`, or with no close spelling
    `unknown key 'x'; known keys: ...`."""
    close = difflib.get_close_matches(key, list(spellings or known), n=1, cutoff=0.6)
    if close:
        return f"unknown key {key[:80]!r} (did you mean {close[0]}?)"
    return f"unknown key {key[:80]!r}; known keys: {', '.join(known)}"


def check_value(key: ExtraKey, value: object, where: str) -> object:
    """`value` converted to the key's type, or ConfigError naming the key and its range."""
    if value is None and key.default is None:
        return None

    def refuse(got: object) -> ConfigError:
        shown = repr(got)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        return ConfigError(f"{where}: {key.name} must be {key.range_text()}, got {shown}")

    kind = key.kind
    if kind in ("list", "object"):
        if not isinstance(value, list if kind == "list" else dict):
            raise refuse(value)
        return value
    if kind == "bool":
        if not isinstance(value, bool):
            raise refuse(value)
        return value
    if kind in ("str", "choice"):
        if not isinstance(value, str):
            raise refuse(value)
        if kind == "choice":
            if value not in key.choices:
                raise refuse(value)
            return value
        if not key.min_len <= len(value) <= key.max_len or any(ord(c) < 32 or ord(c) == 127 for c in value):
            raise refuse(value)
        return value
    if kind == "size":
        if isinstance(value, str):
            try:
                number: float = parse_size(value)
            except ConfigError:
                raise refuse(value) from None
        elif isinstance(value, int) and not isinstance(value, bool):
            number = value
        else:
            raise refuse(value)
    elif kind == "int":
        if not isinstance(value, int) or isinstance(value, bool):
            raise refuse(value)
        number = value
    else:  # float
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise refuse(value)
        number = float(value)
        if not math.isfinite(number):
            raise refuse(value)
    if key.low is not None and (number <= key.low if key.low_open else number < key.low):
        raise refuse(value)
    if key.high is not None and number > key.high:
        raise refuse(value)
    return number


def describe_keys(keys: Sequence[ExtraKey]) -> list[tuple[str, str, str]]:
    """(key with aliases, accepted values, default) per key: for docs and `--help` tables."""
    rows = []
    for k in keys:
        names = k.name + (f" ({', '.join(k.aliases)})" if k.aliases else "")
        rows.append((names, k.range_text(), "unset" if k.default is None else repr(k.default)))
    return rows
