"""Tables stay whole at 80 columns: long keys fold onto the next line, never end in an ellipsis."""

import io

from rich.console import Group
from rich.table import Table

from kvtool.commands.render import FoldingConsole

KEY = "kv_connector_extra_config.offload_block_tokens_and_more"


def _render(renderable, width: int = 80) -> str:
    out = io.StringIO()
    FoldingConsole(file=out, width=width, soft_wrap=True, color_system=None).print(renderable)
    return out.getvalue()


def test_a_narrow_table_keeps_every_character_of_its_keys():
    table = Table()
    for name in ("key", "value", "detail"):
        table.add_column(name)
    table.add_row(KEY, "x" * 60, "y" * 60)
    text = _render(Group(table))
    assert "…" not in text
    key_column = "".join(line.split("│")[1].strip() for line in text.splitlines() if line.startswith("│"))
    assert key_column == KEY
    assert max(len(line) for line in text.splitlines()) <= 80
