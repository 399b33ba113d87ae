"""An fp8 KV cache's scales: one float32 per layer for K and one for V (vLLM's per-tensor
`k_scale` / `v_scale`), read from the checkpoint, else 1.0, as vLLM 0.33 does.

A checkpoint names them as its quantiser wrote them; these are the names vLLM's cache-scale
mappers (`QuantizationConfig.get_cache_scale_mapper`, and `Fp8Config`'s for compressed-tensors
suffixes) map to an attention layer's scales:

    model.layers.N.self_attn.k_scale / v_scale          (llm-compressor, vLLM's own; `attn.` too)
    model.layers.N.self_attn.k_proj.output_scale        (compressed-tensors, Quark)
    model.layers.N.self_attn.k_proj.k_scale             (ModelOpt; qkv_proj.k_scale fused)
    model.layers.N.self_attn.k_cache.scale / v_cache.scale
    model.layers.N.self_attn.kv_scale                   (deprecated: K's, then V's too)

As in vLLM, a layer with only K's scale uses it for V as well, and one with neither uses 1.0.
The query and softmax scales some of these checkpoints carry (`q_scale`, `prob_scale`, their
`output_scale` forms, zero points) serve FP8 attention backends only; they are read past. The
model's loader skips all of them (`is_attention_scale`); a model with an unquantised cache
ignores them, as vLLM does with `--kv-cache-dtype auto`.
"""

from __future__ import annotations

import hashlib
import math
import re
import struct
from pathlib import Path

import msgspec

from kvtool.engine.errors import ModelError

_LAYER = r"(?:^|\.)layers\.(\d+)\.self_attn\."
# A layer's K or V scale in each form vLLM maps: group 1 the layer, group 2 the side ("k", "v";
# "_" for the deprecated kv_scale, which vLLM reads as K's).
_KV_NAMES = [re.compile(_LAYER + p + "$") for p in (
    r"(?:attn\.)?([kv])_scale",
    r"kv(_)scale",  # the deprecated single scale: K's
    r"(?:[kv]|qk(?:qk)?v)_proj\.([kv])_scale",
    r"([kv])_proj\.output_scale",
    r"([kv])_cache\.scale",
)]
# Attention scales read past: the query's and the softmax's (FP8 attention), and zero points.
_OTHER_NAMES = re.compile(
    _LAYER + r"(?:attn\.)?(?:q_scale|prob_scale|prob_output_scale|q\.scale|q_proj\.output_scale|[qkv]_zero_point)$")


class KVScales(msgspec.Struct, frozen=True):
    """Per-layer K and V scales of an fp8 cache."""

    k: tuple[float, ...]
    v: tuple[float, ...]

    @classmethod
    def ones(cls, num_layers: int) -> KVScales:
        return cls((1.0,) * num_layers, (1.0,) * num_layers)

    def describe(self) -> str:
        """What the identity records: the scheme and a digest of every scale's float32 bits, so
        KV stored under other scales is another identity's."""
        if all(s == 1.0 for s in (*self.k, *self.v)):
            return "fp8 per-tensor scales 1.0"
        bits = struct.pack(f"<{2 * len(self.k)}f", *self.k, *self.v)
        return f"fp8 per-tensor scales sha256:{hashlib.sha256(bits).hexdigest()[:16]}"


def kv_scale_target(name: str) -> tuple[int, str] | None:
    """(layer, "k" | "v") of a KV scale tensor's name; None for any other tensor."""
    for pattern in _KV_NAMES:
        m = pattern.search(name)
        if m is not None:
            return int(m.group(1)), "k" if m.group(2) == "_" else m.group(2)
    return None


def is_attention_scale(name: str) -> bool:
    """A K/V scale (`kv_scale_target`) or another attention scale these checkpoints carry."""
    return kv_scale_target(name) is not None or _OTHER_NAMES.search(name) is not None


def read_kv_scales(files: list[Path], num_layers: int) -> KVScales:
    """The scales the checkpoint's safetensors `files` hold, by vLLM's rule for the layers
    (or sides) they do not name. Raises ModelError (one line, naming the file and tensor) for a
    scale that is not one positive finite number, of a layer the model does not have, or a V
    scale without its K scale."""
    from safetensors import safe_open

    k: list[float | None] = [None] * num_layers
    v: list[float | None] = [None] * num_layers
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    target = kv_scale_target(name)
                    if target is None:
                        continue
                    layer, side = target
                    tensor = f.get_tensor(name)
                    value = float(tensor.float().reshape(-1)[0]) if tensor.numel() == 1 else math.nan
                    if tensor.numel() != 1 or not math.isfinite(value) or value <= 0:
                        raise ModelError(f"{path}: KV scale {name!r} must be one positive finite number "
                                         f"(shape {list(tensor.shape)})")
                    if layer >= num_layers:
                        raise ModelError(f"{path}: KV scale {name!r} names layer {layer}; the model has {num_layers}")
                    (k if side == "k" else v)[layer] = value
        except ModelError:
            raise
        except Exception as e:  # safetensors raises its own error types for unreadable data
            raise ModelError(f"{path}: cannot be read as safetensors ({str(e).splitlines()[0]})") from None
    for layer, (ks, vs) in enumerate(zip(k, v)):
        if ks is None and vs is not None:
            raise ModelError(f"{files[0].parent}: layer {layer} has a V scale but no K scale (vLLM requires K's)")
    # vLLM's rule: K's scale stands for V's where V has none; 1.0 where the layer has neither.
    return KVScales(tuple(1.0 if ks is None else ks for ks in k),
                    tuple((1.0 if ks is None else ks) if vs is None else vs for ks, vs in zip(k, v)))
