"""Connector names, as vLLM registers them, plus `kv_connector_module_path` for out-of-tree classes."""

from __future__ import annotations

import importlib

from kvtool.engine.connectors.base import KVConnector
from kvtool.engine.connectors.config import KVTransferConfig
from kvtool.engine.connectors.names import REGISTRY as _REGISTRY
from kvtool.engine.connectors.names import registered_names
from kvtool.engine.errors import ConfigError


def register_connector(name: str, module: str, class_name: str) -> None:
    """Register a connector name (as vLLM's KVConnectorFactory does). Registering a name twice raises."""
    if name in _REGISTRY:
        raise ConfigError(f"connector {name!r} is already registered")
    _REGISTRY[name] = (module, class_name)


def unregister_connector(name: str) -> None:
    _REGISTRY.pop(name, None)


def resolve_connector(config: KVTransferConfig) -> type[KVConnector]:
    """The connector class for a config: kv_connector_module_path first, then the registry."""
    name = config.kv_connector
    if name is None:
        raise ConfigError("no kv_connector set")
    if config.kv_connector_module_path:
        module_name, class_name = config.kv_connector_module_path, name
    elif name in _REGISTRY:
        module_name, class_name = _REGISTRY[name]
    else:
        raise ConfigError(
            f"unknown kv_connector {name!r}; registered connectors: {', '.join(registered_names())}"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"cannot import connector module {module_name!r}: {e}") from None
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, KVConnector)):
        raise ConfigError(f"{module_name}.{class_name} is not a kvtool KVConnector class")
    return cls


def refuse_unrunnable_connector(cls: type[KVConnector], name: str, device_type: str) -> None:
    """The refusal guard: a connector whose worker half cannot move bytes on this device is refused.

    Without a worker half, its scheduler half would report external hits and the engine would
    skip prefill over KV that is never written into the pages: wrong output, silently.
    """
    why = cls.worker_refusal(device_type)
    if why is None:
        return
    runnable = []
    for other in registered_names():
        try:
            other_cls = resolve_connector(KVTransferConfig(kv_connector=other, kv_role="kv_both"))
        except ConfigError:
            continue
        if other_cls.worker_refusal(device_type) is None and other not in runnable:
            runnable.append(other)
    raise ConfigError(
        f"kv_connector {name!r} cannot run on device {device_type}: {why}, so its scheduler half "
        f"would skip prefill over KV that is never written into the pages; connectors that can run "
        f"on {device_type}: {', '.join(runnable) or 'none'}"
    )
