"""The engine's core: requests, the scheduler, the block pool and its hashes, the per-step messages, the output processor."""
