"""`kvtool generate` over a booby-trapped disk tier: nothing planted is loaded, nothing breaks.

A block file replaced by a directory, a FIFO or a link to a valid block outside root_dir, or made
unreadable (the reader without capabilities: the tests run as root), used to end in an internal
error or a hang. A directory, FIFO or link is no hit at all (only regular files count), so both
policies answer as without the tier; an unreadable file is a hit that fails to load, so `fail`
ends the request with one line naming the file and `recompute` answers as without the tier.
"""

import json
import os
import subprocess

import pytest

from tests.conftest import REPO, kvtool_cmd

NO_CAPS = ["setpriv", "--bounding-set=-all", "--inh-caps=-all"]
HANG_GUARD_S = 300


def offload_config(root, policy):
    return json.dumps({"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_load_failure_policy": policy,
                       "kv_connector_extra_config": {"root_dir": str(root)}})


PROMPT = [(i * 31) % 240 + 5 for i in range(48)]


def generate(model_dir, env, tmp_path, ktc=None, prefix=()):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt_token_ids": PROMPT}) + "\n")
    cmd = [*prefix, *kvtool_cmd(), "generate", "--model", str(model_dir), "--prompt-file", str(f), "--json",
           "--max-tokens", "4", "--ignore-eos", "--kv-cache-memory", "64M", "--device", "cpu"]
    if ktc:
        cmd += ["--kv-transfer-config", ktc]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S)


def plant(kind, victim, tmp_path):
    if kind == "directory":
        victim.unlink()
        victim.mkdir()
    elif kind == "fifo":
        victim.unlink()
        os.mkfifo(victim)
    elif kind == "outside-link":
        outside = tmp_path / "outside.kvb"
        victim.rename(outside)
        victim.symlink_to(outside)
    elif kind == "unreadable":
        victim.chmod(0)


@pytest.fixture(scope="module")
def expected(tiny_model_dir, tmp_path_factory):
    """The output without any tier."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    ref = generate(tiny_model_dir, env, tmp_path_factory.mktemp("ref"))
    assert ref.returncode == 0, ref.stderr
    return json.loads(ref.stdout)["requests"][0]["output_token_ids"]


@pytest.mark.parametrize("kind", ["directory", "fifo", "outside-link", "unreadable"])
def test_planted_block_is_never_loaded_and_never_breaks(tiny_model_dir, cli_env, tmp_path, kind, expected):
    root = tmp_path / "tier"
    fill = generate(tiny_model_dir, cli_env, tmp_path, offload_config(root, "fail"))
    assert fill.returncode == 0, fill.stderr
    blocks = sorted(root.rglob("*.kvb"), key=lambda f: f.stat().st_mtime_ns)
    assert len(blocks) == 3
    victim = blocks[0]
    plant(kind, victim, tmp_path)
    outside_mtime = (tmp_path / "outside.kvb").stat().st_mtime_ns if kind == "outside-link" else None
    prefix = NO_CAPS if kind == "unreadable" else ()
    try:
        failed = generate(tiny_model_dir, cli_env, tmp_path, offload_config(root, "fail"), prefix)
        recomputed = generate(tiny_model_dir, cli_env, tmp_path, offload_config(root, "recompute"), prefix)
    finally:
        if kind == "unreadable":
            victim.chmod(0o644)
    assert "internal error" not in failed.stderr and "Traceback" not in failed.stderr, failed.stderr
    r = json.loads(failed.stdout)["requests"][0]
    if kind == "unreadable":
        assert r["finish_reason"] == "error", r
        assert "permission denied" in r["error"] and victim.name in r["error"], r["error"]
    else:
        assert failed.returncode == 0, failed.stderr
        assert r["num_external_tokens"] == 0 and r["output_token_ids"] == expected
    if kind == "outside-link":
        assert (tmp_path / "outside.kvb").stat().st_mtime_ns == outside_mtime
    assert recomputed.returncode == 0, recomputed.stderr
    assert json.loads(recomputed.stdout)["requests"][0]["output_token_ids"] == expected
