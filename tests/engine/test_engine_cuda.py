"""The engine on CUDA: graph decode against eager decode, the fast path against the reference
backend, and the CPU tier's asynchronous copies (whole-block loads, loads in groups of layers as
pitched copies on the copy engine, stores that run beside the next step, disk write-through).
Skipped without CUDA.
"""

import json

import pytest
import torch

from kvtool.engine.connectors.config import parse_kv_transfer_config
from kvtool.engine.params import SamplingParams

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def prompt(n, seed=0):
    return [(i * 31 + seed * 17) % 500 + 5 for i in range(n)]


def offload_config(**extra):
    return parse_kv_transfer_config(json.dumps({
        "kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_load_failure_policy": "fail",
        "kv_connector_extra_config": extra,
    }))


@pytest.fixture
def cuda_engine(tiny_model_dir):
    from kvtool.engine.engine import LLMEngine
    from kvtool.engine.params import EngineParams

    engines = []

    def factory(graphs=True, **overrides):
        params = {"model": str(tiny_model_dir), "device": "cuda", "dtype": "bfloat16", "num_gpu_blocks": 600,
                  "enforce_eager": not graphs}
        params.update(overrides)
        engine = LLMEngine(EngineParams(**params))
        assert engine.executor.worker.runner.backend == ("reference" if params.get("attention_backend") == "reference" else "cuda")
        engines.append(engine)
        return engine

    yield factory
    for engine in engines:
        if not engine.has_unfinished_requests():
            engine.check_integrity()
        engine.close()


@pytest.mark.parametrize("batch", [1, 4, 8])
def test_graph_decode_equals_eager(cuda_engine, batch):
    prompts = [prompt(20 + 37 * i, seed=i) for i in range(batch)]
    graphed = cuda_engine()
    eager = cuda_engine(graphs=False)
    a = graphed.generate(prompts, GREEDY)
    assert sum(graphed.executor.worker.runner.graphs.replays.values()), "no decode step replayed a graph"
    b = eager.generate(prompts, GREEDY)
    assert [r.output_token_ids for r in a] == [r.output_token_ids for r in b]


def test_decode_graphs_are_captured_at_start_up_up_to_max_num_seqs(cuda_engine):
    """Every bucket up to --max-num-seqs is captured when the engine starts, and none above it;
    requests of every batch size replay those graphs and capture nothing."""
    engine = cuda_engine(max_num_seqs=20)
    graphs = engine.executor.worker.runner.graphs
    assert graphs.buckets == [1, 2, 4, 8, 16, 20]
    captured = dict(graphs.graphs)
    assert sorted(captured) == graphs.buckets
    for batch in (1, 3, 13, 20):
        engine.generate([prompt(30 + 7 * i, seed=i) for i in range(batch)], GREEDY)
    assert graphs.graphs == captured
    assert set(graphs.replays) == {1, 4, 16, 20}


def test_graph_decode_with_padding_rows(cuda_engine):
    """5 sequences replay the graph of 8 with 3 padded rows (slot -1, context 0): the outputs
    follow eager decode of the same 5 (same tokens, log-probabilities within bf16 rounding)."""
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
    prompts = [prompt(50 + 11 * i, seed=i) for i in range(5)]
    graphed = cuda_engine()
    a = graphed.generate(prompts, sp)
    assert graphed.executor.worker.runner.graphs.replays.get(8)
    b = cuda_engine(graphs=False).generate(prompts, sp)
    for x, y in zip(a, b):
        for tx, ty, lx, ly in zip(x.output_token_ids, y.output_token_ids, x.logprobs, y.logprobs):
            assert abs(lx[tx] - ly[ty]) < 0.05
            if tx != ty:
                break


