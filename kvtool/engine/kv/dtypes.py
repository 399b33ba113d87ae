"""The one dtype table: the names kvtool accepts for KV pages and weights, and what each means.

Torch-free, so that configs, model directories and headers can be read without importing torch;
`torch_dtype(name)` gives the torch dtype where one is needed.
"""

from __future__ import annotations

# Canonical name -> bytes per element.
ELEMENT_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}
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
