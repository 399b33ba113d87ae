"""The sampler against direct torch computations of vLLM's formulas, and its seeded random stream."""

from __future__ import annotations

import math

import pytest
import torch

from kvtool.engine.errors import InputError
from kvtool.engine.params import SamplingParams
from kvtool.engine.worker.sampler import SampleRow, _apply_processors, row_key, sample, top_ids, uniform_noise

VOCAB = 50


def _logits(n: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def _row(prompt=(), output=(), seed=0, eos=frozenset(), mask=None, **params) -> SampleRow:
    return SampleRow(SamplingParams(max_tokens=64, **params), seed, list(prompt), list(output), frozenset(eos), mask)


def _processed(logits: torch.Tensor, row: SampleRow) -> torch.Tensor:
    x = logits.clone()
    _apply_processors(x, [row])
    return x


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    logits = _logits()
    prompt, output = [1, 2, 3], [3, 4, 4]
    got = _processed(logits, _row(prompt, output, repetition_penalty=1.7))
    want = logits.clone()
    for t in {1, 2, 3, 4}:
        want[0, t] = want[0, t] / 1.7 if want[0, t] > 0 else want[0, t] * 1.7
    torch.testing.assert_close(got, want)


def test_frequency_and_presence_penalties_count_output_tokens_only():
    logits = _logits()
    got = _processed(logits, _row(prompt=[7, 7, 8], output=[4, 4, 4, 5], frequency_penalty=0.5, presence_penalty=1.25))
    want = logits.clone()
    want[0, 4] -= 0.5 * 3 + 1.25
    want[0, 5] -= 0.5 * 1 + 1.25
    torch.testing.assert_close(got, want)


def test_logit_bias_adds_to_the_logit_and_is_clamped_to_100():
    logits = _logits()
    params = SamplingParams(logit_bias={3: 2.5, 9: 1e6})
    assert params.logit_bias == {3: 2.5, 9: 100.0}
    got = _processed(logits, SampleRow(params, 0, [1], []))
    want = logits.clone()
    want[0, 3] += 2.5
    want[0, 9] += 100.0
    torch.testing.assert_close(got, want)
    tokens, _ = sample(logits, [SampleRow(SamplingParams(temperature=0, logit_bias={9: 100.0}), 0, [1], [])])
    assert tokens == [9]


def test_min_tokens_masks_eos_and_stop_token_ids_until_enough_outputs():
    logits = _logits()
    logits[0, 2] = 50.0  # EOS would win
    logits[0, 6] = 40.0  # then a stop token id
    row = _row(output=[1], eos={2}, temperature=0, min_tokens=3, stop_token_ids=[6])
    x = _processed(logits, row)
    assert x[0, 2] == -math.inf and x[0, 6] == -math.inf
    assert sample(logits, [row])[0] != [2]
    done = _row(output=[1, 1, 1], eos={2}, temperature=0, min_tokens=3, stop_token_ids=[6])
    assert sample(logits, [done])[0] == [2]


def test_bad_words_ban_the_last_token_only_after_the_prefix():
    logits = _logits()
    single = _processed(logits, _row(output=[5], bad_words_token_ids=[[11]]))
    assert single[0, 11] == -math.inf
    pending = _processed(logits, _row(output=[5, 8], bad_words_token_ids=[[8, 12], [9, 13]]))
    assert pending[0, 12] == -math.inf and pending[0, 13] == logits[0, 13]


def test_allowed_token_bitmask_keeps_only_allowed_ids():
    allowed = [3, 31, 32, 49]
    words = torch.zeros((VOCAB + 31) // 32, dtype=torch.int64)
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    mask = words.to(torch.int32) if words.max() < 2**31 else (words - 2**32 * (words >= 2**31)).to(torch.int32)
    x = _processed(_logits(), _row(mask=mask))
    assert sorted(torch.nonzero(x[0] > -math.inf).flatten().tolist()) == allowed
    for seed in range(20):
        assert sample(_logits(), [_row(mask=mask, seed=seed)])[0][0] in allowed


def test_greedy_takes_the_argmax_after_penalties():
    logits = _logits()
    best = int(logits.argmax())
    row = _row(output=[best], temperature=0, presence_penalty=2.0, frequency_penalty=2.0, repetition_penalty=100.0)
    assert sample(logits, [row])[0][0] == int(_processed(logits, row).argmax()) != best


def test_top_k_1_and_tiny_top_p_are_greedy():
    logits = _logits(4)
    greedy = logits.argmax(dim=-1).tolist()
    for seed in range(10):
        assert sample(logits, [_row(seed=seed + i, top_k=1) for i in range(4)])[0] == greedy
        assert sample(logits, [_row(seed=seed + i, top_p=1e-6) for i in range(4)])[0] == greedy


def _draws(logits: torch.Tensor, n: int, **params) -> torch.Tensor:
    counts = torch.zeros(VOCAB)
    for seed in range(n):
        counts[sample(logits, [_row(seed=seed, **params)])[0][0]] += 1
    return counts / n


def test_temperature_draws_follow_softmax_of_scaled_logits():
    logits = _logits() / 3
    freq = _draws(logits, 3000, temperature=0.7)
    want = torch.softmax(logits[0] / 0.7, dim=-1)
    assert (freq - want).abs().max() < 0.03


def test_min_p_top_k_top_p_keep_vllm_s_sets():
    logits = _logits() / 3
    probs = torch.softmax(logits[0], dim=-1)
    freq = _draws(logits, 600, min_p=0.3)
    assert set(torch.nonzero(freq).flatten().tolist()) <= set(torch.nonzero(probs >= 0.3 * probs.max()).flatten().tolist())
    freq = _draws(logits, 600, top_k=3)
    assert set(torch.nonzero(freq).flatten().tolist()) <= set(torch.topk(logits[0], 3).indices.tolist())
    sorted_p, order = probs.sort(descending=True)
    keep = int((sorted_p.cumsum(0) - sorted_p < 0.6).sum())  # vLLM keeps the prefix reaching top_p
    freq = _draws(logits, 600, top_p=0.6)
    assert set(torch.nonzero(freq).flatten().tolist()) <= set(order[:keep].tolist())


def test_same_seed_same_token_whatever_the_batch():
    logits = _logits(6)
    alone = [sample(logits[i : i + 1], [_row(seed=1234 + i, output=[1] * i)])[0][0] for i in range(6)]
    batch = sample(logits, [_row(seed=1234 + i, output=[1] * i) for i in range(6)])[0]
    assert batch == alone
    mixed = sample(logits, [_row(seed=1234 + i, output=[1] * i, temperature=0 if i % 2 else 1.0) for i in range(6)])[0]
    assert [mixed[i] for i in range(0, 6, 2)] == [alone[i] for i in range(0, 6, 2)]


def test_random_stream_is_exact_integer_arithmetic():
    # The stream is a fixed function of (seed, position, token): these values never change.
    assert row_key(0, 0) != row_key(1, 0) != row_key(0, 1)
    assert row_key(2**64 - 1, 7) == row_key(2**64 - 1, 7)
    u = uniform_noise(torch.tensor([row_key(42, 3)]), VOCAB)
    assert u.min() > 0 and u.max() < 1
    assert len(set(u[0].tolist())) == VOCAB


def test_logprobs_are_the_raw_log_softmax():
    logits = _logits()
    tokens, lps = sample(logits, [_row(temperature=0, logprobs=3, presence_penalty=1.0, output=[0])])
    raw = torch.log_softmax(logits[0], dim=-1)
    top = torch.topk(raw, 3).indices.tolist()
    assert set(lps[0]) == {tokens[0], *top}
    for t, v in lps[0].items():
        assert v == pytest.approx(float(raw[t]), abs=1e-5)


def test_tied_logprobs_name_the_lower_ids_whatever_the_batch():
    """Tied values go to the lower id: the ids a row's top logprobs name never depend on the
    rows around it (bf16 logits tie often)."""
    x = torch.tensor([[1.0, 3.0, 3.0, -2.0, 3.0, -math.inf, -0.0, 0.0]])
    assert top_ids(x, 8).tolist() == [[1, 2, 4, 0, 7, 6, 3, 5]]
    rand = torch.randn(7, 300, generator=torch.Generator().manual_seed(3))
    assert torch.equal(top_ids(rand, 9), torch.topk(rand, 9).indices)
    tied = (rand * 4).round() / 4  # many ties per row
    alone = [top_ids(tied[i : i + 1], 20) for i in range(7)]
    assert torch.equal(top_ids(tied, 20), torch.cat(alone))
    for row, ids in zip(tied, torch.cat(alone)):
        v = row[ids]
        assert bool((v[:-1] >= v[1:]).all()) and float(v[-1]) >= float(row.sort(descending=True).values[19])


@pytest.mark.parametrize("field,value", [
    ("temperature", 2.5), ("temperature", math.nan), ("top_p", 0.0), ("min_p", 1.5),
    ("presence_penalty", 3.0), ("frequency_penalty", -2.5), ("repetition_penalty", 0.0),
    ("seed", 2**64), ("seed", -1), ("min_tokens", 100), ("logit_bias", {1: math.inf}),
])
def test_out_of_range_params_are_refused(field, value):
    with pytest.raises(InputError):
        SamplingParams(max_tokens=16, **{field: value})


def test_tiny_temperatures_are_raised_to_vllm_s_floor():
    assert SamplingParams(temperature=1e-300).temperature == 0.01
    assert SamplingParams(temperature=1e-45).temperature == 0.01
    tokens, _ = sample(_logits(), [_row(temperature=1e-300)])
    assert 0 <= tokens[0] < VOCAB


def test_drawing_in_row_chunks_changes_nothing(monkeypatch):
    import kvtool.engine.worker.sampler as sampler

    logits = _logits(7)
    rows = [_row(seed=100 + i, output=[1] * i) for i in range(7)]
    whole = sample(logits, rows)[0]
    monkeypatch.setattr(sampler, "_NOISE_ELEMENTS", 2 * VOCAB)  # two rows at a time
    assert sample(logits, rows)[0] == whole
