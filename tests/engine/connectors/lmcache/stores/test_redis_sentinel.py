"""LMCacheConnector on `redis-sentinel://`, as LMCache names it: a real master, a replica and a
Redis Sentinel started by the test (kvtool.workloads.redis_server.RedisSentinelSet).

An engine stores through the master the sentinel names; a new engine finds and loads every full
chunk through it. The master is then killed between the new requests' lookups and their loads:
the load failure policy decides (`fail`: the requests error, naming the store; `recompute`:
their output equals the reference), nothing waits past the store's deadline, and once the
sentinel has promoted the replica the same engine loads every chunk of other stored prompts from it
(the failed chunks stay refused until the engine stores them again, as after any failed load).
"""

from __future__ import annotations

import signal
import time

import pytest
import redis

from kvtool.workloads.redis_server import HOST, redis_sentinel
from tests.support.redis_chunks import GREEDY, fill, prompt, store_config


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_sentinel_master_killed_between_lookup_and_load_then_the_promoted_replica_serves(make_engine, policy):
    prompts = [prompt(300, 41), prompt(600, 42)]
    later = [prompt(300, 43), prompt(600, 44)]  # loaded only after the failover
    ref = make_engine().generate(prompts + later, GREEDY)
    with redis_sentinel() as group:
        url = group.url
        assert fill(make_engine, url, prompts + later) and group.master_port() == group.master.port
        master = redis.Redis(host=HOST, port=group.master.port)
        try:
            assert master.dbsize() > 0 and master.wait(1, 5000) == 1  # the replica has every key
        finally:
            master.close()
        reader = make_engine(kv_transfer_config=store_config(url, policy=policy, timeout_s=5.0))
        first = reader.generate(prompts, GREEDY)
        assert [r.stats.num_external_loaded_tokens for r in first] == [256, 512]

        worker = reader.executor.worker.connector
        original = worker.start_load_kv

        def kill_then_load():
            if worker._meta.loads and group.master.proc is not None:
                group.master.stop(signal.SIGKILL)
            original()

        worker.start_load_kv = kill_then_load
        reader.reset_prefix_cache()
        started = time.monotonic()
        # Lookups run on the scheduler half's own thread: let every one answer before the first
        # step, so the kill falls between all lookups and all loads.
        ids = [reader.add_request(p, GREEDY) for p in prompts]
        half = reader.scheduler.connector
        while any(half.get_num_new_matched_tokens(reader.scheduler.requests[i], 0)[0] is None for i in ids):
            assert time.monotonic() - started < 30, "lookups did not answer"
            time.sleep(0.01)
        while reader.has_unfinished_requests():
            reader.step()
        out = [reader.pop_result(i) for i in ids]
        assert time.monotonic() - started < 30
        for r, expected in zip(out, ref[:2]):
            if policy == "recompute":
                assert r.finish_reason == "length" and r.output_token_ids == expected.output_token_ids
            else:
                assert r.finish_reason == "error" and "redis-sentinel://" in r.error

        worker.start_load_kv = original
        group.wait_for_failover()
        again = reader.generate(later, GREEDY)
        assert [r.stats.num_external_loaded_tokens for r in again] == [256, 512]
        assert [r.output_token_ids for r in again] == [r.output_token_ids for r in ref[2:]]
