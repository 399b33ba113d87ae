"""resp:// stores in the layout of LMCache's native RESP connector.

LMCache's resp:// connector (`RESPConnector` in lmcache/v1/storage_backend/connector/redis_connector.py,
created by `RESPConnectorAdapter` in connector/redis_adapter.py, over the C++ client
csrc/storage_backends/redis/connector.cpp built as `lmcache.lmcache_redis.LMCacheRedisClient`
behind native_clients/resp_client.py; the same in LMCache 0.5.6 and in main's connector.cpp at
2827f8e8a1e8b998aa2a489ffb87d585c10789b6) stores one key per chunk:

    key    `CacheEngineKey.to_string()` itself, UTF-8: model@world_size@worker_id@hash@dtype[@tags],
           the key lm:// carries and valkey:// uses; no suffix (redis:// adds kv_bytes / metadata)
    value  the raw KV_2LTD payload of a full chunk, exactly the connector's full_chunk_size_bytes;
           no header, no metadata key, no length, format, dtype or shape anywhere
    SET    `SET key value`, no expiry and no database selection (always database 0)
    GET    reads `$<full chunk bytes>\\r\\n`, the payload, `\\r\\n`; any other size is an error
    lookup `EXISTS key`; a GET of a missing key never returns in 0.5.6's client (it reads a
           reply header of the full chunk's size), main's reads the `$-1` as a miss

`save_unfull_chunk` and `save_chunk_meta` must be false (its adapter asserts both), so only full
chunks are ever written. Its URL is `resp://HOST:PORT` (resp_url.py); the credentials, when the
password is not empty, go as `AUTH [user] password` on each connection. The socket is plain IPv4
TCP: there is no TLS form (no resps://) and no cluster or Sentinel support.

kvtool writes and reads exactly those bytes: ValkeyStore's layout without an expiry, over the raw
connections of resp_pool.py.

What a load can check: with no metadata on the server, only the value's length, before a byte of
it is read. A value of any length but a full chunk's is refused (KVRefused naming both lengths),
never served; so is a full chunk when the caller expects another shape. Format, dtype and
shape cannot be checked: a value of the right length is taken to be this engine's full chunk, and
its identity comes from the key alone (model name, world size, rank, dtype, tags); a payload
changed in place is caught only by `verify_payload`, whose 32-byte digest objects (keys with the
digest tag, which LMCache's clients never ask for) are the one exception to the full-chunk size.
"""

from __future__ import annotations

from kvtool.engine.connectors.lmcache.stores.protocol import ChunkHeader, refuse_unexpected
from kvtool.engine.connectors.lmcache.stores.resp_pool import ItemReplies, PendingGet
from kvtool.engine.connectors.lmcache.stores.store import StoreAddress
from kvtool.engine.connectors.lmcache.stores.valkey_store import ValkeyStore
from kvtool.engine.errors import KVRefused


class RespChunkStore(ValkeyStore):
    """A Redis-protocol server holding full chunks under their bare keys, as LMCache's resp://
    connector writes them (see the module doc); a value of another size is refused, not a miss.

    Args:
        chunk_header: a full chunk as the pages hold it: the only size a chunk value may have.
    """

    def __init__(self, address: StoreAddress, *, connections: int, timeout_s: float,
                 chunk_header: ChunkHeader) -> None:
        super().__init__(address, connections=connections, timeout_s=timeout_s, chunk_header=chunk_header)

    def read_item(self, item: PendingGet, replies: ItemReplies) -> ChunkHeader | None:
        """The bare key's value into the buffer, once its length proves it a full chunk."""
        size = replies.size(0)
        if size is None:
            return None
        header = self._header_of(item.key)
        refuse_value(item.key, size, header, item.expected, item.target.nbytes)
        replies.body_into(0, item.target[:size])
        return header


def refuse_value(key: str, size: int, header: ChunkHeader, expected: ChunkHeader | None, capacity: int) -> None:
    """Raise KVRefused unless a value of `size` bytes under `key` is the object `header` describes,
    what the caller `expected` (if it said) and fits the buffer. Checked before the value is read."""
    if size != header.length:
        raise KVRefused(f"chunk {key} length: expected {header.length} (a full chunk), found {size}")
    refuse_unexpected(expected, header, f"chunk {key}", " (resp:// holds full chunks only)")
    if capacity < size:
        raise KVRefused(f"chunk {key} length: {size} bytes, the buffer holds {capacity}")
