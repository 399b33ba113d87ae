"""Per-rank KV in the LMCacheConnector, with LMCache's own server, keys and client (and Redis, Valkey).

Each rank of a tensor-parallel engine is one LMCache worker, as each rank of a TP-N vLLM is:
its worker half stores and loads its KV-head shard `[2, L, 256, rank_heads*head_dim]` under
`model@N@rank@hash@dtype`. The halves are built with rank identities and pages of the shard's
shape, exactly as the engine's worker processes build them (tests/support/tp_ranks.py). The tiny preset
has 2 KV heads, so TP 2 splits it as vLLM does (one head per rank).
"""

from __future__ import annotations

import json

import msgspec
import pytest
import torch

from kvtool.engine.connectors.config import parse_kv_transfer_config
from kvtool.engine.connectors.lmcache.keys import LMCacheKeySettings, key_for_worker, make_chunk_keys
from kvtool.engine.connectors.lmcache.stores.lm_client import LMClient
from kvtool.engine.connectors.lmcache.stores.protocol import MemoryFormat, dtype_code, tensor_buffer
from kvtool.engine.core.hashing import make_none_hash
from kvtool.engine.errors import ConfigError
from kvtool.engine.kv.identity import identity_for_model
from kvtool.engine.params import EngineParams, SamplingParams
from kvtool.peer.compare import compare_many_with_peer
from kvtool.peer.env import peer_python
from tests.support.peer_server import finish_client, run_lmcache_client
from tests.support.tp_ranks import RankedHalves, head_slice

CS = 256


def lm_config(server, **extra):
    return parse_kv_transfer_config(json.dumps(
        {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both", "kv_load_failure_policy": "fail",
         "kv_connector_extra_config": {"host": server.host, "port": server.port, "hash_algo": "vllm", **extra}}))


def prompt(n, seed):
    return [(i * 7 + seed * 37) % 250 + 3 for i in range(n)]


def tiny_identity(model_dir):
    return identity_for_model(model_dir, EngineParams(model=str(model_dir), device="cpu"))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.int32), b.view(torch.int32))


