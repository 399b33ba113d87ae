"""LMCacheConnector on CUDA: chunks loaded from an lm:// server into the pages give exactly the
cold run's tokens and logprobs, for a load of more chunks than the ring of pinned host buffers
holds (each buffer refilled once its chunk is in the pages) and for a load that starts inside a
chunk, past a local prefix hit.

LMCache's own server cannot be installed on the GPU machine, so the server is
tests/support/memory_lm_server.py, which speaks the same protocol. Skipped without CUDA.
"""

import json

import pytest
import torch

from kvtool.engine.connectors.config import parse_kv_transfer_config
from kvtool.engine.connectors.lmcache.connector import EAGER_STAGING_BUFFERS
from tests.support.port_process import port_process

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CHUNK = 256


def _lm(port: int, connections: int, role: str):
    return parse_kv_transfer_config(json.dumps({
        "kv_connector": "LMCacheConnector", "kv_role": role, "kv_load_failure_policy": "fail",
        "kv_connector_extra_config": {"host": "127.0.0.1", "port": port, "connections": connections,
                                      "chunk_tokens": CHUNK},
    }))


def test_loads_through_the_ring_of_pinned_buffers_give_the_cold_bits(tmp_path):
    from kvtool.engine.engine import LLMEngine
    from kvtool.engine.params import EngineParams, SamplingParams
    from kvtool.engine.presets.catalog import create_model_dir

    model = tmp_path / "m"
    create_model_dir(model, preset="qwen3-0.6b", config_only=True)
    base = {"model": str(model), "device": "cuda", "dtype": "bfloat16", "load_format": "dummy", "seed": 5,
            "num_gpu_blocks": 1200}
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3)
    # 22 whole chunks and 40 tokens more; `head` ends 76 tokens into chunk 4.
    full = [(i * 131 + 7) % 150000 + 10 for i in range(22 * CHUNK + 40)]
    head = full[: 4 * CHUNK + 76]

    def outputs(results):
        return [(r.output_token_ids, r.logprobs) for r in results]

    with port_process("memory_lm_server.py") as port:
        # The writer only stores (kv_producer): it computes both prompts cold.
        writer = LLMEngine(EngineParams(**base, enable_prefix_caching=False,
                                        kv_transfer_config=_lm(port, 4, "kv_producer")))
        try:
            staging = writer.executor.worker.connector._staging
            # A producer's first staging buffers pinned at start-up, its GET ring never.
            assert staging._allocated == EAGER_STAGING_BUFFERS and all(b.is_pinned() for b in staging._free)
            assert writer.executor.worker.connector._pool == []
            written = [writer.generate([p], sp)[0] for p in (head, full)]
            writer.executor.worker.connector.flush()
            assert [r.stats.num_external_loaded_tokens for r in written] == [0, 0]
            cold = outputs(written)
        finally:
            writer.close()

        # One connection: a ring of 16 host buffers, fewer than the 18 chunks of the second load.
        reader = LLMEngine(EngineParams(**base, enable_prefix_caching=True,
                                        kv_transfer_config=_lm(port, 1, "kv_consumer")))
        try:
            worker = reader.executor.worker.connector
            # The ring pinned when the engine started, before any load; a consumer stages nothing.
            assert len(worker._pool) == 16 and worker._pool[0].is_pinned() and worker._staging is None
            first = reader.generate([head], sp)[0]
            assert first.stats.num_external_loaded_tokens == 4 * CHUNK
            # The prefix cache holds head's whole blocks, which end inside chunk 4: that chunk is
            # loaded past them, and chunks 5 to 21 whole.
            local = len(head) // reader.executor.worker.kv_pages.geometry.block_size * reader.executor.worker.kv_pages.geometry.block_size
            assert local % CHUNK
            second = reader.generate([full], sp)[0]
            assert second.stats.num_external_loaded_tokens == 22 * CHUNK - local
            assert worker.stats.load_failures == 0 and len(worker._pool) == 16 and worker._pool[0].is_pinned()
            assert outputs([first, second]) == cold
        finally:
            reader.close()


def test_stored_chunks_are_staged_in_pinned_buffers_reused_after_their_put():
    """A CUDA engine's stored chunks: copied into pinned buffers by a copy stream (the host copies
    equal the gathers once `wait` returns), at most `max_bytes` of buffers at a time (the chunks
    after those are not staged, never held back: they are not stored; with `wait`, LMCache's
    force_store_wait, they are copied the pageable way), and the buffers reused once released."""
    from kvtool.engine.connectors.lmcache.store_staging import StoreStaging
    from kvtool.engine.kv.pages import KVGeometry, KVPages

    g = KVGeometry(num_layers=3, num_kv_heads=2, head_dim=64, block_size=16, dtype="bfloat16")
    pages = KVPages(g, 40, torch.device("cuda"))
    pages.tensor.copy_(torch.randn(pages.tensor.shape, device="cuda"))
    chunk_bytes = 2 * 3 * 64 * 2 * 64 * 2  # 64-token chunks
    chunks = [([4 * i + j for j in range(4)], 64) for i in range(4)] + [([30, 31], 20)]
    for wait in (False, True):
        staging = StoreStaging(pages, chunk_bytes, max_bytes=2 * chunk_bytes + 100, wait=wait)
        for _ in range(2):
            staged = staging.stage(chunks)
            staged.wait()
            assert len(staged.buffers) == 2 and all(b.is_pinned() for b in staged.buffers)
            assert len(staged.hosts) == (len(chunks) if wait else 2)
            assert staged.hosts[0].is_pinned() and (not staged.hosts[2].is_pinned() if wait else True)
            for host, (blocks, n) in zip(staged.hosts, chunks):
                assert host.device.type == "cpu" and torch.equal(host, pages.gather(blocks, "KV_2LTD", n).cpu())
            if not wait:
                assert staging.stage(chunks[2:]).hosts == []  # every buffer still in flight: nothing staged
            staging.release(staged)
        assert staging._allocated == 2
    # Buffers reserved up front, in one allocation, are the ones the steps take.
    staging = StoreStaging(pages, chunk_bytes, max_bytes=3 * chunk_bytes)
    staging.reserve(5)
    assert staging._allocated == 3 and all(b.is_pinned() for b in staging._free)
    reserved = {b.data_ptr() for b in staging._free}
    staged = staging.stage(chunks)
    staged.wait()
    assert len(staged.hosts) == 3 and {b.data_ptr() for b in staged.buffers} == reserved
    for host, (blocks, n) in zip(staged.hosts, chunks):
        assert torch.equal(host, pages.gather(blocks, "KV_2LTD", n).cpu())
