"""The prompt's ids as Python ints with their range: the C-array path for lists and tuples of
integers gives what int() on every id gives, and every other input still goes through int()."""

import random

import numpy as np
import pytest

from kvtool.engine.engine import token_id_list


@pytest.mark.parametrize("ids", [
    [5, 0, 151935],
    (7, 3),
    [True, np.int64(9), np.int32(4), 2],
    [1.0, 8, "12"],  # not integers: int() on each, as before
    np.array([6, 2, 11]),
    [2**32 + 1, 5],  # past 32 bits: the 64-bit array
    [2**70, 3],  # past 64 bits: int() on each; the range check then names it
    [-4, 10],
])
def test_token_id_list_matches_int_on_every_id(ids):
    expected = [int(x) for x in ids]
    got, lowest, highest = token_id_list(ids)
    assert got == expected and (lowest, highest) == (min(expected), max(expected))
    assert all(type(x) is int for x in got)


def test_a_long_prompt_round_trips():
    rng = random.Random(3)
    ids = [rng.randrange(0, 150000) for _ in range(40000)]
    got, lowest, highest = token_id_list(ids)
    assert got == ids and got is not ids and (lowest, highest) == (min(ids), max(ids))
