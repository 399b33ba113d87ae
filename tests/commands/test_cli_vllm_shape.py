"""The command line as vLLM users expect it: --version, help readable at 80 columns, `serve MODEL`,
vLLM's own `serve` command line word for word,
exit 0 after a clean drain, and the embedded default model answering with its generation config."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys

import click
import httpx
import openai
import typer.main

from kvtool.cli import app
from tests.conftest import kvtool_cmd
from tests.support.server_process import REPO_ROOT, ServerProcess


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
            messages=[{"role": "user", "content": "What is the capital of France?"}],  # nothing else
        )
    content = out.choices[0].message.content
    # A sentence that names Paris, ended by the model itself.
    assert out.choices[0].finish_reason == "stop", content
    assert re.search(r"\bParis\b", content) and len(content.split()) >= 3 and content.rstrip()[-1] in ".!", content


def test_a_vllm_serve_command_line_runs_unchanged(tiny_model_dir, tmp_path):
    """`vllm serve MODEL --port P --api-key K --served-model-name N --max-model-len L --chat-template T
    --generation-config auto --kv-transfer-config JSON`, word for word, in vLLM's order."""
    from kvtool.workloads.redis_server import free_port

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    # `auto`: the model's own generation_config.json supplies the request defaults.
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.0, "max_new_tokens": 5}))
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>")
    port = free_port()
    ktc = '{"kv_connector":"OffloadingConnector","kv_role":"kv_both","kv_connector_extra_config":{"cpu_bytes_to_use":4000000}}'
    flags = ["--api-key", "token-abc123", "--served-model-name", "my-model", "--max-model-len", "200",
             "--chat-template", str(template), "--generation-config", "auto", "--kv-transfer-config", ktc]
    # ServerProcess puts `--port P` right after its launcher: `serve MODEL --port P FLAGS`, vLLM's order.
    launcher = [sys.executable, "-m", "kvtool.cli", "serve", str(model)]
    with ServerProcess(flags, port=port, launcher=launcher) as s:
        assert s.url == f"http://127.0.0.1:{port}"
        client = openai.OpenAI(base_url=s.base_url, api_key="token-abc123", max_retries=0, timeout=120)
        card = client.models.list().data[0]
        assert card.id == "my-model" and card.model_extra["max_model_len"] == 200
        messages = [{"role": "user", "content": "hi"}]
        a = client.chat.completions.create(model="my-model", messages=messages)  # no temperature, no max_tokens
        b = client.chat.completions.create(model="my-model", messages=messages)
        assert a.usage.completion_tokens == 5 and a.choices[0].message.content == b.choices[0].message.content
        assert a.usage.prompt_tokens == len("<user>hi<assistant>")  # the template file rendered it (one token a byte)
        r = httpx.get(f"{s.base_url}/models", headers={"Authorization": "Bearer wrong"}, timeout=10)
        assert r.status_code == 401
        assert s.metrics()["kvtool:kv_offload_cpu_cache_slots"] >= 1  # the connector of --kv-transfer-config runs
