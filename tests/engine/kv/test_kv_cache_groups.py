"""KV cache groups (`kv.groups`, `core.kv_blocks`): vLLM's grouping, per-group tables over one
pool, sliding-window groups that free what falls behind the window, and per-group prefix hits.

The engine runs Gemma 2, Gemma 3 and a windowed Mistral with KV cache groups; a cache that keeps
one table for every layer and every token (vLLM's unified layout for Gemma, a one-group connector's
layout for the Mistral) gives the same tokens and logprobs bit for bit (the CPU kernels give a row the same bits
whatever the masked keys hold), with chunked prefill and prefix hits, while the hybrid engine
holds a window's worth of blocks for each local group.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from kvtool.engine.core.block_pool import NULL_BLOCK, BlockPool
from kvtool.engine.core.kv_blocks import GroupTables
from kvtool.engine.engine import LLMEngine
from kvtool.engine.kv.groups import KVCacheGroup, KVCacheLayout, plan_layout, single_group
from kvtool.engine.params import EngineParams, SamplingParams
from kvtool.peer.env import peer_env
from tests.support.peer_server import require_peer_python
from tests.support.window_models import WINDOW_PRESETS, window_model_dir

PEER_HITS = Path(__file__).resolve().parents[2] / "support" / "peer_vllm_hits.py"

BS = 16
WINDOW = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logprobs=2)
PREFIX = [(i * 37 + 11) % 240 + 5 for i in range(80)]
PROMPTS = [PREFIX + [(i * 13 + k * 7) % 240 + 5 for i in range(n)] for k, n in enumerate((9, 30, 57))]


# ---- the grouping -------------------------------------------------------------------------------


def _gemma3_windows(n: int, w: int = 1024) -> list[int | None]:
    return [None if (i + 1) % 6 == 0 else w for i in range(n)]


PATTERNS = {
    "gemma3-34": _gemma3_windows(34),
    "gemma2-26": [4096 if i % 2 == 0 else None for i in range(26)],
    "mistral-8": [4096] * 8,
    "dense-6": [None] * 6,
    "12sw-13full": [None if i % 2 else 512 for i in range(25)],
    "two-windows": [None if i % 4 == 3 else (128 if i % 2 else 256) for i in range(16)],
}


def test_gemma3_groups_are_vllms():
    layout = plan_layout(PATTERNS["gemma3-34"])
    assert layout.num_groups == 7 and layout.num_slots == 5
    # The 29 local layers split as local[i::6]: five groups of 5, the sixth of 4 (a padding slot).
    assert layout.groups[0] == KVCacheGroup(layers=(0, 7, 14, 21, 28), sliding_window=1024)
    assert layout.groups[5] == KVCacheGroup(layers=(6, 13, 20, 27), sliding_window=1024)
    assert layout.groups[6] == KVCacheGroup(layers=(5, 11, 17, 23, 29), sliding_window=None)
    assert layout.layer_group[29] == 6 and layout.layer_slot[29] == 4 and layout.layer_slot[27] == 3
    assert plan_layout(PATTERNS["gemma3-34"], hybrid=False).num_groups == 1
    assert layout.describe() == "7 groups of 5 slots: window 1024 x5 (5), window 1024 x4, full x5"


def test_a_layout_covers_every_layer_once():
    with pytest.raises(ValueError):
        KVCacheLayout(num_layers=3, groups=(KVCacheGroup(layers=(0, 1)),))


@pytest.mark.peer
def test_grouping_equals_vllms_own_function():
    """vLLM 0.33's `_get_kv_cache_groups_uniform_page_size`, run in the peer environment on the
    same layers' specs, forms the same groups in the same order."""
    script = """
import json, sys, torch
from vllm.v1.core.kv_cache_planning import _get_kv_cache_groups_uniform_page_size
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec
out = {}
for name, windows in json.loads(sys.stdin.read()).items():
    common = dict(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    specs = {f"model.layers.{i}.self_attn.attn": FullAttentionSpec(**common) if w is None
             else SlidingWindowSpec(sliding_window=w, **common) for i, w in enumerate(windows)}
    if len(set(windows)) == 1:
        continue
    groups = _get_kv_cache_groups_uniform_page_size(specs)
    out[name] = [[[int(n.split(".")[2]) for n in g.layer_names], getattr(g.kv_cache_spec, "sliding_window", None)]
                 for g in groups]
print(json.dumps(out))
"""
    hybrid = {k: v for k, v in PATTERNS.items() if len(set(v)) > 1}
    got = subprocess.run([str(require_peer_python()), "-c", script], input=json.dumps(hybrid), capture_output=True,
                         text=True, env=peer_env(), timeout=300)
    assert got.returncode == 0, got.stderr[-3000:]
    vllm = json.loads(got.stdout.strip().splitlines()[-1])
    assert sorted(vllm) == sorted(hybrid)
    for name, windows in hybrid.items():
        ours = [[list(g.layers), g.sliding_window] for g in plan_layout(windows).groups]
        assert ours == vllm[name], name


