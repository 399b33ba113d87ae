"""Arms and the per-request checks of `kvtool replay`, on hand-made pass results."""

import json

import pytest

from kvtool.engine.errors import ConfigError
from kvtool.workloads.arms import hit_source, hit_unit_tokens, make_builtin_arm, parse_arm_spec
from kvtool.workloads.figures import percentile
from kvtool.workloads.replay import check_pass, refuse_unreplayable, summarize_pass
from kvtool.workloads.trace_pass import PassResult, RequestRecord

BS = 16


def record(name, n, out, *, cached=0, loaded=0, error=None, ttft=0.01):
    return RequestRecord(name=name, line=int(name[1:]), num_prompt_tokens=n, output_token_ids=out,
                         finish_reason="error" if error else "length", error=error, num_cached_tokens=cached,
                         num_external_tokens=loaded, num_external_loaded_tokens=loaded, ttft_s=ttft)


def result(*records):
    return PassResult(records=list(records), wall_s=1.0, bytes_loaded=0, bytes_stored=0)


REFERENCE = result(record("r1", 80, [1, 2, 3]), record("r2", 40, [4, 5]), record("r3", 10, [6]))


def test_reuse_pass_that_hits_and_matches_passes():
    arm = make_builtin_arm("cpu")
    # 80 tokens: a full hit loads all 5 blocks (the last token is computed over the last one).
    reuse = result(record("r1", 80, [1, 2, 3], loaded=80), record("r2", 40, [4, 5], cached=16, loaded=16),
                   record("r3", 10, [6]))
    rows, failures = check_pass(arm, "reuse", reuse, REFERENCE, unit=BS, require_hits=True)
    assert failures == []
    assert [r.required_hit_tokens for r in rows] == [80, 16, 0]
    assert all(r.output_equal for r in rows)


def test_mismatch_missing_hit_and_error_name_the_request():
    arm = make_builtin_arm("cpu")
    reuse = result(record("r1", 80, [1, 9, 3], loaded=64), record("r2", 40, [4, 5]),
                   record("r3", 10, [], error="disk tier block 1a: payload checksum mismatch"))
    _, failures = check_pass(arm, "reuse", reuse, REFERENCE, unit=BS, require_hits=True)
    assert [(f.request, f.kind) for f in failures] == [("r1", "mismatch"), ("r2", "missing-hit"), ("r3", "error")]
    assert failures[0].describe() == (
        "request 'r1' (line 1), arm cpu, reuse pass: output differs from the reference arm: "
        "output token 1 is 9, the reference arm's is 2"
    )
    assert "no prompt tokens were loaded through the connector, though 32 could have been" in failures[1].message
    assert "checksum mismatch" in failures[2].message


def test_local_hits_cover_what_the_connector_could_serve():
    arm = make_builtin_arm("cpu")
    # 40 tokens: two whole blocks before the last token, both already in the local prefix cache.
    reuse = result(record("r1", 80, [1, 2, 3], loaded=64), record("r2", 40, [4, 5], cached=32), record("r3", 10, [6]))
    rows, failures = check_pass(arm, "reuse", reuse, REFERENCE, unit=BS, require_hits=True)
    assert failures == [] and rows[1].required_hit_tokens == 0


def test_fill_pass_requires_no_hits_and_prefix_cache_arm_counts_local_hits():
    arm = make_builtin_arm("prefix-cache")
    cold = result(record("r1", 80, [1, 2, 3]), record("r2", 40, [4, 5]), record("r3", 10, [6]))
    assert check_pass(arm, "fill", cold, REFERENCE, unit=BS, require_hits=False)[1] == []
    _, failures = check_pass(arm, "reuse", cold, REFERENCE, unit=BS, require_hits=True)
    assert [(f.request, f.kind) for f in failures] == [("r1", "missing-hit"), ("r2", "missing-hit")]
    assert "served from the cache" in failures[0].message


def test_summary_figures():
    s = summarize_pass(result(record("r1", 80, [1, 2, 3], cached=16, loaded=48, ttft=0.010),
                              record("r2", 40, [4, 5], ttft=0.030)))
    assert (s.num_prompt_tokens, s.num_output_tokens, s.tokens_saved) == (120, 5, 64)
    assert s.hit_rate == round(64 / 120, 4) and s.ttft_p50_ms == 20.0 and s.output_tokens_per_s == 5.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5 and percentile([], 90) is None


def test_arm_specs_and_units(tmp_path):
    disk = make_builtin_arm("disk", disk_root=tmp_path)
    assert disk.survives_restart and disk.rebuild_before_reuse and hit_source(disk, rebuilt=True) == "disk"
    assert hit_source(disk, rebuilt=False) == "cpu"
    assert not make_builtin_arm("cpu").survives_restart
    lm = make_builtin_arm("lmcache", lmcache_url="lm://127.0.0.1:9")
    assert lm.survives_restart and hit_unit_tokens(lm, BS) == BS and hit_source(lm, rebuilt=False) == "lmcache"
    vllm_keys = parse_arm_spec('lm=' + json.dumps({"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both",
                                                   "kv_connector_extra_config": {"hash_algo": "vllm"}}))
    assert hit_unit_tokens(vllm_keys, BS) == 256
    big = parse_arm_spec('big={"kv_connector":"OffloadingConnector","kv_role":"kv_both",'
                         '"kv_connector_extra_config":{"offload_block_tokens":64,"root_dir":"x"}}')
    assert hit_unit_tokens(big, BS) == 64 and big.survives_restart and big.rebuild_before_reuse
    for spec, message in [("cpu", "write NAME=JSON"), ("a b={}", "arm name"), ("none={}", "built in"),
                          ('x={"kv_connector":"Nope","kv_role":"kv_both"}', "unknown kv_connector")]:
        with pytest.raises(ConfigError, match=message):
            parse_arm_spec(spec)
    with pytest.raises(ConfigError, match="needs --lmcache-url"):
        make_builtin_arm("lmcache")


def test_restarts_that_would_lose_the_kv_are_refused(tmp_path):
    cpu, disk = make_builtin_arm("cpu"), make_builtin_arm("disk", disk_root=tmp_path)
    refuse_unreplayable([cpu, disk], "none", "both")
    refuse_unreplayable([disk], "process", "both")
    with pytest.raises(ConfigError, match=r"arm 'cpu' keeps its KV inside the engine .* --restart process"):
        refuse_unreplayable([disk, cpu], "process", "both")
    with pytest.raises(ConfigError, match="a reuse pass on its own"):
        refuse_unreplayable([make_builtin_arm("prefix-cache")], "none", "reuse")


def test_redis_arms_are_lmcache_connectors_on_their_store():
    urls = {"redis": "redis://127.0.0.1:1", "redis-cluster": "redis-cluster://127.0.0.1:1,127.0.0.1:2",
            "redis-sentinel": "redis-sentinel://127.0.0.1:3"}
    for name, url in urls.items():
        arm = make_builtin_arm(name, store_urls=urls)
        assert json.loads(arm.kv_transfer_config)["kv_connector_extra_config"] == {"remote_url": url}
        # a sentinel's store is a Redis: its hits are Redis hits
        assert arm.survives_restart and hit_source(arm, rebuilt=False) == name.removesuffix("-sentinel")
    with pytest.raises(ConfigError, match="needs its store's URL"):
        make_builtin_arm("redis")
