"""Byte sizes as vLLM's human-readable integers, and a check against the machine's memory.

`parse_size` reads what vLLM's `human_readable_int` reads: a plain integer, or a number with a
one-letter suffix where lower case is decimal and upper case is binary:

    k = 10**3   m = 10**6   g = 10**9   t = 10**12      ("1.5g" = 1_500_000_000)
    K = 2**10   M = 2**20   G = 2**30   T = 2**40       ("2G" = 2_147_483_648; no decimals)

A decimal with a decimal suffix is computed as vLLM computes it, in floating point and
truncated (`"2.01k"` = 2009), so that a value means here what it means to vLLM. The text is
bounded (at most 24 characters, at most 2**60 bytes), so a number of a thousand digits is a
one-line refusal instead of an overflow.

`expand_json_human_readable_numbers` is vLLM's rewrite of a config flag's JSON before it is
parsed: every unquoted token such as `8G` or `80m` outside a string literal becomes its integer
(`{"cpu_bytes_to_use": 8G}` reads as `{"cpu_bytes_to_use": 8589934592}`); quoted `"8G"` stays a
string.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from kvtool.engine.errors import ConfigError

MAX_SIZE_BYTES = 1 << 60
_MAX_TEXT = 24
_SIZE = re.compile(r"(\d{1,19})(?:\.(\d{1,9}))?([kKmMgGtT]?)")
# vLLM's human_readable_int pattern; its pattern for such a number bare inside JSON, and its split
# of JSON text on string literals.
_SUFFIXED = re.compile(r"(\d+)(?:\.(\d+))?([kKmMgGtT])")
_JSON_NUMBER = re.compile(r"\b\d+(?:\.\d+)?[kKmMgGtT]\b")
_JSON_STRING = re.compile(r'("(?:[^"\\]|\\.)*")')
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_size(text: str) -> int:
    """`"8G"` -> 8 * 2**30, `"80m"` -> 80 * 10**6, `"1.5g"` -> 1.5e9, `"123"` -> 123.

    Raises ConfigError (one line) for anything else: decimals with a binary suffix or without
    a suffix, signs, spaces inside, more than 24 characters, more than 2**60 bytes.
    """
    stripped = text.strip()
    shown = stripped if len(stripped) <= 40 else stripped[:37] + "..."
    match = _SIZE.fullmatch(stripped) if len(stripped) <= _MAX_TEXT else None
    if not match:
        raise ConfigError(f"not a size: {shown!r} (use e.g. 1024, 80m or 8G)")
    whole, frac, suffix = match.groups()
    if frac is not None and suffix not in _DECIMAL:
        if suffix:
            raise ConfigError(
                f"decimals are not allowed with binary suffixes: {shown!r}; did you mean {whole}.{frac}{suffix.lower()}?"
            )
        raise ConfigError(f"not an integer: {shown!r}")
    value = _scaled(whole, frac, suffix)
    if value > MAX_SIZE_BYTES:
        raise ConfigError(f"size {shown!r} is more than {format_bytes(MAX_SIZE_BYTES)}")
    return value


def _scaled(whole: str, frac: str | None, suffix: str) -> int:
    """The number times its suffix, as vLLM's human_readable_int computes it."""
    if suffix in _DECIMAL:
        return int(float(f"{whole}.{frac or 0}") * _DECIMAL[suffix])
    return int(whole) * _BINARY.get(suffix, 1)


def expand_json_human_readable_numbers(text: str) -> str:
    """vLLM's `_expand_json_human_readable_numbers`: unquoted `8G`, `80m`, `1.5g` outside JSON
    string literals become integers; everything else is left as it is (the JSON parser then
    judges it). Raises ConfigError for a decimal with a binary suffix (vLLM's reason) and for a
    token past `parse_size`'s bounds.
    """
    parts = _JSON_STRING.split(text)
    for i in range(0, len(parts), 2):  # even indices lie outside string literals
        parts[i] = _JSON_NUMBER.sub(lambda m: str(_json_number(m.group())), parts[i])
    return "".join(parts)


def _json_number(token: str) -> int:
    if len(token) > _MAX_TEXT:
        raise ConfigError(f"number {token[:40]!r} is longer than {_MAX_TEXT} characters")
    try:
        value = human_readable_int(token)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if value > MAX_SIZE_BYTES:
        raise ConfigError(f"number {token!r} is more than {format_bytes(MAX_SIZE_BYTES)}")
    return value


def human_readable_int(text: str) -> int:
    """vLLM's `human_readable_int`, unbounded: a number with a suffix (decimal ones in floating
    point), else Python's `int(text)`. Raises ValueError where vLLM raises: text that is neither,
    and a decimal with a binary suffix (with vLLM's reason)."""
    text = text.strip()
    match = _SUFFIXED.fullmatch(text)
    if match is None:
        return int(text)
    whole, frac, suffix = match.groups()
    if frac is not None and suffix in _BINARY:
        raise ValueError(
            f"Decimals are not allowed with binary suffixes like {suffix}. "
            f"Did you mean to use {whole}.{frac}{suffix.lower()} instead?"
        )
    return _scaled(whole, frac, suffix)


def format_bytes(n: float) -> str:
    """`2147483648` -> `2 GiB (2147483648 bytes)`; below 1024 the plain number."""
    n = int(n)
    if n < 1024:
        return str(n)
    size, unit = float(n), "B"
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        size /= 1024
        if size < 1024:
            break
    return f"{size:.4g} {unit} ({n} bytes)"


def machine_memory_bytes() -> int:
    """Physical memory of this machine, or the cgroup limit when that is lower."""
    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit.isdigit():
            total = min(total, int(limit))
    except OSError:
        pass
    return total


def check_fits_memory(what: str, num_bytes: int) -> None:
    """Refuse, before allocating, a host allocation larger than the machine's memory.

    Raises ConfigError naming `what`, the size and the memory.
    """
    total = machine_memory_bytes()
    if num_bytes > total:
        raise ConfigError(
            f"{what} of {format_bytes(num_bytes)} does not fit this machine's memory of {format_bytes(total)}"
        )
