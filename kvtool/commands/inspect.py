"""`kvtool inspect ROOT_DIR`: what a disk tier holds, whether it is whole, and what a model could load.

Examples:

    kvtool inspect /mnt/kv                          # files, bytes, identity groups, capacity use
    kvtool inspect /mnt/kv --verify                 # re-read every payload; exit 1 on any damage
    kvtool inspect /mnt/kv --model ./Qwen3-0.6B     # which groups this model's engine would load
    kvtool inspect /mnt/kv --verify --json | jq .problems
"""

from pathlib import Path
from collections.abc import Sequence
from typing import Annotated

import msgspec
import typer
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from kvtool.commands import render
from kvtool.commands.options import JsonOpt, with_engine_options
from kvtool.engine.connectors.offloading.disk.tier_identity import KVIdentity
from kvtool.engine.connectors.offloading.disk.tier_report import TierReport, scan, with_loadability
from kvtool.engine.errors import ConfigError
from kvtool.engine.params import EngineParams

RootDirArg = Annotated[Path, typer.Argument(help="The disk tier's root_dir.", show_default=False)]
VerifyOpt = Annotated[
    bool, typer.Option("--verify", help="Re-read every payload and check it; exit 1 on damage.")
]

# Table mode lists this many problems; --json always lists all of them.
MAX_PROBLEM_ROWS = 100


@with_engine_options
def inspect(
    root_dir: RootDirArg,
    verify: VerifyOpt = False,
    json_out: JsonOpt = False,
    *,
    engine: EngineParams,
) -> None:
    """Report a disk tier: files, bytes, identity groups, capacity use, damage, loadability.

    Headers only unless --verify. With --model, says which identity groups that model under
    these engine flags (--dtype, --block-size, --kv-transfer-config, ...) could load, and
    names the fields that make the others refused. Exit 0 when fine, 1 when --verify finds
    damage, 2 on bad usage (missing root_dir or model dir).

    Examples:
      kvtool inspect /mnt/kv
      kvtool inspect /mnt/kv --verify
      kvtool inspect /mnt/kv --model ./Qwen3-0.6B --dtype bfloat16 --json
    """
    if not root_dir.is_dir():
        raise ConfigError(f"disk tier root {root_dir} does not exist or is not a directory")
    identity = identities_for_model_dir(Path(engine.model), engine) if engine.model is not None else None
    code = run_inspect(root_dir, verify=verify, json=json_out, identity=identity)
    if code:
        raise typer.Exit(code)


def run_inspect(root_dir: Path, *, verify: bool, json: bool,
                identity: KVIdentity | Sequence[KVIdentity] | None = None) -> int:
    """Scan, render to stdout, and return the exit status (1: --verify found damage).

    Progress goes to stderr and is off with `json`; stdout then carries exactly one JSON
    document. Raises ConfigError when root_dir is not a directory.
    """
    if not root_dir.is_dir():
        raise ConfigError(f"disk tier root {root_dir} does not exist or is not a directory")
    with render.progress_bar("verifying" if verify else "reading headers", enabled=not json) as bar:
        report = scan(root_dir, verify=verify, progress=lambda done, total: bar(f"{done}/{total} files", done / total))
    if identity is not None:
        report = with_loadability(report, identity)
    if json:
        render.print_json(report)
    else:
        render.stdout.print(render_report(report, identity))
    return 1 if verify and report.has_damage else 0


def identity_for_model_dir(model_dir: Path, engine: EngineParams) -> KVIdentity:
    """The disk-tier identity an engine for `model_dir` with `engine`'s flags would write under.

    Raises the engine's own errors (ModelError, ConfigError) for a bad model dir or flags.
    """
    from kvtool.engine.connectors.offloading.connector import disk_identity, parse_settings
    from kvtool.engine.kv.identity import identity_for_model

    # The engine's identity; the tier's adds the offload block size from the connector config.
    identity = identity_for_model(model_dir, engine)
    extra = dict(engine.kv_transfer_config.kv_connector_extra_config) if engine.kv_transfer_config else {}
    settings = parse_settings(extra, engine.block_size)
    return disk_identity(identity, settings.offload_block_tokens)


def identities_for_model_dir(model_dir: Path, engine: EngineParams) -> list[KVIdentity]:
    """The identities an engine for `model_dir` with `engine`'s flags would write under: one, or
    one per KV cache group where its layout has several (the OffloadingConnector's groups, or
    --disable-hybrid-kv-cache-manager for one)."""
    from kvtool.engine.connectors.offloading.connector import group_identities
    from kvtool.engine.kv.identity import layout_for_model

    return group_identities(identity_for_model_dir(model_dir, engine), layout_for_model(model_dir, engine))