def test_one_token_prefill_steps_replay_graphs_with_the_eager_bits(cuda_engine):
    """A full hit's last token (a local prefix-cache hit; a CPU-tier hit in groups of layers,
    whose layer hooks run between the graphs) replays the one-token prefill graphs around its
    eager attention, and gets the token and logprobs of the eager forward of an engine without
    graphs."""
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3)
    p = prompt(593)
    runs = []
    for graphs, ktc in ((False, None), (True, None), (True, offload_config(num_cpu_blocks=64))):
        extra = {"kv_transfer_config": ktc, "enable_prefix_caching": False} if ktc else {}
        engine = cuda_engine(graphs=graphs, **extra)
        assert (engine.executor.worker.runner.prefill_graphs is not None) is graphs
        engine.generate([p], sp)
        if ktc is not None:
            engine.flush_connector()
        hit = engine.generate([p], sp)[0]
        loaded = hit.stats.num_external_loaded_tokens if ktc is not None else hit.stats.num_cached_tokens
        assert loaded == 592
        if graphs:
            assert engine.executor.worker.runner.prefill_graphs.replays == 1
        runs.append(hit)
    eager, local, tier = runs
    assert local.output_token_ids == eager.output_token_ids
    assert local.logprobs[0] == eager.logprobs[0]  # the token the graphs computed
    assert (tier.output_token_ids, tier.logprobs) == (local.output_token_ids, local.logprobs)


def test_fast_path_logprobs_close_to_reference(cuda_engine):
    """Same bf16 weights: Triton/cuDNN/varlen kernels against the reference backend's SDPA."""
    sp = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)
    prompts = [prompt(n, seed=n) for n in (7, 130, 333)]
    fast = cuda_engine()
    ref = cuda_engine(graphs=False, attention_backend="reference")
    a = fast.generate(prompts, sp)
    b = ref.generate(prompts, sp)
    for x, y in zip(a, b):
        lx, ly = x.logprobs[0], y.logprobs[0]
        common = set(lx) & set(ly)
        assert len(common) >= 4
        assert max(abs(lx[t] - ly[t]) for t in common) < 0.1


@pytest.mark.parametrize("arm", ["whole blocks", "layer groups", "layerwise"])
def test_prefix_hit_equals_offload_hit_with_whole_block_and_layerwise_transfers(cuda_engine, monkeypatch, arm):
    """A local prefix-cache hit and a CPU-tier hit give the same step shapes and the same KV bytes:
    the outputs must be identical with loads as whole blocks, in groups of layers (the default
    for a hit of 32 blocks or more) and with `layerwise` (saves through the layer kernel too);
    layerwise saves fill the tier with the same bytes as whole-block ones."""
    from kvtool.engine.connectors.offloading import worker as worker_module

    p = prompt(600)
    local = cuda_engine()
    local.generate([p], GREEDY)
    hit_local = local.generate([p], GREEDY)[0]
    assert hit_local.stats.num_cached_tokens == 592

    if arm == "whole blocks":
        monkeypatch.setattr(worker_module, "LAYER_GROUP_LOAD_MIN_BLOCKS", 38)
    layerwise = arm == "layerwise"
    pools = []
    for saves_layerwise in (False, layerwise):
        engine = cuda_engine(kv_transfer_config=offload_config(num_cpu_blocks=64, layerwise=saves_layerwise),
                             enable_prefix_caching=False)
        worker = engine.executor.worker.connector
        assert worker.layerwise is saves_layerwise
        transfers = worker.transfers
        layer_calls = []
        store_layer = transfers.store_layer
        transfers.store_layer = lambda *a: layer_calls.append(a[-1]) or store_layer(*a)
        pitched_loads = []
        load_layers = transfers._load_layers
        transfers._load_layers = lambda pairs: pitched_loads.append(len(pairs)) or load_layers(pairs)
        cold = engine.generate([p], GREEDY)[0]
        assert cold.stats.num_external_stored_tokens == 592
        # 37 blocks: a layerwise save (at least LAYERWISE_MIN_BLOCKS), one copy per layer
        num_layers = engine.executor.worker.runner.kv_pages.geometry.num_layers
        assert layer_calls == (list(range(num_layers)) if saves_layerwise else [])
        worker.flush()
        pools.append(worker.pool.pool.clone())
        hit = engine.generate([p], GREEDY)[0]
        assert hit.stats.num_external_loaded_tokens == 592
        assert hit.output_token_ids == hit_local.output_token_ids
        # 37 blocks loaded: in groups of layers through the copy engine unless held to whole blocks
        assert pitched_loads == ([] if arm == "whole blocks" else [37])
        assert transfers.layers_per_copy > 1  # the tiny model's pieces are far below LOAD_ROW_BYTES
    assert torch.equal(pools[0].view(torch.uint8), pools[-1].view(torch.uint8))


