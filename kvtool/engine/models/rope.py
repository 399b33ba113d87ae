"""RoPE for every model: config.json's RoPE settings read into one normalised form, and the
inverse frequencies and attention factor they give, by transformers' formulas.

Both config forms are read: classic (`rope_theta` beside `rope_scaling`) and transformers 5
(`rope_parameters`, theta inside). `parse_rope` turns either into (theta, scaling), where scaling
is None for plain RoPE or a dict with every value resolved (defaults filled in, yarn's and
longrope's attention factor computed), so the dict alone says what the model computes:

    linear     {rope_type, factor}: every frequency divided by factor
    dynamic    {rope_type, factor, original_max_position_embeddings}: NTK-aware base
    yarn       {rope_type, factor, original_max_position_embeddings, beta_fast, beta_slow,
                truncate, attention_factor}
    longrope   {rope_type, short_factor, long_factor, original_max_position_embeddings,
                attention_factor}
    llama3     {rope_type, factor, low_freq_factor, high_freq_factor, original_max_position_embeddings}

`rope_frequencies(config, seq_len)` gives (inv_freq [head_dim // 2] float32 on CPU, attention
factor); cos and sin are multiplied by the attention factor, in float32, before they are cast
(transformers' rotary embedding does the same).

Sequence length. Two types depend on how long the sequence is; an engine over a paged, shared
KV cache cannot change a token's rotation once its K is stored, so kvtool computes them once,
for seq_len = the engine's maximum model length (`--max-model-len`, at most
max_position_embeddings):

* longrope: long_factor when seq_len > original_max_position_embeddings, else short_factor.
  This is vLLM's rule (it picks the long factors for every position when max_model_len exceeds
  the original length), and transformers' for a sequence of that length; transformers picks
  per forward call from the call's longest position.
* dynamic: transformers' formula for seq_len, which leaves the frequencies plain for any
  seq_len <= max_position_embeddings. Since kvtool runs no sequence longer than that, it
  equals transformers for every sequence it runs. vLLM instead fixes the base once at the
  length max_position_embeddings * factor, for every sequence, short ones included.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Protocol

import torch

from kvtool.engine.errors import ModelError

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "longrope", "llama3")


class RopeConfig(Protocol):
    """What `rope_frequencies` reads of a model config (`model_dir.ModelConfig` has it)."""

    head_dim: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int


def parse_rope(raw: dict[str, Any], where: Path | str) -> tuple[float, dict[str, Any] | None]:
    """(theta, normalised scaling or None) of a config.json dict; ModelError naming `where` for an
    unsupported type or a missing or mistyped parameter."""
    params = raw.get("rope_parameters")
    if params is None:
        params = dict(raw.get("rope_scaling") or {})
    elif not isinstance(params, dict):
        raise ModelError(f"{where}: 'rope_parameters' must be an object")
    else:
        params = dict(params)
    theta = params.pop("rope_theta", None)
    if theta is None:
        theta = raw.get("rope_theta", 10000.0)
    if isinstance(theta, bool) or not isinstance(theta, (int, float)) or theta <= 0:
        raise ModelError(f"{where}: rope_theta must be a positive number, got {theta!r}")
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ModelError(f"{where}: partial_rotary_factor={partial} is not supported")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    if rope_type not in ROPE_TYPES:
        raise ModelError(f"{where}: unsupported rope type {rope_type!r} (supported: {', '.join(ROPE_TYPES)})")
    try:
        scaling = _SCALING_PARSERS[rope_type](params, raw)
    except (KeyError, TypeError, ValueError) as e:
        raise ModelError(f"{where}: {rope_type} rope scaling lacks or mistypes {e}") from None
    if rope_type == "llama3" and scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
        raise ModelError(f"{where}: llama3 rope scaling needs high_freq_factor > low_freq_factor")
    factor = scaling.get("factor", 1.0)
    if factor <= 0:
        raise ModelError(f"{where}: {rope_type} rope scaling needs a positive factor, got {factor}")
    return float(theta), scaling


def _original_len(params: dict[str, Any], raw: dict[str, Any], top_level_first: bool = False) -> int:
    # transformers gives a top-level original_max_position_embeddings (Phi-3's place) priority
    # for yarn and longrope; llama3 configs keep theirs inside the scaling dict.
    top = raw.get("original_max_position_embeddings")
    if top_level_first and top is not None:
        return int(top)
    return int(params.get("original_max_position_embeddings") or raw["max_position_embeddings"])


def _linear(params: dict[str, Any], raw: dict[str, Any]) -> dict[str, Any]:
    return {"rope_type": "linear", "factor": float(params["factor"])}


def _dynamic(params: dict[str, Any], raw: dict[str, Any]) -> dict[str, Any]:
    # transformers' dynamic NTK scales from max_position_embeddings, whatever else the dict says.
    return {"rope_type": "dynamic", "factor": float(params["factor"]),
            "original_max_position_embeddings": int(raw["max_position_embeddings"])}


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(params: dict[str, Any], raw: dict[str, Any]) -> dict[str, Any]:
    original = _original_len(params, raw, top_level_first=True)
    factor = params.get("factor")
    factor = raw["max_position_embeddings"] / original if factor is None else float(factor)
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    return {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original,
            "beta_fast": float(params.get("beta_fast") or 32), "beta_slow": float(params.get("beta_slow") or 1),
            "truncate": bool(params.get("truncate", True)), "attention_factor": float(attention_factor)}


def _longrope(params: dict[str, Any], raw: dict[str, Any]) -> dict[str, Any]:
    original = _original_len(params, raw, top_level_first=True)
    factor = params.get("factor")
    factor = raw["max_position_embeddings"] / original if factor is None else float(factor)
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    short, long = [float(x) for x in params["short_factor"]], [float(x) for x in params["long_factor"]]
    return {"rope_type": "longrope", "short_factor": short, "long_factor": long,
            "original_max_position_embeddings": original, "attention_factor": float(attention_factor)}


def _llama3(params: dict[str, Any], raw: dict[str, Any]) -> dict[str, Any]:
    return {
        "rope_type": "llama3",
        "factor": float(params["factor"]),
        "low_freq_factor": float(params["low_freq_factor"]),
        "high_freq_factor": float(params["high_freq_factor"]),
        "original_max_position_embeddings": _original_len(params, raw),
    }


_SCALING_PARSERS = {"linear": _linear, "dynamic": _dynamic, "yarn": _yarn, "longrope": _longrope, "llama3": _llama3}


def _plain(head_dim: int, theta: float) -> torch.Tensor:
    # Explicitly on CPU, also inside a `torch.device("meta")` block: meta ops would import torch's compiler.
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / head_dim
    return 1.0 / (theta**exponents)


def rope_frequencies(config: RopeConfig, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim // 2] float32 on CPU, attention factor) of `config` for sequences of
    up to `seq_len` tokens (None: max_position_embeddings). Only longrope and dynamic depend on
    seq_len (module docstring)."""
    d, theta, s = config.head_dim, config.rope_theta, config.rope_scaling
    seq_len = config.max_position_embeddings if seq_len is None else seq_len
    kind = None if s is None else s["rope_type"]
    if kind is None:
        return _plain(d, theta), 1.0
    if kind == "linear":
        return _plain(d, theta) / s["factor"], 1.0
    if kind == "dynamic":
        factor, original = s["factor"], s["original_max_position_embeddings"]
        length = max(seq_len, original)
        base = theta * ((factor * length / original) - (factor - 1)) ** (d / (d - 2))
        return _plain(d, base), 1.0
    if kind == "yarn":
        return _yarn_inv_freq(d, theta, s), s["attention_factor"]
    if kind == "longrope":
        long = seq_len > s["original_max_position_embeddings"]
        factors = torch.tensor(s["long_factor"] if long else s["short_factor"], dtype=torch.float32, device="cpu")
        exponents = torch.arange(0, d, 2, dtype=torch.int64, device="cpu").float() / d
        return 1.0 / (factors * theta**exponents), s["attention_factor"]
    return _llama3_inv_freq(_plain(d, theta), s), 1.0


def _yarn_inv_freq(d: int, theta: float, s: dict[str, Any]) -> torch.Tensor:
    """YaRN: each frequency between its extrapolated (plain) and interpolated (/ factor) value,
    by a linear ramp over the dims whose rotations at the original length lie between
    beta_fast and beta_slow."""
    original = s["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return (d * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(s["beta_fast"]), correction_dim(s["beta_slow"])
    if s["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = torch.clamp((torch.arange(d // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, d, 2, device="cpu").to(torch.float32) / d)
    extrapolation = 1 - ramp
    return (1.0 / (s["factor"] * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    """llama3: long wavelengths are slowed by `factor`, short ones kept, the band between interpolated."""
    factor = s["factor"]
    low, high = s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)
