"""The one dtype table: the names kvtool accepts for KV pages and weights, and what each means.

Torch-free, so that configs, model directories and headers can be read without importing torch;
`torch_dtype(name)` gives the torch dtype where one is needed.
"""

from __future__ import annotations

# Canonical name -> bytes per element.
ELEMENT_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}
# KV pages may also hold an fp8 cache (vLLM's --kv-cache-dtype fp8*): the model's dtype or one of these.
KV_ELEMENT_BYTES: dict[str, int] = {**ELEMENT_BYTES, "float8_e4m3fn": 1, "float8_e5m2": 1}
# vLLM's fp8 cache names -> the dtype of the pages (on CUDA vLLM's `fp8` is e4m3).
FP8_KV_DTYPES: dict[str, str] = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}
# The largest finite value of each fp8 dtype: a quantised value saturates there, as vLLM's
# cache writes do.
FP8_MAX: dict[str, float] = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}
# Other spellings found in Hugging Face configs (`torch_dtype`), mapped to the canonical name.
ALIASES: dict[str, str] = {"float": "float32", "half": "float16"}


def canonical_dtype(name: str) -> str | None:
    """`"torch.bfloat16"`, `"bfloat16"`, `"half"` -> the canonical name; None for anything else."""
    name = str(name).removeprefix("torch.")
    name = ALIASES.get(name, name)
    return name if name in ELEMENT_BYTES else None


def torch_dtype(name: str):
    """The torch dtype of a canonical name."""
    import torch

    return getattr(torch, name)
