"""remote_url parsing, layout-dependent settings and LMCache's RemoteMetadata encoding."""

import struct

import pytest
import torch

from kvtool.engine.connectors.lmcache.connector import parse_settings
from kvtool.engine.connectors.lmcache.stores.protocol import ChunkHeader, kv_chunk_header
from kvtool.engine.connectors.lmcache.stores.redis_store import decode_metadata, encode_metadata
from kvtool.engine.connectors.lmcache.stores.store import StoreAddress, parse_store_url, store_address
from kvtool.engine.errors import ConfigError, KVRefused, PeerError

SECRET = "pa:ss@w0rd"


@pytest.mark.parametrize("url, scheme, nodes, db, user, described", [
    ("lm://127.0.0.1:65432", "lm", (("127.0.0.1", 65432),), 0, None, "lm://127.0.0.1:65432"),
    ("redis://127.0.0.1:6380/3", "redis", (("127.0.0.1", 6380),), 3, None, "redis://127.0.0.1:6380/3"),
    ("redis://127.0.0.1", "redis", (("127.0.0.1", 6379),), 0, None, "redis://127.0.0.1:6379"),
    ("rediss://alice:pw@h:1?ssl_cert_reqs=none", "rediss", (("h", 1),), 0, "alice", "rediss://h:1"),
    ("redis-cluster://a:7000,b:7001,c:7002", "redis-cluster", (("a", 7000), ("b", 7001), ("c", 7002)), 0, None,
     "redis-cluster://a:7000,b:7001,c:7002"),
    ("valkey://:pw@v:6379", "valkey", (("v", 6379),), 0, None, "valkey://v:6379"),
])
def test_schemes(url, scheme, nodes, db, user, described):
    a = parse_store_url(url, environ={})
    assert (a.scheme, a.nodes, a.db, a.username, a.describe()) == (scheme, nodes, db, user, described)


def test_sentinel_urls_name_every_sentinel_and_the_service_as_lmcache_reads_it():
    a = parse_store_url("redis-sentinel://u:pw@s1:26379,s2:26380", environ={})
    assert (a.nodes, a.username, a.password, a.service_name) == ((("s1", 26379), ("s2", 26380)), "u", "pw",
                                                                  "redismaster")
    assert a.describe() == "redis-sentinel://s1:26379,s2:26380"
    assert parse_store_url("redis-sentinel://s1:1", environ={"REDIS_SERVICE_NAME": "kv"}).service_name == "kv"
    assert parse_store_url("redis://h:1", environ={"REDIS_SERVICE_NAME": "kv"}).service_name is None
    with pytest.raises(ConfigError, match="takes no /DB"):
        parse_store_url("redis-sentinel://s1:1/2", environ={})


def test_unix_socket_with_db():
    a = parse_store_url("unix:///run/redis.sock?db=2", environ={})
    assert (a.path, a.db, a.describe()) == ("/run/redis.sock", 2, "unix:///run/redis.sock?db=2")


def test_password_from_url_or_environment_and_never_shown():
    quoted = SECRET.replace(":", "%3A").replace("@", "%40")
    a = parse_store_url(f"redis://u:{quoted}@h:1", environ={"KVTOOL_REDIS_PASSWORD": "other"})
    assert a.password == SECRET  # the URL wins over the environment
    assert SECRET not in repr(a) and SECRET not in a.describe()
    b = parse_store_url("redis-cluster://h:1,h:2", environ={"KVTOOL_REDIS_PASSWORD": SECRET})
    assert b.password == SECRET and SECRET not in repr(b) + b.describe()


@pytest.mark.parametrize("url, message", [
    ("http://h:1", "scheme 'http' is not one of"),
    ("redis://h:1,h:2", "takes one HOST:PORT"),
    ("valkey://h:1/2", "takes no /DB"),
    ("redis://h:1/x", "database 'x'"),
    ("redis://h:port", "invalid port"),
    ("lm://h", "lm://HOST:PORT"),
    ("redis://h:1?ssl_cert_reqs=none", "takes no ?options"),
    ("rediss://h:1?verify=no", "option 'verify'"),
    ("unix://", "no socket path"),
])
def test_bad_urls_are_one_line_config_errors(url, message):
    with pytest.raises(ConfigError, match=message.replace("?", r"\?")):
        parse_store_url(url, environ={})


