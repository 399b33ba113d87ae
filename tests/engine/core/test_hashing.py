"""Block hashes against vLLM 0.33's own values (its `vllm/v1/core/kv_cache_utils.py`)."""

from kvtool.engine.core.hashing import block_extra_keys, extend_block_hashes, hash_block_tokens, make_none_hash


def test_none_hash_default_seed(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert make_none_hash().hex() == "9bd96a485ad84efdafb72ee48a1d7a69bcead0f8f0433173941b276b9581eef0"


def test_none_hash_follows_pythonhashseed(monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    assert make_none_hash().hex() == "4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e"


def test_block_hashes_match_vllm(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    nh = make_none_hash()
    b0 = hash_block_tokens(nh, list(range(1, 17)))
    assert b0.hex() == "cd7c51bc5a8fc8643f383a2b9e01522fba7473c669e9270c7b0bf7bf7fd01682"
    b1 = hash_block_tokens(b0, list(range(17, 33)))
    assert b1.hex() == "2533ea50426b36e9e4d68296cac6bce8cf602e46957d0fe40b368b33d87bf3bf"
    salted = hash_block_tokens(nh, list(range(1, 17)), block_extra_keys(0, "abc"))
    assert salted.hex() == "bf84b0a74923532f9f4df68c58bec36fb6b77385707823c5199b327ce5af59e6"


def test_chain_over_full_blocks_only(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    nh = make_none_hash()
    hs = extend_block_hashes([], list(range(600)), 16, nh)
    assert len(hs) == 37
    assert [h.hex() for h in hs[:3]] == [
        "dc918a88b139e5afe60b88eda27508d4aee16c10fdc354791efea06206ac0749",
        "c300ec275d7bf08af8fc63e76cdc0086911bbc7091e03c5cf892553bef84ef0c",
        "117dad852830e0103c12d7c7f8b7cf58434ea8751d1f42ee07b1c93711e4da6c",
    ]
    big = extend_block_hashes([], list(range(600)), 256, nh)
    assert [h.hex() for h in big] == [
        "dd47fa420415cf9acaf8ddeab12385e1265d5358c82da0c75d3418b1423a61ad",
        "a952543a954e2ac3a06c5d0ce3f464633425dd256d9780fab90bdd035d6d437a",
    ]


def test_salt_changes_every_block(monkeypatch):
    nh = make_none_hash("x")
    plain = extend_block_hashes([], list(range(64)), 16, nh)
    salted = extend_block_hashes([], list(range(64)), 16, nh, cache_salt="s")
    assert all(a != b for a, b in zip(plain, salted))


def _one_link_at_a_time(tokens, block_size, none_hash, salt=None):
    out = []
    for i in range(len(tokens) // block_size):
        block = tokens[i * block_size : (i + 1) * block_size]
        out.append(hash_block_tokens(out[-1] if out else none_hash, block, block_extra_keys(i, salt)))
    return out


def test_long_prompts_hash_as_one_link_at_a_time():
    """Many blocks at once take the vectorized encoding: the same bytes as cbor2's, link by link,
    for ids at every CBOR size boundary, any block size (array heads of 1 and 2 bytes), a salt,
    a chain extended in parts, and ids cbor2 alone can encode (negative, past 2**32)."""
    import random

    from kvtool.engine.core.hashing import BATCH_MIN_BLOCKS

    nh = make_none_hash("x")
    rng = random.Random(0)
    edges = [0, 1, 23, 24, 25, 255, 256, 257, 65535, 65536, 65537, 151935, 2**32 - 1]
    for block_size in (1, 16, 23, 24, 256, 300):
        tokens = [rng.choice(edges) if rng.random() < 0.3 else rng.randrange(200_000) for _ in range(block_size * 20 + 5)]
        for salt in (None, "s"):
            want = _one_link_at_a_time(tokens, block_size, nh, salt)
            assert len(want) - 3 >= BATCH_MIN_BLOCKS
            assert extend_block_hashes([], tokens, block_size, nh, salt) == want, (block_size, salt)
            part = extend_block_hashes([], tokens[: block_size * 3], block_size, nh, salt)
            assert extend_block_hashes(part, tokens, block_size, nh, salt) == want, (block_size, salt)
    for odd in (-5, 2**32, 2**70):
        tokens = [odd] + list(range(16 * 12))
        assert extend_block_hashes([], tokens, 16, nh) == _one_link_at_a_time(tokens, 16, nh)
