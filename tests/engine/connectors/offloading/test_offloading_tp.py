"""Per-rank KV in the OffloadingConnector: each rank's shard in its own files, whole blocks only.

Each rank's worker half moves its own KV-head shard; its disk files live under the directory of
its own identity (whose header records tp_size and tp_rank), so ranks never overwrite each
other. The scheduler half counts a block on disk only when every rank has written it: from
the runtime's aggregate of the ranks' completions while running (an item once every rank
reported it; tests/support/tp_ranks.py stands in for it), from every rank's directory at start-up. The halves are
built with rank identities and pages of the shard's shape (tests/support/tp_ranks.py).
"""

from __future__ import annotations

import json
import shutil

import msgspec
import pytest
import torch

from kvtool.engine.connectors.config import parse_kv_transfer_config
from kvtool.engine.core.hashing import make_none_hash
from kvtool.engine.core.messages import KVConnectorOutput
from kvtool.engine.kv.identity import identity_for_model
from kvtool.engine.params import EngineParams, SamplingParams
from tests.support.tp_ranks import RankedHalves, head_slice

PROMPT = [(i * 11) % 240 + 5 for i in range(70)]  # 4 whole blocks of 16 tokens are offloaded
BLOCKS = 4


def offload(root, policy="fail"):
    return parse_kv_transfer_config(json.dumps(
        {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_load_failure_policy": policy,
         "kv_connector_extra_config": {"num_cpu_blocks": 8, "root_dir": str(root)}}))


def tp_identity(model_dir, num_kv_heads):
    identity = identity_for_model(model_dir, EngineParams(model=str(model_dir), device="cpu"))
    if num_kv_heads != identity.geometry.num_kv_heads:  # the embedded SmolLM2-135M's uneven split
        geometry = msgspec.structs.replace(identity.geometry, num_kv_heads=num_kv_heads)
        identity = msgspec.structs.replace(identity, geometry=geometry, model_num_kv_heads=num_kv_heads)
    return identity


def same_bits(a, b):
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def write_tier(root, identity, full, heads):
    """TP-2 rank halves store PROMPT's blocks (each rank its heads of `full`) and write them to disk."""
    writer = RankedHalves(offload(root), identity, make_none_hash(), 2)
    try:
        blocks = list(range(BLOCKS + 1))
        for r in range(2):
            writer.fill(r, blocks[:BLOCKS], head_slice(full, heads, identity.geometry.head_dim, 2, r))
        req = writer.request("w", PROMPT)
        assert writer.matched(req) == 0
        outputs = writer.step(req, first_block=0, matched=0)
        assert all(not o.invalid_block_ids for o in outputs)
        return [bytes(h) for h in req.block_hashes[:BLOCKS]], [w.disk.tiers[0].digest for w in writer.workers]
    finally:
        writer.shutdown()


@pytest.mark.parametrize("heads", [2, 3])
def test_each_rank_writes_its_shard_and_a_restart_loads_every_rank(tiny_model_dir, tmp_path, heads):
    identity = tp_identity(tiny_model_dir, heads)
    g = identity.geometry
    root = tmp_path / "tier"
    full = torch.randn((2, g.num_layers, BLOCKS * g.block_size, heads * g.head_dim),
                       generator=torch.Generator().manual_seed(heads))
    hashes, digests = write_tier(root, identity, full, heads)
    assert len(set(digests)) == 2  # one directory per rank: no file is shared
    for r, digest in enumerate(digests):
        files = sorted((root / "kv" / digest).rglob("*.kvb"))
        assert len(files) == BLOCKS

    # A restarted engine: its scheduler half finds the blocks in both ranks' directories.
    reader = RankedHalves(offload(root), identity, make_none_hash(), 2)
    try:
        assert [i.geometry.num_kv_heads for i in reader.identities] == ([1, 1] if heads == 2 else [2, 1])
        req = reader.request("r", PROMPT)
        assert reader.matched(req) == BLOCKS * g.block_size
        outputs = reader.step(req, first_block=10)
        assert all(not o.invalid_block_ids for o in outputs)
        for r in range(2):
            got = reader.gathered(r, req.block_ids[:BLOCKS], BLOCKS * g.block_size)
            assert same_bits(got, head_slice(full, heads, g.head_dim, 2, r))
    finally:
        reader.shutdown()