def test_a_steps_inputs_reach_the_device_before_its_loads_are_queued(cuda_engine):
    """Copies to the device run in the order they were queued: a full hit's input copy queued
    after its loads would hold the forward until the last group of layers is in. The runner
    packs the step's inputs first."""
    from kvtool.engine.worker import model_runner as runner_module
    p = prompt(600)
    engine = cuda_engine(kv_transfer_config=offload_config(num_cpu_blocks=64), enable_prefix_caching=False)
    engine.generate([p], GREEDY)
    engine.flush_connector()
    events = []
    transfers = engine.executor.worker.connector.transfers
    load = transfers.load
    transfers.load = lambda pairs, layerwise: events.append(("load", len(pairs), layerwise)) or load(pairs, layerwise)
    pack_step = runner_module.pack_step

    def packed(decode, rows, prefill, *args):
        events.append(("pack", len(decode), [s.num_tokens for s in prefill]))
        return pack_step(decode, rows, prefill, *args)

    runner_module.pack_step = packed
    try:
        hit = engine.generate([p], GREEDY)[0]
    finally:
        runner_module.pack_step = pack_step
    assert hit.stats.num_external_loaded_tokens == 592
    # the hit's step: 8 prompt tokens computed after 592 loaded (37 blocks, in groups of layers)
    assert events[:2] == [("pack", 0, [8]), ("load", 37, True)]


def test_the_host_never_waits_for_a_steps_loads(cuda_engine):
    """A step's CPU-tier loads are reaped by querying their event in later steps, never waited
    for inside a step (that would take async scheduling's lead away); their slots come back once
    the event has completed, and a flush waits for all of them."""
    p = prompt(600)
    engine = cuda_engine(kv_transfer_config=offload_config(num_cpu_blocks=64), enable_prefix_caching=False)
    engine.generate([p], GREEDY)
    engine.flush_connector()
    transfers = engine.executor.worker.connector.transfers
    waits = []
    completed_loads = transfers.completed_loads
    transfers.completed_loads = lambda wait=False: waits.append(wait) or completed_loads(wait)
    hits = engine.generate([p, p[:593]], GREEDY)
    assert [h.stats.num_external_loaded_tokens for h in hits] == [592, 592]
    assert waits and not any(waits)
    before = len(waits)
    engine.flush_connector()
    assert True in waits[before:] and transfers.loads == []
    assert engine.stats().cpu_tier.num_pinned == 0


def test_hits_compile_no_kernel_inside_a_request(cuda_engine):
    """Start-up compiles every kernel a hit runs, with and without the layer hooks of loads in
    groups of layers: a first hit that compiles takes seconds instead of milliseconds."""
    import triton

    engine = cuda_engine(kv_transfer_config=offload_config(num_cpu_blocks=64), enable_prefix_caching=False)
    compiled = []

    def hook(*args, **kwargs):
        compiled.append(getattr(kwargs.get("fn"), "name", repr(kwargs.get("fn"))))
        return False

    runtime = triton.knobs.runtime
    before = runtime.jit_cache_hook
    runtime.jit_cache_hook = hook
    try:
        p = prompt(600)
        engine.generate([p], GREEDY)
        engine.flush_connector()
        full = engine.generate([p[:593]], GREEDY)[0]  # 592 tokens loaded, the last one computed
        partial = engine.generate([p], GREEDY)[0]  # 592 loaded, 8 computed
    finally:
        runtime.jit_cache_hook = before
    assert (full.stats.num_external_loaded_tokens, partial.stats.num_external_loaded_tokens) == (592, 592)
    assert compiled == []


