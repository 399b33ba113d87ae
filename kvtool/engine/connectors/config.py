"""`--kv-transfer-config`: vLLM's KVTransferConfig JSON, parsed strictly.

The document is the one vLLM takes. Like vLLM's CLI, unquoted human-readable numbers
(`80m` = 80 * 10**6, `8G` = 8 * 2**30) are expanded before the JSON is decoded.
"""

from __future__ import annotations

import re
from typing import Literal, Union

import msgspec

from kvtool.engine.errors import ConfigError

ExtraValue = Union[str, int, float, bool]

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
DEFAULT_ENGINE_ID = "kvtool-engine-0"


class KVTransferConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The 9 fields of vLLM's KVTransferConfig; unknown keys are refused, as vLLM does."""

    kv_connector: str | None = None
    kv_role: str | None = None
    kv_connector_extra_config: dict[str, ExtraValue] = {}
    engine_id: str = DEFAULT_ENGINE_ID
    kv_load_failure_policy: Literal["fail", "recompute"] = "fail"
    # Accepted for compatibility with vLLM documents; kvtool uses the engine's device.
    kv_buffer_device: str | None = None
    kv_port: int = 14579
    kv_connector_module_path: str | None = None
    enable_permute_local_kv: bool = False

    @property
    def is_kv_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_kv_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    def extra(self, key: str, default: ExtraValue | None = None) -> ExtraValue | None:
        return self.kv_connector_extra_config.get(key, default)


_HUMAN_NUMBER = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)([kKmMgGtT])(?![\w.])")
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_human_int(text: str) -> int:
    """`8G` -> 8 * 2**30, `80m` -> 80 * 10**6, `1.5g` -> 1.5e9, `123` -> 123 (vLLM's rules)."""
    text = text.strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT]?)", text)
    if not match:
        raise ConfigError(f"not a number: {text!r} (use e.g. 1024, 80m or 8G)")
    number, suffix = match.groups()
    if not suffix:
        if "." in number:
            raise ConfigError(f"not an integer: {text!r}")
        return int(number)
    if suffix in _BINARY:
        if "." in number:
            raise ConfigError(f"decimals are not allowed with binary suffixes: {text!r}")
        return int(number) * _BINARY[suffix]
    return int(float(number) * _DECIMAL[suffix])


def expand_human_numbers(text: str) -> str:
    """Expand unquoted `80m` / `8G` tokens outside JSON string literals."""
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        if text[i] == '"':
            j = i + 1
            while j < n and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
            out.append(text[i : j + 1])
            i = j + 1
            continue
        j = text.find('"', i)
        j = n if j < 0 else j
        out.append(_HUMAN_NUMBER.sub(lambda m: str(parse_human_int(m.group(0))), text[i:j]))
        i = j
    return "".join(out)


def parse_kv_transfer_config(text: str | None) -> KVTransferConfig | None:
    """Parse the flag's JSON. `None`, `""` and `"None"` mean no connector.

    Raises ConfigError with one line naming the problem: malformed JSON, a non-object
    document, an unknown key, a wrongly typed value, an unknown role or connector name.
    """
    if text is None or text.strip() in ("", "None", "null"):
        return None
    try:
        config = msgspec.json.decode(expand_human_numbers(text), type=KVTransferConfig)
    except msgspec.ValidationError as e:
        raise ConfigError(f"invalid --kv-transfer-config: {e}") from None
    except msgspec.DecodeError as e:
        raise ConfigError(f"invalid --kv-transfer-config: malformed JSON ({e})") from None
    validate_kv_transfer_config(config)
    return config


def validate_kv_transfer_config(config: KVTransferConfig) -> None:
    """Checks that span fields: role required with a connector, known role, known connector."""
    from kvtool.engine.connectors.names import registered_names

    if config.kv_role is not None and config.kv_role not in KV_ROLES:
        raise ConfigError(
            f"invalid --kv-transfer-config: unknown kv_role {config.kv_role!r}; "
            f"supported roles are {', '.join(KV_ROLES)}"
        )
    if config.kv_connector_module_path == "":
        raise ConfigError("invalid --kv-transfer-config: kv_connector_module_path cannot be empty")
    if config.kv_connector is None:
        return
    if config.kv_role is None:
        raise ConfigError(
            "invalid --kv-transfer-config: kv_role is required when kv_connector is set; "
            f"supported roles are {', '.join(KV_ROLES)}"
        )
    if config.kv_connector_module_path is None and config.kv_connector not in registered_names():
        raise ConfigError(
            f"invalid --kv-transfer-config: unknown kv_connector {config.kv_connector!r}; "
            f"registered connectors: {', '.join(registered_names())}"
        )
