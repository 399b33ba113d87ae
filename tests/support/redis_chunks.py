"""The LMCacheConnector on a Redis-protocol store, as the store tests drive it: its config, prompts
whose chunks they fill, the chunks' keys, and a writer engine that fills them."""

from __future__ import annotations

import json

from kvtool.engine.connectors.config import parse_kv_transfer_config
from kvtool.engine.connectors.lmcache.keys import LMCacheKeySettings, make_chunk_keys
from kvtool.engine.params import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
MODEL_NAME = "kvtool-test/redis"  # fixed, so keys (and cluster slots) do not depend on temp paths


def store_config(url, policy="fail", **extra):
    doc = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both", "kv_load_failure_policy": policy,
           "kv_connector_extra_config": {"remote_url": url, "hash_algo": "vllm", "model_name": MODEL_NAME, **extra}}
    return parse_kv_transfer_config(json.dumps(doc))


def prompt(n, seed):
    return [(i * 13 + seed * 101) % 240 + 5 for i in range(n)]


def chunk_keys(p, chunk_tokens=256):
    return [c.key for c in make_chunk_keys(p, LMCacheKeySettings(model_name=MODEL_NAME, kv_dtype="float",
                                                                  chunk_tokens=chunk_tokens))]


def fill(make_engine, url, prompts, **extra):
    writer = make_engine(kv_transfer_config=store_config(url, **extra))
    out = writer.generate(prompts, GREEDY)
    writer.executor.worker.connector.flush()
    return out
