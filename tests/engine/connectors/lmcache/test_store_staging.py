"""store_staging on a CPU engine: the host copies of a step's chunks are the gathered chunks
themselves (KV_2LTD, in the jobs' order), with nothing to wait for and no buffer taken."""

import torch

from kvtool.engine.connectors.lmcache.store_staging import StoreStaging
from kvtool.engine.kv.pages import KVGeometry, KVPages


def test_a_cpu_engines_chunks_are_their_gathers():
    g = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype="float32")
    pages = KVPages(g, 8, torch.device("cpu"))
    pages.tensor.copy_(torch.randn(pages.tensor.shape))
    staging = StoreStaging(pages, chunk_bytes=2 * 2 * 8 * 8 * 4)
    chunks = [([3, 1], 8), ([5, 6], 6)]
    staged = staging.stage(chunks)
    staged.wait()
    assert staged.ready is None and staged.buffers == []
    for host, (blocks, n) in zip(staged.hosts, chunks):
        assert host.device.type == "cpu" and host.is_contiguous()
        assert torch.equal(host, pages.gather(blocks, "KV_2LTD", n))
    staging.release(staged)


def test_the_buffer_budget_is_lmcaches_max_local_cpu_size_in_whole_chunks():
    """`max_local_cpu_size` (GB, 5 by default as LMCache's) over the chunk's bytes, at least one
    buffer; the keys parse under their LMCache spellings and are refused out of range."""
    import pytest

    from kvtool.engine.connectors.lmcache.settings import parse_settings
    from kvtool.engine.errors import ConfigError

    g = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype="float32")
    pages = KVPages(g, 8, torch.device("cpu"))
    assert StoreStaging(pages, chunk_bytes=1 << 20).max_buffers == 5 << 10
    assert StoreStaging(pages, chunk_bytes=1 << 20, max_bytes=3 << 20).max_buffers == 3
    assert StoreStaging(pages, chunk_bytes=1 << 20, max_bytes=10).max_buffers == 1
    settings, _ = parse_settings({}, "m", "float32", 16)
    assert settings.max_local_cpu_size == 5.0 and settings.force_store_wait is False
    settings, _ = parse_settings({"lmcache.max_local_cpu_size": 0.5, "force_store_wait": True}, "m", "float32", 16)
    assert settings.max_local_cpu_size == 0.5 and settings.force_store_wait is True
    for bad in ({"max_local_cpu_size": 0}, {"max_local_cpu_size": "5g"}, {"force_store_wait": "yes"}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            parse_settings(bad, "m", "float32", 16)
    # LMCache's own spelling, as vLLM passes its extra_config through
    settings, _ = parse_settings({"lmcache.extra_config": {"force_store_wait": True}}, "m", "float32", 16)
    assert settings.force_store_wait is True and settings.extra_config is None
    # Its other keys are LMCache's own (test_lmcache_config_keys.py): accepted, without effect.
    settings, _ = parse_settings({"lmcache.extra_config": {"enable_nixl_storage": True}}, "m", "float32", 16)
    assert settings.force_store_wait is False
    for bad, needle in (({"lmcache.extra_config": {"force_store_wait": 1}}, "force_store_wait must be true or false"),
                        ({"force_store_wait": True, "extra_config": {"force_store_wait": False}}, "given twice")):
        with pytest.raises(ConfigError, match=needle):
            parse_settings(bad, "m", "float32", 16)
