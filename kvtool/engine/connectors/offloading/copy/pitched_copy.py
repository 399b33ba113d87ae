"""Pitched (2D) copies on the copy engine: many equal rows at a fixed stride, in one transfer.

One layer's K and V of consecutive pool blocks are rows of bs*H*D elements, L rows apart, in
the block-major pool ([*, 2, L, bs, H, D]). torch has no strided host-to-device copy (it makes the
host side contiguous first, on the CPU), so this calls the CUDA driver's `cuMemcpy2DAsync`, whose
C interface has been stable since CUDA 3.2, through ctypes on the driver torch already uses.
`available()` is False where the driver cannot be loaded; callers then take another path.
"""

from __future__ import annotations

import ctypes
import ctypes.util

_HOST, _DEVICE = 1, 2  # CUmemorytype


class _Memcpy2D(ctypes.Structure):
    """CUDA_MEMCPY2D (the _v2 layout, 64-bit pointers and sizes)."""

    _fields_ = [
        ("srcXInBytes", ctypes.c_size_t), ("srcY", ctypes.c_size_t), ("srcMemoryType", ctypes.c_int),
        ("srcHost", ctypes.c_void_p), ("srcDevice", ctypes.c_uint64), ("srcArray", ctypes.c_void_p),
        ("srcPitch", ctypes.c_size_t),
        ("dstXInBytes", ctypes.c_size_t), ("dstY", ctypes.c_size_t), ("dstMemoryType", ctypes.c_int),
        ("dstHost", ctypes.c_void_p), ("dstDevice", ctypes.c_uint64), ("dstArray", ctypes.c_void_p),
        ("dstPitch", ctypes.c_size_t),
        ("WidthInBytes", ctypes.c_size_t), ("Height", ctypes.c_size_t),
    ]


_driver: ctypes.CDLL | None | bool = None  # None: not tried yet; False: unavailable


def _load() -> ctypes.CDLL | None:
    global _driver
    if _driver is None:
        try:
            lib = ctypes.CDLL(ctypes.util.find_library("cuda") or "libcuda.so.1")
            fn = lib.cuMemcpy2DAsync_v2
            fn.argtypes = [ctypes.POINTER(_Memcpy2D), ctypes.c_void_p]
            fn.restype = ctypes.c_int
            lib.cuCtxGetCurrent.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
            lib.cuCtxGetCurrent.restype = ctypes.c_int
            _driver = lib
        except (OSError, AttributeError):
            _driver = False
    return _driver or None


def available() -> bool:
    return _load() is not None


class PitchedCopyError(RuntimeError):
    pass


def copy_rows_h2d(dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int, stream: int) -> None:
    """Queue `height` rows of `width` bytes from pinned host address `src` (rows `src_pitch`
    apart) to device address `dst` (rows `dst_pitch` apart) on CUDA stream handle `stream`.

    The calling thread must have the device's context current (any torch CUDA call on it does
    that); raises PitchedCopyError with the driver's code otherwise or when the driver refuses."""
    lib = _load()
    if lib is None:
        raise PitchedCopyError("the CUDA driver library could not be loaded")
    if height == 0:
        return
    ctx = ctypes.c_void_p()
    if lib.cuCtxGetCurrent(ctypes.byref(ctx)) != 0 or not ctx.value:
        raise PitchedCopyError("no CUDA context is current on this thread")
    p = _Memcpy2D(srcMemoryType=_HOST, srcHost=src, srcPitch=src_pitch,
                  dstMemoryType=_DEVICE, dstDevice=dst, dstPitch=dst_pitch,
                  WidthInBytes=width, Height=height)
    rc = lib.cuMemcpy2DAsync_v2(ctypes.byref(p), ctypes.c_void_p(stream))
    if rc != 0:
        raise PitchedCopyError(f"cuMemcpy2DAsync failed with CUDA driver error {rc}")
