"""redis://, rediss://, unix:// and redis-cluster:// stores in LMCache's RedisConnector layout.

Byte for byte what LMCache 0.5.6 writes (`lmcache/v1/storage_backend/connector/redis_connector.py`):
two keys per chunk, the key string with a suffix and no separator,

    KEY + "kv_bytes"   the raw KV_2LTD payload, SET first
    KEY + "metadata"   LMCache's `RemoteMetadata` (`lmcache/v1/protocol.py`): native int32
                       [length, fmt, dtype code, shape x4], 28 bytes for one KV group; SET second

so a reader that sees the metadata finds the payload. `exists` checks the metadata key. A load
asks for both keys at once (pipelined on the raw connections, resp_pool.py), reads the metadata
reply and checks it against the buffer and the expected chunk, and only then reads the payload
reply, straight into the buffer; a payload that does not match is read past and the chunk fails.
A metadata key whose payload is gone (evicted) is deleted and is a miss, as LMCache does.
Partial chunks keep their own shape. No TTL.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Sequence

from kvtool.engine.connectors.lmcache.stores.protocol import (
    ChunkHeader,
    MemoryFormat,
    refuse_unexpected,
    torch_dtype_from_code,
)
from kvtool.engine.connectors.lmcache.stores.resp_base import RespStore, logger
from kvtool.engine.connectors.lmcache.stores.resp_pool import ItemReplies, PendingGet
from kvtool.engine.connectors.lmcache.stores.store import Buffer
from kvtool.engine.errors import ConfigError, KVRefused, KVToolError, PeerError

KV_SUFFIX = "kv_bytes"
METADATA_SUFFIX = "metadata"
# length, fmt, then (dtype code, 4 dims) per KV group; "i" * 7 in LMCache (native order and size).
REMOTE_METADATA = struct.Struct("=7i")
# A metadata value longer than this is not read (LMCache's holds 8 + 20 bytes per KV group).
MAX_METADATA_BYTES = 1 << 20
_FORMAT_CODES = frozenset(int(m) for m in MemoryFormat)


def encode_metadata(header: ChunkHeader) -> bytes:
    """LMCache's RemoteMetadata of one KV group for a chunk `header` (trailing zeros pad the shape)."""
    if len(header.shape) > 4:
        raise ConfigError(f"chunk shape {header.shape} has more than 4 dims")
    dims = list(header.shape) + [0] * (4 - len(header.shape))
    return REMOTE_METADATA.pack(header.length, header.fmt, header.dtype_code, *dims)


def decode_metadata(raw: bytes, capacity: int, key: str) -> ChunkHeader:
    """The chunk header that metadata describes, checked before a payload byte is read.

    Raises:
        PeerError: malformed metadata (too short, unknown format or dtype, negative dims, a
            length that disagrees with the shape) or a payload larger than `capacity`.
        KVRefused: well-formed metadata of more than one KV group (kvtool's pages are one).
    """
    if len(raw) < REMOTE_METADATA.size or (len(raw) - 8) % 20:
        raise PeerError(f"metadata of chunk {key} is {len(raw)} bytes, not LMCache's RemoteMetadata")
    if len(raw) != REMOTE_METADATA.size:
        raise KVRefused(f"chunk {key} holds {(len(raw) - 8) // 20} KV groups; the pages hold one")
    length, fmt, code, *dims = REMOTE_METADATA.unpack(raw)
    if fmt not in _FORMAT_CODES:
        raise PeerError(f"metadata of chunk {key} has unknown memory format {fmt}")
    try:
        itemsize = torch_dtype_from_code(code).itemsize
    except PeerError:
        raise PeerError(f"metadata of chunk {key} has dtype code {code}, not a KV dtype") from None
    if length < 0 or any(d < 0 for d in dims):
        raise PeerError(f"metadata of chunk {key} has a negative length or shape {dims}")
    while len(dims) > 1 and dims[-1] == 0:  # LMCache's strip_shape_padding
        dims.pop()
    if math.prod(dims) * itemsize != length:
        raise PeerError(f"metadata of chunk {key} announces {length} bytes, its shape {dims} holds "
                        f"{math.prod(dims) * itemsize}")
    if length > capacity:
        raise PeerError(f"metadata of chunk {key} announces {length} bytes, the buffer holds {capacity}")
    return ChunkHeader(fmt, 2 if code == 1 else code, tuple(dims), length)


class RedisStore(RespStore):
    """A Redis or Redis Cluster holding chunks in LMCache's two-key layout (see the module doc)."""

    def exist_many(self, keys: Sequence[str]) -> list[bool]:
        """Whether each chunk's metadata key exists, in one pipeline, in the order of `keys`."""
        if not keys:
            return []
        return self.run("EXISTS", lambda: self.exists_pipelined([k + METADATA_SUFFIX for k in keys]))

    def item_keys(self, key: str) -> tuple[str, ...]:
        return key + METADATA_SUFFIX, key + KV_SUFFIX

    def read_item(self, item: PendingGet, replies: ItemReplies) -> ChunkHeader | None:
        """The metadata reply, checked, then the payload reply into the buffer (see the module doc)."""
        key, target, expected = item.key, item.target, item.expected
        size = replies.size(0)
        if size is None:
            return None
        if size > MAX_METADATA_BYTES:
            raise PeerError(f"metadata of chunk {key} is {size} bytes, not LMCache's RemoteMetadata")
        raw = replies.body(0)
        capacity = target.nbytes if expected is None else min(target.nbytes, expected.length)
        header = decode_metadata(raw, capacity, key)
        refuse_unexpected(expected, header, f"chunk {key}")
        size = replies.size(1)
        if size is None:
            # The payload was evicted (or never landed): LMCache deletes the orphan metadata.
            self.run("DEL", lambda: self._delete(key + METADATA_SUFFIX))
            return None
        if size != header.length:
            raise PeerError(f"chunk {key} payload is {size} bytes, its metadata says {header.length}")
        replies.body_into(1, target[: header.length])
        return header

    async def _delete(self, key: str) -> None:
        async with self.lease() as client:
            await client.delete(key)

    def put_many(self, items: Sequence[tuple[str, Buffer, ChunkHeader]]) -> list[bool]:
        """Store each chunk: payload first, metadata second. A failed item is logged and False."""
        for key, payload, header in items:
            if memoryview(payload).nbytes != header.length:
                raise ConfigError(f"payload of {key} is {memoryview(payload).nbytes} bytes, its header says {header.length}")

        def put_one(item: tuple[str, Buffer, ChunkHeader]) -> bool:
            key, payload, header = item
            view = memoryview(payload).cast("B")
            try:
                self.raw.execute("SET", lambda ok: self._put(ok, key, view, header))
                return True
            except KVToolError as e:
                logger.warning("%s", e)
                return False

        return self.striped(items, put_one)

    @staticmethod
    def _put(ok: Callable[..., None], key: str, payload: memoryview, header: ChunkHeader) -> None:
        # In this order, each confirmed before the next is sent, so that a reader that finds the
        # metadata finds the payload too (the two keys may live on different cluster nodes).
        ok(key + KV_SUFFIX, "SET", key + KV_SUFFIX, payload)
        ok(key + METADATA_SUFFIX, "SET", key + METADATA_SUFFIX, encode_metadata(header))
