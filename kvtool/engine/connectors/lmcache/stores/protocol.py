"""LMCache's lm:// TCP protocol byte for byte (as its `lmcache/v1/protocol.py`): headers and checks.

One request is a 186-byte header (`<9i150s`: command, length, fmt, dtype, location, shape[4], key
right-padded with ASCII spaces), followed by `length` payload bytes for a PUT. One reply is a
36-byte header (`<9i`: code, length, fmt, dtype, shape[4], location *last*), followed by `length`
payload bytes after a GET hit. Requests on one connection are answered strictly in order; PUT gets
no reply at all and LIST never gets one, so the client never sends LIST and confirms every PUT with
an EXIST on the same connection (lm_client.py).

A reply is checked against the caller's buffer (and against the expected geometry, when given)
before one payload byte is read, so a malformed or oversized reply allocates nothing.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from enum import IntEnum
from typing import Union
from urllib.parse import urlparse

import msgspec
import torch

from kvtool.engine.errors import ConfigError, KVRefused, PeerError

REQUEST = struct.Struct("<9i150s")  # command, length, fmt, dtype, location, shape[4], key
RESPONSE = struct.Struct("<9i")  # code, length, fmt, dtype, shape[4], location
MAX_KEY_BYTES = 150
MAX_LENGTH = 2**31 - 1  # `length` is a signed int32 on the wire
HEALTH_KEY = "health@1@0@0@half"  # the server parses the key even for HEALTH, so it must be valid
Buffer = Union[bytes, bytearray, memoryview]


class Command(IntEnum):
    PUT = 1
    GET = 2
    EXIST = 3
    LIST = 4  # the server never answers it; listed only so that it is never reused
    HEALTH = 5


class ReplyCode(IntEnum):
    SUCCESS = 200
    FAIL = 400


class MemoryFormat(IntEnum):
    """LMCache's `MemoryFormat` codes (docs 1.5)."""

    UNDEFINED = 0
    KV_2LTD = 1  # [2, num_layers, num_tokens, hidden]: what LMCache inside vLLM writes
    KV_T2D = 2
    KV_2TD = 3
    BINARY = 4
    BINARY_BUFFER = 5
    KV_MLA_FMT = 6
    EC_TD = 7
    HS_TD = 8


_BINARY_FORMATS = (MemoryFormat.BINARY, MemoryFormat.BINARY_BUFFER)
_FORMAT_CODES = frozenset(int(m) for m in MemoryFormat)

# dtype code -> torch dtype (docs 1.4). Code 1 is float16 too: LMCache decodes it but encodes 2.
_CODE_TO_DTYPE: dict[int, torch.dtype | None] = {
    0: None,
    1: torch.float16,
    2: torch.float16,
    3: torch.bfloat16,
    4: torch.float32,
    5: torch.float64,
    6: torch.uint8,
    7: torch.float8_e4m3fn,
    8: torch.float8_e5m2,
}
_DTYPE_TO_CODE: dict[torch.dtype, int] = {
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.float32: 4,
    torch.float64: 5,
    torch.uint8: 6,
    torch.float8_e4m3fn: 7,
    torch.float8_e5m2: 8,
}
_CODE_ITEMSIZE: dict[int, int] = {1: 2, 2: 2, 3: 2, 4: 4, 5: 8, 6: 1, 7: 1, 8: 1}


def dtype_code(dtype: torch.dtype) -> int:
    """The wire code of a torch dtype; float16 encodes as 2, as LMCache does.

    Raises:
        ConfigError: the dtype has no code (int8/16/32/64, bool, the `*fnuz` fp8 types).
    """
    try:
        return _DTYPE_TO_CODE[dtype]
    except KeyError:
        raise ConfigError(f"dtype {dtype} has no lm:// code; LMCache cannot store it") from None