def test_async_stores_survive_block_reuse(cuda_engine):
    """Requests of one output token free their blocks at once, and the next prompt's prefill
    writes into them while the store of the previous prompt may still be reading: the stored
    KV must still be the old one (hits reproduce the local-prefix-cache outputs)."""
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    prompts = [prompt(160, seed=s) for s in range(12)]
    engine = cuda_engine(kv_transfer_config=offload_config(), enable_prefix_caching=False, num_gpu_blocks=24)
    for p in prompts:
        engine.generate([p], one)
    hits = [engine.generate([p], GREEDY)[0] for p in prompts]
    assert all(h.stats.num_external_loaded_tokens == 160 for h in hits)  # full hits: every block
    local = cuda_engine(num_gpu_blocks=24)
    for p, h in zip(prompts, hits):
        local.generate([p], one)
        ref = local.generate([p], GREEDY)[0]
        assert ref.stats.num_cached_tokens == 144
        assert h.output_token_ids == ref.output_token_ids


def test_disk_write_through_after_async_store(cuda_engine, tmp_path):
    p = prompt(200)
    writer = cuda_engine(kv_transfer_config=offload_config(root_dir=str(tmp_path / "tier")), enable_prefix_caching=False)
    writer.generate([p], GREEDY)
    writer.executor.worker.connector.flush()
    reader = cuda_engine(kv_transfer_config=offload_config(root_dir=str(tmp_path / "tier")), enable_prefix_caching=False)
    hit = reader.generate([p], GREEDY)[0]
    assert hit.stats.num_external_loaded_tokens == 192
    local = cuda_engine()
    local.generate([p], GREEDY)
    assert local.generate([p], GREEDY)[0].output_token_ids == hit.output_token_ids


@pytest.mark.parametrize("scattered", [False, True])
def test_slot_transfers_load_and_store(scattered):
    """Whole-block loads (direct copies, or staged through device buffers when the destination
    blocks are scattered) and stores, checked byte for byte."""
    from kvtool.engine.connectors.offloading.copy import transfers as tr
    from kvtool.engine.kv.pages import KVGeometry, KVPages

    geo = KVGeometry(num_layers=3, num_kv_heads=2, head_dim=64, block_size=16, dtype="bfloat16")
    pages = KVPages(geo, 300, torch.device("cuda"))
    pool = torch.randn((40, 4, 2, 3, 16, 2, 64)).to(torch.bfloat16).pin_memory()  # 40 slots of 4 blocks
    flat = pool.view(-1, *pool.shape[2:])
    t = tr.SlotTransfers(pool, pages)
    old = tr.STAGING_BYTES
    tr.STAGING_BYTES = 5 * geo.bytes_per_block  # several chunks, both buffers reused
    try:
        dst = torch.randperm(300)[:64].tolist() if scattered else list(range(100, 164))
        pairs = list(zip(range(8, 72), dst))
        ticket = t.load(pairs, layerwise=False)
        assert t.completed_loads(wait=True) == [ticket] and t.loads == []
        torch.cuda.synchronize()
        for src, d in pairs:
            assert torch.equal(pages.tensor[d].cpu(), flat[src])
        assert bool(t.staging) == scattered
        # Store the loaded blocks back into other slots.
        back = [(d, 90 + i) for i, (_, d) in enumerate(pairs)]
        ticket = t.store(back)
        assert t.completed_stores(wait=True) == [ticket]
        for (src, _), (_, slot_block) in zip(pairs, back):
            assert torch.equal(flat[slot_block], flat[src])
    finally:
        tr.STAGING_BYTES = old


