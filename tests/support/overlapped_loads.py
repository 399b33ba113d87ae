"""Two requests whose external loads run in consecutive steps under async scheduling.

Under async scheduling step N + 1 is scheduled before step N's output is applied. With a token
budget that admits one waiting request per step, `first` loads in step N and `second` in step
N + 1, and step N's output (a failed load of `first`) reaches the connector while step N + 1's
loads are out: the case a connector keeping one "current step" gets wrong.
"""

from __future__ import annotations

import json

from kvtool.engine.connectors.config import parse_kv_transfer_config
from kvtool.engine.connectors.lmcache.keys import make_chunk_keys
from kvtool.engine.core.hashing import extend_block_hashes
from kvtool.engine.params import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
# 40 tokens: two 16-token blocks (and LMCache chunks) to load, 8 tokens to compute on a hit.
FIRST = [(i * 31) % 240 + 5 for i in range(40)]
SECOND = [(i * 17 + 3) % 240 + 5 for i in range(40)]
# One waiting request admitted per step (each computes 8 tokens on a full hit); every hit
# comes from the connector.
ONE_PER_STEP = {"async_scheduling": True, "max_num_batched_tokens": 8, "enable_prefix_caching": False}


def run_overlapped(engine, first: list[int], second: list[int], sampling, settle_lookup=None):
    """Run both to completion as above and return their results (first, second).

    The engine must schedule asynchronously and admit one of them per step (a token budget no
    larger than the tokens either computes on a full hit). `settle_lookup(request_id)`, for a
    connector that looks up in the background, waits until its answer for a request is in.
    """
    assert engine.async_scheduling
    requests = engine.scheduler.requests
    a = engine.add_request(first, sampling)
    b = engine.add_request(second, sampling)
    while not requests[a].has_load_in_flight:  # step N: `first` and its load are on the device
        assert not requests[b].has_load_in_flight, "both loads were scheduled in one step"
        engine.step()
    if settle_lookup is not None:
        settle_lookup(b)
    engine.step()  # schedules step N + 1, then applies step N
    assert requests[b].has_load_in_flight, "`second` did not load in the step after `first`"
    while engine.has_unfinished_requests():
        engine.step()
    return engine.pop_result(a), engine.pop_result(b)


def block_hash(engine, token_ids: list[int], index: int) -> bytes:
    """The engine's prefix-cache hash of block `index` of a prompt (a disk block file's name)."""
    return extend_block_hashes([], token_ids, engine.params.block_size, engine.none_hash)[index]


def offload_config(root, policy):
    return parse_kv_transfer_config(json.dumps({
        "kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_load_failure_policy": policy,
        "kv_connector_extra_config": {"root_dir": str(root)}}))


def lm_config(port, policy):
    return parse_kv_transfer_config(json.dumps({
        "kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both", "kv_load_failure_policy": policy,
        "kv_connector_extra_config": {"host": "127.0.0.1", "port": port, "hash_algo": "vllm", "chunk_tokens": 16,
                                      "verify_payload": False}}))


def check_outcome(policy, first, second, ref):
    if policy == "fail":
        assert first.finish_reason == "error" and first.output_token_ids == [], first
        assert "KV load failed" in first.error
    else:
        assert first.error is None and first.output_token_ids == ref[0]
    assert second.error is None and second.output_token_ids == ref[1]
    assert second.stats.num_external_loaded_tokens == 32  # its own load, untouched by step N's failure


def check_later_requests(engine, prompt, ref):
    """Later requests never load the refused KV: the one right after a failure computes it (and
    stores it again, if the failed request did not), and the next loads the stored-again KV."""
    engine.flush_connector()
    later = [engine.generate([prompt], GREEDY)[0] for _ in range(2)]
    engine.flush_connector()
    assert engine.stats().load_failures == 1
    assert all(r.error is None and r.output_token_ids == ref for r in later)
    assert later[-1].stats.num_external_loaded_tokens == 32


def torn_disk_block(make_engine, root, policy, **engine_params):
    """OffloadingConnector: FIRST's second block torn on disk, read in step N."""
    ref = [r.output_token_ids for r in make_engine(**engine_params, **ONE_PER_STEP).generate([FIRST, SECOND], GREEDY)]
    fill = make_engine(kv_transfer_config=offload_config(root, policy), **engine_params)
    fill.generate([FIRST, SECOND], GREEDY)
    fill.flush_connector()
    victim = next(root.rglob(f"{block_hash(fill, FIRST, 1).hex()}.kvb"))
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF  # its payload no longer matches its checksum
    victim.write_bytes(bytes(data))

    engine = make_engine(kv_transfer_config=offload_config(root, policy), **engine_params, **ONE_PER_STEP)
    first, second = run_overlapped(engine, FIRST, SECOND, GREEDY)
    check_outcome(policy, first, second, ref)
    assert engine.stats().load_failures == 1
    check_later_requests(engine, FIRST, ref[0])
    # The block on disk is whole again: a new engine loads both blocks of FIRST.
    fresh = make_engine(kv_transfer_config=offload_config(root, policy), **engine_params, **ONE_PER_STEP)
    again = fresh.generate([FIRST], GREEDY)[0]
    assert again.output_token_ids == ref[0] and again.stats.num_external_loaded_tokens == 32
    assert fresh.stats().load_failures == 0


def dropped_chunk(make_engine, server_port, proxy_port, drop, log, policy, prompt_shift=0, **engine_params):
    """LMCacheConnector: the server behind the proxy at `proxy_port` loses FIRST's second chunk
    between the lookup and the GET of step N (tests/support/dropping_lm_proxy.py; `drop` is its drop file,
    `log` its log). `prompt_shift` moves the prompts' token ids, for a server other tests share."""
    first_prompt = [t + prompt_shift for t in FIRST]
    second_prompt = [t + prompt_shift for t in SECOND]
    ref = [r.output_token_ids for r in
           make_engine(**engine_params, **ONE_PER_STEP).generate([first_prompt, second_prompt], GREEDY)]
    fill = make_engine(kv_transfer_config=lm_config(server_port, policy), **engine_params)
    fill.generate([first_prompt, second_prompt], GREEDY)
    fill.flush_connector()
    dropped = make_chunk_keys(first_prompt, fill.scheduler.connector.key_settings)[1].key
    drop.write_text(dropped + "\n")

    engine = make_engine(kv_transfer_config=lm_config(proxy_port, policy), **engine_params, **ONE_PER_STEP)
    connector = engine.scheduler.connector

    def settle_lookup(request_id):
        lookup = connector.inflight_lookups.get(request_id)
        if lookup is not None:
            lookup.future.result(timeout=60)

    first, second = run_overlapped(engine, first_prompt, second_prompt, GREEDY, settle_lookup)
    check_outcome(policy, first, second, ref)
    assert engine.stats().load_failures == 1
    check_later_requests(engine, first_prompt, ref[0])
    # The chunk went missing for the failed load only: it was stored again before any later GET.
    lines = log.read_text().splitlines()
    stored_again = lines.index(f"PUT {dropped}")
    assert f"dropped {dropped}" in lines[:stored_again] and f"dropped {dropped}" not in lines[stored_again:]