def hf_kv(model_dir, tokens) -> torch.Tensor:
    """transformers' KV of `tokens` as KV_2LTD [2, L, T, kv_heads*head_dim], float32."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        cache = hf(torch.tensor([tokens]), use_cache=True).past_key_values
    layers = cache.layers
    t = len(tokens)
    k = torch.stack([lay.keys[0].permute(1, 0, 2).reshape(t, -1) for lay in layers])
    v = torch.stack([lay.values[0].permute(1, 0, 2).reshape(t, -1) for lay in layers])
    return torch.stack([k, v]).contiguous()


def peer_keys(identity, sequences, world_size) -> list[list[list[str]]]:
    """LMCache's own ChunkedTokenDatabase keys, [rank][sequence][chunk]; kvtool's must agree."""
    jobs = [(sequences, LMCacheKeySettings(identity.model_name, world_size=world_size, worker_id=r, kv_dtype="float32",
                                           chunk_tokens=CS, hash_algo="vllm")) for r in range(world_size)]
    result = []
    for comparison in compare_many_with_peer(jobs, peer_python()):
        assert comparison.all_agree
        result.append([[a.lmcache_key for a in seq] for seq in comparison.sequences])
    return result


def test_tp2_interop_both_ways_with_lmcache(lmcache_server, tiny_model_dir, tmp_path, run_kvtool):
    identity = tiny_identity(tiny_model_dir)
    g = identity.geometry
    assert g.num_kv_heads == 2  # one per rank at TP 2, as vLLM splits them
    theirs, ours = prompt(600, 1), prompt(600, 2)
    keys = peer_keys(identity, [theirs, ours], 2)
    kv_theirs, kv_ours = hf_kv(tiny_model_dir, theirs[: 2 * CS]), hf_kv(tiny_model_dir, ours[: 2 * CS])

    # kvtool's rank halves store `ours`: each rank its shard, under its own key.
    ranks = RankedHalves(lm_config(lmcache_server), identity, make_none_hash(), 2)
    try:
        req = ranks.request("ours", ours)
        assert ranks.matched(req) == 0
        blocks = list(range(0, 2 * CS // g.block_size))
        for r in range(2):
            ranks.fill(r, blocks, head_slice(kv_ours, 2, g.head_dim, 2, r))
        outputs = ranks.step(req, first_block=0, matched=0)
        assert all(not o.invalid_block_ids for o in outputs)
        assert [w.take_stats().tokens_stored for w in ranks.workers] == [{"ours": 2 * CS}] * 2
    finally:
        ranks.shutdown()

    # One LMCache client process: it PUTs a TP-2 peer's chunks of `theirs` and GETs kvtool's of `ours`.
    manifest = {"put": [], "get": []}
    for r in range(2):
        for i in range(2):
            f = tmp_path / f"theirs-{r}-{i}.bin"
            f.write_bytes(tensor_buffer(head_slice(kv_theirs[:, :, i * CS : (i + 1) * CS], 2, g.head_dim, 2, r)))
            manifest["put"].append({"key": keys[r][0][i], "shape": [2, g.num_layers, CS, g.head_dim],
                                    "dtype": "float32", "file": str(f)})
            manifest["get"].append({"key": keys[r][1][i], "file": str(tmp_path / f"ours-{r}-{i}.bin")})
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    answer = finish_client(run_lmcache_client("batch", lmcache_server.host, str(lmcache_server.port),
                                              str(tmp_path / "manifest.json")))
    assert answer["stored"] == [True] * 4
    # LMCache's client found and decoded each rank's chunk kvtool stored: its shard, bit for bit.
    for n, got in enumerate(answer["got"]):
        r, i = divmod(n, 2)
        assert got == {"hit": True, "shape": [2, g.num_layers, CS, g.head_dim], "dtype": "float32",
                       "fmt": "KV_2LTD", "fmt_code": 1, "length": 2 * g.num_layers * CS * g.head_dim * 4}
        data = torch.frombuffer(bytearray((tmp_path / f"ours-{r}-{i}.bin").read_bytes()), dtype=torch.float32)
        expected = head_slice(kv_ours[:, :, i * CS : (i + 1) * CS], 2, g.head_dim, 2, r)
        assert same_bits(data.view(expected.shape), expected)

    # kvtool's rank halves load the peer's chunks of `theirs`: each rank exactly its heads.
    ranks = RankedHalves(lm_config(lmcache_server), identity, make_none_hash(), 2)
    try:
        req = ranks.request("theirs", theirs)
        assert ranks.matched(req) == 2 * CS
        outputs = ranks.step(req, first_block=4)
        assert all(not o.invalid_block_ids for o in outputs)
        for r in range(2):
            got = ranks.gathered(r, req.block_ids[: 2 * CS // g.block_size], 2 * CS)
            assert same_bits(got, head_slice(kv_theirs, 2, g.head_dim, 2, r))
    finally:
        ranks.shutdown()

    # verify-keys --peer --world-size 2 agrees with what kvtool stored, rank by rank.
    tokens = tmp_path / "ours.json"
    tokens.write_text(json.dumps(ours))
    url = f"lm://{lmcache_server.host}:{lmcache_server.port}"
    base = ["verify-keys", "--tokens", str(tokens), "--model", str(tiny_model_dir), "--peer", url,
            "--device", "cpu", "--json"]
    for r in range(2):
        code, out, err = run_kvtool(base + ["--world-size", "2", "--worker-id", str(r)])
        assert code == 0, err
        rows = json.loads(out)
        assert [(row["key"], row["present"], row["fits"], row["dtype"]) for row in rows] == [
            (keys[r][1][i], True, True, "float32") for i in range(2)]
    code, out, err = run_kvtool(base)  # as one whole-model writer: no such keys
    assert code == 0 and not any(row["present"] for row in json.loads(out))


def test_a_chunk_of_the_wrong_shard_size_is_refused(lmcache_server, tiny_model_dir, tmp_path, run_kvtool, make_engine):
    """The one chunk-fit check, in `verify-keys --peer` and in the connector's loads."""
    identity = tiny_identity(tiny_model_dir)
    g = identity.geometry
    p = prompt(300, 3)
    rank1 = LMCacheKeySettings(identity.model_name, world_size=2, worker_id=1, kv_dtype="float32", chunk_tokens=CS)
    whole = torch.ones((2, g.num_layers, CS, g.kv_hidden_size), dtype=torch.float32)  # every head, not rank 1's
    with LMClient(lmcache_server.host, lmcache_server.port, connections=1) as client:
        key = make_chunk_keys(p, msgspec.structs.replace(rank1, hash_algo="vllm"))[0].key
        client.put(key, tensor_buffer(whole), MemoryFormat.KV_2LTD, dtype_code(torch.float32), whole.shape)
        # A TP-2 rank's shard under a whole-model (TP 1) key.
        tp1_key = key_for_worker(key.replace("@2@", "@1@", 1), 0)
        shard = torch.ones((2, g.num_layers, CS, g.head_dim), dtype=torch.float32)
        client.put(tp1_key, tensor_buffer(shard), MemoryFormat.KV_2LTD, dtype_code(torch.float32), shard.shape)
        assert client.exists(tp1_key)
    tokens = tmp_path / "p.json"
    tokens.write_text(json.dumps(p))
    url = f"lm://{lmcache_server.host}:{lmcache_server.port}"
    code, out, err = run_kvtool(["verify-keys", "--tokens", str(tokens), "--model", str(tiny_model_dir), "--peer", url,
                                 "--device", "cpu", "--world-size", "2", "--worker-id", "1", "--json"])
    assert code == 1, err
    (row,) = json.loads(out)
    assert row["present"] and row["fits"] is False
    assert row["problem"] == f"KV hidden size {g.kv_hidden_size}, expected {g.head_dim}"

    # The TP-1 engine's worker half refuses the shard with the same check and words.
    engine = make_engine(kv_transfer_config=lm_config(lmcache_server))
    r = engine.generate([p], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))[0]
    assert r.finish_reason == "error" and r.output_token_ids == []
    assert f"KV hidden size {g.head_dim}, expected {g.kv_hidden_size}" in r.error
    assert "does not fit this rank's KV pages" in r.error


