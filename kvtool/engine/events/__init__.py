"""vLLM's KV cache events: what they say, their config and their publisher."""
