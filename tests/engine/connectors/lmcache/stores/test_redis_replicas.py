"""Two `kvtool serve` replicas sharing KV through one Redis Cluster, and credentials kept out of
what a server shows (its logs and /metrics)."""

from __future__ import annotations

import json
import time

import httpx
import openai
import redis

from kvtool.engine.connectors.lmcache.keys import LMCacheKeySettings, make_chunk_keys
from kvtool.workloads.redis_server import HOST
from tests.support.server_process import ServerProcess

PROMPT_IDS = [(i * 29) % 240 + 5 for i in range(700)]
CHUNK = 64
MODEL_NAME = "kvtool-test/replicas"


def serve_args(model_dir, url):
    ktc = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both",
           "kv_connector_extra_config": {"remote_url": url, "hash_algo": "vllm", "chunk_tokens": CHUNK,
                                         "model_name": MODEL_NAME}}
    return ["--model", str(model_dir), "--device", "cpu", "--kv-cache-memory", "64M", "--kv-transfer-config",
            json.dumps(ktc)]


def complete(server, model):
    client = openai.OpenAI(base_url=server.base_url, api_key="x", max_retries=0)
    return client.completions.create(model=model, prompt=PROMPT_IDS, max_tokens=8, temperature=0.0,
                                     extra_body={"ignore_eos": True, "return_token_ids": True})


def wait_for_keys(client, keys, timeout_s=60.0):
    """Stores are asynchronous: wait until every chunk's metadata key is in the store."""
    deadline = time.monotonic() + timeout_s
    while not all(client.exists(k + "metadata") for k in keys):
        assert time.monotonic() < deadline, "replica A never stored its chunks"
        time.sleep(0.1)


def test_replica_b_serves_what_replica_a_stored(redis_cluster, tiny_model_dir):
    model = str(tiny_model_dir)
    args = serve_args(tiny_model_dir, redis_cluster.url)
    expected_hit = (len(PROMPT_IDS) - 1) // CHUNK * CHUNK  # whole chunks before the last prompt token
    keys = [c.key for c in make_chunk_keys(PROMPT_IDS, LMCacheKeySettings(model_name=MODEL_NAME, kv_dtype="float",
                                                                           chunk_tokens=CHUNK))]
    nodes = redis.cluster.RedisCluster(host=HOST, port=redis_cluster.nodes[0].port)
    try:
        with ServerProcess(args) as a, ServerProcess(args) as b:
            first = complete(a, model)
            wait_for_keys(nodes, keys[: expected_hit // CHUNK])
            second = complete(b, model)
            metrics_b = b.metrics()
    finally:
        nodes.close()
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == expected_hit
    assert metrics_b["kvtool:connector_loaded_tokens_total"] == expected_hit
    assert second.choices[0].text == first.choices[0].text
    assert second.choices[0].token_ids == first.choices[0].token_ids


def test_password_never_in_logs_or_metrics(tiny_model_dir, tmp_path):
    from kvtool.workloads.redis_server import RedisServer, free_port

    password = "Zq9-very-secret-Pa55"
    server = RedisServer(free_port(), tmp_path / "auth", ["--requirepass", password]).start()
    try:
        url = f"redis://default:{password}@{HOST}:{server.port}"
        with ServerProcess(serve_args(tiny_model_dir, url) + ["--no-enable-prefix-caching", "--uvicorn-log-level", "debug"]) as srv:
            complete(srv, str(tiny_model_dir))
            second = complete(srv, str(tiny_model_dir))
            server.stop()  # errors now: their messages must not quote the password either
            complete(srv, str(tiny_model_dir))
            metrics_text = httpx.get(f"{srv.url}/metrics", timeout=10).text
            logs = srv.logs()
    finally:
        server.stop()
    assert second.usage.prompt_tokens_details.cached_tokens > 0  # the password was right
    assert f"redis://{HOST}:{server.port}" in logs  # the lost store was reported, by its address only
    assert "kvtool:connector_loaded_tokens_total" in metrics_text
    assert password not in logs and password not in metrics_text
