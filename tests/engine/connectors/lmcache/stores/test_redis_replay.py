"""`kvtool replay` of the shipped traces through the built-in redis and redis-cluster arms, each
of which starts its own real redis-server (or three-master Redis Cluster) for the run, with a
cold second process for the reuse pass."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvtool.cli import app

EXAMPLES = Path(__file__).resolve().parents[5] / "examples" / "traces"
ENGINE = ["--device", "cpu", "--kv-cache-memory", "64M"]


@pytest.mark.parametrize("trace", ["multi-turn", "long-doc-qa", "shared-prefix"])
def test_shipped_traces_pass_redis_and_redis_cluster_across_a_cold_process(trace, tiny_model_dir, tmp_path):
    out = tmp_path / "report.json"
    result = CliRunner().invoke(app, ["replay", str(EXAMPLES / f"{trace}.jsonl"), "--model", str(tiny_model_dir), *ENGINE,
                                      "--arms", "redis", "--arms", "redis-cluster", "--restart", "process",
                                      "--json", str(out)])
    assert result.exit_code == 0, result.output + repr(result.exception)
    assert "OK:" in result.stdout
    report = json.loads(out.read_text())
    assert report["ok"] and report["failures"] == [] and report["restart"] == "process"
    assert [a["name"] for a in report["arms"]] == ["none", "redis", "redis-cluster"]
    num_requests = len([r for r in report["requests"] if r["arm"] == "none" and r["pass_name"] == "reference"])
    for arm in ("redis", "redis-cluster"):
        summary = next(a for a in report["arms"] if a["name"] == arm)
        assert summary["hit_source"] == arm and summary["restart"] == "process"
        assert summary["passes"]["reuse"]["num_loaded_tokens"] > 0 and summary["passes"]["reuse"]["bytes_loaded"] > 0
        assert summary["passes"]["fill"]["bytes_stored"] > 0
        reuse = [r for r in report["requests"] if r["arm"] == arm and r["pass_name"] == "reuse"]
        assert len(reuse) == num_requests and all(r["output_equal"] for r in reuse)
        assert any(r["required_hit_tokens"] > 0 for r in reuse)
        assert all(r["num_loaded_tokens"] > 0 for r in reuse if r["required_hit_tokens"] > 0)
