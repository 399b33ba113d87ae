"""The engine: everything that runs a model. No CLI, no HTTP, no printing."""
