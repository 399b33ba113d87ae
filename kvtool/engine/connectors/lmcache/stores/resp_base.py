"""What the Redis-protocol stores share: a redis-py asyncio client on a loop of its own for commands,
raw connections for chunk payloads, deadlines, one-line errors without credentials, and striping
of many chunks over a few connections.

The client (a standalone `redis.asyncio.Redis` on a connection pool, or a
`redis.asyncio.cluster.RedisCluster`) lives on an event loop in a daemon thread. Callers stay
synchronous: each operation is submitted to the loop under `asyncio.wait_for(..., timeout_s)`, so
a store that answers slowly, trickles bytes or stops answering mid-reply is cut off at the
deadline (the cancelled command drops its connection) and nothing waits longer. Connection
errors are retried once, on a fresh connection (a restarted server); timeouts are not retried.

Chunk payloads (GET into the callers' buffers, SET from their memory) bypass redis-py: they travel
over raw RESP connections (resp_wire.py, resp_pool.py) that read each bulk reply straight into its
buffer and write each payload from its own memory, with the same deadlines, retry and error
lines. redis-py still tells them where a key lives: the master a Sentinel names, the node that
owns a cluster slot (its slot map, reloaded after a -MOVED).

Many-chunk calls stripe their items as the lm:// client does: stripe g takes items g, g+N, ...
in order on its own thread, so a caller's `before_item` may block (waiting for a ring buffer to
free up) without blocking the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, TypeVar

from kvtool.engine.connectors.lmcache.stores.connection import describe_error
from kvtool.engine.connectors.lmcache.stores.protocol import ChunkHeader
from kvtool.engine.connectors.lmcache.stores.resp_pool import ItemReplies, PendingGet, RawPool
from kvtool.engine.connectors.lmcache.stores.resp_wire import Endpoint, ReplyError
from kvtool.engine.connectors.lmcache.stores.store import Buffer, StoreAddress
from kvtool.engine.errors import ConfigError, KVToolError, PeerError

logger = logging.getLogger("kvtool.lmcache")

T = TypeVar("T")
ItemT = TypeVar("ItemT")
ResultT = TypeVar("ResultT")
# Beyond an operation's own deadline, how long a caller waits for the loop to report it (the
# loop itself could be stuck only through a bug, but a caller must never wait forever).
LOOP_GRACE_S = 5.0
CLOSE_TIMEOUT_S = 5.0
NUM_SLOTS = 16384  # Redis Cluster hash slots


class RespStore:
    """Base of the Redis-protocol stores; subclasses define the data layout (what a chunk is).

    Args:
        address: a parsed redis://, rediss://, unix://, redis-cluster:// or valkey:// URL.
        connections: pool size and stripe count of the many-chunk calls.
        timeout_s: deadline of each operation (a lookup batch, one chunk's load or store).
    """

    def __init__(self, address: StoreAddress, *, connections: int, timeout_s: float) -> None:
        self.address = address
        self.num_connections = connections
        self.timeout_s = timeout_s
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvtool-redis-loop", daemon=True)
        self._thread.start()
        self._client: Any = None  # standalone: the one shared client
        self._free: list[Any] = []  # cluster: clients not in use by an operation
        self._stripes: ThreadPoolExecutor | None = None
        self._stripes_lock = threading.Lock()
        self._closed = False
        self._routes_lock = threading.Lock()
        self._slots: list[Endpoint | None] | None = None  # cluster: the master of each slot
        self._master: Endpoint | None = None  # sentinel: the master it named last
        self.raw = RawPool(self.url, address, connections=connections, timeout_s=timeout_s, route=self.route,
                           reroute=self.reroute, error=self.raw_error, on_threads=self.on_threads)

    @property
    def url(self) -> str:
        return self.address.describe()

    @property
    def is_cluster(self) -> bool:
        return self.address.scheme == "redis-cluster"

    # -- the client, on the loop ----------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def lease(self) -> AsyncIterator[Any]:
        """A redis-py client for one operation (on the loop).

        A standalone store shares one client: its connection pool gives each command a
        connection of its own. A cluster client closes the connections of *every* node when one
        node fails, under whatever else runs on it, so each cluster operation leases a client
        of its own from a free list, and a client whose operation failed is closed, not reused.
        """
        if not self.is_cluster:
            if self._client is None:
                self._client = await self._make_client()
            yield self._client
            return
        client = self._free.pop() if self._free else await self._make_client()
        try:
            yield client
        except KVToolError:
            self._release(client)  # refused on purpose (a wrong chunk): the client is fine
            raise
        except BaseException:
            self._discard(client)
            raise
        self._release(client)

    def _release(self, client: Any) -> None:
        if self._closed:
            self._discard(client)
        else:
            self._free.append(client)

    def _discard(self, client: Any) -> None:
        self._loop.create_task(_close_quietly(client))

    async def _make_client(self) -> Any:
        import redis.asyncio as aioredis
        from redis.asyncio.retry import Retry
        from redis.backoff import NoBackoff
        from redis.exceptions import ConnectionError as RedisConnectionError

        a = self.address
        common = dict(
            username=a.username, password=a.password, socket_timeout=self.timeout_s,
            socket_connect_timeout=self.timeout_s, retry=Retry(NoBackoff(), 1, (RedisConnectionError,)),
            decode_responses=False,
        )
        if self.is_cluster:
            from redis.asyncio.cluster import ClusterNode, RedisCluster

            # Without full coverage the live masters keep serving their slots when one master is lost.
            cluster = RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in a.nodes], require_full_coverage=False,
                                   max_connections=max(2, self.num_connections), **common)
            await cluster.initialize()
            return cluster
        if a.scheme == "redis-sentinel":
            from redis.asyncio.sentinel import Sentinel

            # The master the sentinels name now; redis-py asks them again after a connection error,
            # so an operation after a failover reaches the promoted replica.
            sentinel = Sentinel(list(a.nodes), socket_timeout=self.timeout_s,
                                sentinel_kwargs={"socket_timeout": self.timeout_s,
                                                 "socket_connect_timeout": self.timeout_s})
            return sentinel.master_for(a.service_name, max_connections=self.num_connections + 1, **common)
        if a.scheme == "unix":
            pool = aioredis.ConnectionPool(connection_class=aioredis.UnixDomainSocketConnection, path=a.path, db=a.db,
                                           max_connections=self.num_connections + 1, **common)
        else:
            (host, port), = a.nodes
            extra: dict[str, Any] = {}
            if a.scheme == "rediss":
                extra = {"connection_class": aioredis.SSLConnection, **_ssl_options(a.query)}
            pool = aioredis.ConnectionPool(host=host, port=port, db=a.db, max_connections=self.num_connections + 1,
                                           **extra, **common)
        return aioredis.Redis(connection_pool=pool)

    # -- running operations with deadlines -------------------------------------------------------

    def run(self, what: str, make: Callable[[], Awaitable[T]]) -> T:
        """Run the coroutine `make()` on the loop under the deadline; errors become one line.

        Raises:
            PeerError: unreachable, timed out, or an error reply (credentials never quoted).
            ConfigError: the store refused the credentials.
            KVToolError: whatever the coroutine raised on purpose (e.g. KVRefused).
        """
        if self._closed:
            raise PeerError(f"{self.url}: store is closed")
        future = asyncio.run_coroutine_threadsafe(asyncio.wait_for(make(), self.timeout_s), self._loop)
        try:
            return future.result(self.timeout_s + LOOP_GRACE_S)
        except FutureTimeout:
            future.cancel()
            raise PeerError(f"{self.url}: {what} timed out after {self.timeout_s:g} s") from None
        except KVToolError:
            raise
        except Exception as e:  # redis-py, socket and asyncio errors
            raise self.translate(e, what) from None

    def translate(self, e: BaseException, what: str) -> KVToolError:
        """One-line error for a failure of `what` in redis-py, with the password scrubbed."""
        from redis.exceptions import AuthenticationError, ResponseError

        text = str(e) or type(e).__name__
        if isinstance(e, (asyncio.TimeoutError, TimeoutError)):
            text = f"timed out after {self.timeout_s:g} s"
        auth = isinstance(e, AuthenticationError) or (
            isinstance(e, ResponseError) and text.split(" ", 1)[0] in ("NOAUTH", "WRONGPASS"))
        return self._error_line(text, what, auth)

    def raw_error(self, e: BaseException, what: str) -> KVToolError:
        """One-line error for a failure of `what` on a raw connection (an error reply or a socket error)."""
        if isinstance(e, KVToolError):
            return e
        if isinstance(e, ReplyError):
            return self._error_line(e.text, what, e.refuses_credentials)
        if isinstance(e, TimeoutError):  # socket.timeout, the deadline included
            return self._error_line(f"timed out after {self.timeout_s:g} s", what, False)
        text = describe_error(e) if isinstance(e, OSError) else str(e) or type(e).__name__
        return self._error_line(text, what, False)

    def _error_line(self, text: str, what: str, auth: bool) -> KVToolError:
        if self.address.password:
            text = text.replace(self.address.password, "***")
        if auth:
            return ConfigError(
                f"{self.url}: the store refused the credentials ({text.rstrip('.')}); "
                "check the user and password in remote_url or KVTOOL_REDIS_PASSWORD")
        return PeerError(f"{self.url}: {what} failed: {text}")

    def striped(
        self,
        items: Sequence[ItemT],
        one: Callable[[ItemT], ResultT],
        on_result: Callable[[int, ResultT], None] | None = None,
        before_item: Callable[[int], None] | None = None,
    ) -> list[ResultT]:
        """`one(item)` for every item: stripe g runs items g, g+N, ... in order on its own thread."""
        results: list[ResultT] = [None] * len(items)  # type: ignore[list-item]
        num_stripes = min(self.num_connections, len(items))

        def run_stripe(g: int) -> None:
            for i in range(g, len(items), num_stripes):
                if before_item is not None:
                    before_item(i)
                results[i] = one(items[i])
                if on_result is not None:
                    on_result(i, results[i])

        self.on_threads(num_stripes, run_stripe)
        return results

    def on_threads(self, n: int, run: Callable[[int], None]) -> None:
        """run(0) ... run(n - 1), each on a stripe thread (inline when n is 1); re-raises what they raise."""
        executor = None  # inline; so too once closed, where each stripe fails its items at once
        with self._stripes_lock:
            if n > 1 and not self._closed:
                if self._stripes is None:
                    self._stripes = ThreadPoolExecutor(self.num_connections, thread_name_prefix="kvtool-redis")
                executor = self._stripes
        if executor is None:
            for g in range(n):
                run(g)
            return
        for future in [executor.submit(run, g) for g in range(n)]:
            future.result()

    # -- where a key lives, for the raw connections ---------------------------------------------

    def route(self, key: str) -> Endpoint:
        """The node that holds `key`: the one server, the master a Sentinel names, or the slot's master."""
        a = self.address
        if a.scheme == "unix":
            return a.path  # type: ignore[return-value]
        if a.scheme == "redis-sentinel":
            master = self._master
            return master if master is not None else self._load_master()
        if not self.is_cluster:
            return a.nodes[0]
        from redis.crc import key_slot

        slots = self._slots if self._slots is not None else self._load_slots(refresh=False)
        slot = key_slot(key.encode())
        owner = slots[slot]
        if owner is None:
            raise PeerError(f"{self.url}: no master serves slot {slot} (of {key})")
        return owner

    def reroute(self) -> None:
        """Forget the master (Sentinel) or reload the slot map (cluster): a redirect or a broken
        connection said they are stale. Raises PeerError when the slot map cannot be read."""
        if self.address.scheme == "redis-sentinel":
            self._master = None
        elif self.is_cluster:
            self._load_slots(refresh=True)

    def _load_master(self) -> Endpoint:
        async def ask() -> tuple[str, int]:
            async with self.lease() as client:
                return await client.connection_pool.get_master_address()

        with self._routes_lock:
            if self._master is None:
                host, port = self.run("SENTINEL get-master-addr-by-name", ask)
                self._master = (str(host), int(port))
            return self._master

    def _load_slots(self, refresh: bool) -> list[Endpoint | None]:
        async def slot_map() -> list[Endpoint | None]:
            async with self.lease() as client:
                if refresh:
                    await client.nodes_manager.initialize()
                cache = client.nodes_manager.slots_cache
                return [(nodes[0].host, nodes[0].port) if (nodes := cache.get(slot)) else None
                        for slot in range(NUM_SLOTS)]

        with self._routes_lock:
            if refresh or self._slots is None:
                self._slots = self.run("CLUSTER SLOTS", slot_map)
            return self._slots

    # -- RemoteStore operations shared by the layouts -------------------------------------------

    def get_many_into(
        self,
        items: Sequence[tuple[str, Buffer, ChunkHeader | None]],
        on_result: Callable[[int, ChunkHeader | KVToolError | None], None] | None = None,
        before_item: Callable[[int], None] | None = None,
    ) -> list[ChunkHeader | KVToolError | None]:
        """Each chunk into its buffer (see RemoteStore.get_many_into), over the raw connections:
        striped, pipelined, each payload read straight into its buffer; errors are per item."""
        return self.raw.get_wave(items, self.item_keys, self.read_item, on_result, before_item)

    def item_keys(self, key: str) -> tuple[str, ...]:
        """The keys a chunk's GETs ask for, in the order `read_item` reads their replies."""
        raise NotImplementedError

    def read_item(self, item: PendingGet, replies: ItemReplies) -> ChunkHeader | None:
        """One chunk of the layout from its replies into `item.target`: its header on a hit, None on
        a miss. Raises KVToolError for a chunk refused (what it left unread is read past)."""
        raise NotImplementedError

    def health(self) -> bool:
        """PING under the deadline; False when unreachable, ConfigError on refused credentials."""
        async def ping() -> bool:
            async with self.lease() as client:
                return bool(await client.ping())

        try:
            return self.run("PING", ping)
        except PeerError as e:
            logger.debug("%s", e)
            return False

    async def exists_pipelined(self, keys: Sequence[str]) -> list[bool]:
        """EXISTS for each key in one pipeline (grouped by node in a cluster), in key order."""
        async with self.lease() as client:
            pipe = client.pipeline(transaction=False) if not self.is_cluster else client.pipeline()
            for key in keys:
                pipe.exists(key)
            return [bool(n) for n in await pipe.execute()]

    def close(self) -> None:
        """Close the client, the stripe threads and the loop; each step is bounded in time."""
        if self._closed:
            return
        self._closed = True
        self.raw.close()  # wakes any stripe blocked on a socket
        with self._stripes_lock:
            if self._stripes is not None:
                self._stripes.shutdown(wait=True)
                self._stripes = None
        self.raw.drop_all()
        async def close_all() -> None:
            clients = [c for c in [self._client, *self._free] if c is not None]
            await asyncio.gather(*(_close_quietly(c) for c in clients))

        future = asyncio.run_coroutine_threadsafe(asyncio.wait_for(close_all(), CLOSE_TIMEOUT_S), self._loop)
        try:
            future.result(CLOSE_TIMEOUT_S + 1)
        except Exception as e:  # a close that outlives its deadline leaves only sockets to the GC
            logger.debug("%s: close: %s", self.url, e)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(CLOSE_TIMEOUT_S)
        if not self._thread.is_alive():
            self._loop.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def _close_quietly(client: Any) -> None:
    try:
        await client.aclose()
    except Exception as e:  # closing a broken connection may fail; it is gone either way
        logger.debug("close: %s", e)


def _ssl_options(query: dict) -> dict[str, Any]:
    """redis-py SSL keyword arguments from the rediss:// query (keys checked by parse_store_url)."""
    out: dict[str, Any] = dict(query)
    if "ssl_check_hostname" in out:
        out["ssl_check_hostname"] = out["ssl_check_hostname"].lower() in ("1", "true", "yes")
    return out