# ---- hits and freeing over one pool ---------------------------------------------------------------


def _tables(num_blocks: int = 64, windows=(None, 3 * BS)) -> GroupTables:
    layout = KVCacheLayout(num_layers=len(windows),
                           groups=tuple(KVCacheGroup(layers=(i,), sliding_window=w) for i, w in enumerate(windows)))
    return GroupTables(BlockPool(num_blocks, True, null_block=True), layout, BS)


HASHES = [bytes([i]) * 32 for i in range(16)]


def test_a_sliding_group_frees_what_falls_behind_its_window():
    t = _tables()
    tables = t.empty()
    t.grow(tables, 10 * BS)
    assert [len(x) for x in tables] == [10, 10] and NULL_BLOCK not in tables[0] + tables[1]
    free = t.pool.num_free_blocks
    # The next token at position 160 attends (160 - 48, 160]: blocks 0..6 end before position 113.
    t.free_skipped(tables, 10 * BS)
    assert tables[1][:7] == [NULL_BLOCK] * 7 and NULL_BLOCK not in tables[1][7:]
    assert NULL_BLOCK not in tables[0]  # full attention keeps every block
    assert t.pool.num_free_blocks == free + 7
    t.free(tables)
    t.pool.check_integrity()
    assert t.pool.num_free_blocks == t.pool.num_usable_blocks == 63


def test_a_hit_needs_the_full_prefix_and_the_window_before_it():
    t = _tables()
    tables = t.empty()
    t.grow(tables, 10 * BS)
    blocks = [list(x) for x in tables]
    t.cache(tables, HASHES, 0, 10)
    t.free_skipped(tables, 10 * BS)  # the window group's blocks 0..6 go to the free queue, still cached
    hit, n = t.find_hit(HASHES, 9)
    # The window group needs ceil((48 - 1) / 16) = 3 blocks before the hit point: 6, 7, 8.
    assert n == 9 and hit == [blocks[0][:9], [NULL_BLOCK] * 6 + blocks[1][6:9]]
    t.free(tables)
    # Without the window group's block 7, the longest hit whose window is whole ends at block 7
    # (its blocks 4..6 are cached), and the full group agrees.
    t.pool.evict([blocks[1][7]])
    assert t.find_hit(HASHES, 9) == ([blocks[0][:7], [NULL_BLOCK] * 4 + blocks[1][4:7]], 7)
    # The full group missing block 2 caps every group at 2 blocks (a run from block 0 counts).
    t.pool.evict([blocks[0][2]])
    assert t.find_hit(HASHES, 9) == ([blocks[0][:2], blocks[1][:2]], 2)
    t.pool.check_integrity()


@pytest.mark.peer
def test_hits_equal_vllms_coordinator_on_random_caches():
    """vLLM 0.33's `find_longest_cache_hit` (its hybrid coordinator, in the peer environment)
    and kvtool's `find_hit` give the same hit length and the same blocks for every group, over
    random sets of cached blocks per group: full attention with one window, one window alone,
    two windows with full attention."""
    import random

    rng = random.Random(11)
    kinds = [(None, 3 * BS), (2 * BS + 1,), (None, 5 * BS, 2 * BS), (None, None, BS + 1)]
    cases = []
    for n in range(120):
        windows = kinds[n % len(kinds)]
        num_hashes = rng.randint(1, 14)
        density = rng.choice((0.5, 0.8, 0.95))
        cached = [sorted(i for i in range(num_hashes) if rng.random() < density) for _ in windows]
        cases.append({"windows": list(windows), "num_blocks": 64 * len(windows), "num_hashes": num_hashes,
                      "cached": cached, "max_length": rng.randint(0, num_hashes)})
    got = subprocess.run([str(require_peer_python()), str(PEER_HITS)], input=json.dumps({"block_size": BS, "cases": cases}),
                         capture_output=True, text=True, env=peer_env(), timeout=600)
    assert got.returncode == 0, got.stderr[-3000:]
    vllm = json.loads(got.stdout.strip().splitlines()[-1])
    for case, theirs in zip(cases, vllm, strict=True):
        windows = case["windows"]
        t = _tables(num_blocks=64 * len(windows) + 1, windows=windows)
        index_of = {}
        for g, cached in enumerate(case["cached"]):
            for i in cached:
                (b,) = t.pool.allocate(1)
                t.pool.cache_blocks([b], [HASHES[i]], 0, 1, g)
                index_of[b] = i
        t.pool.free(list(index_of))
        tables, length = t.find_hit(HASHES[: case["num_hashes"]], case["max_length"])
        ours = [[-1 if b == NULL_BLOCK else index_of[b] for b in table] for table in tables]
        assert {"length": length, "tables": ours} == theirs, case


