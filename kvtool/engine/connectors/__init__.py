"""KV connectors: the framework (config, API, registry, guard) and the two built-in connectors."""
