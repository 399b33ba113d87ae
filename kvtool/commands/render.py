"""The one output sink: a rich table (or text) on stdout, or exactly one JSON document.

Progress bars, hints and warnings go to stderr, and progress is off under --json.
"""

import contextlib
import sys
from collections.abc import Iterator

import msgspec
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

stdout = Console(soft_wrap=True)
stderr = Console(stderr=True, soft_wrap=True)


def print_json(obj) -> None:
    """Exactly one JSON document on stdout."""
    sys.stdout.write(msgspec.json.format(msgspec.json.encode(obj), indent=2).decode() + "\n")
    sys.stdout.flush()


def info(message: str) -> None:
    stderr.print(message, highlight=False)


def warn(message: str) -> None:
    stderr.print(f"[yellow]warning:[/yellow] {message}", highlight=False)


@contextlib.contextmanager
def progress_bar(description: str, enabled: bool = True) -> Iterator:
    """Yields a callback(stage: str, fraction: float) drawing a bar on stderr.

    The bar appears at the first call only, so work that reports no progress leaves stderr
    untouched (an error after it stays one line). A no-op when disabled.
    """
    if not enabled:
        yield lambda stage, fraction: None
        return
    state: dict = {}

    def update(stage: str, fraction: float) -> None:
        if "bar" not in state:
            bar = Progress(
                TextColumn("{task.description}"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
                TimeElapsedColumn(), console=stderr, transient=True,
            )
            bar.start()
            state["bar"], state["task"] = bar, bar.add_task(description, total=1.0)
        label = f"{description}: {stage}" if stage else description
        state["bar"].update(state["task"], completed=fraction, description=label)

    try:
        yield update
    finally:
        if "bar" in state:
            state["bar"].stop()
