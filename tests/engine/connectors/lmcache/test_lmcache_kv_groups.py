"""The LMCacheConnector with KV cache groups (Gemma 3, Gemma 2, a windowed Mistral) on LMCache's
own server: in kvtool's blake3 mode the engine keeps the model's groups, stores every group's
chunk as an object of its own (a key chain per group), loads a sliding-window group's chunks only
where its window reads at the hit, and gives output with reuse equal bit for bit to a cache that
keeps every token in one group with no connector, in a second engine and in a cold process. In
a peer mode the engine keeps one group, as vLLM does for LMCache.
"""

from __future__ import annotations

import json
import subprocess
import uuid

import msgspec
import pytest
import torch

from kvtool.engine.connectors.config import parse_kv_transfer_config
from kvtool.engine.connectors.lmcache.connector import LMCacheConnector
from kvtool.engine.connectors.lmcache.identity_digest import make_group_digests, make_identity_digest
from kvtool.engine.connectors.lmcache.keys import make_chunk_keys
from kvtool.engine.connectors.lmcache.stores.lm_client import LMClient
from kvtool.engine.connectors.lmcache.stores.protocol import MemoryFormat, dtype_code, tensor_buffer
from kvtool.engine.core.block_pool import NULL_BLOCK
from kvtool.engine.errors import ConfigError
from kvtool.engine.kv.groups import single_group
from tests.conftest import kvtool_cmd
from tests.support.window_models import WINDOW_PRESETS, window_model_dir
from tests.engine.connectors.offloading.test_offload_kv_groups import (
    BS, GREEDY, LONG, PROMPTS, _engine, _reference, _same)

@pytest.fixture(scope="module", params=WINDOW_PRESETS)
def model_dir(request, tmp_path_factory):
    return window_model_dir(tmp_path_factory.mktemp("lmcache-groups"), request.param)


def _ktc(server, policy: str = "fail", **extra) -> str:
    """A connector on the shared server under a model name of the test's own (its keys are new)."""
    extra = {"host": server.host, "port": server.port, "model_name": f"kvtool-test/groups-{uuid.uuid4().hex[:12]}",
             **extra}
    return json.dumps({"kv_connector": "LMCacheConnector", "kv_role": "kv_both", "kv_load_failure_policy": policy,
                       "kv_connector_extra_config": extra})


