"""Token sampling: greedy, temperature, top-k, top-p, with per-request seeded generators.

Sampling runs on CPU float32 logits so that the same seed gives the same tokens on every device.
"""

from __future__ import annotations

import torch

from kvtool.engine.params import SamplingParams


def sample_tokens(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    default_generator: torch.Generator,
) -> tuple[list[int], list[dict[int, float] | None]]:
    """Sample one token per row of logits [N, V]. Returns (token ids, per-row logprobs or None).

    Logprobs are the model's raw log-softmax (before temperature), for the sampled token and the
    top `logprobs` tokens, as vLLM returns them by default.
    """
    logits = logits.float().cpu()
    if all(p.is_greedy for p in params) and all(p.logprobs is None for p in params):
        return logits.argmax(dim=-1).tolist(), [None] * len(params)
    tokens: list[int] = []
    logprobs: list[dict[int, float] | None] = []
    for row, p, gen in zip(logits, params, generators):
        tok = int(row.argmax()) if p.is_greedy else _sample_row(row, p, gen or default_generator)
        tokens.append(tok)
        if p.logprobs is None:
            logprobs.append(None)
            continue
        lp = torch.log_softmax(row, dim=-1)
        entry = {tok: float(lp[tok])}
        if p.logprobs > 0:
            top = torch.topk(lp, p.logprobs)
            entry.update({int(i): float(v) for v, i in zip(top.values, top.indices)})
        logprobs.append(entry)
    return tokens, logprobs


def _sample_row(row: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> int:
    scaled = row / p.temperature
    if p.top_k > 0 and p.top_k < scaled.numel():
        kth = torch.topk(scaled, p.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_probs, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        drop = cum - sorted_probs > p.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=gen))
