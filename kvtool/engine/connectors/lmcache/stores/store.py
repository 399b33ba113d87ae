"""Which remote store the LMCacheConnector talks to: `remote_url` parsed, and a store opened.

Both halves of the connector use only the operations of `RemoteStore`; the lm:// `LMClient`
(lm_client.py) has them already, and the Redis family (redis_store.py, valkey_store.py) has them too,
so the halves never know which store they use.

Schemes (LMCache's own `remote_url` spellings):

    lm://HOST:PORT                                LMCache's server (`lmcache.v1.server`)
    redis://[USER:PASSWORD@]HOST:PORT[/DB]        one Redis; two keys per chunk, LMCache's RedisConnector layout
    rediss://[USER:PASSWORD@]HOST:PORT[/DB][?ssl_ca_certs=FILE&...]   the same over TLS (SSL_OPTIONS)
    unix://[USER:PASSWORD@]/PATH[?db=DB]          the same over a Unix socket
    redis-cluster://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...]   a Redis Cluster, the same layout
    redis-sentinel://[USER:PASSWORD@]HOST:PORT[,HOST:PORT...]  the master Redis Sentinels name, the same
                                                  layout; its service name is LMCache's REDIS_SERVICE_NAME
                                                  (default redismaster)
    valkey://[USER:PASSWORD@]HOST:PORT            one key per chunk, LMCache's ValkeyConnector layout
    resp://[USER:PASSWORD@]HOST:PORT              one key per chunk, LMCache's native RESP connector (resp_store.py)

A password missing from the URL is taken from `KVTOOL_REDIS_PASSWORD` (for resp:// then from
LMCache's `LMCACHE_RESP_PASSWORD`, and a missing user from `LMCACHE_RESP_USERNAME`). Passwords
never appear in what this module logs or raises: a store names itself by `StoreAddress.describe()`,
which leaves the credentials out.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol, Union
from urllib.parse import parse_qs, unquote, urlsplit

from kvtool.engine.connectors.lmcache.stores.protocol import parse_lm_url
from kvtool.engine.connectors.lmcache.stores.protocol import ChunkHeader
from kvtool.engine.connectors.lmcache.stores.resp_url import (
    LMCACHE_PASSWORD_ENV,
    LMCACHE_USERNAME_ENV,
    parse_resp_host_port,
)
from kvtool.engine.errors import ConfigError, KVToolError

Buffer = Union[bytes, bytearray, memoryview]
PASSWORD_ENV = "KVTOOL_REDIS_PASSWORD"
SCHEMES = ("lm", "redis", "rediss", "unix", "redis-cluster", "redis-sentinel", "valkey", "resp")
# The sentinels' name for the master (LMCache's RedisSentinelConnector reads the same variable).
SERVICE_NAME_ENV, DEFAULT_SERVICE_NAME = "REDIS_SERVICE_NAME", "redismaster"
REDIS_DEFAULT_PORT = 6379
DEFAULT_VALKEY_TTL_S = 86400  # LMCache's default when valkey_enable_ttl is set without valkey_ttl_sec
# rediss:// query options, passed to redis-py's SSL connections as they are.
SSL_OPTIONS = ("ssl_keyfile", "ssl_certfile", "ssl_cert_reqs", "ssl_ca_certs", "ssl_ca_path", "ssl_check_hostname")


class RemoteStore(Protocol):
    """What the LMCacheConnector's halves need from a store of KV chunks.

    Every call that talks to the store is thread-safe and bounded by the store's `timeout_s`;
    a store that cannot be reached or misbehaves raises `PeerError` (one line, no credentials).
    """

    @property
    def url(self) -> str:
        """The store's address without credentials, for messages."""
        ...

    def health(self) -> bool:
        """True when the store answers; False when it cannot be reached.

        Raises ConfigError when the store refuses the credentials (a wrong password is a
        configuration mistake, never a transient fault).
        """
        ...

    def exist_many(self, keys: Sequence[str]) -> list[bool]:
        """Whether the store holds each key, in the order of `keys`."""
        ...

    def get_many_into(
        self,
        items: Sequence[tuple[str, Buffer, ChunkHeader | None]],
        on_result: Callable[[int, ChunkHeader | KVToolError | None], None] | None = None,
        before_item: Callable[[int], None] | None = None,
    ) -> list[ChunkHeader | KVToolError | None]:
        """Fetch each `(key, buffer, expected)` into its buffer: per item the chunk's header on a
        hit, None on a miss, or the error of that item (returned, not raised).

        `before_item(i)` is called before anything is written into item i's buffer (it may block
        until the buffer is free; a pipelining store may have sent the item's request already);
        `on_result(i, result)` as each item ends, so a caller can consume chunks as they arrive.
        """
        ...

    def put_many(self, items: Sequence[tuple[str, Buffer, ChunkHeader]]) -> list[bool]:
        """Store each `(key, payload, header)`; True where the store confirmed it."""
        ...

    def close(self) -> None:
        """Release connections and threads (bounded in time). Idempotent."""
        ...


