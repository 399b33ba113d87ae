"""vLLM 0.33's command-line rewrites, applied before typer reads the arguments.

vLLM's `FlexibleArgumentParser.parse_args` (`vllm/utils/argparse_utils.py`) rewrites its
arguments before argparse sees them, and a vLLM command line relies on two of the rewrites:

- A flag's name may spell its dashes as underscores, up to its first dot:
  `--kv_transfer_config` is `--kv-transfer-config`.
- The dotted form sets one key of a JSON flag: `--kv-transfer-config.kv_role kv_both` or
  `--kv-transfer-config.kv_role=kv_both`. The value is read as JSON, else as a human-readable
  integer (`8G`), else kept as a string; a key ending in `+` splits its value on commas into a
  list of strings. The keys given for one flag merge (objects merge key by key, lists
  concatenate, a key given twice keeps its last value) and the merged object is passed as
  `--FLAG JSON` after every other argument, as if it had been written as JSON.

So `--kv-transfer-config.kv_connector OffloadingConnector --kv-transfer-config.kv_role kv_both
--kv-transfer-config.kv_connector_extra_config.cpu_bytes_to_use 8G` reads as
`--kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
"kv_connector_extra_config": {"cpu_bytes_to_use": 8589934592}}'`.

One difference, on purpose: only an argument that starts with `--` can be dotted (vLLM also takes
any argument that starts with one dash and holds a dot, so a value such as `-0.5` was read as a key).
"""

from __future__ import annotations

import json
import re
from typing import Any

from kvtool.engine.config.sizes import human_readable_int
from kvtool.engine.errors import ConfigError

# Everything between the leading `--` and the first `.`: where underscores become dashes.
_FLAG_NAME = re.compile(r"(?<=--)[^.]*")


def rewrite_vllm_argv(args: list[str]) -> tuple[list[str], list[str]]:
    """(the arguments as typer should read them, the dotted keys given more than once).

    Raises ConfigError for a dotted flag without a value or a value nested too deeply to read.
    """
    processed = [_dashed(arg) if arg.startswith("--") else arg for arg in args]
    out: list[str] = []
    dotted: dict[str, dict[str, Any]] = {}
    duplicates: list[str] = []
    i = 0
    while i < len(processed):
        arg = processed[i]
        i += 1
        if not (arg.startswith("--") and "." in arg):
            out.append(arg)
            continue
        if "=" in arg:
            name, value = arg.split("=", 1)
            if "." not in name:  # the dot was in the value only
                out.append(arg)
                continue
        else:
            if i >= len(processed):
                raise ConfigError(f"{arg} needs a value")
            name, value = arg, processed[i]
            i += 1
        if name.endswith("+"):
            name = name[:-1]
            value = json.dumps(value.split(","))
        flag, *keys = name.split(".")
        nested: Any = _dotted_value(name, value)
        for key in reversed(keys):
            nested = {key: nested}
        duplicates += [f"{flag}.{d}" for d in _merge(dotted.setdefault(flag, {}), nested)]
    for flag, doc in dotted.items():
        out += [flag, json.dumps(doc)]
    return out, duplicates


def _dashed(arg: str) -> str:
    key, sep, value = arg.partition("=")
    return _FLAG_NAME.sub(lambda m: m.group(0).replace("_", "-"), key, count=1) + sep + value


def _dotted_value(name: str, text: str) -> Any:
    """JSON, else vLLM's human-readable integer, else the text itself."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    except RecursionError:
        raise ConfigError(f"{name}: the JSON value is nested too deeply") from None
    try:
        return human_readable_int(text)
    except (ValueError, OverflowError):
        return text


def _merge(original: dict[str, Any], update: dict[str, Any]) -> list[str]:
    """vLLM's recursive_dict_update: merge `update` into `original`; returns the keys overwritten."""
    duplicates: list[str] = []
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(original.get(key), dict):
            duplicates += [f"{key}.{d}" for d in _merge(original[key], value)]
        elif isinstance(value, list) and isinstance(original.get(key), list):
            original[key] += value
        else:
            if key in original:
                duplicates.append(key)
            original[key] = value
    return duplicates
