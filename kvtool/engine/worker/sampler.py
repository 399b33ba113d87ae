"""Token sampling on the logits' device, with vLLM's parameters and a counter-based random stream.

`sample(logits, rows)` takes logits [N, V] and one SampleRow per row. The logits never leave
their device: only the sampled ids (and, when asked, the top logprobs) come back to the host.
The processing order is vLLM v1's:

    allowed-token mask (structured outputs) -> bad words -> logit_bias -> min_tokens (not where
    the grammar allows nothing but EOS or a stop id: its end outranks min_tokens)
    -> repetition penalty (prompt + output tokens) -> frequency / presence penalties (output)
    -> greedy rows: argmax here
    -> temperature -> min_p -> top_k -> top_p -> Gumbel-max draw

Random draws come from a counter-based stream: the noise for token v of a row is a hash of
(seed, output position, v) computed with 32-bit integer arithmetic in int64 tensors, exact on
every device. A row's draw therefore depends only on its own seed and position, never on the
batch it runs in or on any generator state, so the same seed gives the same tokens whatever
else is running. Logprobs are the model's raw log-softmax (before any processing), as vLLM
returns them by default.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtool.engine.params import SamplingParams

_MASK32 = 0xFFFFFFFF
# Odd multiplier below 2**31, so that x * _MIX (x < 2**32) never leaves int64.
_MIX = 0x45D9F3B
_NEG_INF = float("-inf")
# Rows whose noise is drawn at once: bounds the int64/float64 temporaries to about this many elements.
_NOISE_ELEMENTS = 1 << 24


@dataclass(slots=True)
class SampleRow:
    """One request's share of a sampling step."""

    params: SamplingParams
    # The request's seed (its own, or the one the engine assigned it at add time).
    seed: int
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    # Ids that end the request (EOS); masked with stop_token_ids until min_tokens outputs.
    eos_token_ids: frozenset[int] = frozenset()
    # Structured outputs: a bitmask of allowed ids, int32 [ceil(V / 32)], bit j of word i = id 32 i + j.
    allowed_token_bitmask: torch.Tensor | None = None
    # Index of the output token being drawn (its random stream's counter); None: len(output_token_ids).
    position: int | None = None


def mix32(x):
    """A 32-bit integer hash (works on Python ints and on int64 tensors of values < 2**32)."""
    x = (((x >> 16) ^ x) * _MIX) & _MASK32
    x = (((x >> 16) ^ x) * _MIX) & _MASK32
    return (x >> 16) ^ x


def row_key(seed: int, position: int) -> int:
    """The 32-bit key of one draw: a row's `seed` at output `position`."""
    h = mix32((seed & _MASK32) ^ 0x9E3779B9)
    h = mix32(h ^ ((seed >> 32) & _MASK32))
    return mix32(h ^ (position & _MASK32))


_token_hashes: dict[tuple[str, int], torch.Tensor] = {}


def _token_hash(vocab: int, device: torch.device) -> torch.Tensor:
    key = (str(device), vocab)
    t = _token_hashes.get(key)
    if t is None:
        t = mix32(torch.arange(vocab, dtype=torch.int64, device=device) + 0x2545F491)
        _token_hashes[key] = t
    return t


def uniform_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """Uniforms in (0, 1), float64 [N, V], from int64 row keys [N] (values < 2**32)."""
    h = mix32(keys.unsqueeze(1) ^ _token_hash(vocab, keys.device).unsqueeze(0))
    return (h.to(torch.float64) + 0.5) * (1.0 / 2**32)


def gumbel_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """Standard Gumbel noise [N, V] (float64) for the rows' keys."""
    return -torch.log(-torch.log(uniform_noise(keys, vocab)))


def sample(
    logits: torch.Tensor, rows: Sequence[SampleRow], greedy: torch.Tensor | None = None
) -> tuple[list[int], list[dict[int, float] | None]]:
    """One token per row of logits [N, V]. Returns (token ids, per-row logprobs or None).

    A row's logprobs hold the sampled token's and its params.logprobs most likely tokens'.
    `greedy`, when given, is the logits' argmax already computed (a CUDA graph's).
    """
    tokens, logprobs = sample_on_device(logits, rows, greedy)
    return tokens.tolist(), logprobs