@dataclass(frozen=True)
class StoreAddress:
    """A parsed `remote_url`. The password is kept out of `repr` and of `describe()`."""

    scheme: str
    nodes: tuple[tuple[str, int], ...] = ()  # (host, port) per node; empty for unix://
    path: str | None = None  # unix:// socket path
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    query: dict = field(default_factory=dict, repr=False)  # redis-py connection options (rediss://)
    ttl_s: int | None = None  # valkey:// only: the expiry of each written key
    service_name: str | None = None  # redis-sentinel:// only: the master's name at the sentinels

    def describe(self) -> str:
        """`scheme://host:port[/db]` (or the socket path): the address, never the credentials."""
        if self.scheme == "unix":
            return f"unix://{self.path}" + (f"?db={self.db}" if self.db else "")
        hosts = ",".join(f"{h}:{p}" for h, p in self.nodes)
        return f"{self.scheme}://{hosts}" + (f"/{self.db}" if self.db else "")


def parse_store_url(url: str, environ: dict | None = None) -> StoreAddress:
    """Parse a `remote_url` of any supported scheme (see the module docstring).

    Raises:
        ConfigError: an unknown scheme, a missing or invalid host, port or database. The
            message never quotes the URL's credentials.
    """
    env = os.environ if environ is None else environ
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in SCHEMES:
        shown = scheme if sep else _without_credentials(url)
        raise ConfigError(f"remote_url scheme {shown!r} is not one of {', '.join(s + '://' for s in SCHEMES)}")
    userinfo, at, hostpart = rest.rpartition("@")
    if not at:
        userinfo, hostpart = "", rest
    username, password = _userinfo(userinfo)
    if password is None and scheme != "lm":
        password = env.get(PASSWORD_ENV) or None
    if scheme == "lm" and userinfo:
        raise ConfigError("remote_url lm:// takes no user or password")
    if scheme == "lm":  # LMCache's own URL rules (protocol.py)
        return StoreAddress(scheme, (parse_lm_url(url),))
    if scheme == "resp":  # LMCache's resp:// rules (resp_url.py); its credentials' variables come last
        username = username or env.get(LMCACHE_USERNAME_ENV) or None
        password = password if password is not None else env.get(LMCACHE_PASSWORD_ENV) or None
        return StoreAddress(scheme, (parse_resp_host_port(hostpart),), None, 0, username, password)
    where = f"{scheme}://{hostpart}"
    if scheme == "unix":
        try:
            parts = urlsplit("unix://" + hostpart)
        except ValueError:
            raise ConfigError(f"remote_url {where!r} is not a unix:// URL") from None
        if not parts.path:
            raise ConfigError(f"remote_url {where!r} names no socket path")
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        db = _int_field(query.pop("db", "0"), "database", where)
        return StoreAddress(scheme, (), parts.path, db, username, password, query)
    hostpart, _, query_text = hostpart.partition("?")
    hosts, _, tail = hostpart.partition("/")
    query = {k: v[-1] for k, v in parse_qs(query_text).items()}
    nodes = tuple(_host_port(h, where) for h in hosts.split(","))
    if scheme not in ("redis-cluster", "redis-sentinel") and len(nodes) != 1:
        raise ConfigError(f"remote_url {where!r}: {scheme}:// takes one HOST:PORT (redis-cluster:// and "
                          f"redis-sentinel:// take several)")
    db = 0
    if tail and scheme in ("redis", "rediss"):
        db = _int_field(tail, "database", where)
    elif tail and scheme != "lm":  # lm:// ignores a path, as LMCache does
        raise ConfigError(f"remote_url {where!r}: {scheme}:// takes no /DB (only redis:// and rediss:// do)")
    if query and scheme != "rediss":
        raise ConfigError(f"remote_url {where!r}: {scheme}:// takes no ?options")
    unknown = sorted(set(query) - set(SSL_OPTIONS))
    if unknown:
        raise ConfigError(f"remote_url {where!r}: option {unknown[0]!r} is not one of {', '.join(SSL_OPTIONS)}")
    service = env.get(SERVICE_NAME_ENV) or DEFAULT_SERVICE_NAME if scheme == "redis-sentinel" else None
    return StoreAddress(scheme, nodes, None, db, username, password, query, service_name=service)


