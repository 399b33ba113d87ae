"""Every supported architecture's KV, stored by kvtool on LMCache's own server, is what LMCache's
own client reads: a KV_2LTD chunk of shape [2, layers, tokens, kv_heads * head_dim] in the
model's dtype, whose bytes are the ones kvtool loads back (each KV-head layout: grouped, one
query head per KV head, head_dim 96, MoE layers). `kvtool verify-keys --against-lmcache --peer`
over the same model directory then finds its keys equal to LMCache's own and every held chunk a
fit for that model."""

import json
import uuid

import pytest
import torch

from kvtool.engine.connectors.config import parse_kv_transfer_config
from kvtool.engine.connectors.lmcache.keys import make_chunk_keys
from kvtool.engine.kv.pages import DTYPES
from kvtool.engine.params import SamplingParams
from kvtool.engine.presets.catalog import create_model_dir
from tests.support.peer_server import finish_client, run_lmcache_client

pytestmark = pytest.mark.peer

PRESETS = ["tiny-qwen2", "tiny-mistral", "phi-3-tiny", "tiny-mixtral", "tiny-qwen3-moe", "tiny-gemma3", "tiny-gemma2"]
CHUNK = 16
PROMPT = [(i * 37) % 240 + 5 for i in range(2 * CHUNK + 5)]


@pytest.mark.parametrize("preset", PRESETS)
def test_lmcache_reads_the_chunks_kvtool_stores(make_engine, lmcache_server, tmp_path, preset, run_kvtool):
    host, port, _ = lmcache_server
    model = tmp_path / preset
    create_model_dir(model, preset=preset, seed=5)
    name = f"kvtool-test/{preset}-{uuid.uuid4().hex[:8]}"
    ktc = parse_kv_transfer_config(json.dumps({
        "kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both",
        "kv_connector_extra_config": {"host": host, "port": port, "hash_algo": "vllm", "chunk_tokens": CHUNK,
                                      "model_name": name}}))
    engine = make_engine(model=str(model), max_model_len=1024, kv_transfer_config=ktc)
    engine.generate([PROMPT], SamplingParams(max_tokens=1, temperature=0.0))
    engine.executor.worker.connector.flush()
    cfg, pages = engine.model_config, engine.executor.worker.kv_pages
    key = make_chunk_keys(PROMPT, engine.scheduler.connector.key_settings)[1].key

    fetched = tmp_path / "chunk.bin"
    got = finish_client(run_lmcache_client("get", host, str(port), key, str(fetched)))
    shape = [2, cfg.num_layers, CHUNK, cfg.num_kv_heads * cfg.head_dim]
    dtype = pages.geometry.dtype
    assert got["hit"] and got["fmt"] == "KV_2LTD" and got["shape"] == shape and got["dtype"] == dtype, got
    # The bytes LMCache read are the pages' K and V of the chunk's tokens [16, 32).
    chunk = torch.frombuffer(bytearray(fetched.read_bytes()), dtype=DTYPES[dtype]).view(shape)
    expected = pages.gather(_prompt_blocks(engine, PROMPT)[1:2], "KV_2LTD", CHUNK)
    assert torch.equal(chunk, expected.cpu())

    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps(PROMPT))
    code, out, err = run_kvtool(["verify-keys", "--tokens", tokens, "--model", model, "--model-name", name,
                                 "--chunk-tokens", CHUNK, "--against-lmcache", "--peer", f"lm://{host}:{port}",
                                 "--kv-dtype", dtype, "--json"])
    assert code == 0, err
    rows = json.loads(out)
    assert [(r["agrees"], r["present"], r["fits"]) for r in rows] == [(True, True, True)] * 2, rows


def _prompt_blocks(engine, prompt):
    """The device blocks holding the prompt's full blocks (its prefix-cache hit, on an idle engine)."""
    from kvtool.engine.core.hashing import extend_block_hashes

    hashes = extend_block_hashes([], prompt, engine.params.block_size, engine.none_hash)
    return engine.scheduler.pool.find_cached_prefix(hashes)
