"""The OpenAI-compatible HTTP server over the engine loop (`kvtool serve`)."""

from kvtool.server.app import create_app
from kvtool.server.context import ServerSettings
from kvtool.server.engine_loop import EngineLoop, GenerationJob
from kvtool.server.errors import APIError
from kvtool.server.metrics import ServerMetrics
from kvtool.server.sampling import SamplingDefaults, load_generation_defaults

__all__ = ["APIError", "EngineLoop", "GenerationJob", "SamplingDefaults", "ServerMetrics", "ServerSettings",
           "create_app", "load_generation_defaults"]
