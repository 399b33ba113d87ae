"""The OpenAI-compatible HTTP server over the engine loop (`kvtool serve`)."""

from kvtool.server.app import APIError, ServerSettings, create_app
from kvtool.server.engine_loop import EngineLoop, GenerationJob
from kvtool.server.metrics import ServerMetrics

__all__ = ["APIError", "EngineLoop", "GenerationJob", "ServerMetrics", "ServerSettings", "create_app"]
