"""FP8 checkpoints: config.json's `quantization_config`, the scale tensors, and dequantisation.

Two forms are read:

    quant_method "fp8"                  float8_e4m3fn weights; block-wise (`weight_block_size`,
                                        e.g. [128, 128], scales `<weight>_scale_inv` of
                                        [ceil(out/128), ceil(in/128)]: DeepSeek and Qwen FP8
                                        releases) or, without a block size, one scale per tensor
                                        or per output channel (`weight_scale`; transformers
                                        writes `weight_scale_inv`, read too)
    quant_method "compressed-tensors"   format "float-quantized": FP8 weights with a static
                                        `weight_scale` per tensor or per channel, activations
                                        dynamic per token (or static per tensor, `input_scale`)

Every weight is dequantised once as it loads (fp8 -> float32, times its scale expanded over its
block, then cast to the model's dtype: transformers' order), so the model computes as a dense one
and the fast paths apply unchanged. Activation scales (`input_scale`, `activation_scale`) are
read past: no product quantises its input. The checkpoint's FP8 form stays part of the engine's
identity (`identity_name`), so KV made by another form of the same model is never reused.

Any other `quant_method` (awq, gptq, bitsandbytes, ...) is refused in one line naming it.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Literal

import msgspec
import torch

from kvtool.engine.errors import ModelError

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_SAFETENSORS_DTYPE = "F8_E4M3"
# Scale tensors a weight `<module>.weight` may carry, stored as `<module>.<suffix>`.
SCALE_SUFFIXES = ("weight_scale_inv", "weight_scale")
# Static activation scales: read past (dequantised products take unquantised inputs).
ACTIVATION_SCALE_SUFFIXES = ("input_scale", "activation_scale")
# The linear layers a writer stores in FP8 (`is_quantized_module`); a loader takes any FP8
# weight with its scale.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "gate_proj", "up_proj", "down_proj",
               "gate_up_proj")
SUPPORTED = "fp8 (block-wise, per-tensor, per-channel) and compressed-tensors float-quantized FP8"

WeightStrategy = Literal["block", "tensor", "channel", "tensor-or-channel"]


class WeightQuantization(msgspec.Struct, frozen=True, kw_only=True):
    """A checkpoint's `quantization_config`, normalised. Part of ModelConfig (and its digest)."""

    method: Literal["fp8", "compressed-tensors"]
    # "block": one scale per weight_block_size block; "tensor-or-channel": quant_method fp8
    # without a block size, which leaves the scale's shape to say.
    weight_strategy: WeightStrategy
    weight_block_size: tuple[int, int] | None = None
    activation_scheme: Literal["dynamic", "static", "none"] = "dynamic"  # "none": weight-only
    # Activation granularity as compressed-tensors names it ("token", "tensor"); None for fp8.
    activation_strategy: str | None = None
    # Module names kept unquantised (fp8's modules_to_not_convert, compressed-tensors' ignore;
    # "re:" entries are regular expressions).
    not_quantized: tuple[str, ...] = ()
    scale_suffix: str = "weight_scale"  # the name a writer gives scales; a loader takes either


def identity_name(q: WeightQuantization | None) -> str:
    """The engine identity's `weight_quantization`: "none", or method, scheme and block size,
    e.g. "fp8:block128x128:dynamic", "compressed-tensors:fp8:channel:dynamic-token"."""
    if q is None:
        return "none"
    if q.method == "fp8":
        weights = f"block{q.weight_block_size[0]}x{q.weight_block_size[1]}" if q.weight_block_size else q.weight_strategy
        return f"fp8:{weights}:{q.activation_scheme}"
    acts = "weight-only" if q.activation_scheme == "none" else f"{q.activation_scheme}-{q.activation_strategy}"
    return f"compressed-tensors:fp8:{q.weight_strategy}:{acts}"