def render_report(report: TierReport, identity: KVIdentity | Sequence[KVIdentity] | None = None,
                  json: bool = False) -> str | RenderableType:
    """The report as the JSON document `--json` prints (a str) or as rich tables; no I/O.

    With `identity`, loadability verdicts are added (the JSON's `loadability` key; a
    `loadable` row and marked differing fields in the table).
    """
    if identity is not None and report.loadability is None:
        report = with_loadability(report, identity)
    if json:
        return msgspec.json.format(msgspec.json.encode(report), indent=2).decode()
    parts: list[RenderableType] = [_summary_table(report)]
    if report.groups:
        parts.append(_groups_table(report, identity))
    if report.problems:
        parts.append(_problems_table(report))
    return Group(*parts)


def _human_bytes(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    size = float(n)
    for unit in ("KiB", "MiB", "GiB"):
        size /= 1024
        if size < 1024:
            return f"{size:.1f} {unit}"
    return f"{size / 1024:.1f} TiB"


def _summary_table(report: TierReport) -> Table:
    table = Table(title=f"disk tier {report.root_dir}", show_header=False, title_justify="left")
    table.add_column(style="bold")
    table.add_column()
    capacity = (
        f"{_human_bytes(report.tier_bytes)} of {_human_bytes(report.capacity_bytes)} ({report.capacity_used:.1%})"
        if report.capacity_used is not None
        else "no capacity limit recorded"
    )
    damage = Text(str(report.num_damaged), style="bold red" if report.num_damaged else "green")
    rows: list[tuple[str, str | Text]] = [
        ("files", str(report.num_files)),
        ("total bytes", f"{_human_bytes(report.total_bytes)} ({report.total_bytes})"),
        ("healthy blocks", f"{report.num_blocks} ({_human_bytes(report.block_bytes)})"),
        ("identity groups", str(len(report.groups))),
        ("capacity use", capacity),
        ("least recently used", report.oldest_used_at or "-"),
        ("most recently used", report.newest_used_at or "-"),
        ("writes in flight", str(report.num_temp_files_in_flight)),
        ("checked", "headers and payloads (--verify)" if report.verified else "headers only"),
        ("damaged or foreign files", damage),
        ("scan time", f"{report.scan_ms:.0f} ms"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    return table


def _groups_table(report: TierReport, identity: KVIdentity | Sequence[KVIdentity] | None) -> Table:
    """One column per identity group, one row per header field: each group's fields shown once
    (the --model engine's column: each value its KV cache groups' identities hold, once)."""
    identities = None if identity is None else [identity] if isinstance(identity, KVIdentity) else list(identity)
    verdicts = report.loadability or []  # one per group, in group order
    table = Table(title="identity groups", title_justify="left")
    table.add_column("field", style="bold")
    if identity is not None:
        table.add_column("--model engine", style="cyan")
    for i, group in enumerate(report.groups):
        table.add_column(f"group {i + 1}\n{group.tier_digest}")
    for field in KVIdentity.__struct_fields__:
        row: list[str | Text] = [field]
        if identities is not None:
            row.append(" | ".join(dict.fromkeys(str(getattr(i, field)) for i in identities)))
        for i, group in enumerate(report.groups):
            value = getattr(group.identity, field)
            differs = bool(verdicts) and any(d.field == field for d in verdicts[i].differences)
            row.append(Text(str(value), style="bold red") if differs else str(value))
        table.add_row(*row)
    table.add_section()
    stats = (
        ("blocks", lambda g: str(g.num_blocks)),
        ("tokens", lambda g: str(g.num_tokens)),
        ("bytes", lambda g: _human_bytes(g.total_bytes)),
        ("oldest use", lambda g: g.oldest_used_at),
        ("newest use", lambda g: g.newest_used_at),
    )
    for name, cell in stats:
        table.add_row(name, *([""] if identity is not None else []), *(cell(g) for g in report.groups))
    if verdicts:
        verdict_cells = []
        for v in verdicts:
            verdict_cells.append(
                Text("yes", style="bold green")
                if v.loadable
                else Text(f"no: {', '.join(d.field for d in v.differences)}", style="bold red")
            )
        table.add_row("loadable", *([""] if identity is not None else []), *verdict_cells)
    return table


def _problems_table(report: TierReport) -> Table:
    table = Table(title="damaged, foreign and leftover files (never loaded)", title_justify="left")
    table.add_column("problem", style="bold red")
    table.add_column("path")
    table.add_column("bytes", justify="right")
    table.add_column("detail")
    for p in report.problems[:MAX_PROBLEM_ROWS]:
        table.add_row(p.problem, p.path, str(p.size_bytes), p.detail)
    hidden = len(report.problems) - MAX_PROBLEM_ROWS
    if hidden > 0:
        table.add_row("…", f"{hidden} more", "", "use --json for the full list")
    return table
