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
    got, lowest, highest, u32 = token_id_list(ids)
    assert got == expected and (lowest, highest) == (min(expected), max(expected))
    assert all(type(x) is int for x in got)
    # The uint32 array (the block-hash memo's key) only where every id fits one, and equal to them.
    fits = isinstance(ids, (list, tuple)) and all(isinstance(x, (int, np.integer)) and 0 <= x < 2**32 for x in ids)
    assert (u32 is not None) == fits
    if fits:
        assert u32.dtype == np.uint32 and u32.tolist() == expected


def test_a_long_prompt_round_trips():
    rng = random.Random(3)
    ids = [rng.randrange(0, 150000) for _ in range(40000)]
    got, lowest, highest, u32 = token_id_list(ids)
    assert got == ids and got is not ids and u32.tolist() == ids and (lowest, highest) == (min(ids), max(ids))
