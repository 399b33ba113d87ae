"""`kvtool bench ttft` and `kvtool bench throughput` on the tiny preset on CPU.

Timings are never asserted (machines are noisy): the tests check the report's structure, the
validity flags, the hit proofs and output identity, and that the figure is written.
"""

import json

from typer.testing import CliRunner

from kvtool.cli import app

ENGINE = ["--preset", "tiny", "--load-format", "dummy", "--device", "cpu", "--kv-cache-memory", "64M"]
# Stores every block, never loads one: an arm whose hits are removed.
NO_LOADS = json.dumps({"kv_connector": "OffloadingConnector", "kv_role": "kv_producer"})
CELL_KEYS = {
    "arm", "prompt_len", "hit_fraction", "concurrency", "repeats", "valid", "invalid_reason", "ttft_ms",
    "cold_ttft_ms", "speedup_vs_none", "hit_source", "shared_prefix_tokens", "expected_hit_tokens", "hit_tokens",
    "local_cached_tokens", "loaded_tokens", "bytes_loaded", "output_equal", "note",
}


def bench(*args: str):
    return CliRunner().invoke(app, ["bench", *args])


def test_ttft_grid_proves_hits_and_flags_an_arm_without_them(lmcache_server, tmp_path):
    out, png = tmp_path / "ttft.json", tmp_path / "ttft.png"
    result = bench(
        "ttft", *ENGINE, "--prompt-lens", "40,72", "--hit-fractions", "0,0.5,1", "--concurrency", "1,2",
        "--repeats", "2", "--max-tokens", "4", "--arms", "none,prefix-cache,cpu,disk,lmcache,hf,no-loads",
        "--lmcache-url", f"lm://{lmcache_server.host}:{lmcache_server.port}", "--arm", f"no-loads={NO_LOADS}",
        "--json", str(out), "--plot", str(png),
    )
    # The arm without hits makes the run fail, after the report and the figure are written.
    assert result.exit_code == 1, result.output + repr(result.exception)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    report = json.loads(out.read_text())
    assert report["model"] == "preset:tiny"
    cells = report["cells"]
    arms = ["none", "prefix-cache", "cpu", "disk", "lmcache", "hf", "no-loads"]
    assert len(cells) == len(arms) * 2 * 3 * 2
    assert [c["arm"] for c in cells[:: 2 * 3 * 2]] == arms
    for c in cells:
        assert set(c) == CELL_KEYS
        assert isinstance(c["valid"], bool) and c["repeats"] == 2
    for c in cells:
        if c["arm"] == "no-loads":
            continue
        assert c["valid"], c
        assert c["invalid_reason"] is None and c["output_equal"] is True
        assert c["ttft_ms"]["num_samples"] == 2 * c["concurrency"]
        assert c["ttft_ms"]["min_ms"] <= c["ttft_ms"]["median_ms"] <= c["ttft_ms"]["max_ms"]
        assert c["hit_tokens"] == c["expected_hit_tokens"]
        assert c["shared_prefix_tokens"] == round(c["hit_fraction"] * c["prompt_len"])
        if c["arm"] == "none":
            assert c["speedup_vs_none"] == 1.0 and c["hit_source"] is None and c["expected_hit_tokens"] == 0
        else:
            assert c["speedup_vs_none"] > 0
        if c["hit_fraction"] > 0 and c["arm"] != "none":
            assert c["expected_hit_tokens"] > 0
    by_arm = {(c["arm"], c["prompt_len"], c["hit_fraction"], c["concurrency"]): c for c in cells}
    # Where the hits came from: the engine's own counters per arm.
    full = {arm: by_arm[(arm, 72, 1.0, 2)] for arm in arms}
    assert full["prefix-cache"]["local_cached_tokens"] == full["prefix-cache"]["expected_hit_tokens"] == 2 * 2 * 64
    for arm in ("cpu", "disk", "lmcache"):
        assert full[arm]["hit_source"] == arm and full[arm]["loaded_tokens"] == 2 * 2 * 64
        assert full[arm]["local_cached_tokens"] == 0 and full[arm]["bytes_loaded"] > 0
    assert full["hf"]["hit_source"] == "hf" and full["hf"]["hit_tokens"] == 2 * 2 * 71
    # The arm whose hits were removed: invalid wherever a hit was due, and no number for it.
    for c in cells:
        if c["arm"] != "no-loads":
            continue
        if c["hit_fraction"] == 0:
            assert c["valid"]
        else:
            assert not c["valid"] and c["ttft_ms"] is None and c["speedup_vs_none"] is None
            assert c["invalid_reason"].startswith("hits not proven") and c["hit_tokens"] == 0
    assert "INVALID: hits not proven" in result.stdout