# ---- the engine -------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=WINDOW_PRESETS)
def model_dir(request, tmp_path_factory):
    return window_model_dir(tmp_path_factory.mktemp("groups"), request.param, WINDOW)


def _engine(model_dir, **overrides) -> LLMEngine:
    params = {"model": str(model_dir), "device": "cpu", "kv_cache_memory": 16 << 20, "max_model_len": 512,
              "max_num_batched_tokens": 32, "block_size": BS, **overrides}
    return LLMEngine(EngineParams(**params))


def _run(engine: LLMEngine) -> tuple[list, list]:
    """The prompts twice (the second time from the prefix cache), each run's results."""
    first = engine.generate(PROMPTS, GREEDY)
    again = engine.generate(PROMPTS, GREEDY)
    return first, again


def test_hybrid_groups_give_the_unified_caches_bits(model_dir):
    """Against a cache that keeps every token in one full-attention group: vLLM's unified layout
    (the flag) for Gemma; for the windowed Mistral, whose one window group the flag keeps, the
    layout of a connector that moves one group (a test connector's)."""
    hybrid = _engine(model_dir)
    unified = _engine(model_dir, disable_hybrid_kv_cache_manager=True)
    if unified.kv_layout.hybrid:
        unified.close()
        ktc = json.dumps({"kv_connector": "DictConnector", "kv_role": "kv_both",
                          "kv_connector_module_path": "tests.support.connectors.dict_connector"})
        from kvtool.engine.connectors.config import parse_kv_transfer_config

        unified = _engine(model_dir, kv_transfer_config=parse_kv_transfer_config(ktc))
    try:
        assert hybrid.kv_layout.hybrid
        assert unified.kv_layout == single_group(hybrid.kv_layout.num_layers)
        # The same --kv-cache-memory holds L / slots times the blocks: a block holds one group's layers.
        slots, layers = hybrid.kv_layout.num_slots, hybrid.kv_layout.num_layers
        assert abs(hybrid.num_blocks * slots - unified.num_blocks * layers) < layers
        h_first, h_again = _run(hybrid)
        u_first, u_again = _run(unified)
        hybrid.check_integrity()
        pool = hybrid.scheduler.pool
        assert pool.num_free_blocks == pool.num_usable_blocks
        pages = hybrid.executor.worker.kv_pages.tensor
        assert torch.count_nonzero(pages[NULL_BLOCK]) == 0  # nothing ever wrote the null block
    finally:
        hybrid.close()
        unified.close()
    for a, b in ((h_first, u_first), (h_again, u_again), (h_again, h_first)):
        assert [r.output_token_ids for r in a] == [r.output_token_ids for r in b]
        assert [r.logprobs for r in a] == [r.logprobs for r in b]
    assert all(r.stats.num_cached_tokens >= 80 for r in h_again)


