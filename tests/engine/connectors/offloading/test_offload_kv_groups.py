"""The OffloadingConnector with KV cache groups (Gemma 3, Gemma 2, a windowed Mistral): every
group's chunks stored and loaded under keys ending in the group, a sliding-window group loading
only what its window reads at the hit, the disk tier keeping each group under an identity of its
own, and output with reuse equal bit for bit to output of a cache that keeps every token in one
group with no connector: from the CPU tier, from disk after a restart, and in a cold process.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from kvtool.engine.connectors.config import parse_kv_transfer_config
from kvtool.engine.connectors.offloading.disk.tier_identity import tier_digest
from kvtool.engine.core.block_pool import NULL_BLOCK
from kvtool.engine.engine import LLMEngine
from kvtool.engine.params import EngineParams, SamplingParams
from tests.conftest import kvtool_cmd
from tests.support.window_models import WINDOW_PRESETS, window_model_dir

BS = 16
WINDOW = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
PREFIX = [(i * 37 + 11) % 240 + 5 for i in range(80)]
PROMPTS = [PREFIX + [(i * 13 + k * 7) % 240 + 5 for i in range(n)] for k, n in enumerate((9, 30, 57))]
LONG = [(i * 29 + 3) % 240 + 5 for i in range(300)]


@pytest.fixture(scope="module", params=WINDOW_PRESETS)
def model_dir(request, tmp_path_factory):
    return window_model_dir(tmp_path_factory.mktemp("offload-groups"), request.param, WINDOW)


def _ktc(root: Path, obt: int = BS, **extra) -> str:
    return json.dumps({"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                       "kv_connector_extra_config": {"num_cpu_blocks": 256, "offload_block_tokens": obt,
                                                     "root_dir": str(root), **extra}})


def _engine(model_dir, ktc: str | None = None, **overrides) -> LLMEngine:
    params = {"model": str(model_dir), "device": "cpu", "kv_cache_memory": 16 << 20, "max_model_len": 512,
              "max_num_batched_tokens": 64, "block_size": BS, "enable_prefix_caching": False, **overrides}
    if ktc is not None:
        params["kv_transfer_config"] = parse_kv_transfer_config(ktc)
    return LLMEngine(EngineParams(**params))


def _reference(model_dir, prompts) -> list:
    """Every token kept in one full-attention group, no connector, no prefix cache (for the
    windowed Mistral, whose window group the unified flag keeps, a one-group connector's layout)."""
    engine = _engine(model_dir, disable_hybrid_kv_cache_manager=True)
    if engine.kv_layout.hybrid:
        engine.close()
        ktc = json.dumps({"kv_connector": "DictConnector", "kv_role": "kv_both",
                          "kv_connector_module_path": "tests.support.connectors.dict_connector"})
        engine = _engine(model_dir, ktc)
    try:
        assert not engine.kv_layout.hybrid
        return engine.generate(prompts, GREEDY)
    finally:
        engine.close()


def _same(got, expected) -> None:
    assert [r.output_token_ids for r in got] == [r.output_token_ids for r in expected]
    assert [r.logprobs for r in got] == [r.logprobs for r in expected]


@pytest.mark.parametrize("obt", [BS, 2 * BS])
def test_every_group_offloads_and_reloads_the_reference_bits(model_dir, tmp_path, obt):
    """CPU-tier hits in one engine, then disk hits in a new engine on the same tier (its CPU
    tier empty), with chunked prefill of 64 tokens and offload blocks of one and two engine blocks."""
    prompts = PROMPTS + [LONG]
    expected = _reference(model_dir, prompts)
    root = tmp_path / "tier"
    engine = _engine(model_dir, _ktc(root, obt))
    try:
        layout = engine.kv_layout
        assert layout.hybrid  # the connector keeps the model's groups
        first = engine.generate(prompts, GREEDY)
        again = engine.generate(prompts, GREEDY)
        engine.executor.worker.connector.flush()
        engine.check_integrity()
    finally:
        engine.close()
    restarted = _engine(model_dir, _ktc(root, obt))
    try:
        from_disk = restarted.generate(prompts, GREEDY)
        stats = restarted.stats()
        restarted.check_integrity()
    finally:
        restarted.close()
    for got in (first, again, from_disk):
        _same(got, expected)
    hit = [min(len(p) // obt * obt, len(p) - 1) for p in prompts]
    assert [r.stats.num_external_tokens for r in again] == hit
    assert [r.stats.num_external_tokens for r in from_disk] == hit
    assert stats.external_tokens_loaded_from_disk > 0
    assert stats.external_tokens_loaded == sum(-(-h // BS) * BS for h in hit)
    # Every group's chunks are on disk, each group under its own identity directory.
    tier_dirs = [p.name for p in (root / "kv").iterdir() if p.is_dir()]
    assert len(tier_dirs) == layout.num_groups
    # A sliding-window group reads only its window at the hit: far fewer bytes than every
    # group's every block of the hit.
    per_block = restarted.executor.worker.kv_pages.block_bytes
    everything = layout.num_groups * sum(-(-h // BS) for h in hit) * per_block
    assert stats.bytes_loaded < everything


def test_window_groups_hold_the_null_block_below_the_hit_window(model_dir, tmp_path):
    """Admitted with a 288-token hit, each sliding-window group's table holds the null block below
    its window at the hit (vLLM's allocation for a connector's hit), every full group real blocks
    for the whole hit; the loads fill exactly the real entries."""
    root = tmp_path / "tier"
    writer = _engine(model_dir, _ktc(root))
    try:
        writer.generate([LONG], GREEDY)
        writer.executor.worker.connector.flush()
    finally:
        writer.close()
    reader = _engine(model_dir, _ktc(root))
    try:
        layout = reader.kv_layout
        rid = reader.add_request(LONG, GREEDY)
        out = reader.scheduler.schedule()  # the admission step, before any result frees a block
        req = reader.scheduler.requests[rid]
        assert req.num_external_tokens == 288
        loaded = {b for job in out.connector_meta.loads for b in job.block_ids}
        for table, group in zip(req.group_block_ids, layout.groups):
            real = [i for i, b in enumerate(table[:288 // BS]) if b != NULL_BLOCK]
            first = 0 if group.sliding_window is None else (288 - group.sliding_window + 1) // BS
            assert real == list(range(first, 288 // BS)), group
            assert {table[i] for i in real} <= loaded
        assert NULL_BLOCK not in loaded
    finally:
        reader.close()


def test_group_identities_name_the_layout(model_dir, tmp_path):
    """One group keeps the tier's identity (tiers written before groups stay readable); each of
    several groups has its own, naming its layers and window, so no group reads another's chunk."""
    engine = _engine(model_dir, _ktc(tmp_path / "tier"))
    try:
        layout = engine.kv_layout
        identities = [t.identity for t in engine.executor.worker.connector.disk.tiers]
    finally:
        engine.close()
    assert len(identities) == layout.num_groups
    if layout.num_groups == 1:
        assert identities[0].byte_layout == "block_major"
        assert identities[0].num_layers == layout.num_layers
        return
    assert len({tier_digest(i) for i in identities}) == layout.num_groups
    for g, (identity, group) in enumerate(zip(identities, layout.groups)):
        layers = ",".join(map(str, group.layers))
        assert identity.byte_layout == (f"block_major kv_cache_group {g} of {layout.num_groups}: layers {layers} "
                                        f"in {layout.num_slots} slots")
        assert identity.sliding_window == group.sliding_window
        assert identity.num_layers == layout.num_slots


def test_cold_process_loads_every_group_from_disk(model_dir, cli_env, tmp_path):
    """`kvtool generate` in fresh processes: the second loads the first's chunks of every group
    from disk and prints the tokens of a process with one full group and no connector."""
    root = tmp_path / "tier"
    prompts = [LONG, PROMPTS[2]]
    f = tmp_path / "prompts.jsonl"
    f.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in prompts))

    def run(*extra: str) -> list[dict]:
        cmd = kvtool_cmd() + ["generate", "--model", str(model_dir), "--prompt-file", str(f), "--json",
                              "--max-tokens", "16", "--ignore-eos", "--kv-cache-memory", "16M", "--device", "cpu",
                              "--max-model-len", "512", "--no-enable-prefix-caching", *extra]
        out = subprocess.run(cmd, env=cli_env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)["requests"]

    ref = run("--disable-hybrid-kv-cache-manager", "--kv-transfer-config",
              json.dumps({"kv_connector": "DictConnector", "kv_role": "kv_both",
                          "kv_connector_module_path": "tests.support.connectors.dict_connector"}))
    a = run("--kv-transfer-config", _ktc(root))
    b = run("--kv-transfer-config", _ktc(root))
    assert [r["num_external_tokens"] for r in a] == [0, 0]
    assert [r["num_external_tokens"] for r in b] == [288, 128]
    assert [r["output_token_ids"] for r in a] == [r["output_token_ids"] for r in b] == [r["output_token_ids"] for r in ref]


def test_inspect_shows_each_groups_layout_and_what_loads(model_dir, tmp_path, run_kvtool):
    """`kvtool inspect` lists one identity group per KV cache group (its layers, window and KV
    dtype), and with --model says every one loads into an engine of the same groups and none
    into one that keeps every token in one group."""
    root = tmp_path / "tier"
    engine = _engine(model_dir, _ktc(root))
    try:
        layout = engine.kv_layout
        engine.generate([LONG], GREEDY)
        engine.executor.worker.connector.flush()
    finally:
        engine.close()
    args = ["inspect", str(root), "--json", "--model", str(model_dir), "--max-model-len", "512", "--device", "cpu",
            "--kv-transfer-config", _ktc(root)]
    code, out, err = run_kvtool(args)
    assert code == 0, err
    report = json.loads(out)
    assert len(report["groups"]) == layout.num_groups
    windows = sorted((g["identity"]["sliding_window"] or 0) for g in report["groups"])
    assert windows == sorted((g.sliding_window or 0) for g in layout.groups)
    assert all(g["identity"]["kv_dtype"] == "float32" for g in report["groups"])
    if layout.num_groups > 1:
        assert {g["identity"]["byte_layout"].split(":")[0] for g in report["groups"]} == {
            f"block_major kv_cache_group {i} of {layout.num_groups}" for i in range(layout.num_groups)}
    assert all(v["loadable"] for v in report["loadability"])
    code, out, err = run_kvtool(args + ["--disable-hybrid-kv-cache-manager"])
    assert code == 0, err
    unified = json.loads(out)["loadability"]
    assert not any(v["loadable"] for v in unified) or layout.num_groups == 1
