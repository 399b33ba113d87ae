"""Token sequences from files, for verify-keys: JSON arrays, JSON Lines of arrays, or whitespace-separated ids."""

from __future__ import annotations

import os
import re
from pathlib import Path

import msgspec

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
    text = _read_text(file)
    if text.lstrip().startswith("["):
        token_ids = _decode_json_tokens(text, file)
    else:
        token_ids = _decode_line_tokens(text, file)
    if not token_ids:
        raise ConfigError(f"token file {str(file)!r} holds no token ids")
    return token_ids


def read_token_sequences(path: str | os.PathLike[str]) -> list[list[int]]:
    """One or more token sequences from a file.

    A file whose first non-blank line is a whole JSON array and which has further non-blank
    lines is JSON Lines: one JSON array of ints per line, one sequence each. Any other file is
    one sequence, read as `read_token_file` reads it (a JSON array, which may span lines, or
    one int per line). Raises ConfigError (one line, naming the line) as `read_token_file`
    does, and for a JSON Lines line that is not an array of non-negative ints or is empty.
    """
    file = Path(path)
    text = _read_text(file)
    lines = [(n, line) for n, line in enumerate(text.splitlines(), start=1) if line.strip()]
    if len(lines) > 1 and lines[0][1].lstrip().startswith("[") and _is_int_array(lines[0][1]):
        return [_decode_json_line(line, file, n) for n, line in lines]
    return [read_token_file(file)]


def _read_text(file: Path) -> str:
    try:
        return file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"token file {str(file)!r} not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read token file {str(file)!r}: {e}") from None


def _is_int_array(line: str) -> bool:
    try:
        msgspec.json.decode(line, type=list[int])
    except (msgspec.ValidationError, msgspec.DecodeError):
        return False
    return True


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


def _decode_json_line(line: str, file: Path, line_no: int) -> list[int]:
    where = f"token file {str(file)!r} line {line_no}"
    try:
        values = msgspec.json.decode(line, type=list[int])
    except msgspec.ValidationError as e:
        raise ConfigError(f"{where}: {e} (JSON Lines: one JSON array of ints per line)") from None
    except msgspec.DecodeError as e:
        raise ConfigError(f"{where}: malformed JSON ({e})") from None
    if not values:
        raise ConfigError(f"{where}: holds no token ids")
    for index, value in enumerate(values):
        if value < 0:
            raise ConfigError(f"{where}: token id {value} at $[{index}] is negative")
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
