"""The Gluon kernels (`attention.hopper_prefill`, `hopper_fp8_gemm`) are written against the Gluon
of Triton 3.6, an experimental interface that other Triton versions change: they are imported
only there, and where the import fails their callers keep their Triton kernels."""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

import torch
import triton

GLUON_TRITON = "3.6."


@functools.cache
def gluon_module(name: str) -> ModuleType | None:
    """The kvtool module `name` (e.g. "kvtool.engine.kernels.hopper_fp8_gemm") once imported, or
    None under another Triton or where its Gluon is missing."""
    if not triton.__version__.startswith(GLUON_TRITON):
        return None
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


_hopper_devices: dict[int, bool] = {}


def is_hopper(device: torch.device) -> bool:
    """Whether `device` is a Hopper GPU (compute capability 9.0), the one the Gluon kernels are
    written for; asked of the driver once per device (the kernels' callers ask every product)."""
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _hopper_devices:
        _hopper_devices[index] = torch.cuda.get_device_capability(index) == (9, 0)
    return _hopper_devices[index]
