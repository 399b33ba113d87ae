"""Executors: who runs the workers (in this process, or one process per tensor-parallel rank)."""
