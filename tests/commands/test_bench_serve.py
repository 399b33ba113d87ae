"""`kvtool bench serve` on the tiny preset on CPU: every kvtool arm on a short multi-turn trace.

Timings are never asserted (machines are noisy): the tests check the report's fields, the hit
counters of the tier arms, output identity across arms, the figure, the vLLM arms' one-line
skip, and the one-line refusals of bad input.
"""

import gc
import json
import weakref

import pytest
from typer.testing import CliRunner

from kvtool.cli import app

ENGINE = ["--preset", "tiny", "--load-format", "dummy", "--device", "cpu"]
RUN_KEYS = {"arm", "engine", "load", "request_rate", "max_concurrency", "figures", "sources", "outputs_equal",
            "num_outputs_differing", "vllm_stats", "host", "requests"}
FIGURE_KEYS = {"num_requests", "num_failed", "duration_s", "num_prompt_tokens", "num_output_tokens", "ttft", "tpot",
               "e2e", "output_tokens_per_s", "total_tokens_per_s", "requests_per_s", "queue"}
QUEUE_KEYS = {"grew", "waiting_mid", "waiting_end", "waiting_min_late", "backlog_at_last_arrival", "max_waiting", "last_arrival_s",
              "drain_s", "max_send_lag_ms"}


def invoke(*args: str):
    return CliRunner().invoke(app, [*args])


@pytest.fixture(scope="module")
def chat_trace(tmp_path_factory):
    """8 users x 3 turns sharing a 16-token system prompt."""
    path = tmp_path_factory.mktemp("serve") / "chat.jsonl"
    result = invoke("replay", "make-trace", "--kind", "multi-turn", "--num-conversations", "8", "--num-turns", "3",
                    "--system-len", "16", "--turn-len", "16", "--answer-len", "8", "--max-tokens", "4",
                    "--out", str(path))
    assert result.exit_code == 0, result.output
    return path


def test_every_kvtool_arm_serves_the_trace_with_hits_and_equal_outputs(chat_trace, lmcache_server, tmp_path):
    out, png = tmp_path / "serve.json", tmp_path / "serve.png"
    result = invoke("bench", "serve", str(chat_trace), *ENGINE, "--arms", "prefix-cache,cpu,disk,lmcache,vllm",
                    "--lmcache-url", f"lm://{lmcache_server.host}:{lmcache_server.port}",
                    "--request-rate", "40,inf", "--num-warmups", "2", "--json", str(out), "--plot", str(png))
    assert result.exit_code == 0, result.output + repr(result.exception)
    # The vLLM arm cannot run on a CPU machine: skipped, in one line saying why.
    assert "vllm skipped: the vLLM arms need a CUDA device" in result.stderr
    assert "SKIPPED vllm: the vLLM arms need a CUDA device" in result.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    report = json.loads(out.read_text())
    assert report["ok"] and report["failures"] == []
    assert report["model"] == "preset:tiny" and report["device"] == "cpu" and report["num_requests"] == 24
    assert report["skipped"] == [{"arm": "vllm", "reason": report["skipped"][0]["reason"]}]
    assert "--vllm-site" in report["skipped"][0]["reason"]
    sizes = report["sizes"]
    # The device cache holds at most a quarter of the working set (--kv-pressure 4, the default).
    # Per user: its 64 distinct tokens, and turn 1's last partial block (8 tokens), which turn 2
    # holds in a full block of other tokens.
    assert sizes["working_set_tokens"] == 16 + 8 * (3 * 16 + 2 * 8 + 8)
    assert sizes["kv_capacity_tokens"] == sizes["num_gpu_blocks"] * 16
    assert sizes["working_set_tokens"] >= 4 * sizes["kv_capacity_tokens"]
    assert sizes["kv_capacity_tokens"] >= sizes["longest_request_tokens"]
    assert sizes["cpu_tier_tokens"] >= sizes["working_set_tokens"]
    assert [a["name"] for a in report["arms"]] == ["prefix-cache", "cpu", "disk", "lmcache"]
    assert [a["hits_from"] for a in report["arms"]] == [None, "cpu", "cpu+disk", "lmcache"]
    # The tier arms' CPU tiers get the same bytes, as does the disk tier (auto: the working set and a quarter).
    extras = [json.loads(a["kv_transfer_config"])["kv_connector_extra_config"] for a in report["arms"][1:3]]
    assert [e["cpu_bytes_to_use"] for e in extras] == [sizes["cpu_tier_bytes"]] * 2
    assert extras[1]["fs_capacity_bytes"] == sizes["disk_tier_bytes"] == sizes["cpu_tier_bytes"]
    assert report["reference_arm"] == "prefix-cache"

    runs = {(r["arm"], r["load"]): r for r in report["runs"]}
    assert len(runs) == len(report["runs"]) == 4 * 2
    for run in report["runs"]:
        assert set(run) == RUN_KEYS and set(run["figures"]) == FIGURE_KEYS
        figures = run["figures"]
        assert set(figures["queue"]) == QUEUE_KEYS
        assert figures["num_requests"] == 24 and figures["num_failed"] == 0
        assert figures["num_output_tokens"] == 24 * 4  # greedy, EOS ignored: exactly max_tokens each
        for name in ("ttft", "e2e"):
            p = figures[name]
            assert p["num_samples"] == 24 and p["p50_ms"] <= p["p90_ms"] <= p["p99_ms"]
        assert figures["tpot"]["p50_ms"] <= figures["tpot"]["p99_ms"]
        assert figures["output_tokens_per_s"] > 0 and figures["total_tokens_per_s"] > figures["output_tokens_per_s"]
        assert run["outputs_equal"] is True and run["num_outputs_differing"] == 0
        s = run["sources"]
        assert s["computed"] + s["device_cache"] + s["connector"] == s["num_prompt_tokens"]
        assert s["num_prompt_tokens"] == figures["num_prompt_tokens"]
        assert s["device_cache"] > 0  # the shared system prompt, at least
        assert len(run["requests"]) == 24
        assert sum(r["num_loaded_tokens"] for r in run["requests"]) == s["connector"]
        # The engine's host seconds by phase over the run: its own steps only (each run's engine
        # steps at least once per output token of its longest request).
        host = run["host"]
        assert host["steps"] >= 4 and all(host[k] >= 0 for k in host)
        assert host["schedule_s"] + host["launch_s"] + host["wait_s"] + host["update_s"] + host["outputs_s"] <= \
            figures["duration_s"]
    # A burst has no arrival window to compare; Poisson arrivals do.
    assert runs[("cpu", "inf")]["figures"]["queue"]["grew"] is None
    assert runs[("cpu", "40")]["figures"]["queue"]["grew"] in (True, False)
    assert runs[("cpu", "40")]["request_rate"] == 40.0 and runs[("cpu", "inf")]["request_rate"] is None
    # The tiers served prompt tokens, each counted under its own source.
    for load in ("40", "inf"):
        assert runs[("prefix-cache", load)]["sources"]["connector"] == 0
        assert runs[("cpu", load)]["sources"]["cpu_tier"] == runs[("cpu", load)]["sources"]["connector"] > 0
        disk = runs[("disk", load)]["sources"]
        assert disk["cpu_tier"] + disk["disk_tier"] == disk["connector"] > 0
        assert runs[("lmcache", load)]["sources"]["remote_store"] == runs[("lmcache", load)]["sources"]["connector"] > 0
        # Every arm got the same Poisson arrival times.
        arrivals = {arm: [r["arrival_s"] for r in runs[(arm, load)]["requests"]] for arm in ("cpu", "lmcache")}
        assert arrivals["cpu"] == arrivals["lmcache"]
    assert "OK:" in result.stdout


