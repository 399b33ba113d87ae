"""Block hashes, byte-compatible with vLLM's prefix cache (`sha256_cbor`).

A block hash chains over full blocks only:

    h[i] = SHA-256(canonical_cbor((h[i-1] or NONE_HASH, tuple(tokens_i), extra_keys_i or None)))

NONE_HASH is the hash of the `PYTHONHASHSEED` string when that variable is present
(even empty), else of "vllm-none-hash" (vLLM >= 0.29). The chain carries the full
32-byte digest. A request's `cache_salt` enters the first block as the extra key
`(("cache_salt", salt),)` and so fingerprints every later block through the chain.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence

import cbor2

DEFAULT_NONE_HASH_SEED = "vllm-none-hash"
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
) -> list[BlockHash]:
    """Append the hashes of every newly full block of `token_ids` to `hashes` (in place)."""
    num_full = len(token_ids) // block_size
    for i in range(len(hashes), num_full):
        parent = hashes[i - 1] if i else none_hash
        block = token_ids[i * block_size : (i + 1) * block_size]
        hashes.append(hash_block_tokens(parent, block, block_extra_keys(i, cache_salt)))
    return hashes
