"""The `kvtool` command line: registers the subcommands and maps errors to one line and an exit code."""

import os
import sys
from typing import Annotated

import typer

from kvtool.commands.generate import generate
from kvtool.commands.vllm_argv import rewrite_vllm_argv
from kvtool.engine.errors import KVToolError

app = typer.Typer(
    name="kvtool",
    help="An LLM inference engine and toolkit for KV offload and external KV caches.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    # Plain click help wraps text and never cuts an option name at 80 columns (rich panels do).
    rich_markup_mode=None,
)


def _print_version(value: bool) -> None:
    if value:
        from kvtool import __version__

        print(f"kvtool {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_print_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """An LLM inference engine and toolkit for KV offload and external KV caches."""
model_app = typer.Typer(help="Create model directories.", no_args_is_help=True)
app.add_typer(model_app, name="model")

app.command("generate")(generate)


def _register_optional() -> None:
    """Subcommands whose modules exist in this build."""
    import importlib

    for module, attr, name, target in (
        ("kvtool.commands.model", "model_create", "create", model_app),
        ("kvtool.commands.serve", "serve", "serve", app),
        ("kvtool.commands.inspect", "inspect", "inspect", app),
        ("kvtool.commands.verify_keys", "verify_keys", "verify-keys", app),
        ("kvtool.commands.replay", "replay_app", "replay", None),
        ("kvtool.commands.bench", "bench_app", "bench", None),
    ):
        try:
            mod = importlib.import_module(module)
        except ImportError as e:
            if e.name != module:
                raise
            continue
        obj = getattr(mod, attr, None)
        if obj is None:
            continue
        if target is None:
            app.add_typer(obj, name=name)
        else:
            target.command(name)(obj)


_register_optional()


def keep_indented_blocks(doc: str) -> str:
    """Mark each paragraph holding indented lines (an Examples block) so click prints it as written
    instead of re-wrapping its command lines into one run of text."""
    import inspect

    paragraphs = inspect.cleandoc(doc).split("\n\n")
    for i, para in enumerate(paragraphs):
        lines = para.strip("\n").splitlines()
        indents = {len(l) - len(l.lstrip()) for l in lines if l.strip()}
        if len(lines) > 1 and len(indents) > 1 and "\b" not in para:
            paragraphs[i] = "\b\n" + para.strip("\n")
    return "\n\n".join(paragraphs)


def _plain_help(typer_app: typer.Typer) -> None:
    """Click's plain help everywhere (rich panels cut option names at 80 columns), examples kept as written."""
    typer_app.rich_markup_mode = None
    for info in typer_app.registered_commands:
        if info.callback is not None and info.callback.__doc__:
            info.callback.__doc__ = keep_indented_blocks(info.callback.__doc__)
    for group in typer_app.registered_groups:
        if group.typer_instance is not None:
            _plain_help(group.typer_instance)


def _plain_help_everywhere() -> None:
    # Commands may dispatch to Typer apps of their own (replay's make-trace): reach them all.
    _plain_help(app)
    for name, module in list(sys.modules.items()):
        if name.startswith("kvtool.commands.") and module is not None:
            for value in vars(module).values():
                if isinstance(value, typer.Typer):
                    _plain_help(value)


_plain_help_everywhere()


def main(argv: list[str] | None = None) -> None:
    """Run the CLI (argv defaults to sys.argv[1:]) after vLLM's rewrites of its arguments
    (vllm_argv.py: `--flag_name`, `--json-flag.key VALUE`); always ends with SystemExit."""
    try:
        args, duplicates = rewrite_vllm_argv(sys.argv[1:] if argv is None else list(argv))
        if duplicates:
            from kvtool.commands.render import warn

            warn(f"found duplicate keys {', '.join(duplicates)}; the last value of each is used")
        app(args=args, prog_name="kvtool")
    except KVToolError as e:
        if os.environ.get("KVTOOL_DEBUG") == "1":
            raise
        print(f"error: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as e:  # noqa: BLE001 - the one place unknown errors become one line
        if os.environ.get("KVTOOL_DEBUG") == "1":
            raise
        print(f"internal error: {type(e).__name__}: {e} (set KVTOOL_DEBUG=1 for the traceback)", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