def test_throughput_reports_both_engines_on_the_same_workload():
    result = bench("throughput", *ENGINE, "--num-seqs", "6", "--input-len", "8,24", "--output-len", "4,12",
                   "--hf-batch-size", "4", "--json", "-")
    assert result.exit_code == 0, result.output + repr(result.exception)
    report = json.loads(result.stdout)
    assert [r["engine"] for r in report["results"]] == ["kvtool", "hf"]
    ours, hf = report["results"]
    assert ours["num_seqs"] == hf["num_seqs"] == 6
    assert ours["num_prompt_tokens"] == hf["num_prompt_tokens"]
    # EOS is ignored, so every sequence produced exactly its output length.
    assert ours["num_output_tokens"] == hf["num_output_tokens"]
    assert 6 * 4 <= ours["num_output_tokens"] <= 6 * 12
    for r in (ours, hf):
        assert r["output_tokens_per_s"] > 0 and r["total_tokens_per_s"] > r["output_tokens_per_s"]
        assert r["num_cached_prompt_tokens"] == 0  # the timed pass computed every prompt token
    assert report["device"] == "cpu" and report["dtype"] == "float32"
    assert report["model"] == "preset:tiny"  # not the run's temporary directory


def test_throughput_timed_pass_is_cold_after_a_warm_up_over_the_same_prompts(monkeypatch, tmp_path):
    """The CUDA warm-up runs the workload itself: the reset after it keeps the timed pass cold,
    and a timed pass that a cache served anyway is counted and fails the run (exit 1)."""
    from kvtool.workloads import throughput

    def full_warm_up(engine, seqs):
        engine.generate([s.prompt_token_ids for s in seqs],
                        [throughput.SamplingParams(max_tokens=s.output_len, temperature=0.0, ignore_eos=True)
                         for s in seqs])

    monkeypatch.setattr(throughput, "warm_up", full_warm_up)
    args = ("throughput", *ENGINE, "--num-seqs", "4", "--input-len", "40,60", "--output-len", "2,4",
            "--engines", "kvtool")
    cold = bench(*args, "--json", str(tmp_path / "cold.json"))
    assert cold.exit_code == 0, cold.output + repr(cold.exception)
    assert json.loads((tmp_path / "cold.json").read_text())["results"][0]["num_cached_prompt_tokens"] == 0

    monkeypatch.setattr(throughput, "reset_prefix_cache", lambda engine: None)
    warm = bench(*args, "--json", str(tmp_path / "warm.json"))
    assert isinstance(warm.exception, throughput.WarmTimedPass) and warm.exception.exit_code == 1
    cached = json.loads((tmp_path / "warm.json").read_text())["results"][0]["num_cached_prompt_tokens"]
    assert cached >= 4 * 32  # at least two full blocks of every prompt
    assert f"served {cached} prompt tokens from a cache" in str(warm.exception)


def test_ttft_redis_arms_start_their_stores_and_prove_their_hits(tmp_path):
    out = tmp_path / "ttft.json"
    result = bench("ttft", *ENGINE, "--prompt-lens", "72", "--hit-fractions", "0,1", "--concurrency", "2",
                   "--repeats", "1", "--max-tokens", "4", "--arms", "none,redis,redis-cluster,redis-sentinel", "--json",
                   str(out))
    assert result.exit_code == 0, result.output + repr(result.exception)
    cells = {(c["arm"], c["hit_fraction"]): c for c in json.loads(out.read_text())["cells"]}
    for arm in ("redis", "redis-cluster", "redis-sentinel"):
        full = cells[(arm, 1.0)]
        assert full["valid"] and full["output_equal"] and full["hit_source"] == arm.removesuffix("-sentinel")
        assert full["loaded_tokens"] == full["expected_hit_tokens"] == 2 * 64 and full["bytes_loaded"] > 0
        assert cells[(arm, 0.0)]["valid"]