def torch_dtype_from_code(code: int) -> torch.dtype:
    """The torch dtype of a received wire code (1 and 2 both mean float16).

    Raises:
        PeerError: the code is unknown or 0 (untyped BINARY data).
    """
    dtype = _CODE_TO_DTYPE.get(code)
    if dtype is None:
        raise PeerError(f"lm:// dtype code {code} is not a KV dtype")
    return dtype


class ChunkHeader(msgspec.Struct, frozen=True):
    """What the server reports about a stored object (and what a PUT announces)."""

    fmt: int  # MemoryFormat code
    dtype_code: int  # wire dtype code (float16 as 2)
    shape: tuple[int, ...]  # logical shape, trailing zero padding stripped (kept for BINARY)
    length: int  # payload bytes


def kv_chunk_header(shape: Sequence[int], dtype: torch.dtype, fmt: int = MemoryFormat.KV_2LTD) -> ChunkHeader:
    """The header of a KV chunk of `shape` and `dtype`: what a PUT sends and a GET must report."""
    code = dtype_code(dtype)
    return ChunkHeader(int(fmt), code, tuple(int(d) for d in shape), math.prod(shape) * _CODE_ITEMSIZE[code])


def tensor_buffer(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's storage (pinned memory included).

    The view aliases the tensor: a `get_into` on it fills the tensor in place, with no copy.
    """
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("tensor_buffer needs a contiguous CPU tensor")
    return memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy()).cast("B")


def parse_lm_url(url: str) -> tuple[str, int]:
    """`lm://HOST:PORT` -> (host, port). Any path or query is ignored, as LMCache does.

    Raises:
        ConfigError: not an lm:// URL, or the host or port is missing or invalid.
    """
    shown = url if len(url) <= 60 else url[:57] + "..."
    try:
        parsed = urlparse(url)
        host, port = parsed.hostname, parsed.port
    except ValueError:  # a bad IPv6 literal, a port out of range or not a number
        host = port = None
    if _scheme(url) != "lm" or not host or port is None or not 1 <= port <= 65535:
        raise ConfigError(f"{shown!r} is not an lm://HOST:PORT URL (port 1 to 65535)")
    return host, port


def _scheme(url: str) -> str:
    return url.split("://", 1)[0] if "://" in url else ""


def encode_key(key: str) -> bytes:
    """The 150-byte key field: UTF-8, right-padded with spaces (NUL padding breaks the server).

    Raises:
        ConfigError: the key is longer than 150 bytes or would change under the server's strip().
    """
    raw = key.encode("utf-8")
    if len(raw) > MAX_KEY_BYTES:
        raise ConfigError(f"lm:// key is {len(raw)} bytes, the limit is {MAX_KEY_BYTES}: {key[:60]}...")
    if key != key.strip():
        raise ConfigError(f"lm:// key {key!r} has leading or trailing whitespace")
    return raw.ljust(MAX_KEY_BYTES, b" ")


def pack_request(
    command: Command,
    key: str,
    length: int = 0,
    fmt: int = MemoryFormat.KV_2LTD,
    dtype: int = 2,
    shape: Sequence[int] = (),
) -> bytes:
    """One 186-byte request header. The defaults are what LMCache's client sends for GET/EXIST.

    Raises:
        ConfigError: a key, length, shape, fmt or dtype code the server would not accept.
    """
    if len(shape) > 4 or any(d < 0 for d in shape):
        raise ConfigError(f"lm:// shape {tuple(shape)} must have at most 4 non-negative dims")
    if not 0 <= length <= MAX_LENGTH:
        raise ConfigError(f"lm:// payload of {length} bytes does not fit a signed int32")
    # The server drops the connection on an unknown code; refuse it here with a reason instead.
    if int(fmt) not in _FORMAT_CODES or dtype not in _CODE_TO_DTYPE:
        raise ConfigError(f"lm:// fmt {int(fmt)} / dtype code {dtype} is not one LMCache knows")
    padded = list(shape) + [0] * (4 - len(shape))  # trailing zeros, as LMCache pads
    return REQUEST.pack(int(command), length, int(fmt), dtype, 0, *padded, encode_key(key))


class Reply(msgspec.Struct, frozen=True):
    """A decoded 36-byte reply header."""

    code: int
    length: int
    fmt: int
    dtype_code: int
    dims: tuple[int, int, int, int]  # the four shape ints as sent
    location: int


def unpack_reply(data: Buffer) -> Reply:
    """Decode a 36-byte reply header; nothing is validated here (see `refuse_reply`)."""
    code, length, fmt, dtype, d0, d1, d2, d3, location = RESPONSE.unpack(data)
    return Reply(code, length, fmt, dtype, (d0, d1, d2, d3), location)


def header_of(reply: Reply) -> ChunkHeader:
    """The chunk header a GET hit describes, shape padding stripped as LMCache strips it."""
    dims = list(reply.dims)
    if reply.fmt not in _BINARY_FORMATS:
        while len(dims) > 1 and dims[-1] == 0:
            dims.pop()
    code = 2 if reply.dtype_code == 1 else reply.dtype_code
    return ChunkHeader(reply.fmt, code, tuple(dims), reply.length)


def refuse_reply(reply: Reply, capacity: int, expected: ChunkHeader | None) -> ChunkHeader | None:
    """Check a GET reply before any payload byte is read; None on a miss.

    Raises:
        PeerError: the header is malformed: unknown code, fmt or dtype, negative dims, a length
            that is negative, disagrees with its own shape, or exceeds `capacity`.
        KVRefused: it is well formed but is not the `expected` chunk (names the field).
    """
    if reply.code == ReplyCode.FAIL:
        if reply.length != 0:
            raise PeerError(f"lm:// miss reply announces {reply.length} payload bytes")
        return None
    if reply.code != ReplyCode.SUCCESS:
        raise PeerError(f"lm:// reply code {reply.code} is neither 200 nor 400")
    if reply.length < 0:
        raise PeerError(f"lm:// reply announces a negative length {reply.length}")
    if reply.fmt not in _FORMAT_CODES:
        raise PeerError(f"lm:// reply has unknown memory format {reply.fmt}")
    if reply.dtype_code not in _CODE_TO_DTYPE:
        raise PeerError(f"lm:// reply has unknown dtype code {reply.dtype_code}")
    if any(d < 0 for d in reply.dims):
        raise PeerError(f"lm:// reply has negative shape {reply.dims}")
    header = header_of(reply)
    if reply.fmt not in _BINARY_FORMATS and reply.dtype_code != 0:
        want = math.prod(header.shape) * _CODE_ITEMSIZE[reply.dtype_code]
        if want != reply.length:
            raise PeerError(
                f"lm:// reply length {reply.length} disagrees with shape {header.shape} "
                f"dtype code {reply.dtype_code} ({want} bytes)"
            )
    if reply.length > capacity:
        raise PeerError(f"lm:// reply announces {reply.length} bytes, the buffer holds {capacity}")
    refuse_unexpected(expected, header, "lm:// chunk")
    return header


def refuse_unexpected(expected: ChunkHeader | None, found: ChunkHeader, what: str, why: str = "") -> None:
    """KVRefused naming the first of format, dtype, shape and length in which the chunk `found`
    is not the one the caller `expected` (nothing when it expected none)."""
    if expected is None:
        return
    for name in ("fmt", "dtype_code", "shape", "length"):
        want, got = getattr(expected, name), getattr(found, name)
        if want != got:
            raise KVRefused(f"{what} {name}: expected {want}, found {got}{why}")


def exist_code(reply: Reply) -> bool:
    """An EXIST reply as found (200) or not (400); PeerError for anything else."""
    if reply.code == ReplyCode.SUCCESS:
        found = True
    elif reply.code == ReplyCode.FAIL:
        found = False
    else:
        raise PeerError(f"lm:// EXIST reply code {reply.code} is neither 200 nor 400")
    if reply.length != 0:
        raise PeerError(f"lm:// EXIST reply announces {reply.length} payload bytes")
    return found
