"""OffloadingConnector: CPU + disk tier across restarts, identity refusal, damage, capacity."""

import json
import subprocess
from pathlib import Path

import pytest

from kvtool.engine.connectors.config import parse_kv_transfer_config
from kvtool.engine.params import SamplingParams
from tests.conftest import kvtool_cmd

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def offload_config(root=None, policy="fail", **extra):
    doc = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_load_failure_policy": policy,
           "kv_connector_extra_config": dict(extra, **({"root_dir": str(root)} if root else {}))}
    return json.dumps(doc)


def prompt(n, seed=0):
    return [(i * 31 + seed * 17) % 240 + 5 for i in range(n)]


def test_cpu_tier_hits_within_one_engine(make_engine):
    ref = make_engine().generate([prompt(80)], GREEDY)[0]
    engine = make_engine(kv_transfer_config=parse_kv_transfer_config(offload_config()), enable_prefix_caching=False)
    first = engine.generate([prompt(80)], GREEDY)[0]
    second = engine.generate([prompt(80)], GREEDY)[0]
    assert first.stats.num_external_stored_tokens == 80
    # A full hit: every block loaded, only the last token computed.
    assert second.stats.num_external_tokens == 79 and second.stats.num_external_loaded_tokens == 80
    assert first.output_token_ids == second.output_token_ids == ref.output_token_ids


def _generate_process(env, model_dir, prompts, ktc, tmp_path, name, kv_cache_dtype="auto"):
    f = tmp_path / f"{name}.jsonl"
    f.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in prompts))
    cmd = kvtool_cmd() + ["generate", "--model", str(model_dir), "--prompt-file", str(f), "--json",
                          "--max-tokens", "8", "--ignore-eos", "--kv-cache-memory", "64M", "--device", "cpu",
                          "--kv-cache-dtype", kv_cache_dtype]
    if ktc:
        cmd += ["--kv-transfer-config", ktc]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    return out


@pytest.mark.parametrize("lengths,kv_cache_dtype", [([48], "auto"), ([2000, 700, 1500], "auto"),
                                                    ([2000, 700, 1500], "fp8")])