def test_sliding_groups_hold_a_window_not_the_context(model_dir):
    """A 400-token request: each sliding-window group holds at most the blocks of its window and of
    one step's tokens at every step; full-attention groups hold the whole context."""
    engine = _engine(model_dir)
    try:
        layout = engine.kv_layout
        prompt = [(i * 29 + 3) % 240 + 5 for i in range(400)]
        rid = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
        bound = -(-(WINDOW - 1 + 32) // BS) + 1
        most = [0] * layout.num_groups
        while engine.has_unfinished_requests():
            engine.step()
            req = engine.scheduler.requests.get(rid)
            if req is None or req.is_finished:
                continue
            for g, table in enumerate(req.group_block_ids):
                most[g] = max(most[g], sum(1 for b in table if b != NULL_BLOCK))
    finally:
        engine.close()
    for g, group in enumerate(layout.groups):
        if group.sliding_window is None:
            assert most[g] >= 400 // BS
        else:
            assert 0 < most[g] <= bound, (g, most[g])


def test_a_connector_that_moves_one_group_keeps_one_group(model_dir):
    """As vLLM turns its hybrid manager off for a connector that is not SupportsHMA: one full
    group with such a connector (a test connector here, LMCache's in a peer key mode in use), the
    model's groups with the OffloadingConnector (tests/engine/connectors/offloading/test_offload_kv_groups.py)
    and with LMCache's in its blake3 mode (tests/engine/connectors/lmcache/test_lmcache_kv_groups.py)."""
    from kvtool.engine.connectors.config import parse_kv_transfer_config

    one = json.dumps({"kv_connector": "DictConnector", "kv_role": "kv_both",
                      "kv_connector_module_path": "tests.support.connectors.dict_connector"})
    groups = json.dumps({"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                         "kv_connector_extra_config": {"num_cpu_blocks": 64}})
    engine = _engine(model_dir, kv_transfer_config=parse_kv_transfer_config(one))
    try:
        assert engine.kv_layout.num_groups == 1 and not engine.kv_layout.hybrid
    finally:
        engine.close()
    engine = _engine(model_dir, kv_transfer_config=parse_kv_transfer_config(groups))
    try:
        assert engine.kv_layout == _engine_layout(model_dir)
    finally:
        engine.close()


def _engine_layout(model_dir):
    engine = _engine(model_dir)
    try:
        return engine.kv_layout
    finally:
        engine.close()


def test_groups_under_preemption_async_scheduling_and_two_ranks(model_dir):
    """A pool too small for the batch (preemptions), steps scheduled ahead of their results, and
    two tensor-parallel ranks (whose runners build their tables from the messages' per-group
    block ids) give the unified cache's tokens; the ranks' logprobs within float32 tolerance."""
    prompts = PROMPTS + [[(i * 11 + 5) % 240 + 5 for i in range(150)]]
    unified = _engine(model_dir, disable_hybrid_kv_cache_manager=True)
    try:
        expected = unified.generate(prompts, GREEDY)
    finally:
        unified.close()
    probe = _engine(model_dir, max_num_batched_tokens=64)
    try:
        # Room for the longest request alone (beside the null block): the rest wait or are preempted.
        longest = probe.scheduler.tables.max_blocks(len(prompts[-1]) + GREEDY.max_tokens, 64)
    finally:
        probe.close()
    for overrides in ({"num_gpu_blocks": longest + 1, "max_num_batched_tokens": 64},
                      {"async_scheduling": True},
                      {"tensor_parallel_size": 2, "async_scheduling": True}):
        engine = _engine(model_dir, **overrides)
        try:
            assert engine.kv_layout.hybrid
            got = engine.generate(prompts, GREEDY)
            engine.check_integrity()
            preempted = engine.stats().num_preemptions
        finally:
            engine.close()
        assert [r.output_token_ids for r in got] == [r.output_token_ids for r in expected], overrides
        if "num_gpu_blocks" in overrides:
            assert preempted > 0
        if "tensor_parallel_size" not in overrides:
            assert [r.logprobs for r in got] == [r.logprobs for r in expected], overrides
        else:
            for a, b in zip(got, expected):
                for la, lb in zip(a.logprobs, b.logprobs):
                    assert la.keys() == lb.keys()
                    assert all(abs(la[t] - lb[t]) < 1e-4 for t in la)


def test_the_flag_is_vllms_three_way_switch(model_dir, run_kvtool):
    """Unset: groups where the engine can; --disable-hybrid-kv-cache-manager: one group;
    --no-disable-hybrid-kv-cache-manager where the engine cannot keep groups: one line and a
    non-zero exit, as vLLM refuses it (LMCache's connector in a peer key mode there, whatever the
    model)."""
    from kvtool.engine.connectors.config import parse_kv_transfer_config
    from kvtool.engine.errors import ConfigError

    engine = _engine(model_dir, disable_hybrid_kv_cache_manager=False)
    try:
        assert engine.kv_layout.hybrid
        all_local = engine.kv_layout.num_groups == 1
    finally:
        engine.close()
    # vLLM's unified layout keeps the window group of a model whose layers all share one window.
    engine = _engine(model_dir, disable_hybrid_kv_cache_manager=True)
    try:
        assert engine.kv_layout.num_groups == 1 and engine.kv_layout.hybrid == all_local
    finally:
        engine.close()
    lm = parse_kv_transfer_config('{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both",'
                                  '"kv_connector_extra_config":{"remote_url":"lm://127.0.0.1:1","hash_algo":"vllm"}}')
    with pytest.raises(ConfigError, match="LMCacheConnectorV1 does not support the hybrid KV cache manager"):
        _engine(model_dir, disable_hybrid_kv_cache_manager=False, kv_transfer_config=lm)
    code, out, err = run_kvtool(["generate", "--model", str(model_dir), "--device", "cpu",
                                 "--no-disable-hybrid-kv-cache-manager", "--kv-transfer-config",
                                 '{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both",'
                                 '"kv_connector_extra_config":{"remote_url":"lm://127.0.0.1:1","hash_algo":"vllm"}}',
                                 "--prompt", "hello"])
    assert code != 0 and "Traceback" not in err
    assert "--no-disable-hybrid-kv-cache-manager: LMCacheConnectorV1 does not support the hybrid" in err
