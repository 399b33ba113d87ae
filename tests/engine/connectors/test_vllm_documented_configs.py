"""The example configs vLLM 0.33 documents for `--kv-transfer-config`, row by row: each one vLLM
accepts runs in `kvtool generate` and `kvtool serve` as written (the bare `8G` included), and
each one it rejects is refused in one line with exit status 2."""

from __future__ import annotations

import subprocess

import openai
import pytest

from tests.conftest import kvtool_cmd
from tests.support.server_process import ServerProcess

TIER_DIR = "TIER_DIR"  # replaced by a temporary directory (vLLM's example says /mnt/kv_cache)

# (row, config, runs): vLLM's table of example configs.
ROWS = [
    ("native CPU offload, 8 GiB in total",
     '{"kv_connector":"OffloadingConnector","kv_role":"kv_both","kv_connector_extra_config":{"cpu_bytes_to_use":8589934592}}',
     True),
    ("the same, using the size shorthand",
     '{"kv_connector":"OffloadingConnector","kv_role":"kv_both","kv_connector_extra_config":{"cpu_bytes_to_use":8G}}',
     True),
    ("offload in 64-token chunks, ARC eviction",
     '{"kv_connector":"OffloadingConnector","kv_role":"kv_both","kv_connector_extra_config":'
     '{"cpu_bytes_to_use":1000000000,"block_size":64,"eviction_policy":"arc"}}',
     True),
    ("CPU tier plus fs tier",
     '{"kv_connector":"OffloadingConnector","kv_role":"kv_both","kv_connector_extra_config":'
     '{"spec_name":"TieringOffloadingSpec","cpu_bytes_to_use":10737418240,'
     '"secondary_tiers":[{"type":"fs","root_dir":"TIER_DIR"}]}}',
     True),
    ("LMCache in-process connector",
     '{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both"}', True),
    ("LMCache with an interoperable hash",
     '{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both",'
     '"kv_connector_extra_config":{"lmcache.pre_caching_hash_algorithm":"sha256_cbor"}}',
     True),
    ("rejected: unknown key", '{"kv_connector":"OffloadingConnector","kv_role":"kv_both","kv_ip":"127.0.0.1"}', False),
    ("rejected: connector without a role", '{"kv_connector":"OffloadingConnector"}', False),
    # vLLM accepts this one when it parses the flag and fails at engine start; so does kvtool, at once.
    ("fails at engine start", '{"kv_connector":"SharedStorageConnector","kv_role":"kv_both"}', False),
]
PROMPT = "The cat sat on the mat, and the dog lay by the door, and the bird sang in the tree all day long."


@pytest.fixture
def run_env(lmcache_server, cli_env):
    # LMCache's settings come from the environment, as LMCACHE_* do for vLLM's connector.
    env = dict(cli_env, KVTOOL_LMCACHE_HOST=lmcache_server.host, KVTOOL_LMCACHE_PORT=str(lmcache_server.port))
    return env


@pytest.mark.parametrize("row, config, runs", ROWS, ids=[r[0] for r in ROWS])
def test_vllm_example_config_in_generate(row, config, runs, tiny_model_dir, tmp_path, run_env):
    config = config.replace(TIER_DIR, str(tmp_path / "kv_cache"))
    out = subprocess.run(kvtool_cmd() + ["generate", "--model", str(tiny_model_dir), "--device", "cpu",
                                         "--kv-cache-memory", "64M", "--prompt", PROMPT, "--max-tokens", "3",
                                         "--kv-transfer-config", config],
                         env=run_env, capture_output=True, text=True, timeout=300)
    if runs:
        assert out.returncode == 0, out.stderr
    else:
        assert out.returncode == 2, out.stderr
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: invalid --kv-transfer-config"), out.stderr


def test_vllm_example_configs_in_serve(tiny_model_dir, tmp_path, run_env):
    for row, config, runs in ROWS:
        if not runs:
            continue
        config = config.replace(TIER_DIR, str(tmp_path / row.replace(" ", "-")))
        flags = [str(tiny_model_dir), "--device", "cpu", "--kv-cache-memory", "64M", "--kv-transfer-config", config]
        with ServerProcess(flags, env={k: v for k, v in run_env.items() if k.startswith("KVTOOL_LMCACHE")}) as srv:
            client = openai.OpenAI(base_url=srv.base_url, api_key="x", max_retries=0, timeout=120)
            answers = [client.completions.create(model=str(tiny_model_dir), prompt=PROMPT, max_tokens=3,
                                                 temperature=0.0) for _ in range(2)]
        assert answers[0].choices[0].text == answers[1].choices[0].text, row
