"""On CUDA (async scheduling by default): a load that fails in step N while step N + 1 already
holds other loads leads to exactly the policy's outcome, for both connectors
(tests/support/overlapped_loads.py). LMCache's own server cannot be installed on the GPU machine, so
the lm:// server is tests/support/memory_lm_server.py. Skipped without CUDA.
"""

import pytest
import torch

from tests.support.overlapped_loads import dropped_chunk, torn_disk_block
from tests.support.port_process import port_process

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = {"device": "cuda", "dtype": "bfloat16", "num_gpu_blocks": 400}


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_offloading_disk_block_torn_in_step_n(make_engine, tmp_path, policy):
    torn_disk_block(make_engine, tmp_path / "tier", policy, **CUDA)


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_lmcache_chunk_dropped_in_step_n(make_engine, tmp_path, policy):
    drop, log = tmp_path / "drop", tmp_path / "proxy.log"
    with port_process("memory_lm_server.py") as server_port, port_process(
            "dropping_lm_proxy.py", str(server_port), "--drop-file", str(drop), "--log", str(log)) as proxy_port:
        dropped_chunk(make_engine, server_port, proxy_port, drop, log, policy, **CUDA)
