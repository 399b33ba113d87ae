"""`--kv-transfer-config`: vLLM's KVTransferConfig JSON, read as vLLM 0.33 reads it.

The document is the one vLLM takes, with vLLM's command-line rules (config/json_document.py): an
unquoted size such as `{"cpu_bytes_to_use": 8G}` is expanded to its integer before the JSON is
parsed, and unknown top-level keys are refused. Sizes inside kv_connector_extra_config may also
be JSON strings with vLLM's suffixes (`"80m"` = 80 * 10**6, `"8G"` = 8 * 2**30; sizes.py), which
each connector's declared keys accept (extra_keys.py), since a JSON file cannot carry the bare form.
"""

from __future__ import annotations

import re
from typing import Any, Literal

import msgspec

from kvtool.engine.config.json_document import convert_config, json_value_excess, read_config_document
from kvtool.engine.config.sizes import parse_size
from kvtool.engine.errors import ConfigError

# kv_connector_extra_config is free-form, as in vLLM: any JSON value, each connector checking the
# keys it declares (extra_keys.py). Lists and objects (secondary_tiers, backpressure) are bounded.
MAX_EXTRA_DEPTH = 8
MAX_EXTRA_ITEMS = 4096

KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
FLAG = "--kv-transfer-config"
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
    """Parse the flag's JSON as vLLM 0.33 does (config/json_document.py): `None`, `""` and `"None"` mean
    no connector; unquoted sizes such as `8G` are expanded; `kv_port` and
    `enable_permute_local_kv` take pydantic's lax forms (`"15000"`, `"true"`).

    Raises ConfigError with one line naming the problem: malformed JSON, a non-object
    document, an unknown key, a wrongly typed value, an unknown role or connector name.
    """
    doc = read_config_document(FLAG, text)
    if doc is None:
        return None
    if doc.get("engine_id", DEFAULT_ENGINE_ID) is None:
        del doc["engine_id"]  # vLLM makes one up for a null engine_id
    config = convert_config(FLAG, doc, KVTransferConfig, ints=("kv_port",), bools=("enable_permute_local_kv",))
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
    excess = json_value_excess(extra, MAX_EXTRA_DEPTH, MAX_EXTRA_ITEMS)
    if excess is not None:
        raise ConfigError(f"invalid --kv-transfer-config: kv_connector_extra_config {excess}")


KV_OFFLOADING_BACKENDS = ("native", "lmcache")
# The connector each backend of vLLM's shortcut flags builds. vLLM's `lmcache` backend names its
# multi-process LMCacheMPConnector; kvtool's LMCache connector is the one it has.
_OFFLOADING_BACKEND_CONNECTOR = {"native": "OffloadingConnector", "lmcache": "LMCacheConnectorV1"}


def apply_kv_offloading_flags(config: KVTransferConfig | None, size_gib: float | None,
                              backend: str) -> tuple[KVTransferConfig | None, str | None]:
    """vLLM's `--kv-offloading-size GIB --kv-offloading-backend native|lmcache` over `config`
    (`VllmConfig._post_init_kv_transfer_config`): (the config to run, a one-line notice or None).

    Without a size the flags change nothing, as in vLLM. With one, the backend's connector
    replaces any connector `config` names, kv_role becomes kv_both, and `native` sets
    `cpu_bytes_to_use` to size * 2**30 (the total over tensor-parallel ranks), keeping the other
    keys of kv_connector_extra_config. The notice says what a given connector was replaced with.
    Raises ConfigError for an unknown backend or a size that is not a positive number.
    """
    if backend not in KV_OFFLOADING_BACKENDS:
        raise ConfigError(f"--kv-offloading-backend must be one of {', '.join(KV_OFFLOADING_BACKENDS)}, got {backend!r}")
    if size_gib is None:
        return config, None
    if not 0 < size_gib < 1 << 30:
        raise ConfigError(f"--kv-offloading-size must be a positive number of GiB, got {size_gib:g}")
    connector = _OFFLOADING_BACKEND_CONNECTOR[backend]
    base = config if config is not None else KVTransferConfig()
    extra = dict(base.kv_connector_extra_config)
    if backend == "native":
        extra["cpu_bytes_to_use"] = int(size_gib * (1 << 30))
    notice = None
    if base.kv_connector is not None:
        notice = (f"--kv-offloading-backend {backend} replaces kv_connector {base.kv_connector!r} of "
                  f"--kv-transfer-config with {connector!r}, as vLLM does")
    new = msgspec.structs.replace(base, kv_connector=connector, kv_role="kv_both", kv_connector_extra_config=extra)
    validate_kv_transfer_config(new)
    return new, notice
