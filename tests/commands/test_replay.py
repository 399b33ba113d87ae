"""`kvtool replay` end to end: the shipped traces through the disk tier and LMCache's own server
with a cold second process, the CPU tier in one engine, a damaged tier under `fail`, and a
running `kvtool serve`."""

import json
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtool.cli import app
from kvtool.engine.errors import ConfigError
from tests.conftest import kvtool_cmd
from tests.support.server_process import ServerProcess

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "traces"
ENGINE = ["--device", "cpu", "--kv-cache-memory", "64M"]


def replay(*args: str):
    return CliRunner().invoke(app, ["replay", *args])


def offloading(root=None) -> str:
    extra = {"root_dir": str(root)} if root else {}
    return json.dumps({"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_load_failure_policy": "fail",
                       "kv_connector_extra_config": extra})


def rows(report: dict, arm: str, pass_name: str) -> list[dict]:
    return [r for r in report["requests"] if r["arm"] == arm and r["pass_name"] == pass_name]


@pytest.mark.parametrize("trace", ["multi-turn", "long-doc-qa", "shared-prefix"])
def test_shipped_traces_pass_disk_and_lmcache_across_a_cold_process(trace, tiny_model_dir, lmcache_server, tmp_path):
    out = tmp_path / "report.json"
    result = replay(str(EXAMPLES / f"{trace}.jsonl"), "--model", str(tiny_model_dir), *ENGINE,
                    "--arms", "disk", "--arms", "lmcache", "--lmcache-url", f"lm://{lmcache_server.host}:{lmcache_server.port}",
                    "--restart", "process", "--json", str(out))
    assert result.exit_code == 0, result.output + repr(result.exception)
    assert "OK:" in result.stdout
    report = json.loads(out.read_text())
    assert report["ok"] and report["failures"] == [] and report["restart"] == "process"
    assert [a["name"] for a in report["arms"]] == ["none", "disk", "lmcache"]
    num_requests = len(rows(report, "none", "reference"))
    for arm, source in (("disk", "disk"), ("lmcache", "lmcache")):
        summary = next(a for a in report["arms"] if a["name"] == arm)
        assert summary["hit_source"] == source and summary["restart"] == "process"
        assert summary["passes"]["reuse"]["num_loaded_tokens"] > 0 and summary["passes"]["reuse"]["bytes_loaded"] > 0
        assert summary["passes"]["fill"]["bytes_stored"] > 0
        reuse = rows(report, arm, "reuse")
        assert len(reuse) == num_requests and all(r["output_equal"] for r in reuse)
        # Every request with a block the cache could serve was served from the tier.
        assert any(r["required_hit_tokens"] > 0 for r in reuse)
        assert all(r["num_loaded_tokens"] > 0 for r in reuse if r["required_hit_tokens"] > 0)


def test_cpu_tier_and_prefix_cache_in_one_engine(tiny_model_dir):
    result = replay(str(EXAMPLES / "multi-turn.jsonl"), "--model", str(tiny_model_dir), *ENGINE,
                    "--kv-transfer-config", offloading(), "--arms", "prefix-cache", "--json", "-")
    assert result.exit_code == 0, result.output + repr(result.exception)
    report = json.loads(result.stdout)
    assert report["ok"] and [a["name"] for a in report["arms"]] == ["none", "prefix-cache", "OffloadingConnector"]
    sources = {a["name"]: a["hit_source"] for a in report["arms"]}
    assert sources == {"none": None, "OffloadingConnector": "cpu", "prefix-cache": "prefix-cache"}
    assert sum(r["num_loaded_tokens"] for r in rows(report, "OffloadingConnector", "reuse")) > 0
    assert sum(r["num_cached_tokens"] for r in rows(report, "prefix-cache", "reuse")) > 0


def test_damaged_disk_tier_under_fail_names_the_request(tiny_model_dir, tmp_path, cli_env):
    root = tmp_path / "tier"
    trace = EXAMPLES / "long-doc-qa.jsonl"
    arm = f"disk={offloading(root)}"
    fill = replay(str(trace), "--model", str(tiny_model_dir), *ENGINE, "--arms", arm, "--passes", "fill")
    assert fill.exit_code == 0, fill.output + repr(fill.exception)
    files = sorted(root.rglob("*.kvb"), key=lambda f: (f.stat().st_mtime_ns, f.name))
    assert len(files) > 2
    data = bytearray(files[1].read_bytes())
    data[-10] ^= 0xFF  # a payload byte, before the trailing checksum
    files[1].write_bytes(bytes(data))
    report_path = tmp_path / "reuse.json"
    reuse = subprocess.run(
        kvtool_cmd() + ["replay", str(trace), "--model", str(tiny_model_dir), *ENGINE, "--arms", arm,
                        "--passes", "reuse", "--json", str(report_path)],
        env=cli_env, capture_output=True, text=True, timeout=300,
    )
    assert reuse.returncode == 1, reuse.stdout + reuse.stderr
    report = json.loads(report_path.read_text())
    assert not report["ok"] and report["failures"]
    failure = report["failures"][0]
    assert failure["kind"] == "error" and failure["arm"] == "disk" and failure["pass_name"] == "reuse"
    assert "checksum" in failure["message"]
    names = {r["request"]: r["line"] for r in rows(report, "none", "reference")}
    assert names[failure["request"]] == failure["line"]
    assert f"FAIL request '{failure['request']}' (line {failure['line']}), arm disk, reuse pass: finished with an error" in reuse.stdout
    assert "FAILED:" in reuse.stdout


def test_arms_whose_kv_cannot_survive_the_restart_are_refused(tiny_model_dir):
    trace = str(EXAMPLES / "shared-prefix.jsonl")
    for args, message in [
        (["--arms", "cpu", "--restart", "process"], "arm 'cpu' keeps its KV inside the engine"),
        (["--arms", "prefix-cache", "--restart", "engine"], "arm 'prefix-cache' keeps its KV inside the engine"),
        (["--arms", "disk", "--passes", "reuse"], "built-in disk arm's tier is a temporary directory"),
        ([], "give at least one arm"),
        (["--arms", "cpu", "--restart", "sometimes"], "--restart must be one of none, engine, process"),
    ]:
        result = replay(trace, "--model", str(tiny_model_dir), *ENGINE, *args)
        assert isinstance(result.exception, ConfigError), (args, result.output)
        assert message in str(result.exception)


def test_replay_against_a_running_kvtool_serve(tiny_model_dir):
    ktc = offloading()
    with ServerProcess(["--model", str(tiny_model_dir), *ENGINE, "--kv-transfer-config", ktc]) as server:
        result = replay(str(EXAMPLES / "shared-prefix.jsonl"), "--model", str(tiny_model_dir), *ENGINE,
                        "--server", server.url, "--json", "-")
    assert result.exit_code == 0, result.output + repr(result.exception)
    report = json.loads(result.stdout)
    assert report["ok"] and report["compared"] == "token_ids"
    server_arm = report["arms"][1]
    assert server_arm["name"] == "server" and set(server_arm["passes"]) == {"fill", "reuse"}
    assert server_arm["passes"]["reuse"]["tokens_saved"] > 0
    assert server_arm["passes"]["reuse"]["ttft_p50_ms"] is not None
    assert all(r["output_equal"] for r in rows(report, "server", "reuse"))
