"""valkey:// stores in LMCache's ValkeyConnector layout (`valkey_connector.py`, `valkey/worker_pool.py`).

One key per chunk, the key string itself (UTF-8), holding the raw KV_2LTD payload and no
metadata. A value of any size but a full chunk's is a miss (LMCache's size check), so partial
chunks cannot be stored (`save_unfull_chunk` is refused at configuration). With a TTL
(`valkey_enable_ttl`, `valkey_ttl_sec`) every key is written with that expiry, so `volatile-*`
eviction policies can reclaim it. Valkey speaks the Redis protocol; redis-py is the client.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvtool.engine.connectors.lmcache.resp_base import RespStore
from kvtool.engine.connectors.lmcache.store import Buffer, StoreAddress
from kvtool.engine.connectors.lmcache.wire import ChunkHeader
from kvtool.engine.errors import KVToolError

logger = logging.getLogger("kvtool.lmcache")


class ValkeyStore(RespStore):
    """A Valkey (or Redis) holding full chunks under their bare keys.

    Args:
        chunk_header: a full chunk as the pages hold it; a stored value of another size is a miss.
        ttl_s: expiry of each written key in seconds; None writes keys without expiry.
    """

    def __init__(self, address: StoreAddress, *, connections: int, timeout_s: float, chunk_header: ChunkHeader,
                 ttl_s: int | None = None) -> None:
        super().__init__(address, connections=connections, timeout_s=timeout_s)
        self.chunk_header = chunk_header
        self.ttl_s = ttl_s

    def exist_many(self, keys: Sequence[str]) -> list[bool]:
        """EXISTS for each key, in one pipeline, in the order of `keys`."""
        if not keys:
            return []
        return self.run("EXISTS", lambda: self.exists_pipelined(list(keys)))

    async def get_chunk_into(self, key: str, target: memoryview, expected: ChunkHeader | None) -> ChunkHeader | None:
        """The bare key's value; one of any size but a full chunk's is a miss (no metadata to check)."""
        async with self.lease() as client:
            value = await client.get(key)
        if value is None:
            return None
        size = self.chunk_header.length
        if len(value) != size or target.nbytes < size:
            logger.warning("%s: chunk %s is %d bytes, a full chunk is %d: treated as a miss", self.url, key,
                           len(value), size)
            return None
        target[:size] = value
        return self.chunk_header

    def put_many(self, items: Sequence[tuple[str, Buffer, ChunkHeader]]) -> list[bool]:
        """SET each full chunk (with the TTL, if any); partial chunks are refused (False, logged)."""

        def put_one(item: tuple[str, Buffer, ChunkHeader]) -> bool:
            key, payload, _ = item
            view = memoryview(payload).cast("B")
            if view.nbytes != self.chunk_header.length:
                logger.warning("%s: chunk %s is %d bytes, not a full chunk: not stored", self.url, key, view.nbytes)
                return False
            try:
                return self.run("SET", lambda: self._set(key, view))
            except KVToolError as e:
                logger.warning("%s", e)
                return False

        return self.striped(items, put_one)

    async def _set(self, key: str, payload: memoryview) -> bool:
        async with self.lease() as client:
            return bool(await client.set(key, payload, ex=self.ttl_s))