@pytest.mark.parametrize("cs", [BS, 2 * BS])
def test_every_group_is_stored_and_loaded_to_the_reference_bits(model_dir, lmcache_server, cli_env, tmp_path, cs):
    """A second engine on the store, then a cold `kvtool generate`, hit every prompt's chunks of
    every group and print the reference's tokens (and, in process, its logprobs); with chunks of
    one and of two blocks (a window's first block then falls inside a chunk)."""
    prompts = PROMPTS + [LONG]
    expected = _reference(model_dir, prompts)
    ktc = _ktc(lmcache_server, chunk_tokens=cs)
    writer = _engine(model_dir, ktc)
    try:
        layout = writer.kv_layout
        assert layout.hybrid  # blake3 keys move every group: the engine keeps the model's groups
        first = writer.generate(prompts, GREEDY)
        writer.executor.worker.connector.flush()
    finally:
        writer.close()
    reader = _engine(model_dir, ktc)
    try:
        again = reader.generate(prompts, GREEDY)
        stats = reader.stats()
        pages = reader.executor.worker.kv_pages
        assert not pages.tensor[NULL_BLOCK].any()  # no load wrote the null block below a window
        per_block = pages.block_bytes
        reader.check_integrity()
    finally:
        reader.close()
    _same(first, expected)
    _same(again, expected)
    hit = [min(len(p) // cs * cs, len(p) - 1) for p in prompts]
    assert [r.stats.num_external_tokens for r in first] == [0] * len(prompts)
    assert [r.stats.num_external_tokens for r in again] == hit
    # Whole chunks load; a chunk's tokens count once, whatever its groups.
    loaded = [-(-h // cs) * cs for h in hit]
    assert stats.external_tokens_loaded == sum(loaded)
    # A sliding-window group reads only its window at the hit.
    assert 0 < stats.bytes_loaded < layout.num_groups * sum(loaded) // BS * per_block

    f = tmp_path / "prompts.jsonl"
    f.write_text("".join(json.dumps({"prompt_token_ids": p}) + "\n" for p in prompts))
    cmd = kvtool_cmd() + ["generate", "--model", str(model_dir), "--prompt-file", str(f), "--json",
                          "--max-tokens", str(GREEDY.max_tokens), "--ignore-eos", "--kv-cache-memory", "16M",
                          "--device", "cpu", "--max-model-len", "512", "--no-enable-prefix-caching",
                          "--kv-transfer-config", ktc]
    out = subprocess.run(cmd, env=cli_env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    cold = json.loads(out.stdout)["requests"]
    assert [r["num_external_tokens"] for r in cold] == hit
    assert [r["output_token_ids"] for r in cold] == [r.output_token_ids for r in expected]


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_bad_chunk_of_one_group_fails_the_load(model_dir, lmcache_server, policy):
    """Another shape under the key of a sliding-window group's last chunk of the hit: the load
    fails through the engine's failure path (an error, or a recompute that gives the reference)."""
    prompt = PROMPTS[1]
    expected = _reference(model_dir, [prompt])
    ktc = _ktc(lmcache_server, policy)
    writer = _engine(model_dir, ktc)
    try:
        writer.generate([prompt], GREEDY)
        writer.executor.worker.connector.flush()
        g = next(g for g, group in enumerate(writer.kv_layout.groups) if group.sliding_window is not None)
        settings = writer.scheduler.connector.group_key_settings[g]
    finally:
        writer.close()
    key = make_chunk_keys(prompt, settings)[len(prompt) // BS - 1].key
    wrong = torch.ones((2, 1, BS, 4))
    with LMClient(lmcache_server.host, lmcache_server.port, connections=1) as client:
        client.put(key, tensor_buffer(wrong), MemoryFormat.KV_2LTD, dtype_code(wrong.dtype), wrong.shape)
    reader = _engine(model_dir, ktc)
    try:
        r = reader.generate([prompt], GREEDY)[0]
    finally:
        reader.close()
    if policy == "fail":
        assert r.finish_reason == "error" and "does not fit" in r.error
    else:
        _same([r], expected)


def test_peer_modes_keep_one_group(model_dir, lmcache_server):
    """hash_algo vllm keys what LMCache keys inside vLLM, which turns its hybrid manager off for
    LMCache: one group, and --no-disable-hybrid-kv-cache-manager refused in one line."""
    ktc = _ktc(lmcache_server, hash_algo="vllm", chunk_tokens=BS)
    engine = _engine(model_dir, ktc)
    try:
        assert engine.kv_layout.num_groups == 1 and not engine.kv_layout.hybrid
    finally:
        engine.close()
    with pytest.raises(ConfigError, match="^--no-disable-hybrid-kv-cache-manager: LMCacheConnector does not support"):
        _engine(model_dir, ktc, disable_hybrid_kv_cache_manager=False)


def test_group_keys_are_chains_of_their_own(model_dir, lmcache_server):
    """One group keeps the engine's identity digest (its keys are what they were); each of
    several groups has a digest of its own, so no group's key is another's or a one-group key."""
    engine = _engine(model_dir, _ktc(lmcache_server))
    try:
        layout, identity = engine.kv_layout, engine.identity
        settings = engine.scheduler.connector.group_key_settings
    finally:
        engine.close()
    base = make_identity_digest(identity)
    assert make_group_digests(identity, single_group(layout.num_layers)) == [base]
    assert [s.identity_digest for s in settings] == make_group_digests(identity, layout)
    one_group = msgspec.structs.replace(settings[0], identity_digest=base)
    keys = [[k.key for k in make_chunk_keys(LONG, s)] for s in (one_group, *settings)]
    if layout.num_groups == 1:
        assert keys[1] == keys[0]
    else:
        every = [key for group_keys in keys for key in group_keys]
        assert len(set(every)) == len(every) == (layout.num_groups + 1) * (len(LONG) // BS)


def test_the_mode_decides_the_groups_and_a_bad_config_is_one_line():
    """Only blake3 mode keeps groups; the mode is read as the settings read it, so a bad config
    is the settings' one-line error."""
    def ktc(**extra):
        return parse_kv_transfer_config(json.dumps({"kv_connector": "LMCacheConnector", "kv_role": "kv_both",
                                                    "kv_connector_extra_config": extra}))

    assert LMCacheConnector.groups_unsupported(ktc()) is None
    assert LMCacheConnector.groups_unsupported(ktc(hash_algo="blake3")) is None
    for algo in ("vllm", "sha256_cbor", "builtin", "sha256"):
        reason = LMCacheConnector.groups_unsupported(ktc(hash_algo=algo))
        assert reason == "does not support the hybrid KV cache manager (as in vLLM)"
    with pytest.raises(ConfigError, match="invalid LMCacheConnector config: .*hash_algo"):
        LMCacheConnector.groups_unsupported(ktc(hash_algo="md5"))
