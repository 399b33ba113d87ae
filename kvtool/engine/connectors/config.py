"""`--kv-transfer-config`: vLLM's KVTransferConfig JSON, parsed strictly.

The document is the one vLLM takes, and exactly JSON: an unquoted `2G` is malformed JSON and
refused like any other. Sizes inside kv_connector_extra_config are integers or JSON strings
with vLLM's suffixes (`"80m"` = 80 * 10**6, `"8G"` = 8 * 2**30; sizes.py), which each
connector's declared keys accept (extra_keys.py).
"""

from __future__ import annotations

import re
from typing import Any, Literal

import msgspec

from kvtool.engine.errors import ConfigError
from kvtool.engine.sizes import parse_size

# kv_connector_extra_config is free-form, as in vLLM: any JSON value, each connector checking the
# keys it declares (extra_keys.py). Lists and objects (secondary_tiers, backpressure) are bounded.
MAX_EXTRA_DEPTH = 8
MAX_EXTRA_ITEMS = 4096

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
DEFAULT_ENGINE_ID = "kvtool-engine-0"
# engine_id lands in every disk-tier header: bounded so that a header always fits its limit.
MAX_ENGINE_ID_CHARS = 256
MAX_NAME_CHARS = 256
_MODULE_PATH = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


class KVTransferConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """The 9 fields of vLLM's KVTransferConfig; unknown keys are refused, as vLLM does."""

    kv_connector: str | None = None
    kv_role: str | None = None
    kv_connector_extra_config: dict[str, Any] = {}
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

    def extra(self, key: str, default: Any = None) -> Any:
        return self.kv_connector_extra_config.get(key, default)


def parse_human_int(text: str) -> int:
    """`8G` -> 8 * 2**30, `80m` -> 80 * 10**6, `123` -> 123: vLLM's human-readable ints (sizes.py)."""
    return parse_size(text)


def parse_kv_transfer_config(text: str | None) -> KVTransferConfig | None:
    """Parse the flag's JSON. `None`, `""` and `"None"` mean no connector.

    Raises ConfigError with one line naming the problem: malformed JSON, a non-object
    document, an unknown key, a wrongly typed value, an unknown role or connector name.
    """
    if text is None or text.strip() in ("", "None", "null"):
        return None
    try:
        config = msgspec.json.decode(text.encode(), type=KVTransferConfig)
    except msgspec.ValidationError as e:
        raise ConfigError(f"invalid --kv-transfer-config: {e}") from None
    except msgspec.DecodeError as e:
        raise ConfigError(f"invalid --kv-transfer-config: malformed JSON ({e})") from None
    except RecursionError:
        raise ConfigError(f"invalid --kv-transfer-config: nested more than {MAX_EXTRA_DEPTH} levels deep") from None
    validate_kv_transfer_config(config)
    return config


def validate_kv_transfer_config(config: KVTransferConfig) -> None:
    """Checks that span fields: role required with a connector, known role, known connector."""
    from kvtool.engine.connectors.names import registered_names

    refuse_deep_extra(config.kv_connector_extra_config)
    if config.kv_role is not None and config.kv_role not in KV_ROLES:
        raise ConfigError(
            f"invalid --kv-transfer-config: unknown kv_role {config.kv_role!r}; "
            f"supported roles are {', '.join(KV_ROLES)}"
        )
    if config.kv_connector_module_path == "":
        raise ConfigError("invalid --kv-transfer-config: kv_connector_module_path cannot be empty")
    path = config.kv_connector_module_path
    if path is not None and (len(path) > MAX_NAME_CHARS or not _MODULE_PATH.fullmatch(path)):
        raise ConfigError(
            f"invalid --kv-transfer-config: kv_connector_module_path {path[:60]!r} is not a dotted "
            f"Python module name (e.g. my_pkg.my_connector) of at most {MAX_NAME_CHARS} characters"
        )
    engine_id = config.engine_id
    if not 1 <= len(engine_id) <= MAX_ENGINE_ID_CHARS or not engine_id.isprintable():
        raise ConfigError(
            f"invalid --kv-transfer-config: engine_id must be 1 to {MAX_ENGINE_ID_CHARS} printable "
            f"characters, got {len(engine_id)} characters"
        )
    if not 1 <= config.kv_port <= 65535:
        raise ConfigError(f"invalid --kv-transfer-config: kv_port must be between 1 and 65535, got {config.kv_port}")
    for name in ("kv_connector", "kv_buffer_device"):
        value = getattr(config, name)
        if value is not None and (len(value) > MAX_NAME_CHARS or not value.isprintable()):
            raise ConfigError(
                f"invalid --kv-transfer-config: {name} must be at most {MAX_NAME_CHARS} printable characters"
            )
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


def refuse_deep_extra(extra: dict[str, Any]) -> None:
    """Refuse a kv_connector_extra_config nested deeper than MAX_EXTRA_DEPTH or holding more than
    MAX_EXTRA_ITEMS values in all: one line naming the bound."""
    count = 0
    stack: list[tuple[object, int]] = [(extra, 1)]
    while stack:
        value, depth = stack.pop()
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
        for child in children:
            count += 1
            if count > MAX_EXTRA_ITEMS:
                raise ConfigError(
                    f"invalid --kv-transfer-config: kv_connector_extra_config holds more than {MAX_EXTRA_ITEMS} values"
                )
            if isinstance(child, (dict, list)):
                if depth + 1 > MAX_EXTRA_DEPTH:
                    raise ConfigError(
                        f"invalid --kv-transfer-config: kv_connector_extra_config is nested more than "
                        f"{MAX_EXTRA_DEPTH} levels deep"
                    )
                stack.append((child, depth + 1))
