"""A load that fails in step N while step N + 1 already holds other loads (async scheduling, CPU).

Each connector's scheduler half must match step N's failures to step N's jobs: the failed
request gets exactly its policy's outcome, the bad KV is refused and stored again from the
recomputed KV, no later request loads it, and the request loading in step N + 1 is unaffected
(tests/support/overlapped_loads.py; tests/engine/connectors/test_steps_in_flight_cuda.py runs the same on CUDA).
"""

from __future__ import annotations

import pytest

from tests.support.overlapped_loads import dropped_chunk, torn_disk_block
from tests.support.port_process import port_process


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_offloading_disk_block_torn_in_step_n(make_engine, tmp_path, policy):
    torn_disk_block(make_engine, tmp_path / "tier", policy)


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_lmcache_chunk_dropped_in_step_n(make_engine, lmcache_server, tmp_path, policy):
    drop, log = tmp_path / "drop", tmp_path / "proxy.log"
    with port_process("dropping_lm_proxy.py", str(lmcache_server.port), "--drop-file", str(drop),
                      "--log", str(log)) as proxy_port:
        # Prompts of this test's own: LMCache's server is shared by the session.
        dropped_chunk(make_engine, lmcache_server.port, proxy_port, drop, log, policy,
                      prompt_shift=1 + ["fail", "recompute"].index(policy))
