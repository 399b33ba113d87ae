"""Building an engine for a command: the default-model announcement and its progress bar."""

import contextlib
from collections.abc import Iterator

from kvtool.commands import render
from kvtool.engine.params import EngineParams


@contextlib.contextmanager
def open_engine(params: EngineParams, show_progress: bool = True) -> Iterator:
    """An LLMEngine that is closed (pending stores written) when the block ends."""
    from kvtool.engine.engine import LLMEngine  # torch is imported only by commands that run a model
    with render.progress_bar("Converting SmolLM2-135M-Instruct", enabled=show_progress) as bar:
        announced = []

        def progress(stage: str, fraction: float) -> None:
            if not announced:
                announced.append(True)
                render.info("Preparing the embedded default model SmolLM2-135M-Instruct (once per user)...")
            bar(stage, fraction)

        engine = LLMEngine(params, progress=progress)
    try:
        yield engine
    finally:
        engine.close()
