"""Connectors under tensor parallelism, end to end: 2 ranks in 2 worker processes over gloo.

With a connector on, TP=2 gives the tokens of TP=2 without one: when filling, after an
in-process restart (a new engine, empty prefix cache) and in a cold second process. A TP-2
LMCache peer's chunks (transformers' KV sliced by KV head, LMCache's own keys and client) load
into kvtool at TP=2 with the output of no connector.
"""

from __future__ import annotations

import json
import subprocess

import pytest

from kvtool.engine.connectors.config import parse_kv_transfer_config
from kvtool.engine.connectors.lmcache.stores.protocol import tensor_buffer
from kvtool.engine.engine import LLMEngine
from kvtool.engine.params import EngineParams, SamplingParams
from tests.conftest import kvtool_cmd
from tests.engine.connectors.lmcache.test_lmcache_tp import CS, hf_kv, peer_keys, tiny_identity
from tests.support.peer_server import finish_client, run_lmcache_client
from tests.support.tp_ranks import head_slice

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def prompt(n, seed):
    return [(i * 13 + seed * 101) % 240 + 5 for i in range(n)]


def run(model, prompts, ktc=None):
    params = EngineParams(model=str(model), device="cpu", kv_cache_memory=64 << 20, max_model_len=1024,
                          tensor_parallel_size=2, kv_transfer_config=parse_kv_transfer_config(ktc) if ktc else None)
    with LLMEngine(params) as engine:
        results = engine.generate(prompts, GREEDY)
        engine.flush_connector()
    return results


def connector_config(kind, lmcache_server, tmp_path) -> str:
    if kind == "lmcache":
        extra = {"host": lmcache_server.host, "port": lmcache_server.port, "hash_algo": "vllm"}
        return json.dumps({"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both",
                           "kv_load_failure_policy": "fail", "kv_connector_extra_config": extra})
    return json.dumps({"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_load_failure_policy": "fail",
                       "kv_connector_extra_config": {"num_cpu_blocks": 64, "root_dir": str(tmp_path / "tier")}})


@pytest.mark.parametrize("kind", ["lmcache", "offload"])
def test_tp2_with_a_connector_equals_tp2_without(kind, tiny_model_dir, lmcache_server, tmp_path, cli_env):
    prompts = [prompt(600, 11 if kind == "lmcache" else 12), prompt(300, 13 if kind == "lmcache" else 14)]
    ref = [r.output_token_ids for r in run(tiny_model_dir, prompts)]
    ktc = connector_config(kind, lmcache_server, tmp_path)
    filled = run(tiny_model_dir, prompts, ktc)
    assert [r.output_token_ids for r in filled] == ref
    assert all(r.stats.num_external_stored_tokens > 0 for r in filled)
    again = run(tiny_model_dir, prompts, ktc)  # an in-process restart
    assert [r.output_token_ids for r in again] == ref
    loaded = [r.stats.num_external_loaded_tokens for r in again]
    assert all(n > 0 for n in loaded)
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in prompts))
    out = subprocess.run(
        kvtool_cmd() + ["generate", "--model", str(tiny_model_dir), "--prompt-file", str(f), "--json",
                        "--max-tokens", "6", "--ignore-eos", "--device", "cpu", "--kv-cache-memory", "64M",
                        "--max-model-len", "1024", "--tensor-parallel-size", "2", "--kv-transfer-config", ktc],
        env=cli_env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    cold = json.loads(out.stdout)["requests"]
    assert [r["output_token_ids"] for r in cold] == ref
    assert [r["num_external_tokens"] for r in cold] == loaded


def test_tp2_loads_a_tp2_lmcache_peers_chunks_with_the_output_of_no_connector(lmcache_server, tiny_model_dir,
                                                                           tmp_path):
    identity = tiny_identity(tiny_model_dir)
    g = identity.geometry
    p = prompt(600, 15)
    (keys_0,), (keys_1,) = peer_keys(identity, [p], 2)
    kv = hf_kv(tiny_model_dir, p[: 2 * CS])
    manifest = {"put": []}
    for r, keys in enumerate((keys_0, keys_1)):
        for i in range(2):
            f = tmp_path / f"chunk-{r}-{i}.bin"
            f.write_bytes(tensor_buffer(head_slice(kv[:, :, i * CS : (i + 1) * CS], 2, g.head_dim, 2, r)))
            manifest["put"].append({"key": keys[i], "shape": [2, g.num_layers, CS, g.head_dim], "dtype": "float32",
                                    "file": str(f)})
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    answer = finish_client(run_lmcache_client("batch", lmcache_server.host, str(lmcache_server.port),
                                              str(tmp_path / "manifest.json")))
    assert answer["stored"] == [True] * 4
    ref = run(tiny_model_dir, [p])[0]
    ktc = connector_config("lmcache", lmcache_server, tmp_path)
    r = run(tiny_model_dir, [p], ktc)[0]
    assert r.stats.num_external_loaded_tokens == 2 * CS and r.error is None
    assert r.output_token_ids == ref.output_token_ids