def test_a_block_counts_only_when_every_rank_holds_it(tiny_model_dir, tmp_path):
    identity = tp_identity(tiny_model_dir, 2)
    g = identity.geometry
    root = tmp_path / "tier"
    full = torch.randn((2, g.num_layers, BLOCKS * g.block_size, 2 * g.head_dim))
    hashes, digests = write_tier(root, identity, full, 2)
    # Rank 1 lost block 2's file: only blocks 0 and 1 are whole at start-up.
    (victim,) = (root / "kv" / digests[1]).rglob(f"{hashes[2].hex()}.kvb")
    victim.unlink()
    ranks = RankedHalves(offload(root), identity, make_none_hash(), 2)
    try:
        assert ranks.matched(ranks.request("a", PROMPT)) == 2 * g.block_size
        disk = ranks.scheduler.disk.indexes[0]
        assert hashes[1] in disk and hashes[2] not in disk
        # While running, a block is on disk only once every rank reported writing it.
        for r in range(2):
            ranks.fill(r, list(range(BLOCKS)), head_slice(full, 2, g.head_dim, 2, r))
        req = ranks.request("b", PROMPT)
        ranks.scheduler.update_state_after_alloc(req, list(range(20, 25)), 0)
        req.block_ids = list(range(20, 25))
        from kvtool.engine.core.messages import ScheduledRequest, SchedulerOutput

        meta = ranks.scheduler.build_connector_meta(SchedulerOutput(step_id=ranks.next_step_id(), scheduled=[ScheduledRequest(
            request_id="b", token_ids=PROMPT, start=0, new_block_ids=req.block_ids, sample=True)]))
        parts = []
        for w in ranks.workers:
            w.bind_connector_metadata(meta)
            w.start_load_kv()
            w.wait_for_save()
            w.flush()
            parts.append(w.take_completions())
            w.clear_connector_metadata()
        key = hashes[2] + bytes(4)  # the offload key: block hash + group 0
        assert key in parts[0].written and key in parts[1].written
        # The runtime passes a written block on once every rank reported it (here rank 1 a step later).
        agg = ranks.aggregator
        ranks.scheduler.update_connector_output(KVConnectorOutput(completions=agg.completions([parts[0], None])))
        assert hashes[2] not in disk
        ranks.scheduler.update_connector_output(KVConnectorOutput(completions=agg.completions([None, parts[1]])))
        assert hashes[2] in disk
    finally:
        ranks.shutdown()


def test_a_tier_of_another_tp_size_is_refused_naming_the_fields(make_engine, tiny_model_dir, tmp_path):
    root = tmp_path / "tier"
    writer = make_engine(kv_transfer_config=offload(root))  # TP 1: every KV head in one file
    writer.generate([PROMPT], SamplingParams(max_tokens=2, temperature=0.0))
    writer.executor.worker.connector.flush()
    written = root / "kv" / writer.executor.worker.connector.disk.tiers[0].digest
    identity = tp_identity(tiny_model_dir, 2)
    ranks = RankedHalves(offload(root), identity, make_none_hash(), 2)
    try:
        for w in ranks.workers:  # the TP-1 files where each TP-2 rank looks (a copied tier)
            target = root / "kv" / w.disk.tiers[0].digest
            assert target != written
            shutil.rmtree(target, ignore_errors=True)
            shutil.copytree(written, target)
        ranks.scheduler.disk.refresh()
        req = ranks.request("r", PROMPT)
        assert ranks.matched(req) == BLOCKS * 16
        outputs = ranks.step(req, first_block=10)
        for r, out in enumerate(outputs):
            assert out.invalid_block_ids
            reason = next(iter(out.invalid_reasons.values()))
            assert "tp_size (expected 2, found 1)" in reason and "num_kv_heads (expected 1, found 2)" in reason
            assert ("tp_rank (expected 1, found 0)" in reason) == (r == 1)
    finally:
        ranks.shutdown()


def test_inspect_reports_each_rank_of_a_tp_tier(tiny_model_dir, tmp_path, run_kvtool):
    identity = tp_identity(tiny_model_dir, 2)
    g = identity.geometry
    root = tmp_path / "tier"
    write_tier(root, identity, torch.zeros((2, g.num_layers, BLOCKS * g.block_size, 2 * g.head_dim)), 2)
    code, out, err = run_kvtool(["inspect", str(root), "--json"])
    assert code == 0, err
    report = json.loads(out)
    assert report["num_blocks"] == 2 * BLOCKS and report["num_damaged"] == 0
    groups = sorted(report["groups"], key=lambda grp: grp["identity"]["tp_rank"])
    assert [(grp["identity"]["tp_size"], grp["identity"]["tp_rank"], grp["identity"]["num_kv_heads"],
             grp["num_blocks"]) for grp in groups] == [(2, 0, 1, BLOCKS), (2, 1, 1, BLOCKS)]
