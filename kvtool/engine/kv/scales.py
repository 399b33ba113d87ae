"""An fp8 KV cache's scales: one float32 per layer for K and one for V (vLLM's per-tensor
`k_scale` / `v_scale`), read from the checkpoint, else 1.0, as vLLM does.

A checkpoint names them as its quantiser wrote them; these are the names vLLM's loader maps to
an attention layer's scales (`maybe_remap_kv_scale_name`):

    model.layers.N.self_attn.k_scale / v_scale       (llm-compressor, vLLM's own)
    model.layers.N.self_attn.kv_scale                (older: one scale for both)
    model.layers.N.self_attn.k_proj.output_scale     (compressed-tensors)
    model.layers.N.self_attn.k_proj.k_scale          (ModelOpt; v_proj.v_scale likewise)

The model's loader skips these tensors (`is_kv_scale`); a model with an unquantised cache
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

_NAME = re.compile(
    r"(?:^|\.)layers\.(\d+)\.self_attn\.(?:attn\.)?"
    r"(?:(k|v)_proj\.(?:output_scale|k_scale|v_scale)|(k|v|kv)_scale)$"
)


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
    """(layer, "k" | "v" | "kv") of a KV scale tensor's name; None for any other tensor."""
    m = _NAME.search(name)
    if m is None:
        return None
    return int(m.group(1)), m.group(2) or m.group(3)


def is_kv_scale(name: str) -> bool:
    return kv_scale_target(name) is not None


def read_kv_scales(files: list[Path], num_layers: int) -> KVScales:
    """The scales the checkpoint's safetensors `files` hold; 1.0 for a layer (or a side) they
    do not name. Raises ModelError (one line, naming the file and tensor) for a scale that is
    not one positive finite number, or of a layer the model does not have."""
    from safetensors import safe_open

    k, v = [1.0] * num_layers, [1.0] * num_layers
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
                    if side in ("k", "kv"):
                        k[layer] = value
                    if side in ("v", "kv"):
                        v[layer] = value
        except ModelError:
            raise
        except Exception as e:  # safetensors raises its own error types for unreadable data
            raise ModelError(f"{path}: cannot be read as safetensors ({str(e).splitlines()[0]})") from None
    return KVScales(tuple(k), tuple(v))
