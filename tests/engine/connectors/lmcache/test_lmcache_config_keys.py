"""LMCache's own keys in kv_connector_extra_config run unchanged (lmcache_config_keys.py): honoured,
translated, refused for a wire format kvtool does not write, or accepted with a notice, as
LMCache's vLLM adapter takes them; the list of LMCache's fields is the peer's own."""

from __future__ import annotations

import ast
import json
import logging

import pytest

from kvtool.engine.connectors.lmcache.lmcache_config_keys import LMCACHE_CONFIG_FIELDS
from kvtool.engine.connectors.lmcache.settings import parse_settings
from kvtool.engine.errors import ConfigError


def settings_of(extra: dict):
    return parse_settings(extra, "m", "float32", 16)[0]


def test_the_fields_are_the_peers_lmcache_config():
    from kvtool.peer.env import is_peer_ready, peer_venv

    if not is_peer_ready():
        pytest.skip("the peer environment is not built (scripts/peer-env)")
    source = next(peer_venv().glob("lib/python3*/site-packages/lmcache/v1/config.py")).read_text()
    tree = ast.parse(source)
    table = next(n for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign))
                 and getattr(n.target if isinstance(n, ast.AnnAssign) else n.targets[0], "id", "") == "_CONFIG_DEFINITIONS")
    assert tuple(k.value for k in table.value.keys) == LMCACHE_CONFIG_FIELDS


def test_lmcache_keys_with_a_kvtool_equivalent_are_translated():
    s = settings_of({"lmcache.save_decode_cache": True, "lmcache.lookup_timeout_ms": 2500,
                     "lmcache.blocking_timeout_secs": 7, "lmcache.save_unfull_chunk": True,
                     "discard_partial_chunks": True})
    assert s.offload_prompt_only is False and s.lookup_timeout_s == 2.5 and s.timeout_s == 7.0
    assert s.save_unfull_chunk is False  # LMCache discards a partial chunk when either key says so
    s = settings_of({"lmcache.save_decode_cache": False, "discard_partial_chunks": False,
                     "lmcache.save_unfull_chunk": True, "lmcache.remote_serde": "naive"})
    assert s.offload_prompt_only is True and s.save_unfull_chunk is True


def test_lmcache_keys_without_effect_are_accepted_with_one_notice_each(caplog, monkeypatch):
    from kvtool.engine.connectors.lmcache import settings

    monkeypatch.setattr(settings, "_noticed", set())  # notices are once per process
    extra = {"lmcache.local_cpu": False, "lmcache.use_layerwise": True, "lmcache.enable_async_loading": True,
             "lmcache.max_local_disk_size": 20, "lmcache.chunk_sise": 128, "lmcache.mp.port": 5555,
             "skip_last_n_tokens": 1, "lmcache.max_tokens_per_load": 131072,
             "lmcache.extra_config": {"force_store_wait": True, "enable_nixl_storage": True},
             "lmcache.chunk_size": 256, "hash_algo": "vllm"}
    with caplog.at_level(logging.WARNING, logger="kvtool.lmcache"):
        first = settings_of(extra)
        again = settings_of(extra)
    assert first == again and first.chunk_tokens == 256 and first.force_store_wait is True
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == len(set(lines)) == 9, lines  # once each, however often the config is parsed
    text = "\n".join(lines)
    for key in ("lmcache.local_cpu", "lmcache.use_layerwise", "lmcache.enable_async_loading",
                "lmcache.max_local_disk_size"):
        assert f"{key} is LMCache's own setting and has no effect in kvtool" in text
    assert "lmcache.chunk_sise is not a key of LMCache's configuration (did you mean lmcache.chunk_size?)" in text
    assert "lmcache.mp.port is a key of LMCache's multi-process connector and has no effect here" in text
    assert "skip_last_n_tokens is read by LMCache's vLLM adapter" in text
    assert "lmcache.max_tokens_per_load is read by LMCache's vLLM adapter" in text
    assert "lmcache.extra_config's enable_nixl_storage is LMCache's own setting" in text


@pytest.mark.parametrize("extra,needle", [
    ({"lmcache.remote_serde": "cachegen"}, "lmcache.remote_serde 'cachegen' is not supported"),
    ({"lmcache.save_decode_cache": "yes"}, "lmcache.save_decode_cache must be true or false"),
    ({"lmcache.lookup_timeout_ms": 0}, "lmcache.lookup_timeout_ms must be a number > 0"),
    ({"lmcache.blocking_timeout_secs": True}, "lmcache.blocking_timeout_secs must be a number > 0"),
    ({"discard_partial_chunks": 1}, "discard_partial_chunks must be true or false"),
    ({"lmcache.save_decode_cache": True, "offload_prompt_only": True}, "disagree"),
    ({"lmcache.lookup_timeout_ms": 100, "lookup_timeout_s": 2}, "disagree"),
    ({"conections": 4}, r"unknown key 'conections' \(did you mean connections\?\)"),
])
def test_what_kvtool_cannot_honour_is_refused_in_one_line(extra, needle):
    with pytest.raises(ConfigError, match=needle) as e:
        settings_of(extra)
    assert "\n" not in str(e.value)


@pytest.mark.peer
def test_a_vllm_lmcache_config_runs_unchanged(make_engine, lmcache_server):
    """A kv_connector_extra_config as a vLLM + LMCache deployment writes it (LMCache's keys, its
    local tier settings among them) stores and loads through LMCache's own server."""
    from kvtool.engine.connectors.config import parse_kv_transfer_config
    from kvtool.engine.params import SamplingParams

    ktc = parse_kv_transfer_config(json.dumps({
        "kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "lmcache.remote_url": f"lm://{lmcache_server.host}:{lmcache_server.port}", "lmcache.chunk_size": 16,
            "lmcache.local_cpu": False, "lmcache.max_local_cpu_size": 1, "lmcache.remote_serde": "naive",
            "lmcache.use_layerwise": False, "lmcache.save_decode_cache": False, "discard_partial_chunks": True,
            "lmcache.lookup_timeout_ms": 3000, "lmcache.extra_config": {"save_only_first_rank": False},
        },
    }))
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    p = [(i * 53 + 7) % 240 + 5 for i in range(8 * 16 + 3)]
    ref = make_engine().generate([p], sp)[0]
    writer = make_engine(kv_transfer_config=ktc, enable_prefix_caching=False)
    writer.generate([p], sp)
    writer.flush_connector()
    hit = make_engine(kv_transfer_config=ktc, enable_prefix_caching=False).generate([p], sp)[0]
    assert hit.stats.num_external_loaded_tokens == 8 * 16 and hit.output_token_ids == ref.output_token_ids