def sample_on_device(
    logits: torch.Tensor, rows: Sequence[SampleRow], greedy: torch.Tensor | None = None
) -> tuple[torch.Tensor, list[dict[int, float] | None]]:
    """`sample` with the token ids left on the logits' device (int64 [N]): the host waits for
    them only when it reads them. Logprobs, when any row asks for them, are read at once."""
    params = [r.params for r in rows]
    want_logprobs = any(p.logprobs is not None for p in params)
    needs_processing = any(_needs_processing(r) for r in rows)
    if all(p.is_greedy for p in params) and not needs_processing and not want_logprobs:
        return (greedy.clone() if greedy is not None else logits.argmax(dim=-1)), [None] * len(rows)

    raw_logprobs = torch.log_softmax(logits.float(), dim=-1) if want_logprobs else None
    x = logits.float()
    if needs_processing:
        if x is logits:
            x = x.clone()  # the processors write in place; the caller's logits stay as they were
        _apply_processors(x, rows)
    tokens = x.argmax(dim=-1)
    random_rows = [i for i, p in enumerate(params) if not p.is_greedy]
    if random_rows:
        idx = torch.tensor(random_rows, dtype=torch.long, device=x.device) if len(random_rows) < len(rows) else None
        sub = x if idx is None else x.index_select(0, idx)
        drawn = _draw(sub, [rows[i] for i in random_rows])
        if idx is None:
            tokens = drawn
        else:
            tokens = tokens.index_copy(0, idx, drawn)
    if raw_logprobs is None:
        return tokens, [None] * len(rows)
    return tokens, _gather_logprobs(raw_logprobs, tokens, params)


# ---- logits processors (they change greedy results too) ------------------------------------------


def _needs_processing(r: SampleRow) -> bool:
    p = r.params
    return bool(
        r.allowed_token_bitmask is not None
        or p.bad_words_token_ids
        or p.logit_bias
        or (p.min_tokens and len(r.output_token_ids) < p.min_tokens)
        or p.has_penalties
    )


def _apply_processors(x: torch.Tensor, rows: Sequence[SampleRow]) -> None:
    """Apply every logits-changing parameter to x [N, V] in place, in vLLM's order."""
    n, vocab = x.shape
    dev = x.device
    masked = [(i, r.allowed_token_bitmask) for i, r in enumerate(rows) if r.allowed_token_bitmask is not None]
    if masked:
        bitmask = torch.stack([m for _, m in masked]).to(dev, non_blocking=True)
        allowed = unpack_bitmask(bitmask, vocab)
        idx = torch.tensor([i for i, _ in masked], dtype=torch.long, device=dev)
        x[idx] = x[idx].masked_fill(~allowed, _NEG_INF)

    # Bad words, logit_bias and min_tokens all name single (row, token) cells: gather them on the
    # host and write them with one scatter each.
    banned_rows: list[int] = []
    banned_ids: list[int] = []
    bias_rows: list[int] = []
    bias_ids: list[int] = []
    bias_values: list[float] = []
    for i, r in enumerate(rows):
        p = r.params
        out = r.output_token_ids
        for word in p.bad_words_token_ids:
            prefix = word[:-1]
            if len(prefix) <= len(out) and (not prefix or list(out[len(out) - len(prefix):]) == prefix):
                banned_rows.append(i)
                banned_ids.append(word[-1])
        if p.min_tokens and len(out) < p.min_tokens:
            ends = (*r.eos_token_ids, *p.stop_token_ids)
            # A complete grammar allows nothing but its end: it outranks min_tokens (vLLM masks the
            # end too and samples from a row with every token banned, a token outside the grammar).
            if r.allowed_token_bitmask is None or not _allows_only(r.allowed_token_bitmask, ends, vocab):
                for t in ends:
                    banned_rows.append(i)
                    banned_ids.append(t)
        if p.logit_bias:
            for t, b in p.logit_bias.items():
                bias_rows.append(i)
                bias_ids.append(t)
                bias_values.append(b)
    if bias_rows:
        keep = [k for k, t in enumerate(bias_ids) if t < vocab]
        rr = torch.tensor([bias_rows[k] for k in keep], dtype=torch.long, device=dev)
        cc = torch.tensor([bias_ids[k] for k in keep], dtype=torch.long, device=dev)
        x.index_put_((rr, cc), torch.tensor([bias_values[k] for k in keep], dtype=x.dtype, device=dev), accumulate=True)
    if banned_rows:
        keep = [k for k, t in enumerate(banned_ids) if t < vocab]
        rr = torch.tensor([banned_rows[k] for k in keep], dtype=torch.long, device=dev)
        cc = torch.tensor([banned_ids[k] for k in keep], dtype=torch.long, device=dev)
        x.index_put_((rr, cc), torch.full((len(keep),), _NEG_INF, dtype=x.dtype, device=dev))

    penalised = [i for i, r in enumerate(rows) if r.params.has_penalties]
    if penalised:
        _apply_penalties(x, [rows[i] for i in penalised], torch.tensor(penalised, dtype=torch.long, device=dev))


