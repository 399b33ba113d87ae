"""The resp:// URL as LMCache's `RESPConnectorAdapter` reads it (connector/redis_adapter.py).

LMCache takes `resp://HOST:PORT` through its `parse_remote_url`, which requires both; it ignores a
path or query (its client never sends SELECT: always database 0) and the URL's user and password,
reading the credentials from `extra_config` `username` / `password` or from the environment
variables below. kvtool accepts `resp://[USER:PASSWORD@]HOST:PORT` (store.py parses the user and
password and falls back to these variables) and refuses what LMCache would silently drop: a /DB,
?options, and a second host.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from kvtool.engine.errors import ConfigError

LMCACHE_USERNAME_ENV, LMCACHE_PASSWORD_ENV = "LMCACHE_RESP_USERNAME", "LMCACHE_RESP_PASSWORD"


def parse_resp_host_port(hostpart: str) -> tuple[str, int]:
    """(host, port) of the part of a resp:// URL after any `USER:PASSWORD@`.

    Raises:
        ConfigError: no host or port, an invalid port, several hosts, a /DB or ?options.
    """
    where = f"resp://{hostpart}"
    if any(c in hostpart for c in ",/?#"):
        raise ConfigError(f"remote_url {where!r}: resp:// takes one HOST:PORT and no /DB or ?options "
                          "(LMCache's resp connector reads database 0 of one server)")
    parts = urlsplit("//" + hostpart)
    try:
        port = parts.port
    except ValueError:
        raise ConfigError(f"remote_url {where!r} has an invalid port") from None
    if not parts.hostname or not port:
        raise ConfigError(f"remote_url {where!r} is not a resp://HOST:PORT URL (LMCache requires both)")
    return parts.hostname, port
