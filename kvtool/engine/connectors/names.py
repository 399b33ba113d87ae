"""The connector names kvtool registers, as vLLM registers them: name -> (module, class).

A leaf: the config parser checks names against it without importing any connector.
"""

from __future__ import annotations

BUILTIN_CONNECTORS: dict[str, tuple[str, str]] = {
    "LMCacheConnector": ("kvtool.engine.connectors.lmcache.connector", "LMCacheConnector"),
    "LMCacheConnectorV1": ("kvtool.engine.connectors.lmcache.connector", "LMCacheConnector"),
    "OffloadingConnector": ("kvtool.engine.connectors.offloading.connector", "OffloadingConnector"),
}

# Connectors registered at run time (register_connector), beside the built-in ones.
REGISTRY: dict[str, tuple[str, str]] = dict(BUILTIN_CONNECTORS)


def registered_names() -> list[str]:
    return list(REGISTRY)
