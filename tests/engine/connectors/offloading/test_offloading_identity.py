"""A disk tier written under one engine setting is refused under another, naming the fields.

Block files live under a directory named by the identity's digest, so another setting simply
misses them. These tests move the files to where the other engine looks (as a copied or
tampered tier would be) to prove the header check itself refuses them: never loaded, an error
under `fail`, and output equal to a run without a connector under `recompute`.
(tests/engine/connectors/offloading/disk/test_disk_tier.py covers every compared identity field at the header level.)
"""

import json
import os
import shutil

import pytest
import safetensors.torch

from kvtool.engine.connectors.config import parse_kv_transfer_config
from kvtool.engine.params import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
PROMPT = [(i * 11) % 240 + 5 for i in range(70)]


def ktc(root, policy):
    return parse_kv_transfer_config(json.dumps(
        {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_load_failure_policy": policy,
         "kv_connector_extra_config": {"root_dir": str(root)}}))


def _variant(name, base, tmp_path):
    """(engine overrides, fields expected in the refusal) for one setting that differs."""
    if name == "dtype":
        return {"dtype": "bfloat16"}, ["kv_dtype", "element_size"]
    d = tmp_path / f"model-{name}"
    if name == "model_name":
        os.symlink(base, d)  # the same files under another --model string
        return {"model": str(d)}, ["model_name"]
    shutil.copytree(base, d)
    if name == "weights":
        weights = safetensors.torch.load_file(d / "model.safetensors")
        key = next(k for k in weights if k.endswith("input_layernorm.weight"))
        weights[key] = weights[key] * 1.01
        safetensors.torch.save_file(weights, d / "model.safetensors")
        return {"model": str(d)}, ["weights_digest"]
    cfg = json.loads((d / "config.json").read_text())
    if name == "rope":
        cfg["rope_theta"] = cfg.get("rope_theta", 10000) * 2
        fields = ["rope_digest", "config_digest"]
    else:  # config
        cfg["rms_norm_eps"] = cfg["rms_norm_eps"] * 10
        fields = ["config_digest"]
    (d / "config.json").write_text(json.dumps(cfg))
    return {"model": str(d)}, fields


@pytest.mark.parametrize("setting", ["model_name", "dtype", "weights", "rope", "config"])
def test_foreign_tier_is_refused_naming_fields(setting, make_engine, tiny_model_dir, tmp_path):
    root = tmp_path / "tier"
    writer = make_engine(kv_transfer_config=ktc(root, "fail"))
    writer.generate([PROMPT], GREEDY)
    writer.executor.worker.connector.flush()
    written = root / "kv" / writer.executor.worker.connector.disk.tiers[0].digest
    overrides, fields = _variant(setting, tiny_model_dir, tmp_path)
    ref = make_engine(**{k: v for k, v in overrides.items()}).generate([PROMPT], GREEDY)[0]
    for policy in ("fail", "recompute"):
        reader = make_engine(kv_transfer_config=ktc(root, policy), **overrides)
        target = root / "kv" / reader.executor.worker.connector.disk.tiers[0].digest
        assert target != written  # another identity looks elsewhere...
        if not target.exists() or not any(target.rglob("*.kvb")):
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(written, target)  # ...so put the foreign files where it looks
            reader.scheduler.connector.disk.refresh()  # (what its background listing would find)
        r = reader.generate([PROMPT], GREEDY)[0]
        if policy == "fail":
            assert r.finish_reason == "error" and r.output_token_ids == []
            for field in fields:
                assert field in r.error, (field, r.error)
        else:
            assert r.output_token_ids == ref.output_token_ids
            assert r.stats.num_external_loaded_tokens == 0
