"""kvtool: an LLM inference engine and toolkit for KV offload and external KV caches."""

__version__ = "0.1.0"