def store_address(
    url: str,
    *,
    save_unfull_chunk: bool = False,
    valkey_enable_ttl: bool = False,
    valkey_ttl_sec: int | None = None,
    environ: dict | None = None,
) -> StoreAddress:
    """`parse_store_url` plus the settings that depend on the layout.

    Raises:
        ConfigError: `save_unfull_chunk` with valkey:// or resp:// (their values carry no shape, so
            only full chunks can be told apart), TTL settings with another scheme, a TTL that is not > 0.
    """
    address = parse_store_url(url, environ)
    if address.scheme == "resp" and save_unfull_chunk:
        raise ConfigError("save_unfull_chunk must be false for resp:// (LMCache's resp connector stores full chunks "
                          "only, with no metadata)")
    if address.scheme != "valkey":
        if valkey_enable_ttl or valkey_ttl_sec is not None:
            raise ConfigError(f"valkey_enable_ttl / valkey_ttl_sec apply to valkey:// only, not {address.scheme}://")
        return address
    if save_unfull_chunk:
        raise ConfigError("save_unfull_chunk must be false for valkey:// (one key per chunk with no metadata: "
                          "only full chunks can be stored)")
    if valkey_ttl_sec is not None and valkey_ttl_sec <= 0:
        raise ConfigError(f"valkey_ttl_sec must be a positive number of seconds, got {valkey_ttl_sec}")
    if not valkey_enable_ttl:
        return address
    return replace(address, ttl_s=valkey_ttl_sec if valkey_ttl_sec is not None else DEFAULT_VALKEY_TTL_S)


def _userinfo(text: str) -> tuple[str | None, str | None]:
    if not text:
        return None, None
    user, colon, password = text.partition(":")
    return (unquote(user) or None), (unquote(password) if colon else None)


def _host_port(text: str, where: str) -> tuple[str, int]:
    parts = urlsplit("//" + text)
    try:
        port = parts.port
    except ValueError:
        raise ConfigError(f"remote_url {where!r}: {text!r} has an invalid port") from None
    if not parts.hostname:
        raise ConfigError(f"remote_url {where!r}: {text!r} names no host")
    if port is None:
        if where.startswith("lm://"):
            raise ConfigError(f"remote_url {where!r} is not an lm://HOST:PORT URL")
        port = REDIS_DEFAULT_PORT
    return parts.hostname, port


def _int_field(text: str, what: str, where: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ConfigError(f"remote_url {where!r}: {what} {text!r} is not a non-negative integer")
    return value


def _without_credentials(url: str) -> str:
    head, at, tail = url.rpartition("@")
    return tail if at else url
