"""verify-keys: the LMCache keys kvtool computes for a token sequence, to compare with a peer's.

This module holds the command's logic only; `cli.py` wires it to typer. Importing it has no
side effects.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path

import msgspec

from kvtool.engine.connectors.lmcache.keys import LMCacheKeySettings, make_chunk_keys
from kvtool.engine.errors import ConfigError

_TOKEN_LINE = re.compile(r"[0-9]+")


def read_token_file(path: str | os.PathLike[str]) -> list[int]:
    """Token ids from a file: a JSON array of non-negative ints, or one such int per line.

    A file whose first non-blank character is `[` is read as JSON; anything else as lines
    (blank lines and surrounding whitespace are ignored). Raises ConfigError (one line) for a
    missing or unreadable file, malformed JSON, a value that is not a non-negative integer
    (naming its index or line), or a file with no token ids.
    """
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"token file {str(file)!r} not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read token file {str(file)!r}: {e}") from None
    if text.lstrip().startswith("["):
        token_ids = _decode_json_tokens(text, file)
    else:
        token_ids = _decode_line_tokens(text, file)
    if not token_ids:
        raise ConfigError(f"token file {str(file)!r} holds no token ids")
    return token_ids


def _decode_json_tokens(text: str, file: Path) -> list[int]:
    try:
        # msgspec's int refuses bools and floats, so `true` or `1.0` is an error, not a token.
        values = msgspec.json.decode(text, type=list[int])
    except msgspec.ValidationError as e:
        raise ConfigError(
            f"token file {str(file)!r}: {e} (expected a JSON array of ints)"
        ) from None
    except msgspec.DecodeError as e:
        raise ConfigError(f"token file {str(file)!r}: malformed JSON ({e})") from None
    for index, value in enumerate(values):
        if value < 0:
            raise ConfigError(
                f"token file {str(file)!r}: token id {value} at $[{index}] is negative"
            )
    return values


def _decode_line_tokens(text: str, file: Path) -> list[int]:
    token_ids = []
    for line_no, line in enumerate(text.splitlines(), start=1):
        field = line.strip()
        if not field:
            continue
        if not _TOKEN_LINE.fullmatch(field):
            raise ConfigError(
                f"token file {str(file)!r} line {line_no}: {field[:40]!r} is not a non-negative "
                "integer (expected a JSON array or one token id per line)"
            )
        token_ids.append(int(field))
    return token_ids


def build_key_report(tokens: Sequence[int], settings: LMCacheKeySettings) -> list[dict]:
    """One `{"start", "end", "key"}` dict per chunk that gets a key, in chunk order.

    The keys are exactly those `make_chunk_keys` gives (and a peer with these settings
    writes). Raises what `make_chunk_keys` raises.
    """
    return [
        {"start": chunk.start, "end": chunk.end, "key": chunk.key}
        for chunk in make_chunk_keys(tokens, settings)
    ]