@pytest.mark.parametrize("per", [1, 2, 3])
@pytest.mark.parametrize("scattered", [False, True])
def test_layerwise_loads_through_the_copy_engine(scattered, per):
    """Layerwise loads as pitched copies (one per group of `per` layers and run, straight into the
    pages or staged and scattered): every byte in place, an event per layer, and the first
    group's pieces in place once layer 0's event has completed, whatever later groups are doing."""
    from kvtool.engine.connectors.offloading.copy import transfers as tr
    from kvtool.engine.kv.pages import KVGeometry, KVPages

    geo = KVGeometry(num_layers=3, num_kv_heads=2, head_dim=64, block_size=16, dtype="bfloat16")
    pages = KVPages(geo, 300, torch.device("cuda"))
    pool = torch.randn((40, 4, 2, 3, 16, 2, 64)).to(torch.bfloat16).pin_memory()
    flat = pool.view(-1, *pool.shape[2:])
    t = tr.SlotTransfers(pool, pages)
    assert t.can_copy_rows()
    assert t.layers_per_copy == 3  # 4 KB pieces: every layer in one row, up to LOAD_ROW_BYTES
    t.layers_per_copy = per
    old = tr.STAGING_BYTES
    tr.STAGING_BYTES = 5 * geo.bytes_per_block  # several chunks per layer, both buffers reused
    try:
        dst = torch.randperm(300)[:64].tolist() if scattered else list(range(100, 164))
        # three runs of consecutive sources: several copies per fill or per layer
        pairs = list(zip([*range(8, 30), *range(50, 60), *range(100, 132)], dst))
        t.load(pairs, layerwise=True)
        assert len(t.layer_events) == geo.num_layers
        t.layer_events[0].synchronize()
        for src, d in pairs:
            assert torch.equal(pages.tensor[d, :, :per].cpu(), flat[src, :, :per])
        assert len(set(t.layer_events)) == -(-geo.num_layers // per)
        ticket = t.load(pairs, layerwise=True)  # a second step's loads, queued behind the first's
        done = t.completed_loads(wait=True)
        assert done[-1] is ticket and len(done) == 2 and t.loads == []
        for src, d in pairs:
            assert torch.equal(pages.tensor[d].cpu(), flat[src])
        assert bool(t.staging) == scattered
    finally:
        tr.STAGING_BYTES = old


def test_pitched_copy_moves_strided_rows():
    from kvtool.engine.connectors.offloading.copy import pitched_copy

    host = torch.arange(7 * 300, dtype=torch.int16).view(7, 300).pin_memory()
    out = torch.zeros((7, 100), dtype=torch.int16, device="cuda")
    stream = torch.cuda.current_stream()
    # rows 1..6, 100 int16 from column 50 each, 600 bytes apart in the host, 200 on the device
    pitched_copy.copy_rows_h2d(out[1].data_ptr(), 200, host[1, 50:].data_ptr(), 600, 200, 6, stream.cuda_stream)
    stream.synchronize()
    assert torch.equal(out[1:].cpu(), host[1:, 50:150]) and not out[0].any()


@pytest.mark.parametrize("graphs", [True, False])
def test_async_scheduling_equals_sync(cuda_engine, graphs):
    """Step N+1 queued while step N runs: the same tokens and logprobs as the synchronous engine
    (requests end by length, so both modes run the very same batches)."""
    prompts = [prompt(30 + 41 * i, seed=i) for i in range(8)]
    params = [SamplingParams(max_tokens=6 + 3 * i, temperature=0.0, ignore_eos=True, logprobs=1 if i % 2 else None)
              for i in range(8)]
    runs = []
    for mode in (False, True):
        engine = cuda_engine(graphs=graphs, async_scheduling=mode)
        assert engine.async_scheduling is mode
        runs.append([(r.output_token_ids, r.logprobs) for r in engine.generate(prompts, params)])
    assert runs[0] == runs[1]


@pytest.mark.parametrize("graphs", [False, True])
def test_the_last_layer_for_the_sampled_rows_alone_keeps_every_token(cuda_engine, graphs):
    """The runner has the model compute the last layer for a step's sampled rows alone: chunked
    prompts (chunks that sample nothing), prompts beside decode rows and prompts alone give the
    tokens and logprobs of an engine computing every row."""
    prompts = [prompt(300 + 97 * i, seed=i) for i in range(6)]
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3)
    runs, taken = [], {False: [], True: []}  # rows passed to the decoder per forward (-1: every row)
    for rows_only in (False, True):
        engine = cuda_engine(graphs=graphs, max_num_batched_tokens=256, enable_prefix_caching=False)
        assert engine.executor.worker.runner.sampled_rows_only
        engine.executor.worker.runner.sampled_rows_only = rows_only
        decoder = engine.executor.worker.runner.model.model
        forward = decoder.forward
        seen = taken[rows_only]
        decoder.forward = lambda ids, pos, rows=None: seen.append(-1 if rows is None else rows.shape[0]) \
            or forward(ids, pos, rows)
        runs.append([(r.output_token_ids, r.logprobs) for r in engine.generate(prompts, sp)])
        runs.append([(r.output_token_ids, r.logprobs) for r in (engine.generate([p], sp)[0] for p in prompts[:2])])
        decoder.forward = forward
    assert runs[2:] == runs[:2]
    assert set(taken[False]) == {-1}
    assert {0, 1} <= set(taken[True])  # chunks that sample nothing, a prompt's last chunk alone
    assert any(n > 1 for n in taken[True])  # beside decode rows


