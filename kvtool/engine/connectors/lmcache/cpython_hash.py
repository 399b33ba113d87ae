"""CPython 3.11's `hash()` of ints, strs and tuples, reproduced exactly for any PYTHONHASHSEED.

LMCache's `builtin` chunk hash is Python's own `hash((prefix, tuple(tokens), ()))` under the
peer's PYTHONHASHSEED; kvtool computes the same integers without depending on its own seed.
"""

from __future__ import annotations

from collections.abc import Iterable

_MASK64 = (1 << 64) - 1
# CPython 3.11 on a 64-bit build (Python/pyhash.c, Objects/longobject.c, Objects/tupleobject.c).

_MODULUS = (1 << 61) - 1  # sys.hash_info.modulus
_XXPRIME_1 = 11400714785074694791
_XXPRIME_2 = 14029467366897019727
_XXPRIME_5 = 2870177450012600261
_TUPLE_LEN_MIX = _XXPRIME_5 ^ 3527539
_EMPTY_TUPLE_HASH = 5740354900026072187  # hash(())


def _int_hash(x: int) -> int:
    h = x % _MODULUS if x >= 0 else -((-x) % _MODULUS)
    return -2 if h == -1 else h


def _tuple_hash_of_lanes(lanes: Iterable[int], length: int) -> int:
    """tuplehash() over item hashes already reduced to unsigned 64-bit lanes."""
    acc = _XXPRIME_5
    for lane in lanes:
        acc = (acc + lane * _XXPRIME_2) & _MASK64
        acc = ((acc << 31) | (acc >> 33)) & _MASK64
        acc = (acc * _XXPRIME_1) & _MASK64
    acc = (acc + (length ^ _TUPLE_LEN_MIX)) & _MASK64
    if acc == _MASK64:
        return 1546275796
    return acc - (1 << 64) if acc >> 63 else acc


def _hash_secret_key(hash_seed: int) -> tuple[int, int]:
    """SipHash key (k0, k1): the first 16 bytes of the secret PYTHONHASHSEED=hash_seed sets."""
    if hash_seed == 0:
        return 0, 0  # PYTHONHASHSEED=0 disables randomisation: an all-zero secret
    secret = bytearray(16)
    x = hash_seed
    for i in range(16):
        x = (x * 214013 + 2531011) & 0xFFFFFFFF  # lcg_urandom
        secret[i] = (x >> 16) & 0xFF
    return int.from_bytes(secret[:8], "little"), int.from_bytes(secret[8:], "little")


def _rotl(x: int, b: int) -> int:
    return ((x << b) | (x >> (64 - b))) & _MASK64


def _siphash13(k0: int, k1: int, data: bytes) -> int:
    v0 = k0 ^ 0x736F6D6570736575
    v1 = k1 ^ 0x646F72616E646F6D
    v2 = k0 ^ 0x6C7967656E657261
    v3 = k1 ^ 0x7465646279746573

    def sip_round() -> None:
        nonlocal v0, v1, v2, v3
        v0 = (v0 + v1) & _MASK64
        v2 = (v2 + v3) & _MASK64
        v1 = _rotl(v1, 13) ^ v0
        v3 = _rotl(v3, 16) ^ v2
        v0 = _rotl(v0, 32)
        v2 = (v2 + v1) & _MASK64
        v0 = (v0 + v3) & _MASK64
        v1 = _rotl(v1, 17) ^ v2
        v3 = _rotl(v3, 21) ^ v0
        v2 = _rotl(v2, 32)

    n = len(data)
    tail = n - n % 8
    for off in range(0, tail, 8):
        m = int.from_bytes(data[off : off + 8], "little")
        v3 ^= m
        sip_round()
        v0 ^= m
    b = ((n & 0xFF) << 56) | int.from_bytes(data[tail:], "little")
    v3 ^= b
    sip_round()
    v0 ^= b
    v2 ^= 0xFF
    sip_round()
    sip_round()
    sip_round()
    return v0 ^ v1 ^ v2 ^ v3


def _str_hash(s: str, hash_seed: int) -> int:
    if not s:
        return 0
    # CPython hashes its internal representation: 1, 2 or 4 bytes per code point.
    widest = max(map(ord, s))
    if widest < 0x100:
        data = s.encode("latin-1")
    elif widest < 0x10000:
        data = s.encode("utf-16-le", "surrogatepass")
    else:
        data = s.encode("utf-32-le", "surrogatepass")
    h = _siphash13(*_hash_secret_key(hash_seed), data)
    h = h - (1 << 64) if h >> 63 else h
    return -2 if h == -1 else h


def cpython_hash(value: int | str | tuple, hash_seed: int = 0) -> int:
    """CPython 3.11's `hash(value)` (64-bit build) under PYTHONHASHSEED=hash_seed.

    Supports int (and bool), str (SipHash-1-3) and tuples of these, nested. `hash_seed` only
    matters for str. Raises TypeError for any other type and ValueError for a seed outside
    [0, 4294967295].
    """
    if not 0 <= hash_seed <= 0xFFFFFFFF:
        raise ValueError(f"PYTHONHASHSEED must be in [0, 4294967295], got {hash_seed}")
    if isinstance(value, int):
        return _int_hash(value)
    if isinstance(value, str):
        return _str_hash(value, hash_seed)
    if isinstance(value, tuple):
        lanes = [cpython_hash(item, hash_seed) & _MASK64 for item in value]
        return _tuple_hash_of_lanes(lanes, len(value))
    raise TypeError(f"cpython_hash supports int, str and tuple, not {type(value).__name__}")


def _builtin_chunk_hash(prefix: int, tokens: list[int]) -> int:
    """hash((prefix, tuple(tokens), ())) for non-negative tokens."""
    if tokens and max(tokens) >= _MODULUS:
        inner = _tuple_hash_of_lanes((_int_hash(t) & _MASK64 for t in tokens), len(tokens))
    else:
        inner = _tuple_hash_of_lanes(tokens, len(tokens))  # small ints hash to themselves
    lanes = (_int_hash(prefix) & _MASK64, inner & _MASK64, _EMPTY_TUPLE_HASH)
    return _tuple_hash_of_lanes(lanes, 3)
