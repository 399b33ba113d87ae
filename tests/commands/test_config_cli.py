"""Hostile configs through the CLI: exit 2 and one line naming the key, before anything runs."""

import json
import subprocess

import pytest

from tests.conftest import kvtool_cmd


def offload(extra, **fields):
    return json.dumps({"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                       "kv_connector_extra_config": extra, **fields})


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--kv-transfer-config", '{"kv_connector":"OffloadingConnector","kv_role":"kv_both",'
                                  '"kv_connector_extra_config":{"cpu_bytes_to_use":1.5G}}'],
         "Decimals are not allowed with binary suffixes like G"),
        (["--kv-transfer-config", '{"kv_connector":"OffloadingConnector","kv_role":'], "malformed JSON"),
        (["--kv-transfer-config.kv_role"], "--kv-transfer-config.kv_role needs a value"),
        (["--kv-transfer-config.kv_connector", "OffloadingConnector"], "kv_role is required"),
        (["--kv-offloading-size", "0"], "--kv-offloading-size must be a positive number of GiB"),
        (["--kv-offloading-size", "1", "--kv-offloading-backend", "disk"], "--kv-offloading-backend must be one of"),
        (["--kv-transfer-config", offload({"root_dri": "kv-tier"})], "did you mean root_dir?"),
        (["--kv-transfer-config", offload({"num_cpu_blocks": 10**12})], "num_cpu_blocks must be an integer"),
        (["--kv-transfer-config", offload({}, engine_id="e" * 70_000)], "engine_id must be 1 to 256"),
        (["--kv-cache-memory", "9" * 5000 + "G"], "--kv-cache-memory: not a size"),
        (["--kv-cache-memory", "1" + "0" * 399], "--kv-cache-memory: not a size"),
    ],
)
def test_bad_configs_exit_2_with_one_line(tiny_model_dir, cli_env, flags, needle):
    out = subprocess.run(kvtool_cmd() + ["generate", "--model", str(tiny_model_dir), "--device", "cpu",
                                         "--prompt", "hello", "--max-tokens", "2"] + flags,
                         env=cli_env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], out.stderr
    assert "Traceback" not in out.stderr


def test_kv_offloading_size_replaces_a_given_connector_and_says_so(tiny_model_dir, cli_env):
    out = subprocess.run(kvtool_cmd() + ["generate", "--model", str(tiny_model_dir), "--device", "cpu", "--json",
                                         "--prompt", "hello", "--max-tokens", "2", "--kv-offloading-size", "0.01",
                                         "--kv-transfer-config",
                                         '{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_consumer"}'],
                         env=cli_env, capture_output=True, text=True, timeout=300)
    # The LMCache connector would need a server; the OffloadingConnector that replaced it does not.
    assert out.returncode == 0, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "--kv-offloading-backend native replaces kv_connector 'LMCacheConnectorV1'" in lines[0]
    assert json.loads(out.stdout)["requests"][0]["finish_reason"] == "length"
