"""The command line as vLLM users expect it: --version, help readable at 80 columns, `serve MODEL`,
exit 0 after a clean drain, and the embedded default model answering with its generation config."""

from __future__ import annotations

import os
import re
import signal
import subprocess

import click
import openai
import pytest
import typer.main

from kvtool.cli import app
from tests.conftest import kvtool_cmd
from tests.server_process import REPO_ROOT, ServerProcess


def _run(*args: str, columns: int = 80) -> subprocess.CompletedProcess:
    env = {**os.environ, "COLUMNS": str(columns)}
    return subprocess.run([*kvtool_cmd(), *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)


def test_version():
    from kvtool import __version__

    r = _run("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"kvtool {__version__}"


def _commands(group: click.Group, path: tuple[str, ...] = ()):
    for name, cmd in group.commands.items():
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, (*path, name))
        else:
            yield (*path, name), cmd


def test_every_command_s_help_shows_every_option_name_whole_at_80_columns():
    from kvtool.commands import replay

    root = typer.main.get_command(app)
    commands = list(_commands(root))
    # replay dispatches to apps of its own: their help is checked too.
    commands += [(("replay",), typer.main.get_command(replay._run_app)),
                 (("replay", "make-trace"), typer.main.get_command(replay._make_trace_app))]
    assert len(commands) >= 7
    for path, cmd in commands:
        r = _run(*path, "--help")
        assert r.returncode == 0, (path, r.stderr)
        assert "…" not in r.stdout and "╭" not in r.stdout, path
        for param in cmd.params:
            for opt in param.opts + param.secondary_opts:
                if opt.startswith("--"):
                    assert re.search(re.escape(opt) + r"(?![\w-])", r.stdout), (path, opt)


def test_serve_model_positional_and_clean_drain_exits_0(tiny_model_dir):
    s = ServerProcess([str(tiny_model_dir), "--max-model-len", "128"])
    s.start()
    try:
        client = openai.OpenAI(base_url=s.base_url, api_key="x", max_retries=0)
        assert client.models.list().data[0].id == str(tiny_model_dir)
    finally:
        code = s.stop(signal.SIGTERM)
    assert code == 0, s.logs()[-2000:]
    s2 = ServerProcess([str(tiny_model_dir), "--max-model-len", "128"]).start()
    assert s2.stop(signal.SIGINT) == 0


def test_bad_serve_flags_are_one_line_errors(tiny_model_dir):
    r = _run("serve", str(tiny_model_dir), "--generation-config", "/nonexistent-dir")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    r = _run("serve", str(tiny_model_dir), "--chat-template", "no-such-file.jinja")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1


def test_default_model_names_paris_with_its_generation_config_only():
    # No flags: the embedded default model, its generation_config.json's sampling (no temperature
    # in the request). A fresh server's first unseeded request draws from --seed 0's stream.
    with ServerProcess([]) as s:
        client = openai.OpenAI(base_url=s.base_url, api_key="x", max_retries=0, timeout=300)
        out = client.chat.completions.create(
            model="HuggingFaceTB/SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=30,
        )
    assert "Paris" in out.choices[0].message.content
