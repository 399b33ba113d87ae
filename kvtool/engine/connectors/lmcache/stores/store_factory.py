"""Opening the store a `remote_url` names: lm:// (LMClient), redis:// and redis-cluster:// (RedisStore),
valkey:// (ValkeyStore), resp:// (RespChunkStore). The store modules depend on store.py's types;
this factory depends on them.
"""

from __future__ import annotations

from kvtool.engine.connectors.lmcache.stores.lm_client import LMClient
from kvtool.engine.connectors.lmcache.stores.protocol import ChunkHeader
from kvtool.engine.connectors.lmcache.stores.store import RemoteStore, StoreAddress
from kvtool.engine.errors import ConfigError


def open_store(
    address: StoreAddress,
    *,
    connections: int,
    timeout_s: float,
    chunk_header: ChunkHeader,
    valkey_ttl_s: int | None = None,
    backoff_s: float | None = None,
) -> RemoteStore:
    """A store for `address`, connected lazily (nothing is sent until the first call).

    Args:
        connections: how many requests may be in flight at once.
        timeout_s: the deadline of each operation (one lookup, one chunk's load or store).
        chunk_header: a full chunk as the engine's pages hold it; the valkey:// and resp://
            layouts store no metadata, so a value is a chunk only if it has exactly this size.
        valkey_ttl_s: expiry of every key a valkey:// store writes; None keeps keys forever.
        backoff_s: lm:// only: how long a peer that missed a deadline is failed fast (LMClient's default when None).
    """
    if connections < 1:
        raise ConfigError(f"remote store connections must be >= 1, got {connections}")
    if timeout_s <= 0:
        raise ConfigError(f"remote store timeout_s must be > 0, got {timeout_s}")
    if address.scheme == "lm":
        (host, port), = address.nodes
        if backoff_s is None:
            return LMClient(host, port, connections=connections, timeout_s=timeout_s)
        return LMClient(host, port, connections=connections, timeout_s=timeout_s, backoff_s=backoff_s)
    if address.scheme == "valkey":
        from kvtool.engine.connectors.lmcache.stores.valkey_store import ValkeyStore

        return ValkeyStore(address, connections=connections, timeout_s=timeout_s, chunk_header=chunk_header,
                           ttl_s=valkey_ttl_s)
    if address.scheme == "resp":
        from kvtool.engine.connectors.lmcache.stores.resp_store import RespChunkStore

        return RespChunkStore(address, connections=connections, timeout_s=timeout_s, chunk_header=chunk_header)
    from kvtool.engine.connectors.lmcache.stores.redis_store import RedisStore

    return RedisStore(address, connections=connections, timeout_s=timeout_s)
