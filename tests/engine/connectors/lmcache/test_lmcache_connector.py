"""LMCacheConnector end to end against LMCache's own server (started from the peer environment)."""

import json
import subprocess

import pytest
import torch

from kvtool.engine.connectors.config import parse_kv_transfer_config
from kvtool.engine.connectors.lmcache.keys import LMCacheKeySettings, make_chunk_keys
from kvtool.engine.connectors.lmcache.stores.lm_client import LMClient
from kvtool.engine.connectors.lmcache.stores.protocol import MemoryFormat, dtype_code, tensor_buffer
from kvtool.engine.errors import PeerError
from kvtool.engine.params import SamplingParams
from tests.conftest import kvtool_cmd

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def lm_config(server, policy="fail", role="kv_both", **extra):
    doc = {"kv_connector": "LMCacheConnectorV1", "kv_role": role, "kv_load_failure_policy": policy,
           "kv_connector_extra_config": {"host": server.host, "port": server.port, "hash_algo": "vllm", **extra}}
    return json.dumps(doc)


def prompt(n, seed):
    return [(i * 13 + seed * 101) % 240 + 5 for i in range(n)]


def test_fill_then_cold_process_and_in_process_restart(make_engine, lmcache_server, tiny_model_dir, cli_env, tmp_path):
    prompts = [prompt(600, 1), prompt(300, 2)]
    ref = make_engine().generate(prompts, GREEDY)
    ktc = lm_config(lmcache_server)
    a = make_engine(kv_transfer_config=parse_kv_transfer_config(ktc))
    filled = a.generate(prompts, GREEDY)
    a.executor.worker.connector.flush()
    assert [r.stats.num_external_stored_tokens for r in filled] == [512, 256]
    # In-process restart: a new engine (empty prefix cache) loads every full chunk.
    b = make_engine(kv_transfer_config=parse_kv_transfer_config(ktc))
    again = b.generate(prompts, GREEDY)
    assert [r.stats.num_external_tokens for r in again] == [512, 256]
    assert [r.stats.num_external_loaded_tokens for r in again] == [512, 256]
    # A cold second process.
    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in prompts))
    out = subprocess.run(
        kvtool_cmd() + ["generate", "--model", str(tiny_model_dir), "--prompt-file", str(f), "--json", "--max-tokens", "8",
                        "--ignore-eos", "--device", "cpu", "--kv-cache-memory", "64M", "--kv-transfer-config", ktc],
        env=cli_env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    cold = json.loads(out.stdout)["requests"]
    assert [r["num_external_tokens"] for r in cold] == [512, 256]
    expected = [r.output_token_ids for r in ref]
    assert [r.output_token_ids for r in filled] == [r.output_token_ids for r in again] == expected
    assert [r["output_token_ids"] for r in cold] == expected


def test_server_not_running_at_start(make_engine):
    from tests.support.peer_server import free_port

    port = free_port()
    down = {"host": "127.0.0.1", "port": port}

    class Down:
        host, port = down["host"], down["port"]

    with pytest.raises(PeerError, match="cannot reach the LMCache server"):
        make_engine(kv_transfer_config=parse_kv_transfer_config(lm_config(Down)))
    engine = make_engine(kv_transfer_config=parse_kv_transfer_config(lm_config(Down, policy="recompute")))
    r = engine.generate([prompt(300, 3)], GREEDY)[0]
    assert r.finish_reason == "length" and r.stats.num_external_tokens == 0
    assert r.output_token_ids == make_engine().generate([prompt(300, 3)], GREEDY)[0].output_token_ids


@pytest.mark.parametrize("policy", ["fail", "recompute"])
@pytest.mark.parametrize("fault", ["killed", "restarted_empty"])
def test_server_lost_between_exist_and_get(make_engine, restartable_lmcache_server, policy, fault):
    server = restartable_lmcache_server
    p = prompt(600, 4)
    ref = make_engine().generate([p], GREEDY)[0]
    writer = make_engine(kv_transfer_config=parse_kv_transfer_config(lm_config(server)))
    writer.generate([p], GREEDY)
    writer.executor.worker.connector.flush()
    engine = make_engine(kv_transfer_config=parse_kv_transfer_config(lm_config(server, policy=policy, timeout_s=5.0)))
    worker = engine.executor.worker.connector
    original = worker.start_load_kv

    def lose_server_then_load():
        if worker._meta.loads:
            server.stop() if fault == "killed" else server.restart()
        original()

    worker.start_load_kv = lose_server_then_load
    r = engine.generate([p], GREEDY)[0]
    if policy == "fail":
        assert r.finish_reason == "error" and r.output_token_ids == []
        assert "LMCache" in r.error or "lm://" in r.error
    else:
        assert r.output_token_ids == ref.output_token_ids


@pytest.mark.parametrize("variant", ["bigger", "same_size_other_shape"])
def test_wrong_shape_under_the_right_key_is_refused(make_engine, lmcache_server, variant):
    p = prompt(300, 5 if variant == "bigger" else 6)
    ref = make_engine().generate([p], GREEDY)[0]
    engine = make_engine(kv_transfer_config=parse_kv_transfer_config(lm_config(lmcache_server, policy="fail")))
    g = engine.executor.worker.kv_pages.geometry
    settings = LMCacheKeySettings(model_name=engine.identity.model_name, kv_dtype="float", chunk_tokens=256)
    key = make_chunk_keys(p, settings)[0].key
    if variant == "bigger":
        shape = (2, g.num_layers + 1, 256, g.kv_hidden_size)
    else:
        shape = (2, g.num_layers * 2, 256, g.kv_hidden_size // 2)
    wrong = torch.ones(shape, dtype=torch.float32)
    with LMClient(lmcache_server.host, lmcache_server.port, connections=1) as client:
        client.put(key, tensor_buffer(wrong), MemoryFormat.KV_2LTD, dtype_code(torch.float32), wrong.shape)
    r = engine.generate([p], GREEDY)[0]
    assert r.finish_reason == "error" and r.output_token_ids == []
    if variant == "bigger":
        assert "reply announces" in r.error  # refused before a byte of payload is read
    else:
        assert "does not fit this rank's KV pages" in r.error
        assert f"layers {g.num_layers * 2}, expected {g.num_layers}" in r.error
        assert f"KV hidden size {g.kv_hidden_size // 2}, expected {g.kv_hidden_size}" in r.error
    # Never scattered: the pages of a recomputing engine give the reference output.
    rec = make_engine(kv_transfer_config=parse_kv_transfer_config(lm_config(lmcache_server, policy="recompute")))
    r2 = rec.generate([p], GREEDY)[0]
    assert r2.output_token_ids == ref.output_token_ids


def test_more_chunks_than_load_buffers(make_engine, lmcache_server):
    """37 chunks of 16 tokens through a ring of 16 host buffers: buffers are reused in order."""
    p = prompt(600, 7)
    ref = make_engine().generate([p], GREEDY)[0]
    ktc = lm_config(lmcache_server, chunk_tokens=16, connections=2)
    writer = make_engine(kv_transfer_config=parse_kv_transfer_config(ktc))
    writer.generate([p], GREEDY)
    writer.executor.worker.connector.flush()
    reader = make_engine(kv_transfer_config=parse_kv_transfer_config(ktc))
    r = reader.generate([p], GREEDY)[0]
    assert r.stats.num_external_loaded_tokens == 592
    assert r.output_token_ids == ref.output_token_ids


def test_a_store_backlog_skips_the_steps_remaining_chunks_never_stalls_it(make_engine, lmcache_server, monkeypatch):
    """When a slow store's backlog holds every staging buffer (StoreStaging.stage stages fewer
    chunks than asked), the step's chunks from there on are not stored, as LMCache stores only the
    chunks its CPU memory has room for: the skip is counted, the staged prefix is
    stored and served, and the output is the one without reuse."""
    from kvtool.engine.connectors.lmcache import store_staging

    staged_at_most = 3
    stage = store_staging.StoreStaging.stage

    def full_pool(self, chunks):
        return stage(self, chunks[:staged_at_most])

    monkeypatch.setattr(store_staging.StoreStaging, "stage", full_pool)
    p = prompt(200, 9)  # 12 whole chunks of 16 tokens
    ref = make_engine().generate([p], GREEDY)[0]
    ktc = parse_kv_transfer_config(lm_config(lmcache_server, chunk_tokens=16))
    writer = make_engine(kv_transfer_config=ktc)
    writer.generate([p], GREEDY)
    writer.executor.worker.connector.flush()
    stats = writer.stats()
    assert stats.store_skipped_chunks == 12 - staged_at_most
    assert stats.external_tokens_stored == 16 * staged_at_most
    reader = make_engine(kv_transfer_config=ktc)
    r = reader.generate([p], GREEDY)[0]
    assert r.stats.num_external_loaded_tokens == 16 * staged_at_most
    assert r.output_token_ids == ref.output_token_ids