def test_a_chunk_is_a_hit_only_when_every_rank_holds_it(lmcache_server, tiny_model_dir):
    identity = tiny_identity(tiny_model_dir)
    g = identity.geometry
    p = prompt(700, 4)
    keys = make_chunk_keys(p, LMCacheKeySettings(identity.model_name, world_size=2, worker_id=0, kv_dtype="float32",
                                                 chunk_tokens=CS, hash_algo="vllm"))
    shard = torch.zeros((2, g.num_layers, CS, g.head_dim), dtype=torch.float32)
    with LMClient(lmcache_server.host, lmcache_server.port, connections=1) as client:
        # Rank 0 holds both chunks, rank 1 only the first.
        for key in (keys[0].key, keys[1].key, key_for_worker(keys[0].key, 1)):
            client.put(key, tensor_buffer(shard), MemoryFormat.KV_2LTD, dtype_code(torch.float32), shard.shape)
        assert client.exists(key_for_worker(keys[0].key, 1))
    ranks = RankedHalves(lm_config(lmcache_server), identity, make_none_hash(), 2)
    try:
        assert ranks.matched(ranks.request("a", p)) == CS
    finally:
        ranks.shutdown()


def test_uneven_head_split_round_trips_between_kvtool_ranks(lmcache_server, tiny_model_dir):
    """3 KV heads at TP 2 (the embedded SmolLM2-135M's split): rank 0 keeps 2 heads, rank 1 one."""
    identity = tiny_identity(tiny_model_dir)
    identity = msgspec.structs.replace(identity, model_name="kvtool-test/three-kv-heads",
                                       geometry=msgspec.structs.replace(identity.geometry, num_kv_heads=3),
                                       model_num_kv_heads=3)
    g = identity.geometry
    p = prompt(520, 5)
    full = torch.randn((2, g.num_layers, 2 * CS, 3 * g.head_dim), generator=torch.Generator().manual_seed(5))
    blocks = list(range(2 * CS // g.block_size))
    writer = RankedHalves(lm_config(lmcache_server), identity, make_none_hash(), 2)
    try:
        assert [ident.geometry.num_kv_heads for ident in writer.identities] == [2, 1]
        for r in range(2):
            writer.fill(r, blocks, head_slice(full, 3, g.head_dim, 2, r))
        writer.step(writer.request("w", p), first_block=0, matched=0)
    finally:
        writer.shutdown()
    reader = RankedHalves(lm_config(lmcache_server), identity, make_none_hash(), 2)
    try:
        req = reader.request("r", p)
        assert reader.matched(req) == 2 * CS
        outputs = reader.step(req, first_block=8)
        assert all(not o.invalid_block_ids for o in outputs)
        for r in range(2):
            got = reader.gathered(r, req.block_ids[: len(blocks)], 2 * CS)
            assert same_bits(got, head_slice(full, 3, g.head_dim, 2, r))
    finally:
        reader.shutdown()


@pytest.mark.parametrize("extra, rank, needle", [
    ({"world_size": 2, "worker_id": 1}, None, "world_size 2 disagrees with the engine's tensor-parallel size 1"),
    ({"worker_id": 1}, None, "worker_id 1 disagrees with the engine's tensor-parallel rank 0"),
    ({"world_size": 1}, (2, 1), "world_size 1 disagrees with the engine's tensor-parallel size 2"),
    ({"world_size": 2, "worker_id": 0}, (2, 1), "worker_id 0 disagrees with the engine's tensor-parallel rank 1"),
])
def test_world_size_or_worker_id_other_than_the_engine_is_refused(lmcache_server, tiny_model_dir, make_engine,
                                                                 extra, rank, needle):
    config = lm_config(lmcache_server, **extra)
    with pytest.raises(ConfigError) as e:
        if rank is None:
            make_engine(kv_transfer_config=config)  # a TP-1 engine: at start-up, before any store
        else:
            RankedHalves(config, tiny_identity(tiny_model_dir), make_none_hash(), rank[0]).shutdown()
    message = str(e.value)
    assert needle in message and "\n" not in message


def test_agreeing_world_size_and_worker_id_are_accepted(lmcache_server, tiny_model_dir):
    ranks = RankedHalves(lm_config(lmcache_server, world_size=2), tiny_identity(tiny_model_dir), make_none_hash(), 2)
    try:
        assert [w.worker_id for w in ranks.workers] == [0, 1]
        assert ranks.scheduler.num_ranks == 2
    finally:
        ranks.shutdown()


@pytest.mark.parametrize("scheme", ["redis", "valkey"])
def test_redis_and_valkey_hold_each_rank_under_its_own_key(redis_server, tiny_model_dir, scheme):
    """The same per-rank keys in LMCache's Redis and Valkey layouts; a TP-2 restart loads each rank's shard."""
    import redis

    from kvtool.workloads.redis_server import HOST

    identity = tiny_identity(tiny_model_dir)
    g = identity.geometry
    p = prompt(300, 6 if scheme == "redis" else 7)
    url = f"{scheme}://{HOST}:{redis_server.port}"
    config = parse_kv_transfer_config(json.dumps(
        {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both", "kv_load_failure_policy": "fail",
         "kv_connector_extra_config": {"remote_url": url, "hash_algo": "vllm"}}))
    full = torch.randn((2, g.num_layers, CS, g.kv_hidden_size), generator=torch.Generator().manual_seed(6))
    blocks = list(range(CS // g.block_size))
    writer = RankedHalves(config, identity, make_none_hash(), 2)
    try:
        for r in range(2):
            writer.fill(r, blocks, head_slice(full, 2, g.head_dim, 2, r))
        writer.step(writer.request("w", p), first_block=0, matched=0)
    finally:
        writer.shutdown()
    (key,) = make_chunk_keys(p, LMCacheKeySettings(identity.model_name, world_size=2, worker_id=0, kv_dtype="float32",
                                                   chunk_tokens=CS, hash_algo="vllm"))
    db = redis.Redis(host=HOST, port=redis_server.port)
    suffix = "kv_bytes" if scheme == "redis" else ""
    for r in range(2):
        raw = db.get(key_for_worker(key.key, r) + suffix)
        expected = head_slice(full, 2, g.head_dim, 2, r)
        assert raw is not None and same_bits(torch.frombuffer(bytearray(raw), dtype=torch.float32).view(expected.shape),
                                             expected)
    reader = RankedHalves(config, identity, make_none_hash(), 2)
    try:
        req = reader.request("r", p)
        assert reader.matched(req) == CS
        outputs = reader.step(req, first_block=20)
        assert all(not o.invalid_block_ids for o in outputs)
        for r in range(2):
            assert same_bits(reader.gathered(r, req.block_ids[: len(blocks)], CS), head_slice(full, 2, g.head_dim, 2, r))
    finally:
        reader.shutdown()
