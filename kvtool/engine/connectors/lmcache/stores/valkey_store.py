"""valkey:// stores in LMCache's ValkeyConnector layout (`valkey_connector.py`, `valkey/worker_pool.py`).

One key per chunk, the key string itself (UTF-8), holding the raw KV_2LTD payload and no
metadata. A value of any size but a full chunk's is a miss (LMCache's size check), so partial
chunks cannot be stored (`save_unfull_chunk` is refused at configuration). The one exception is
kvtool's payload digest (payload_digest.py): a 32-byte value under a chunk key plus the digest
tag, a key LMCache's own clients never ask for. With a TTL
(`valkey_enable_ttl`, `valkey_ttl_sec`) every key is written with that expiry, so `volatile-*`
eviction policies can reclaim it. Valkey speaks the Redis protocol: redis-py asks the lookups,
and values travel over raw connections (resp_pool.py), read straight into the buffers and
written from the callers' memory.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from kvtool.engine.connectors.lmcache.payload_digest import DIGEST_HEADER, DIGEST_SUFFIX
from kvtool.engine.connectors.lmcache.stores.protocol import ChunkHeader
from kvtool.engine.connectors.lmcache.stores.resp_base import RespStore
from kvtool.engine.connectors.lmcache.stores.resp_pool import ItemReplies, PendingGet
from kvtool.engine.connectors.lmcache.stores.store import Buffer, StoreAddress
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

    def _header_of(self, key: str) -> ChunkHeader:
        """What the value under `key` must be: a payload digest under a digest key, else a full chunk."""
        return DIGEST_HEADER if key.endswith(DIGEST_SUFFIX) else self.chunk_header

    def item_keys(self, key: str) -> tuple[str, ...]:
        return (key,)

    def read_item(self, item: PendingGet, replies: ItemReplies) -> ChunkHeader | None:
        """The bare key's value; one of any size but a full chunk's is a miss (no metadata to check)."""
        size = replies.size(0)
        if size is None:
            return None
        header = self._header_of(item.key)
        if size != header.length or item.target.nbytes < header.length:
            logger.warning("%s: value of %s is %d bytes, expected %d: treated as a miss", self.url, item.key,
                           size, header.length)
            return None
        replies.body_into(0, item.target[:size])
        return header

    def put_many(self, items: Sequence[tuple[str, Buffer, ChunkHeader]]) -> list[bool]:
        """SET each full chunk (with the TTL, if any); partial chunks are refused (False, logged)."""

        def put_one(item: tuple[str, Buffer, ChunkHeader]) -> bool:
            key, payload, _ = item
            view = memoryview(payload).cast("B")
            if view.nbytes != self._header_of(key).length:
                logger.warning("%s: chunk %s is %d bytes, not a full chunk: not stored", self.url, key, view.nbytes)
                return False
            expiry = () if self.ttl_s is None else ("EX", str(self.ttl_s))
            try:
                self.raw.execute("SET", lambda ok: ok(key, "SET", key, view, *expiry))
                return True
            except KVToolError as e:
                logger.warning("%s", e)
                return False

        return self.striped(items, put_one)
