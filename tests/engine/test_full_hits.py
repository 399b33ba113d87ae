"""Full hits: a prompt whose every block (offload block, chunk) is held by a connector loads the
whole prefix, its last block too, and computes only the last token, as LMCache's vLLM adapter
does. That one token rewrites its own slot of the loaded block with the bits it had there (a
prompt row is computed the same whatever rows come with it), so tokens and log-probabilities
equal a run without any connector.

A local prefix-cache full hit is unchanged: like vLLM's, it stops at the last whole block
before the last token and computes the rest.
"""

import json

import pytest

from kvtool.engine.connectors.config import parse_kv_transfer_config
from kvtool.engine.params import SamplingParams

SAMPLING = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3)


def prompt(n, seed):
    return [(i * 29 + seed * 53) % 240 + 5 for i in range(n)]


def config(connector, **extra):
    return parse_kv_transfer_config(json.dumps({
        "kv_connector": connector, "kv_role": "kv_both", "kv_load_failure_policy": "fail",
        "kv_connector_extra_config": extra,
    }))


def record_steps(engine):
    """Every (request id, start, num_tokens) the runner is given, in order."""
    steps = []
    execute_async = engine.executor.execute_async

    def spy(so):
        steps.extend((s.request_id, s.start, s.num_tokens) for s in so.scheduled)
        return execute_async(so)

    engine.executor.execute_async = spy
    return steps


def prompt_steps(steps, result, n):
    """The steps that computed prompt tokens of `result`'s request."""
    return [(start, k) for rid, start, k in steps if rid == result.request_id and start < n]


def assert_same_output(got, want):
    assert got.output_token_ids == want.output_token_ids
    assert got.logprobs == want.logprobs  # bit-identical, not close


def full_hit(make_engine, ktc, p, *, rebuild=False, **engine_args):
    """Fill with one engine, then generate `p` again on a cold local cache; returns (fill, hit, steps)."""
    filler = make_engine(kv_transfer_config=ktc, enable_prefix_caching=False, **engine_args)
    fill = filler.generate([p], SAMPLING)[0]
    filler.executor.worker.connector.flush()
    engine = make_engine(kv_transfer_config=ktc, enable_prefix_caching=False, **engine_args) if rebuild else filler
    steps = record_steps(engine)
    hit = engine.generate([p], SAMPLING)[0]
    return fill, hit, steps


@pytest.mark.parametrize(("n", "extra"), [
    (64, {}),  # engine blocks of 16 tokens as the offload unit
    (512, {"offload_block_tokens": 256}),
])
def test_cpu_tier_full_hit_computes_one_token(make_engine, n, extra):
    p = prompt(n, 1)
    ref = make_engine().generate([p], SAMPLING)[0]
    fill, hit, steps = full_hit(make_engine, config("OffloadingConnector", num_cpu_blocks=64, **extra), p)
    assert fill.stats.num_external_stored_tokens == n
    assert hit.stats.num_cached_tokens == 0
    assert hit.stats.num_external_tokens == n - 1
    assert hit.stats.num_external_loaded_tokens == n  # the last block is loaded whole
    assert prompt_steps(steps, hit, n) == [(n - 1, 1)]
    assert_same_output(fill, ref)
    assert_same_output(hit, ref)


@pytest.mark.parametrize(("n", "extra"), [(48, {}), (512, {"offload_block_tokens": 256})])
def test_disk_tier_full_hit_after_restart_computes_one_token(make_engine, tmp_path, n, extra):
    p = prompt(n, 2)
    ref = make_engine().generate([p], SAMPLING)[0]
    ktc = config("OffloadingConnector", num_cpu_blocks=64, root_dir=str(tmp_path / "tier"), **extra)
    _, hit, steps = full_hit(make_engine, ktc, p, rebuild=True)
    assert hit.stats.num_external_tokens == n - 1 and hit.stats.num_external_loaded_tokens == n
    assert prompt_steps(steps, hit, n) == [(n - 1, 1)]
    assert_same_output(hit, ref)


def test_lmcache_full_hit_computes_one_token(make_engine, lmcache_server):
    n = 512
    p = prompt(n, 3)
    ref = make_engine().generate([p], SAMPLING)[0]
    ktc = config("LMCacheConnectorV1", host=lmcache_server.host, port=lmcache_server.port, hash_algo="vllm")
    fill, hit, steps = full_hit(make_engine, ktc, p, rebuild=True)
    assert fill.stats.num_external_stored_tokens == n
    assert hit.stats.num_external_tokens == n - 1 and hit.stats.num_external_loaded_tokens == n
    assert prompt_steps(steps, hit, n) == [(n - 1, 1)]
    assert_same_output(hit, ref)


