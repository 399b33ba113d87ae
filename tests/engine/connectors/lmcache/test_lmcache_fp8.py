"""An fp8 KV cache on LMCache's own server: its chunks are what a vLLM engine with an fp8 cache
stores (key and chunk dtype `uint8`, the fp8 pages' bytes, read by LMCache's own client), and a
new engine loads them back with the tokens and logprobs of the engine that computed them."""

import json
import uuid

import pytest
import torch

from kvtool.engine.connectors.config import parse_kv_transfer_config
from kvtool.engine.connectors.lmcache.keys import make_chunk_keys
from kvtool.engine.params import SamplingParams
from tests.support.peer_server import finish_client, run_lmcache_client

pytestmark = pytest.mark.peer

CHUNK = 16
PROMPT = [(i * 41) % 240 + 5 for i in range(2 * CHUNK + 7)]
SAMPLING = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)


def test_fp8_chunks_are_uint8_for_lmcache_and_load_back_bit_identical(make_engine, lmcache_server, tmp_path):
    host, port, _ = lmcache_server
    ktc = parse_kv_transfer_config(json.dumps({
        "kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both",
        "kv_connector_extra_config": {"host": host, "port": port, "hash_algo": "vllm", "chunk_tokens": CHUNK,
                                      "model_name": f"kvtool-test/fp8-{uuid.uuid4().hex[:8]}"}}))
    writer = make_engine(kv_cache_dtype="fp8", max_model_len=1024, kv_transfer_config=ktc)
    first = writer.generate([PROMPT], SAMPLING)[0]
    writer.executor.worker.connector.flush()
    key = make_chunk_keys(PROMPT, writer.scheduler.connector.key_settings)[1].key
    assert key.split("@")[4] == "uint8", key

    fetched = tmp_path / "chunk.bin"
    got = finish_client(run_lmcache_client("get", host, str(port), key, str(fetched)))
    cfg, pages = writer.model_config, writer.executor.worker.kv_pages
    shape = [2, cfg.num_layers, CHUNK, cfg.num_kv_heads * cfg.head_dim]
    assert got["hit"] and got["fmt"] == "KV_2LTD" and got["shape"] == shape and got["dtype"] == "uint8", got
    assert fetched.stat().st_size == 2 * cfg.num_layers * CHUNK * cfg.num_kv_heads * cfg.head_dim  # one byte each
    from kvtool.engine.core.hashing import extend_block_hashes

    hashes = extend_block_hashes([], PROMPT, writer.params.block_size, writer.none_hash)
    blocks = writer.scheduler.pool.find_cached_prefix(hashes)
    expected = pages.gather(blocks[1:2], "KV_2LTD", CHUNK).cpu().view(torch.uint8)
    assert torch.equal(torch.frombuffer(bytearray(fetched.read_bytes()), dtype=torch.uint8).view(shape), expected)

    reader = make_engine(kv_cache_dtype="fp8", max_model_len=1024, kv_transfer_config=ktc, enable_prefix_caching=False)
    again = reader.generate([PROMPT], SAMPLING)[0]
    assert again.stats.num_external_tokens >= 2 * CHUNK
    assert (again.output_token_ids, again.logprobs) == (first.output_token_ids, first.logprobs)


@pytest.mark.parametrize("scheme", ["redis", "resp"])
def test_fp8_chunks_through_redis_load_back_bit_identical(make_engine, redis_server, scheme):
    """The same over a Redis server, in LMCache's two-key layout (`redis://`, the metadata says
    uint8) and its raw one (`resp://`): a new engine loads every full chunk, output unchanged."""
    from kvtool.workloads.redis_server import HOST
    from tests.support.redis_chunks import prompt, store_config

    url = f"{scheme}://{HOST}:{redis_server.port}"
    prompts = [prompt(600, 31), prompt(300, 32)]
    ktc = store_config(url, model_name=f"kvtool-test/fp8-{uuid.uuid4().hex[:8]}")
    writer = make_engine(kv_cache_dtype="fp8", kv_transfer_config=ktc)
    first = writer.generate(prompts, SAMPLING)
    writer.executor.worker.connector.flush()
    reader = make_engine(kv_cache_dtype="fp8", kv_transfer_config=ktc, enable_prefix_caching=False)
    again = reader.generate(prompts, SAMPLING)
    assert [r.stats.num_external_loaded_tokens for r in again] == [512, 256]
    assert [(r.output_token_ids, r.logprobs) for r in again] == [(r.output_token_ids, r.logprobs) for r in first]
