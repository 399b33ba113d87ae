"""`verify_payload`: a digest of each chunk's payload, stored beside it as an object of its own.

LMCache's protocol has no payload checksum, so whoever can write to the store can change the KV
a reader loads, and with it the reader's outputs. With `"verify_payload": true` (the default in
kvtool's own blake3 key mode; the peer modes default to false) the writer also
PUTs, under the chunk's key plus the tag `@kvtool-digest%b3`, a 32-byte object (announced as a
[2, 1, 1, 16] uint8 KV_2LTD chunk): the blake3 digest of the chunk key and its payload bytes. LMCache's server stores it like any
object, and LMCache's own clients never ask for it (their keys never carry that tag). A reader
with `verify_payload` GETs the digest with each chunk and refuses a chunk whose digest is
missing or disagrees (the load-failure policy decides).

The digest is keyed when `KVTOOL_LMCACHE_PAYLOAD_KEY` is set (the same secret on every engine
that shares the store): only then does it also stop a writer who knows this scheme, since an
unkeyed digest can be recomputed for a forged payload.
"""

from __future__ import annotations

import os

import blake3

import torch

from kvtool.engine.connectors.lmcache.stores.protocol import Buffer, ChunkHeader, kv_chunk_header
from kvtool.engine.errors import KVRefused

DIGEST_TAG = ("kvtool-digest", "b3")
DIGEST_SUFFIX = f"@{DIGEST_TAG[0]}%{DIGEST_TAG[1]}"
DIGEST_BYTES = 32
# Announced as a tiny uint8 KV_2LTD object: LMCache's own client allocates those on a GET
# (it refuses BINARY ones), so even a client that asked for it would read it without harm.
DIGEST_HEADER = kv_chunk_header((2, 1, 1, DIGEST_BYTES // 2), torch.uint8)
SECRET_ENV = "KVTOOL_LMCACHE_PAYLOAD_KEY"
# Payloads from this size up are hashed on every core: blake3's tree gives the same digest on any
# number of threads, and a chunk's tens of megabytes are hashed in the load loop of a hit.
PARALLEL_BYTES = 1 << 20


def digest_key(chunk_key: str) -> str:
    """The key the digest of `chunk_key`'s payload is stored under."""
    return chunk_key + DIGEST_SUFFIX


def payload_secret() -> bytes | None:
    """The 32-byte blake3 key derived from KVTOOL_LMCACHE_PAYLOAD_KEY, or None when unset."""
    secret = os.environ.get(SECRET_ENV)
    if not secret:
        return None
    return blake3.blake3(secret.encode(), derive_key_context="kvtool lmcache payload digest v1").digest()


def payload_digest(chunk_key: str, payload: Buffer, secret: bytes | None) -> bytes:
    """The digest of one chunk: bound to its key, so a digest copied from another chunk fails."""
    threads = blake3.blake3.AUTO if memoryview(payload).nbytes >= PARALLEL_BYTES else 1
    if secret is not None:
        hasher = blake3.blake3(key=secret, max_threads=threads)
    else:
        hasher = blake3.blake3(max_threads=threads)
    hasher.update(chunk_key.encode())
    hasher.update(b"\0")
    hasher.update(payload)
    return hasher.digest()


def refuse_payload(chunk_key: str, payload: Buffer, found: ChunkHeader | KVRefused | Exception | None,
                   stored: Buffer, secret: bytes | None) -> None:
    """Raise KVRefused unless the digest GET (`found`, its bytes in `stored`) matches `payload`."""
    if found is None:
        raise KVRefused(f"chunk {chunk_key} has no payload digest on the server (verify_payload)")
    if isinstance(found, Exception):
        raise KVRefused(f"chunk {chunk_key}: its payload digest could not be read: {found}")
    if (found.fmt, found.dtype_code, found.shape, found.length) != (
        DIGEST_HEADER.fmt, DIGEST_HEADER.dtype_code, DIGEST_HEADER.shape, DIGEST_HEADER.length
    ):
        raise KVRefused(f"chunk {chunk_key}: its payload digest object is malformed ({found.length} bytes)")
    if bytes(memoryview(stored)[:DIGEST_BYTES]) != payload_digest(chunk_key, payload, secret):
        raise KVRefused(f"chunk {chunk_key}: payload digest mismatch: the stored bytes were changed (verify_payload)")
