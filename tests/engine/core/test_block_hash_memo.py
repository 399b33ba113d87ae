"""The block-hash memo gives every prompt exactly the hashes a fresh chain gives it, and reuses
the shared full blocks of recent prompts (same salt) to get there."""

import random

import numpy as np
import pytest

from kvtool.engine.core.block_hash_memo import BlockHashMemo, shared_full_blocks
from kvtool.engine.core.hashing import extend_block_hashes, make_none_hash

BS = 16
NONE_HASH = make_none_hash("memo-test")


def fresh(prompt, salt=None, bs=BS):
    return extend_block_hashes([], prompt, bs, NONE_HASH, salt)


def ids(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(0, 150_000) for _ in range(n)]


def test_repeated_and_extended_prompts_reuse_their_blocks():
    memo = BlockHashMemo(BS, NONE_HASH)
    doc = ids(32 * BS + 5, 1)
    assert memo.prompt_hashes(doc, None) == fresh(doc)
    assert (memo.hits, memo.reused_blocks) == (0, 0)
    assert memo.prompt_hashes(list(doc), None) == fresh(doc)  # the same document again
    assert (memo.hits, memo.reused_blocks) == (1, 32)
    turn2 = doc + ids(3 * BS, 2)  # the next turn of a chat: the last prompt and more
    assert memo.prompt_hashes(turn2, None) == fresh(turn2)
    assert memo.reused_blocks == 32 + 32
    assert len(memo.entries) == 1  # the previous turn is superseded, not kept beside it


@pytest.mark.parametrize("cut", [0, 1, BS - 1, BS, BS + 1, 7 * BS, 7 * BS + 9, 20 * BS - 1])
def test_a_prompt_that_differs_at_any_token_reuses_only_the_blocks_before_it(cut):
    memo = BlockHashMemo(BS, NONE_HASH)
    base = ids(20 * BS, 3)
    memo.prompt_hashes(base, None)
    other = list(base)
    other[cut] = (other[cut] + 1) % 150_000
    assert memo.prompt_hashes(other, None) == fresh(other)
    assert memo.reused_blocks == cut // BS
    # Shorter prompts that stop inside the remembered one: its full blocks only.
    for n in (BS - 1, BS, 3 * BS + 2):
        assert memo.prompt_hashes(base[:n], None) == fresh(base[:n])


def test_salts_never_share_hashes():
    memo = BlockHashMemo(BS, NONE_HASH)
    doc = ids(10 * BS, 4)
    memo.prompt_hashes(doc, "alice")
    for salt in (None, "bob", "alice"):
        assert memo.prompt_hashes(doc, salt) == fresh(doc, salt)
    assert memo.reused_blocks == 10  # alice's second prompt only


def test_random_prompts_with_shared_prefixes_match_fresh_chains():
    rng = random.Random(5)
    memo = BlockHashMemo(BS, NONE_HASH, capacity=4)
    docs = [ids(rng.randrange(1, 40) * BS + rng.randrange(BS), 10 + i) for i in range(6)]
    for _ in range(200):
        doc = rng.choice(docs)
        keep = rng.randrange(len(doc) + 1)
        prompt = doc[:keep] + ids(rng.randrange(0, 3 * BS), rng.randrange(1 << 30))
        salt = rng.choice([None, None, "s"])
        assert memo.prompt_hashes(prompt, salt) == fresh(prompt, salt)
        assert len(memo.entries) <= 4
    assert memo.hits > 50


def test_a_callers_uint32_array_gives_the_same_hashes():
    memo = BlockHashMemo(BS, NONE_HASH)
    doc = ids(9 * BS + 3, 7)
    values = np.array(doc, dtype=np.uint32)
    assert memo.prompt_hashes(doc, None, values) == fresh(doc)
    assert memo.prompt_hashes(doc + [1] * BS, None, np.array(doc + [1] * BS, dtype=np.uint32)) == fresh(doc + [1] * BS)
    assert memo.reused_blocks == 9


def test_returned_lists_are_the_callers_own():
    memo = BlockHashMemo(BS, NONE_HASH)
    doc = ids(12 * BS, 6)
    first = memo.prompt_hashes(doc, None)
    first.append(b"decode block")  # a request's list grows as it decodes
    assert memo.prompt_hashes(doc, None) == fresh(doc)


def test_ids_no_uint32_holds_take_the_plain_chain():
    memo = BlockHashMemo(BS, NONE_HASH)
    for prompt in ([2**32 + 5] * (3 * BS), [-1] * (2 * BS), [0.5] * (2 * BS), list(range(BS - 1))):
        assert memo.prompt_hashes(prompt, None) == fresh(prompt)
    assert memo.entries == []


def test_shared_full_blocks_counts_whole_blocks_from_the_start():
    a = np.arange(100, dtype=np.uint32)
    b = a.copy()
    assert shared_full_blocks(a, b, 16) == 6
    assert shared_full_blocks(a, b[:40], 16) == 2
    b[33] += 1
    assert shared_full_blocks(a, b, 16) == 2
    b[0] += 1
    assert shared_full_blocks(a, b, 16) == 0
