"""The one output sink: a rich table (or text) on stdout, or exactly one JSON document.

Progress bars, hints and warnings go to stderr, and progress is off under --json.
Tables never cut a cell at a narrow terminal: their columns fold long values onto the next line
instead of ending them with an ellipsis (rich's default).
"""

import contextlib
import sys
from collections.abc import Iterator

import msgspec
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table


def fold_tables(renderable) -> None:
    """Make every table in `renderable` (a Table, or a Group of them) fold instead of cutting."""
    if isinstance(renderable, Table):
        for column in renderable.columns:
            if column.overflow == "ellipsis":
                column.overflow = "fold"
    for child in getattr(renderable, "renderables", ()):
        fold_tables(child)


class FoldingConsole(Console):
    """A Console whose tables keep every character of their cells at any width."""

    def print(self, *objects, **kwargs) -> None:
        for obj in objects:
            fold_tables(obj)
        super().print(*objects, **kwargs)


stdout = FoldingConsole(soft_wrap=True)
stderr = FoldingConsole(stderr=True, soft_wrap=True)


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
