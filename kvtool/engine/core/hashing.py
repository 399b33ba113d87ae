"""Block hashes, byte-compatible with vLLM's prefix cache (`sha256_cbor`).

A block hash chains over full blocks only:

    h[i] = SHA-256(canonical_cbor((h[i-1] or NONE_HASH, tuple(tokens_i), extra_keys_i or None)))

NONE_HASH is the hash of the `PYTHONHASHSEED` string when that variable is present
(even empty), else of "vllm-none-hash" (vLLM >= 0.29). The chain carries the full
32-byte digest. A request's `cache_salt` enters the first block as the extra key
`(("cache_salt", salt),)` and so fingerprints every later block through the chain.
"""

from __future__ import annotations

import array
import hashlib
import os
from collections.abc import Sequence

import cbor2
import numpy as np

DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
# From this many new blocks up, `extend_block_hashes` encodes the blocks' tokens in one vectorized
# pass (a long prompt: about a quarter of cbor2's time per block); below it, one cbor2 call each.
BATCH_MIN_BLOCKS = 8
# Canonical CBOR heads: an array of 3 items, then a byte string of 32 bytes (the parent digest).
_LINK_HEAD = b"\x83\x58\x20"
_CBOR_NULL = b"\xf6"
BlockHash = bytes


def sha256_cbor(value: object) -> bytes:
    """SHA-256 over canonical CBOR: vLLM's `sha256_cbor` (32-byte digest)."""
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


def resolve_none_hash_seed(seed: str | None = None) -> str:
    """The seed string vLLM >= 0.29 uses: an explicit seed, else `PYTHONHASHSEED`, else the default."""
    if seed is not None:
        return seed
    env = os.environ.get("PYTHONHASHSEED")
    return env if env is not None else DEFAULT_NONE_HASH_SEED


def make_none_hash(seed: str | None = None) -> BlockHash:
    """The start of every block-hash chain (vLLM's NONE_HASH)."""
    return sha256_cbor(resolve_none_hash_seed(seed))


def hash_block_tokens(
    parent: BlockHash,
    token_ids: Sequence[int],
    extra_keys: tuple | None = None,
) -> BlockHash:
    """One link of the chain; `parent` is the previous block's hash or NONE_HASH."""
    return sha256_cbor((parent, tuple(token_ids), extra_keys or None))


def block_extra_keys(block_index: int, cache_salt: str | None) -> tuple | None:
    """vLLM 0.33's tagged extra keys: the cache salt on the first block only."""
    if block_index == 0 and cache_salt:
        return (("cache_salt", cache_salt),)
    return None


def extend_block_hashes(
    hashes: list[BlockHash],
    token_ids: Sequence[int],
    block_size: int,
    none_hash: BlockHash,
    cache_salt: str | None = None,
    values: np.ndarray | None = None,
) -> list[BlockHash]:
    """Append the hashes of every newly full block of `token_ids` to `hashes` (in place).
    `values`: the same ids as a uint32 array, when the caller has one."""
    num_full = len(token_ids) // block_size
    if num_full - len(hashes) >= BATCH_MIN_BLOCKS:
        if not hashes and cache_salt:  # the salted first block: cbor2 encodes its extra keys
            hashes.append(hash_block_tokens(none_hash, token_ids[:block_size], block_extra_keys(0, cache_salt)))
        span = slice(len(hashes) * block_size, num_full * block_size)
        rest = token_ids[span] if values is None else values[span]
        hashes.extend(_chain_plain_blocks(hashes[-1] if hashes else none_hash, rest, block_size))
    for i in range(len(hashes), num_full):  # few blocks, or ids only cbor2 encodes
        parent = hashes[i - 1] if i else none_hash
        block = token_ids[i * block_size : (i + 1) * block_size]
        hashes.append(hash_block_tokens(parent, block, block_extra_keys(i, cache_salt)))
    return hashes


def _cbor_array_head(n: int) -> bytes:
    """Canonical CBOR head of an array of n items (major type 4, shortest length)."""
    if n < 24:
        return bytes([0x80 | n])
    for extra, size in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if n < 1 << (8 * size):
            return bytes([0x80 | extra]) + n.to_bytes(size, "big")
    raise ValueError(f"array of {n} items")


_U32 = next(code for code in "IL" if array.array(code).itemsize == 4)  # array typecode of a uint32


def uint32_ids(token_ids: Sequence[int]) -> np.ndarray | None:
    """The ids as one uint32 array, or None when one is not an int in [0, 2**32) (never a real
    vocabulary's). Through a C array of unsigned 32-bit ints, which is faster than np.asarray."""
    try:
        return np.frombuffer(array.array(_U32, token_ids), dtype=np.uint32)
    except (OverflowError, TypeError):
        return None


def _cbor_uints(values: np.ndarray, block_size: int) -> tuple[bytes, np.ndarray]:
    """Canonical CBOR of each integer of `values` (uint32; major type 0, shortest form: the id
    itself below 24, else a head byte 24/25/26 and 1/2/4 big-endian bytes), concatenated, and
    the byte offset where each full block of `block_size` of them ends."""
    ge24, ge256, ge64k = values >= 24, values >= 1 << 8, values >= 1 << 16
    cells = np.empty((values.size, 5), dtype=np.uint8)
    cells[:, 1:] = values.astype(">u4").view(np.uint8).reshape(-1, 4)
    cells[:, 0] = np.where(ge24, 23 + ge24.view(np.uint8) + ge256 + ge64k, values)
    keep = np.empty((values.size, 5), dtype=bool)
    keep[:, 0] = True
    keep[:, 1] = keep[:, 2] = ge64k
    keep[:, 3] = ge256
    keep[:, 4] = ge24
    sizes = 1 + ge24.view(np.uint8) + ge256.view(np.uint8) + 2 * ge64k.view(np.uint8)  # 1, 2, 3 or 5 bytes
    full = values.size // block_size * block_size
    ends = np.cumsum(sizes[:full].reshape(-1, block_size).sum(axis=1, dtype=np.int64))
    return cells[keep].tobytes(), ends


def _chain_plain_blocks(parent: BlockHash, token_ids: Sequence[int] | np.ndarray, block_size: int) -> list[BlockHash]:
    """Hashes of the full blocks of `token_ids` (no extra keys; a uint32 array or a sequence of
    ints), chained from `parent`: the same bytes as `hash_block_tokens`, each block's CBOR
    assembled from one encoding of every token. Empty when an id lies outside [0, 2**32) (never
    a real vocabulary's): cbor2 encodes those."""
    values = token_ids if isinstance(token_ids, np.ndarray) else uint32_ids(token_ids)
    if values is None:
        return []
    data, ends = _cbor_uints(values, block_size)
    bounds = [0, *ends.tolist()]
    head = _cbor_array_head(block_size)
    out = []
    sha256 = hashlib.sha256
    for i in range(len(bounds) - 1):
        parent = sha256(b"".join((_LINK_HEAD, parent, head, data[bounds[i] : bounds[i + 1]], _CBOR_NULL))).digest()
        out.append(parent)
    return out