def test_each_arms_engine_is_gone_when_the_device_memory_is_returned(chat_trace, monkeypatch):
    """Each kvtool arm's engine is unreferenced by the time its memory is handed back, so the
    next arm and vLLM's process (which checks the free device memory at start) find it free."""
    from kvtool.workloads import serve_bench

    engines, alive_at_free = [], []
    real_engine = serve_bench.LLMEngine

    def tracked_engine(*args, **kwargs):
        engine = real_engine(*args, **kwargs)
        engines.append(weakref.ref(engine))
        return engine

    def free_device_memory():
        gc.collect()
        alive_at_free.append(sum(ref() is not None for ref in engines))

    monkeypatch.setattr(serve_bench, "LLMEngine", tracked_engine)
    monkeypatch.setattr(serve_bench, "free_device_memory", free_device_memory)
    result = invoke("bench", "serve", str(chat_trace), *ENGINE, "--arms", "prefix-cache,cpu",
                    "--request-rate", "inf", "--num-warmups", "0")
    assert result.exit_code == 0, result.output + repr(result.exception)
    assert len(engines) == 2 and alive_at_free == [0, 0]


def test_only_vllm_arms_on_a_cpu_machine_is_one_line_and_exit_2(chat_trace, run_kvtool):
    code, out, err = run_kvtool(["bench", "serve", chat_trace, *ENGINE, "--arms", "vllm,vllm-offload"])
    assert code == 2 and out == ""
    assert "nothing to run: the vLLM arms need a CUDA device" in err and "--vllm-site" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(("args", "message"), [
    (["--arms", "cpu,gpu-tier"], "unknown arm 'gpu-tier' in --arms"),
    (["--arms", "hf"], "arm 'hf' belongs to `bench ttft`"),
    (["--request-rate", "fast"], "--request-rate takes comma-separated positive numbers, inf or trace, got 'fast'"),
    (["--request-rate", "-1"], "--request-rate takes comma-separated positive numbers"),
    (["--request-rate", "trace"], "--request-rate trace needs a trace whose every request has arrival_s"),
    (["--kv-pressure", "64"], "--kv-pressure 64 leaves the device cache"),
    (["--cpu-tier-size", "lots"], "--cpu-tier-size:"),
    (["--max-concurrency", "0"], "--max-concurrency must be at least 1"),
    (["--vllm-site", "/nonexistent", "--arms", "vllm"], "--vllm-site /nonexistent: no vllm package in it"),
    (["--model", "/nonexistent"], "model directory not found"),
])
def test_bad_input_is_one_line_and_exit_2(chat_trace, run_kvtool, args, message):
    code, out, err = run_kvtool(["bench", "serve", chat_trace, *ENGINE, "--arms", "prefix-cache", *args])
    assert code == 2 and out == "", err
    assert message in err and err.strip().count("\n") == 0 and "Traceback" not in err


def test_a_missing_trace_is_one_line_and_exit_2(tmp_path, run_kvtool):
    code, _, err = run_kvtool(["bench", "serve", tmp_path / "none.jsonl", *ENGINE, "--arms", "prefix-cache"])
    assert code == 2 and "trace file not found" in err and err.strip().count("\n") == 0