def test_lmcache_full_hit_at_engine_block_chunks(make_engine, lmcache_server):
    """Chunks of one engine block (16 tokens): the same rule at the finest unit."""
    n = 80
    p = prompt(n, 4)
    ref = make_engine().generate([p], SAMPLING)[0]
    ktc = config("LMCacheConnectorV1", host=lmcache_server.host, port=lmcache_server.port, hash_algo="vllm",
                 chunk_tokens=16)
    _, hit, steps = full_hit(make_engine, ktc, p, rebuild=True)
    assert hit.stats.num_external_tokens == n - 1 and hit.stats.num_external_loaded_tokens == n
    assert prompt_steps(steps, hit, n) == [(n - 1, 1)]
    assert_same_output(hit, ref)


def test_partial_last_block_is_computed_as_before(make_engine):
    """A prompt that does not end on a block boundary: its partial block is in no tier, so the
    whole blocks are loaded and the partial one computed."""
    n = 70
    p = prompt(n, 5)
    ref = make_engine().generate([p], SAMPLING)[0]
    _, hit, steps = full_hit(make_engine, config("OffloadingConnector", num_cpu_blocks=64), p)
    assert hit.stats.num_external_tokens == 64 and hit.stats.num_external_loaded_tokens == 64
    assert prompt_steps(steps, hit, n) == [(64, 6)]
    assert_same_output(hit, ref)


def test_local_full_hit_then_connector_loads_the_last_block(make_engine):
    """The local prefix cache stops one block short (vLLM's rule); the connector then serves
    the last block, and still only the last token is computed."""
    n = 64
    p = prompt(n, 6)
    ref = make_engine().generate([p], SAMPLING)[0]
    engine = make_engine(kv_transfer_config=config("OffloadingConnector", num_cpu_blocks=64))
    engine.generate([p], SAMPLING)
    steps = record_steps(engine)
    hit = engine.generate([p], SAMPLING)[0]
    assert hit.stats.num_cached_tokens == 48
    assert hit.stats.num_external_tokens == 15 and hit.stats.num_external_loaded_tokens == 16
    assert prompt_steps(steps, hit, n) == [(n - 1, 1)]
    assert_same_output(hit, ref)


def test_local_prefix_cache_full_hit_unchanged(make_engine):
    n = 64
    p = prompt(n, 7)
    ref = make_engine(enable_prefix_caching=False).generate([p], SAMPLING)[0]
    engine = make_engine()
    engine.generate([p], SAMPLING)
    steps = record_steps(engine)
    hit = engine.generate([p], SAMPLING)[0]
    assert hit.stats.num_cached_tokens == 48 and hit.stats.num_external_tokens == 0
    assert prompt_steps(steps, hit, n) == [(48, 16)]
    assert_same_output(hit, ref)


def test_dict_connector_full_hit_loads_the_last_block_whole(make_engine):
    from tests.support.connectors import dict_connector

    dict_connector.STORE.clear()
    n = 48
    p = prompt(n, 8)
    ref = make_engine().generate([p], SAMPLING)[0]
    ktc = parse_kv_transfer_config(json.dumps({
        "kv_connector": "DictConnector", "kv_connector_module_path": "tests.support.connectors.dict_connector",
        "kv_role": "kv_both"}))
    engine = make_engine(kv_transfer_config=ktc, enable_prefix_caching=False)
    engine.generate([p], SAMPLING)
    steps = record_steps(engine)
    hit = engine.generate([p], SAMPLING)[0]
    assert hit.stats.num_external_tokens == n - 1 and hit.stats.num_external_loaded_tokens == n
    assert hit.stats.num_external_stored_tokens == 0  # the loaded blocks are not stored back
    assert prompt_steps(steps, hit, n) == [(n - 1, 1)]
    assert_same_output(hit, ref)
    dict_connector.STORE.clear()


def test_ttft_grid_of_full_hits_is_valid(lmcache_server, tmp_path):
    """`kvtool bench ttft` at a prompt of whole blocks, hit fraction 1: every connector arm loads
    all 4 blocks and computes one token, the prefix-cache arm serves 3, and every cell is valid."""
    from typer.testing import CliRunner

    from kvtool.cli import app

    out = tmp_path / "ttft.json"
    result = CliRunner().invoke(app, [
        "bench", "ttft", "--preset", "tiny", "--load-format", "dummy", "--device", "cpu", "--kv-cache-memory", "64M",
        "--prompt-lens", "64", "--hit-fractions", "1", "--concurrency", "1,2", "--repeats", "1", "--max-tokens", "3",
        "--arms", "none,prefix-cache,cpu,disk,lmcache", "--lmcache-url",
        f"lm://{lmcache_server.host}:{lmcache_server.port}", "--json", str(out),
    ])
    assert result.exit_code == 0, result.output + repr(result.exception)
    cells = json.loads(out.read_text())["cells"]
    assert len(cells) == 5 * 2
    for c in cells:
        assert c["valid"] and c["output_equal"] is True, c
        assert c["hit_tokens"] == c["expected_hit_tokens"]
        per_request = {"none": 0, "prefix-cache": 48}.get(c["arm"], 64)
        assert c["expected_hit_tokens"] == per_request * c["concurrency"], c