def test_restart_cold_process_promotes_from_disk(tiny_model_dir, cli_env, tmp_path, lengths, kv_cache_dtype):
    root = tmp_path / "tier"
    prompts = [prompt(n, seed=i) for i, n in enumerate(lengths)]
    ref = _generate_process(cli_env, tiny_model_dir, prompts, None, tmp_path, "ref", kv_cache_dtype)
    assert ref.returncode == 0, ref.stderr
    a = _generate_process(cli_env, tiny_model_dir, prompts, offload_config(root), tmp_path, "a", kv_cache_dtype)
    assert a.returncode == 0, a.stderr
    b = _generate_process(cli_env, tiny_model_dir, prompts, offload_config(root), tmp_path, "b", kv_cache_dtype)
    assert b.returncode == 0, b.stderr
    ref_r, a_r, b_r = (json.loads(x.stdout)["requests"] for x in (ref, a, b))
    for n, r0, ra, rb in zip(lengths, ref_r, a_r, b_r):
        assert ra["num_external_tokens"] == 0
        # Every whole block, up to the last prompt token: 48 tokens -> 47 (all 3 blocks, the
        # last computed), 700 -> 688 (the partial block is computed).
        assert rb["num_external_tokens"] == min(n // 16 * 16, n - 1)
        assert rb["num_cached_tokens"] == 0
        assert r0["output_token_ids"] == ra["output_token_ids"] == rb["output_token_ids"]


def test_tiny_cpu_pool_still_loads_through_promotion(make_engine, tmp_path):
    root = tmp_path / "tier"
    p = prompt(200)
    ref = make_engine().generate([p], GREEDY)[0]
    writer = make_engine(kv_transfer_config=parse_kv_transfer_config(offload_config(root)))
    writer.generate([p], GREEDY)
    writer.executor.worker.connector.flush()
    # One CPU slot for 12 blocks: every load goes disk -> slot (or staging) -> pages.
    reader = make_engine(kv_transfer_config=parse_kv_transfer_config(offload_config(root, num_cpu_blocks=1)))
    r = reader.generate([p], GREEDY)[0]
    assert r.stats.num_external_loaded_tokens == 192
    assert r.output_token_ids == ref.output_token_ids


def test_disk_capacity_is_never_exceeded(make_engine, tmp_path):
    root = tmp_path / "tier"
    engine = make_engine(kv_transfer_config=parse_kv_transfer_config(offload_config(root, fs_capacity_bytes=200_000)))
    for i in range(6):
        engine.generate([prompt(100, seed=i)], GREEDY)
        engine.executor.worker.connector.flush()
        total = sum(f.stat().st_size for f in root.rglob("*.kvb"))
        assert total <= 200_000
    assert total > 0


def _tier_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.kvb"))


def test_damaged_files_are_never_loaded(make_engine, tmp_path, cli_env):
    root = tmp_path / "tier"
    p = prompt(80)
    ref = make_engine().generate([p], GREEDY)[0]
    w = make_engine(kv_transfer_config=parse_kv_transfer_config(offload_config(root)))
    w.generate([p], GREEDY)
    w.executor.worker.connector.flush()
    files = _tier_files(root)
    assert len(files) == 5
    # A flipped payload byte in the second block.
    victim = sorted(files, key=lambda f: f.stat().st_mtime_ns)[1]
    data = bytearray(victim.read_bytes())
    data[-10] ^= 0xFF
    victim.write_bytes(bytes(data))
    verify = subprocess.run(kvtool_cmd() + ["inspect", str(root), "--verify", "--json"], env=cli_env,
                            capture_output=True, text=True, timeout=120)
    assert verify.returncode == 1, verify.stderr
    assert "torn" in verify.stdout
    fail = make_engine(kv_transfer_config=parse_kv_transfer_config(offload_config(root, policy="fail")))
    r = fail.generate([p], GREEDY)[0]
    assert r.finish_reason == "error" and "checksum" in r.error.lower()
    rec = make_engine(kv_transfer_config=parse_kv_transfer_config(offload_config(root, policy="recompute")))
    r2 = rec.generate([p], GREEDY)[0]
    assert r2.output_token_ids == ref.output_token_ids
    assert r2.stats.num_external_tokens == 16  # only the block before the damaged one


def test_two_processes_share_one_root_dir(tiny_model_dir, cli_env, tmp_path):
    root = tmp_path / "tier"
    prompts = [prompt(300, seed=i) for i in range(3)]
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in prompts))
    cmd = kvtool_cmd() + ["generate", "--model", str(tiny_model_dir), "--prompt-file", str(f), "--json",
                          "--max-tokens", "2", "--device", "cpu", "--kv-cache-memory", "64M",
                          "--kv-transfer-config", offload_config(root)]
    procs = [subprocess.Popen(cmd, env=cli_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err.decode()
    verify = subprocess.run(kvtool_cmd() + ["inspect", str(root), "--verify", "--json"], env=cli_env,
                            capture_output=True, text=True, timeout=120)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert len(_tier_files(root)) == 3 * (300 // 16)
    assert not [x for x in root.rglob("*") if x.is_file() and ".tmp" in x.name]


def test_flush_frees_the_tier_slots_its_stores_held(make_engine, tmp_path):
    """Store jobs pin their CPU slots until the worker reports them done (after the disk write):
    flush_connector() reports them at once, so the next request finds every slot free again."""
    engine = make_engine(kv_transfer_config=parse_kv_transfer_config(offload_config(tmp_path / "tier", num_cpu_blocks=4)))
    one = SamplingParams(max_tokens=1, temperature=0.0)  # ends in the step that stores: no later step reports
    first = engine.generate([prompt(70, seed=1)], one)[0]
    assert first.stats.num_external_stored_tokens == 64
    engine.flush_connector()
    assert engine.scheduler.connector.slots.num_pinned == 0
    second = engine.generate([prompt(70, seed=2)], one)[0]
    assert second.stats.num_external_stored_tokens == 64  # all four slots were free for it