def test_bad_url_error_never_quotes_the_password():
    with pytest.raises(ConfigError) as info:
        parse_store_url(f"redis://u:{SECRET}@h:notaport", environ={})
    assert "w0rd" not in str(info.value)


def test_valkey_settings():
    assert store_address("valkey://h:1", environ={}).ttl_s is None
    assert store_address("valkey://h:1", valkey_enable_ttl=True, environ={}).ttl_s == 86400
    assert store_address("valkey://h:1", valkey_enable_ttl=True, valkey_ttl_sec=60, environ={}).ttl_s == 60
    with pytest.raises(ConfigError, match="save_unfull_chunk must be false for valkey"):
        store_address("valkey://h:1", save_unfull_chunk=True, environ={})
    with pytest.raises(ConfigError, match="valkey:// only"):
        store_address("redis://h:1", valkey_enable_ttl=True, environ={})
    with pytest.raises(ConfigError, match="positive"):
        store_address("valkey://h:1", valkey_enable_ttl=True, valkey_ttl_sec=0, environ={})


def test_connector_settings_check_the_url():
    s, _ = parse_settings({"remote_url": "lm://10.0.0.1:7777"}, "m", "bfloat16", 16)
    assert (s.host, s.port) == ("10.0.0.1", 7777)
    s, _ = parse_settings({"lmcache.remote_url": "valkey://h:1", "valkey_enable_ttl": True}, "m", "bfloat16", 16)
    assert s.remote_url == "valkey://h:1" and s.valkey_enable_ttl
    with pytest.raises(ConfigError, match="save_unfull_chunk"):
        parse_settings({"remote_url": "valkey://h:1", "save_unfull_chunk": True}, "m", "bfloat16", 16)
    with pytest.raises(ConfigError, match="scheme"):
        parse_settings({"remote_url": "mongodb://h:1"}, "m", "bfloat16", 16)
    with pytest.raises(ConfigError, match="need a valkey:// remote_url"):
        parse_settings({"host": "h", "port": 1, "valkey_ttl_sec": 5}, "m", "bfloat16", 16)


def test_remote_metadata_is_lmcaches_28_bytes():
    header = kv_chunk_header((2, 28, 256, 1024), torch.bfloat16)
    raw = encode_metadata(header)
    assert raw == struct.pack("=7i", header.length, 1, 3, 2, 28, 256, 1024) and len(raw) == 28
    assert decode_metadata(raw, header.length, "k") == header
    half = struct.pack("=7i", 2 * 4 * 2, 1, 1, 2, 4, 0, 0)  # dtype code 1 (torch.half) reads as float16
    assert decode_metadata(half, 100, "k") == ChunkHeader(1, 2, (2, 4), 16)


@pytest.mark.parametrize("raw, error, message", [
    (b"\0" * 20, PeerError, "not LMCache's RemoteMetadata"),
    (struct.pack("=12i", 16, 1, 4, 2, 2, 0, 0, 4, 2, 2, 0, 0), KVRefused, "2 KV groups"),
    (struct.pack("=7i", 16, 99, 4, 2, 2, 0, 0), PeerError, "unknown memory format 99"),
    (struct.pack("=7i", 16, 1, 42, 2, 2, 0, 0), PeerError, "dtype code 42"),
    (struct.pack("=7i", 17, 1, 4, 2, 2, 0, 0), PeerError, "announces 17 bytes, its shape"),
    (struct.pack("=7i", 16, 1, 4, -2, 2, 0, 0), PeerError, "negative"),
    (struct.pack("=7i", 400, 1, 4, 100, 0, 0, 0), PeerError, "the buffer holds 64"),
])
def test_bad_metadata_is_refused_before_the_payload(raw, error, message):
    with pytest.raises(error, match=message):
        decode_metadata(raw, 64, "k")


def test_store_address_repr_hides_the_password():
    a = StoreAddress("redis", (("h", 1),), password=SECRET)
    assert SECRET not in repr(a)
