"""An FP8 checkpoint rewritten as the dense one it stands for: the reference its tests compare with."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file, save_file

FP8_DTYPE = torch.float8_e4m3fn


def dense_copy(src, dest) -> None:
    """`src` rewritten as an unquantised checkpoint of the same model: every FP8 weight times its
    scale, computed here from the file (not by kvtool's loader), in float32."""
    tensors = load_file(str(src / "model.safetensors"))
    dense = {}
    for name, value in tensors.items():
        if name.endswith(("_scale", "_scale_inv")):
            continue
        if value.dtype == FP8_DTYPE:
            scale = tensors.get(f"{name}_scale_inv", tensors.get(f"{name}_scale"))
            if scale.shape == value.shape[:1] + (1,) or scale.numel() == 1:
                value = value.float() * scale.float()
            else:  # blocks: each scale over its rows and columns
                rows, cols = -(-value.shape[0] // scale.shape[0]), -(-value.shape[1] // scale.shape[1])
                full = scale.float().repeat_interleave(rows, 0).repeat_interleave(cols, 1)
                value = value.float() * full[: value.shape[0], : value.shape[1]]
        dense[name] = value
    dest.mkdir()
    for f in src.iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            (dest / f.name).write_bytes(f.read_bytes())
    config = json.loads((src / "config.json").read_text())
    del config["quantization_config"]
    (dest / "config.json").write_text(json.dumps(config))
    save_file(dense, str(dest / "model.safetensors"), metadata={"format": "pt"})
