"""verify-keys hints: a sequence shorter than one chunk, the KV dtype --peer assumes, a miss explained."""

from __future__ import annotations

import json
import uuid

import torch

from kvtool.engine.connectors.lmcache.keys import LMCacheKeySettings, make_chunk_keys
from kvtool.engine.connectors.lmcache.probe import ChunkGeometry, chunk_problem
from kvtool.engine.connectors.lmcache.stores.lm_client import LMClient
from kvtool.engine.connectors.lmcache.stores.protocol import kv_chunk_header, tensor_buffer

TOKENS = [(i * 7) % 200 + 3 for i in range(40)]


def test_a_sequence_shorter_than_one_chunk_says_so(tmp_path, run_kvtool):
    tokens = tmp_path / "t.json"
    tokens.write_text(json.dumps(TOKENS[:10]))
    code, out, err = run_kvtool(["verify-keys", "--tokens", tokens, "--json"])
    assert code == 0, err
    assert json.loads(out) == []  # stdout stays one JSON document
    assert "has 10 tokens, fewer than one chunk: a chunk needs 256 tokens" in err


def test_peer_takes_the_kv_dtype_serve_stores_on_the_device(lmcache_server, tiny_model_dir, tmp_path, run_kvtool):
    model_name = f"kvtool-test/hints-{uuid.uuid4().hex[:12]}"
    # What `kvtool serve --device cpu` stores: float32 KV, LMCache's "float" in the key.
    key = make_chunk_keys(TOKENS, LMCacheKeySettings(model_name, kv_dtype="float32", chunk_tokens=16))[0].key
    t = torch.zeros((2, 4, 16, 128), dtype=torch.float32)
    header = kv_chunk_header(t.shape, t.dtype)
    with LMClient(lmcache_server.host, lmcache_server.port, connections=1) as client:
        client.put(key, tensor_buffer(t), header.fmt, header.dtype_code, header.shape)
    tokens = tmp_path / "t.json"
    tokens.write_text(json.dumps(TOKENS))
    args = ["verify-keys", "--peer", f"lm://{lmcache_server.host}:{lmcache_server.port}", "--tokens", tokens,
            "--model", tiny_model_dir, "--model-name", model_name, "--chunk-tokens", "16"]
    code, out, err = run_kvtool(args + ["--device", "cpu", "--json"])
    assert code == 0, err
    rows = json.loads(out)
    assert [r["present"] for r in rows] == [True, False] and rows[0]["dtype"] == "float32" and rows[0]["fits"]
    code, out, err = run_kvtool(args + ["--device", "cuda", "--json"])  # a CUDA writer's keys: bfloat16
    assert code == 0, err
    assert [r["present"] for r in json.loads(out)] == [False, False]
    assert "holds none of the 2 keys" in err and "KV dtype bfloat16 (LMCache's 'bfloat16')" in err
    assert repr(model_name) in err and "chunks of 16 tokens" in err


def test_the_fit_check_compares_the_dtype_not_only_its_size():
    bf16 = ChunkGeometry(num_layers=4, kv_hidden_size=128, dtype="bfloat16")
    as_float16 = kv_chunk_header((2, 4, 16, 128), torch.float16)
    as_bfloat16 = kv_chunk_header((2, 4, 16, 128), torch.bfloat16)
    assert chunk_problem(as_float16, 16, bf16) == "dtype float16, expected bfloat16"
    assert chunk_problem(as_bfloat16, 16, bf16) is None
