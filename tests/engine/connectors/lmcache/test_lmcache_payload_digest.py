"""verify_payload against LMCache's own server and client: a forged chunk is refused, not loaded.

LMCache's protocol carries no payload checksum: a chunk PUT with the right header and forged
bytes (1000.0 everywhere) is loaded and changes the output. With verify_payload, on by default
in kvtool's own blake3 key mode, the writer stores a digest object beside each chunk, which
LMCache's server keeps and LMCache's own client reads past; a reader with verify_payload
refuses the forged chunk. The peer modes keep it off unless asked.
"""

from __future__ import annotations

import json

import pytest
import torch

from kvtool.engine.connectors.config import parse_kv_transfer_config
from kvtool.engine.connectors.lmcache.keys import make_chunk_keys
from kvtool.engine.connectors.lmcache.payload_digest import digest_key
from kvtool.engine.connectors.lmcache.stores.lm_client import LMClient
from kvtool.engine.errors import ConfigError
from kvtool.engine.params import SamplingParams
from tests.support.peer_server import finish_client, run_lmcache_client

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def lm_config(server, policy="fail", **extra):
    return parse_kv_transfer_config(json.dumps({
        "kv_connector": "LMCacheConnector", "kv_role": "kv_both", "kv_load_failure_policy": policy,
        "kv_connector_extra_config": {"host": server.host, "port": server.port, **extra},
    }))


def prompt(n: int, seed: int) -> list[int]:
    return [(i * 29 + seed * 7) % 240 + 5 for i in range(n)]


def test_forged_chunk_is_refused_by_default_in_blake3_mode(make_engine, lmcache_server, tmp_path):
    p = prompt(80, seed=41)
    ref = make_engine().generate([p], GREEDY)[0]
    writer = make_engine(kv_transfer_config=lm_config(lmcache_server))  # blake3: digests by default
    assert writer.executor.worker.connector.verify_payload
    writer.generate([p], GREEDY)
    writer.executor.worker.connector.flush()
    keys = [k.key for k in make_chunk_keys(p, writer.scheduler.connector.key_settings)]
    first = keys[0]
    with LMClient(lmcache_server.host, lmcache_server.port, connections=1) as client:
        assert client.exist_many(keys + [digest_key(k) for k in keys]) == [True] * (2 * len(keys))

    # LMCache's own client reads the chunk as before: the digest objects beside it are harmless.
    original = tmp_path / "original.bin"
    got = finish_client(run_lmcache_client("get", lmcache_server.host, str(lmcache_server.port), first, str(original)))
    assert got["hit"] and got["fmt"] == "KV_2LTD" and got["dtype"] == "float32"
    digest_file = tmp_path / "digest.bin"
    dig = finish_client(run_lmcache_client("get", lmcache_server.host, str(lmcache_server.port), digest_key(first),
                                           str(digest_file)))
    assert dig["hit"] and dig["shape"] == [2, 1, 1, 16] and dig["dtype"] == "uint8" and dig["length"] == 32

    # A writer of the store replaces the chunk: the right header, forged bytes.
    forged = tmp_path / "forged.bin"
    forged.write_bytes(torch.full((original.stat().st_size // 4,), 1000.0, dtype=torch.float32).numpy().tobytes())
    shape = ",".join(str(d) for d in got["shape"])
    put = finish_client(run_lmcache_client("put", lmcache_server.host, str(lmcache_server.port), first, shape,
                                           "float32", str(forged)))
    assert put["stored"]

    # With verify_payload turned off the forged chunk is loaded and changes the output.
    trusting = make_engine(kv_transfer_config=lm_config(lmcache_server, verify_payload=False))
    fooled = trusting.generate([p], GREEDY)[0]
    assert fooled.stats.num_external_loaded_tokens == 80  # a full hit: every chunk, the last token computed
    assert fooled.output_token_ids != ref.output_token_ids

    refusing = make_engine(kv_transfer_config=lm_config(lmcache_server))
    refused = refusing.generate([p], GREEDY)[0]
    assert refused.finish_reason == "error" and "payload digest mismatch" in refused.error

    recomputing = make_engine(kv_transfer_config=lm_config(lmcache_server, "recompute"))
    recomputed = recomputing.generate([p], GREEDY)[0]
    assert recomputed.output_token_ids == ref.output_token_ids


def test_chunk_without_its_digest_is_refused(make_engine, lmcache_server):
    p = prompt(48, seed=43)
    plain = make_engine(kv_transfer_config=lm_config(lmcache_server, verify_payload=False))  # no digests
    plain.generate([p], GREEDY)
    plain.executor.worker.connector.flush()
    reader = make_engine(kv_transfer_config=lm_config(lmcache_server))
    r = reader.generate([p], GREEDY)[0]
    assert r.finish_reason == "error" and "has no payload digest" in r.error


def test_peer_modes_store_no_digest_unless_asked(make_engine, lmcache_server):
    """vllm-mode keys are the peer's, byte for byte: verify_payload stays off by default there."""
    p = prompt(48, seed=47)
    peer_mode = lm_config(lmcache_server, hash_algo="vllm", chunk_tokens=16)
    writer = make_engine(kv_transfer_config=peer_mode)
    assert not writer.executor.worker.connector.verify_payload
    writer.generate([p], GREEDY)
    writer.executor.worker.connector.flush()
    keys = [k.key for k in make_chunk_keys(p, writer.scheduler.connector.key_settings)]
    with LMClient(lmcache_server.host, lmcache_server.port, connections=1) as client:
        assert client.exist_many(keys) == [True] * len(keys)
        assert client.exist_many([digest_key(k) for k in keys]) == [False] * len(keys)
    asked = make_engine(kv_transfer_config=lm_config(lmcache_server, hash_algo="vllm", chunk_tokens=16,
                                                     verify_payload=True))
    assert asked.executor.worker.connector.verify_payload


def test_verify_payload_refuses_a_model_name_too_long_for_the_digest_key(make_engine, lmcache_server):
    with pytest.raises(ConfigError, match="verify_payload"):
        make_engine(kv_transfer_config=lm_config(lmcache_server, verify_payload=True, model_name="m" * 110))
    with pytest.raises(ConfigError, match="verify_payload"):  # on by default in blake3 mode
        make_engine(kv_transfer_config=lm_config(lmcache_server, model_name="m" * 110))
    make_engine(kv_transfer_config=lm_config(lmcache_server, verify_payload=False, model_name="m" * 110))


@pytest.mark.parametrize("secret", [None, bytes(range(32))])
def test_a_large_payloads_digest_is_the_one_thread_digest(secret):
    """Payloads of PARALLEL_BYTES and more are hashed on every core: the digest is the one a single
    thread computes (blake3's tree), so digests stored before stay valid."""
    import os

    import blake3

    from kvtool.engine.connectors.lmcache.payload_digest import PARALLEL_BYTES, payload_digest

    for size in (PARALLEL_BYTES - 1, PARALLEL_BYTES, 3 * PARALLEL_BYTES + 17):
        payload = memoryview(os.urandom(size))
        one = blake3.blake3(key=secret) if secret is not None else blake3.blake3()
        one.update(b"key@1@0@ab@bfloat16")
        one.update(b"\0")
        one.update(payload)
        assert payload_digest("key@1@0@ab@bfloat16", payload, secret) == one.digest()