def test_seeded_sampling_is_reproducible_on_the_device(cuda_engine):
    """Sampling runs on the device: the same seed gives the same tokens (alone, and in the same
    batch again), and an unseeded request follows the engine's --seed. (Across different batches
    bf16 decode may round differently, so the tokens are compared batch for batch.)"""
    p = prompt(40, seed=3)
    seeded = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)
    others = [SamplingParams(max_tokens=9, temperature=1.0, ignore_eos=True), seeded,
              SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)]
    batch = [prompt(70, seed=5), p, prompt(33, seed=6)]
    engine = cuda_engine()
    alone = engine.generate([p], seeded)[0].output_token_ids
    batched = [r.output_token_ids for r in engine.generate(batch, others)]
    other = cuda_engine()
    assert other.generate([p], seeded)[0].output_token_ids == alone
    assert [r.output_token_ids for r in other.generate(batch, others)][1] == batched[1]
    unseeded = SamplingParams(max_tokens=16, temperature=1.0, ignore_eos=True)
    assert cuda_engine(seed=7).generate([p], unseeded)[0].output_token_ids == \
        cuda_engine(seed=7).generate([p], unseeded)[0].output_token_ids


def test_pinned_staging_never_overwrites_inputs_still_to_be_copied():
    """Steps queued back to back behind device work (async scheduling) each get their own inputs
    on the device, through two reused pinned buffers that grow as steps do."""
    import numpy as np

    from kvtool.engine.worker.pinned_staging import MIN_ITEMS, PinnedStaging

    staging = PinnedStaging(torch.int32)
    busy = torch.randn(4096, 4096, device="cuda")
    sent = []
    for i, n in enumerate((10, 3 * MIN_ITEMS, 7, 5 * MIN_ITEMS, 12)):
        busy = busy @ busy  # keeps the stream busy, so copies queue up behind it
        host = np.full(n, i, dtype=np.int32)
        host[0] = n
        sent.append((host, staging.to_device(host, torch.device("cuda"))))
    torch.cuda.synchronize()
    for host, dev in sent:
        assert np.array_equal(dev.cpu().numpy(), host)