def parse_quantization(raw: Any, where: Path | str) -> WeightQuantization | None:
    """config.json's `quantization_config` (None or absent: an unquantised model). Raises
    ModelError in one line naming the method for anything outside SUPPORTED."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise ModelError(f"{where}: 'quantization_config' must be an object")
    method = raw.get("quant_method")
    if method == "fp8":
        return _parse_fp8(raw, where)
    if method == "compressed-tensors":
        return _parse_compressed_tensors(raw, where)
    raise ModelError(f"{where}: quantization method {method!r} is not supported (supported: {SUPPORTED})")


def _parse_fp8(raw: dict[str, Any], where: Path | str) -> WeightQuantization:
    scheme = str(raw.get("activation_scheme", "dynamic")).lower()
    if scheme not in ("dynamic", "static"):
        raise ModelError(f"{where}: fp8 activation_scheme {scheme!r} is not supported (dynamic, static)")
    if raw.get("fmt", "e4m3") != "e4m3":
        raise ModelError(f"{where}: fp8 format {raw['fmt']!r} is not supported (e4m3)")
    block = raw.get("weight_block_size")
    if block is not None and not (isinstance(block, list) and len(block) == 2
                                  and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise ModelError(f"{where}: fp8 weight_block_size must be two positive integers, got {block!r}")
    skip = raw.get("modules_to_not_convert") or raw.get("ignored_layers") or []
    return WeightQuantization(
        method="fp8",
        weight_strategy="block" if block else "tensor-or-channel",
        weight_block_size=tuple(block) if block else None,
        activation_scheme=scheme,
        not_quantized=_names(skip, "modules_to_not_convert", where),
        scale_suffix="weight_scale_inv" if block else "weight_scale",
    )


def _parse_compressed_tensors(raw: dict[str, Any], where: Path | str) -> WeightQuantization:
    def refuse(what: str) -> ModelError:
        return ModelError(f"{where}: compressed-tensors {what} is not supported (supported: {SUPPORTED})")

    fmt = raw.get("format")
    if fmt != "float-quantized":
        raise refuse(f"format {fmt!r}")
    groups = raw.get("config_groups")
    if not isinstance(groups, dict) or len(groups) != 1:
        raise refuse("config with other than one config group")
    group = next(iter(groups.values()))
    weights = group.get("weights") if isinstance(group, dict) else None
    if not isinstance(weights, dict):
        raise refuse("config group without weights")
    if (weights.get("type"), weights.get("num_bits")) != ("float", 8) or weights.get("dynamic", False):
        raise refuse(f"weights of type {weights.get('type')!r}, {weights.get('num_bits')!r} bits"
                     f"{', dynamic' if weights.get('dynamic') else ''}")
    if weights.get("strategy") not in ("tensor", "channel") or not weights.get("symmetric", True):
        raise refuse(f"weight strategy {weights.get('strategy')!r}")
    acts = group.get("input_activations")
    if acts is None:
        scheme, strategy = "none", "weight-only"
    elif isinstance(acts, dict) and (acts.get("type"), acts.get("num_bits")) == ("float", 8):
        dynamic = bool(acts.get("dynamic", False))
        strategy = acts.get("strategy")
        if (dynamic, strategy) not in ((True, "token"), (False, "tensor")):
            raise refuse(f"input activations {'dynamic' if dynamic else 'static'} per {strategy!r}")
        scheme = "dynamic" if dynamic else "static"
    else:
        raise refuse("input activations other than FP8")
    return WeightQuantization(
        method="compressed-tensors",
        weight_strategy=weights["strategy"],
        activation_scheme=scheme,
        activation_strategy=strategy,
        not_quantized=_names(raw.get("ignore") or [], "ignore", where),
        scale_suffix="weight_scale",
    )


def _names(value: Any, key: str, where: Path | str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ModelError(f"{where}: quantization_config {key!r} must be a list of module names")
    return tuple(value)


def is_quantized_module(q: WeightQuantization, module: str) -> bool:
    """Whether a writer stores `module`'s weight in FP8: a projection not named in not_quantized."""
    if module.rpartition(".")[2] not in PROJECTIONS:
        return False
    return not is_kept_unquantized(q, module)


def is_kept_unquantized(q: WeightQuantization, module: str) -> bool:
    """Whether not_quantized names `module`: exactly, as its last dotted parts, or by a "re:" pattern."""
    return any(re.match(n[3:], module) if n.startswith("re:") else module == n or module.endswith("." + n)
               for n in q.not_quantized)


def expected_scale_shape(q: WeightQuantization, weight_shape: tuple[int, ...], scale_shape: tuple[int, ...],
                         ) -> tuple[int, ...] | None:
    """The shape `scale_shape` must have for a weight of `weight_shape` under `q`; None when it
    fits (a per-tensor scale may be stored as [] or [1], a per-channel one as [out] or [out, 1])."""
    out, inp = weight_shape
    if q.weight_strategy == "block":
        bm, bn = q.weight_block_size
        want = (math.ceil(out / bm), math.ceil(inp / bn))
        return None if scale_shape == want else want
    fits = {"tensor": [(), (1,)], "channel": [(out,), (out, 1)]}
    allowed = fits["tensor"] + fits["channel"] if q.weight_strategy == "tensor-or-channel" else fits[q.weight_strategy]
    return None if scale_shape in allowed else allowed[-1]


