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
