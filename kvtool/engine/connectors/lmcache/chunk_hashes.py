"""LMCache's chunk hashes: one link of the chain per chunk, in each of kvtool's hash modes (keys.py's table)."""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Sequence
from typing import Literal, get_args

import blake3
import cbor2

from kvtool.engine.connectors.lmcache.cpython_hash import _builtin_chunk_hash
from kvtool.engine.errors import ConfigError

HashAlgo = Literal["vllm", "sha256_cbor", "sha256", "builtin", "blake3"]
HASH_ALGOS: tuple[str, ...] = get_args(HashAlgo)
_ALGO_ALIASES = {"sha256_cbor": "vllm"}

def _fold(digest: bytes) -> int:
    return int.from_bytes(digest[:8], "big")


def _cbor(value: object) -> bytes:
    # Canonical: shortest-form heads; ints up to 2**64-1 are unsigned (major type 0).
    return cbor2.dumps(value, canonical=True)


def _sha256_cbor_chunk_hash(prefix: int, tokens: list[int]) -> int:
    return _fold(hashlib.sha256(_cbor((prefix, tokens, ()))).digest())


def _sha256_pickle_chunk_hash(prefix: int, tokens: list[int]) -> int:
    # A tuple, not a list: pickle spells the two differently.
    data = pickle.dumps((prefix, tuple(tokens), ()), protocol=5)
    return _fold(hashlib.sha256(data).digest())


def _blake3_chunk_hash(prefix: int, tokens: list[int]) -> int:
    return _fold(blake3.blake3(_cbor((prefix, tokens, ()))).digest())


_CHUNK_HASH_FNS: dict[str, Callable[[int, list[int]], int]] = {
    "vllm": _sha256_cbor_chunk_hash,
    "sha256": _sha256_pickle_chunk_hash,
    "builtin": _builtin_chunk_hash,
    "blake3": _blake3_chunk_hash,
}


def canonical_hash_algo(hash_algo: str) -> str:
    """The kvtool mode behind a name (`sha256_cbor` -> `vllm`); ConfigError for an unknown name."""
    if hash_algo not in HASH_ALGOS:
        raise ConfigError(
            f"unknown LMCache hash_algo {hash_algo!r}; use one of {', '.join(HASH_ALGOS)}"
        )
    return _ALGO_ALIASES.get(hash_algo, hash_algo)


def make_chunk_hash(prefix: int, chunk_tokens: Sequence[int], hash_algo: str = "vllm") -> int:
    """One link of the chain: the hash of a chunk whose predecessor hashed to `prefix`."""
    return _CHUNK_HASH_FNS[canonical_hash_algo(hash_algo)](prefix, list(chunk_tokens))