def stored_scale_shape(q: WeightQuantization, weight_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of the scale `quantize` makes for a weight of `weight_shape`."""
    out, inp = weight_shape
    if q.weight_strategy == "block":
        return (math.ceil(out / q.weight_block_size[0]), math.ceil(inp / q.weight_block_size[1]))
    return (out, 1) if q.weight_strategy == "channel" else (1,)


def dequantize(weight: torch.Tensor, scale: torch.Tensor, q: WeightQuantization) -> torch.Tensor:
    """float32 weight * scale, the scale expanded over its block (or row, or the whole tensor)."""
    w = weight.to(torch.float32)
    s = scale.to(torch.float32)
    if q.weight_strategy == "block":
        bm, bn = q.weight_block_size
        s = s.repeat_interleave(bm, dim=0).repeat_interleave(bn, dim=1)[: w.shape[0], : w.shape[1]]
    elif s.numel() > 1:
        s = s.reshape(-1, 1)
    else:
        s = s.reshape(())
    return w * s


def quantize(weight: torch.Tensor, q: WeightQuantization) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 scale) of a float weight [out, in], as FP8 checkpoints store
    them: each block's (row's, tensor's) absolute maximum maps to FP8_MAX."""
    w = weight.to(torch.float32)
    if q.weight_strategy == "block":
        bm, bn = q.weight_block_size
        out, inp = w.shape
        padded = torch.zeros(math.ceil(out / bm) * bm, math.ceil(inp / bn) * bn, dtype=torch.float32, device=w.device)
        padded[:out, :inp] = w
        blocks = padded.view(padded.shape[0] // bm, bm, padded.shape[1] // bn, bn)
        scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    elif q.weight_strategy == "channel":
        scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    else:
        scale = (w.abs().amax().clamp(min=1e-12) / FP8_MAX).reshape(1)
    expanded = dequantize(torch.ones_like(w), scale, q)
    return (w / expanded).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def scale_owner(name: str) -> tuple[str, bool] | None:
    """(the weight it scales, whether it is a weight scale) for a scale tensor's name; None for
    any other tensor. `x.weight_scale_inv` -> ("x.weight", True); `x.input_scale` -> ("x.weight", False)."""
    module, _, leaf = name.rpartition(".")
    if leaf in SCALE_SUFFIXES or leaf in ACTIVATION_SCALE_SUFFIXES:
        return f"{module}.weight", leaf in SCALE_SUFFIXES
    return None


def match_scales(q: WeightQuantization | None, headers: dict[Path, dict[str, dict[str, Any]]]) -> dict[str, tuple[Path, str]]:
    """FP8 weight name -> (file, name) of its weight scale, over every file's header.

    Refuses in one line naming the file and tensor: an FP8 tensor in an unquantised model or
    outside a weight, an FP8 weight without its scale (or with two), a scale of no FP8 weight,
    and a scale whose shape does not fit the weight under `q`.
    """
    fp8: dict[str, tuple[Path, tuple[int, ...]]] = {}
    scales: dict[str, tuple[Path, str, tuple[int, ...]]] = {}
    others: list[tuple[Path, str, str]] = []
    for path, header in headers.items():
        for name, info in header.items():
            owner = scale_owner(name) if q is not None else None
            if info["dtype"] == FP8_SAFETENSORS_DTYPE:
                if q is None:
                    raise ModelError(f"{path}: tensor {name!r} is FP8 but config.json has no quantization_config")
                if owner is not None or not name.endswith(".weight") or len(info["shape"]) != 2:
                    raise ModelError(f"{path}: tensor {name!r} is FP8; only linear weights may be")
                fp8[name] = (path, tuple(info["shape"]))
            elif owner is not None and owner[1]:
                if owner[0] in scales:
                    raise ModelError(f"{path}: tensor {name!r}: {owner[0]!r} already has a scale "
                                     f"({scales[owner[0]][1]!r} in {scales[owner[0]][0].name})")
                scales[owner[0]] = (path, name, tuple(info["shape"]))
            elif owner is not None:
                others.append((path, name, owner[0]))
    for weight, (path, name, shape) in scales.items():
        if weight not in fp8:
            raise ModelError(f"{path}: unexpected tensor {name!r} (its weight {weight!r} is not FP8)")
        want = expected_scale_shape(q, fp8[weight][1], shape)
        if want is not None:
            raise ModelError(f"{path}: tensor {name!r} has shape {list(shape)}, the weight's "
                             f"{list(fp8[weight][1])} under {identity_name(q)} implies {list(want)}")
    for path, name, weight in others:
        if weight not in fp8:
            raise ModelError(f"{path}: unexpected tensor {name!r} (its weight {weight!r} is not FP8)")
    for weight, (path, _) in fp8.items():
        if weight not in scales:
            raise ModelError(f"{path}: FP8 tensor {weight!r} has no scale "
                             f"({' or '.join(weight[: -len('weight')] + s for s in SCALE_SUFFIXES)})")
        module = weight[: -len(".weight")]
        if is_kept_unquantized(q, module):
            raise ModelError(f"{path}: tensor {weight!r} is FP8 but quantization_config keeps {module!r} unquantised")
    return {weight: (path, name) for weight, (path, name, _) in scales.items()}
