"""The OpenAI-compatible HTTP server over the engine loop (`kvtool serve`)."""