def _allows_only(bitmask: torch.Tensor, ids: Sequence[int], vocab: int) -> bool:
    """Whether a structured-output bitmask (int32 [W]) allows no id of [0, vocab) outside `ids`."""
    allowed = unpack_bitmask(bitmask.cpu().unsqueeze(0), vocab)[0]
    allowed[[t for t in ids if t < vocab]] = False
    return not bool(allowed.any())


def unpack_bitmask(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """bool [N, vocab] from int32 bitmasks [N, W] (bit j of word i: token 32 i + j); ids past 32 W are banned."""
    n, words = bitmask.shape
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = ((bitmask.unsqueeze(-1) >> shifts) & 1).bool().reshape(n, words * 32)
    if words * 32 >= vocab:
        return bits[:, :vocab]
    pad = torch.zeros(n, vocab - words * 32, dtype=torch.bool, device=bitmask.device)
    return torch.cat([bits, pad], dim=1)


def _token_counts(seqs: list[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """Counts [len(seqs), vocab] of each id in each sequence (ids >= vocab ignored)."""
    width = max((len(s) for s in seqs), default=0)
    counts = torch.zeros(len(seqs), vocab + 1, dtype=torch.int32, device=device)
    if width == 0:
        return counts[:, :vocab]
    padded = torch.full((len(seqs), width), vocab, dtype=torch.long)
    for i, s in enumerate(seqs):
        if s:
            padded[i, : len(s)] = torch.as_tensor(list(s), dtype=torch.long).clamp_(max=vocab)
    padded = padded.to(device, non_blocking=True)
    counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=torch.int32))
    return counts[:, :vocab]


def _apply_penalties(x: torch.Tensor, rows: list[SampleRow], idx: torch.Tensor) -> None:
    """vLLM's penalties on rows `idx` of x: repetition over prompt + output ids, the OpenAI
    frequency and presence penalties over output ids."""
    vocab = x.shape[1]
    dev = x.device
    out_counts = _token_counts([r.output_token_ids for r in rows], vocab, dev)
    prompt_seen = _token_counts([r.prompt_token_ids for r in rows], vocab, dev) > 0
    out_seen = out_counts > 0
    rep = torch.tensor([r.params.repetition_penalty for r in rows], dtype=x.dtype, device=dev).unsqueeze(1)
    freq = torch.tensor([r.params.frequency_penalty for r in rows], dtype=x.dtype, device=dev).unsqueeze(1)
    pres = torch.tensor([r.params.presence_penalty for r in rows], dtype=x.dtype, device=dev).unsqueeze(1)
    sub = x.index_select(0, idx)
    penalties = torch.where(prompt_seen | out_seen, rep, torch.ones_like(rep))
    sub = sub * torch.where(sub > 0, 1.0 / penalties, penalties)
    sub = sub - freq * out_counts.to(x.dtype) - pres * out_seen.to(x.dtype)
    x.index_copy_(0, idx, sub)


# ---- random sampling ---------------------------------------------------------------------------------


def _draw(x: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """Token ids [N] drawn from processed logits x [N, V] of random rows."""
    n, vocab = x.shape
    dev = x.device
    params = [r.params for r in rows]
    temp = torch.tensor([p.temperature for p in params], dtype=x.dtype, device=dev).unsqueeze(1)
    x = x / temp
    if any(p.min_p > 0.0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], dtype=x.dtype, device=dev).unsqueeze(1)
        probs = torch.softmax(x, dim=-1)
        x = x.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), _NEG_INF)
    if any(0 < p.top_k < vocab or p.top_p < 1.0 for p in params):
        x = _top_k_top_p(x, params)
    keys = torch.tensor([row_key(r.seed, len(r.output_token_ids) if r.position is None else r.position) for r in rows],
                        dtype=torch.int64, device=dev)
    step = max(1, _NOISE_ELEMENTS // vocab)
    parts = [
        (x[i : i + step].double() + gumbel_noise(keys[i : i + step], vocab)).argmax(dim=-1)
        for i in range(0, n, step)
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _top_k_top_p(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """vLLM's apply_top_k_top_p: keep the k largest logits, then the smallest set of tokens
    whose probability reaches top_p (at least one)."""
    n, vocab = x.shape
    dev = x.device
    # Stable: tied logits keep id order, so which of them a cut drops never depends on the batch.
    sorted_x, order = x.sort(dim=-1, descending=False, stable=True)
    k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], dtype=torch.long, device=dev)
    kth = sorted_x.gather(1, (vocab - k).unsqueeze(1))
    sorted_x = sorted_x.masked_fill(sorted_x < kth, _NEG_INF)
    top_p = torch.tensor([p.top_p for p in params], dtype=x.dtype, device=dev).unsqueeze(1)
    probs_sum = torch.softmax(sorted_x, dim=-1).cumsum(dim=-1)
    drop = probs_sum <= 1 - top_p
    drop[:, -1] = False
    sorted_x = sorted_x.masked_fill(drop, _NEG_INF)
    return torch.empty_like(x).scatter_(1, order, sorted_x)


# ---- logprobs --------------------------------------------------------------------------------------------


def top_ids(x: torch.Tensor, k: int) -> torch.Tensor:
    """Ids [N, k] of each row's k largest values of float32 x [N, V], ties to the lower id.

    torch.topk breaks ties by whichever kernel the shape selects, so the ids of tied logprobs
    could change with the batch. Each value is mapped to an int64 that orders like the float
    (its bits, negatives flipped) in the high half and the reversed id in the low half: every
    key is distinct, and the top k keys are the same whatever rows surround them.
    """
    bits = x.contiguous().view(torch.int32).to(torch.int64)
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    ids = torch.arange(x.shape[-1], dtype=torch.int64, device=x.device)
    keys = ordered * (1 << 32) + (_MASK32 - ids)
    return _MASK32 - torch.topk(keys, k, dim=-1).values % (1 << 32)


def _gather_logprobs(
    raw: torch.Tensor, tokens: torch.Tensor, params: list[SamplingParams]
) -> list[dict[int, float] | None]:
    """{token id: logprob} per row: the sampled token's and the top params.logprobs ones."""
    k = max(p.logprobs or 0 for p in params)
    chosen = raw.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
    top_v: list[list[float]] = [[] for _ in params]
    top_i: list[list[int]] = [[] for _ in params]
    if k > 0:
        indices = top_ids(raw, k)
        top_v, top_i = raw.gather(1, indices).tolist(), indices.tolist()
    token_list = tokens.tolist()
    out: list[dict[int, float] | None] = []
    for row, p in enumerate(params):
        if p.logprobs is None:
            out.append(None)
            continue
        entry = {token_list[row]: chosen[row]}
        entry.update(zip(top_i[row][: p.logprobs], top_v[row][: p.logprobs]))
        out.append(entry)
    return out
