"""The LMCacheConnector's kv_connector_extra_config: declared keys, ranges, and their checks."""

from __future__ import annotations

import logging
import os
import re
import threading

import msgspec

from kvtool.engine.connectors.extra_keys import ExtraKey, parse_extra
from kvtool.engine.connectors.lmcache.keys import HASH_ALGOS, LMCacheKeySettings, check_request_tags
from kvtool.engine.connectors.lmcache.lmcache_config_keys import split_lmcache_keys
from kvtool.engine.connectors.lmcache.payload_digest import DIGEST_TAG
from kvtool.engine.connectors.lmcache.stores.store import store_address
from kvtool.engine.errors import ConfigError, InputError
from kvtool.engine.models.shard_layout import TPRank

logger = logging.getLogger("kvtool.lmcache")

CONNECTOR = "LMCacheConnector"
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 65432
MAX_CONNECTIONS = 64
MAX_TIMEOUT_S = 600.0
MAX_LOCAL_CPU_GB = 1 << 14
# A DNS name is at most 253 characters; an IPv6 literal far less.
MAX_HOST_CHARS = 253
_HOST = re.compile(r"[A-Za-z0-9_.\-:%]+")

LMCACHE_KEYS: tuple[ExtraKey, ...] = (
    ExtraKey(name="host", kind="str", max_len=MAX_HOST_CHARS, doc="default KVTOOL_LMCACHE_HOST or 127.0.0.1"),
    ExtraKey(name="port", kind="int", low=1, high=65535, doc="default KVTOOL_LMCACHE_PORT or 65432"),
    ExtraKey(name="remote_url", kind="str", aliases=("lmcache.remote_url",), max_len=4096,
             doc="the store: lm://HOST:PORT (an alternative to host and port), redis://, rediss://, unix://, "
                 "redis-cluster://, redis-sentinel://, valkey://, resp://"),
    ExtraKey(name="hash_algo", kind="choice", default="blake3", aliases=("lmcache.pre_caching_hash_algorithm",),
             choices=tuple(HASH_ALGOS)),
    ExtraKey(name="chunk_tokens", kind="int", aliases=("lmcache.chunk_size",), low=1, high=1 << 20,
             doc="default 256 in vllm/builtin mode, the block size in blake3 mode"),
    ExtraKey(name="model_name", kind="str", max_len=150, doc="default the --model string"),
    ExtraKey(name="world_size", kind="int", low=1, high=1 << 16,
             doc="default the engine's --tensor-parallel-size; another value is refused"),
    ExtraKey(name="worker_id", kind="int", low=0, high=(1 << 16) - 1,
             doc="default the rank; another value is refused"),
    ExtraKey(name="kv_dtype", kind="str", max_len=32, doc="default the engine's KV dtype"),
    ExtraKey(name="offload_prompt_only", kind="bool", default=True),
    ExtraKey(name="save_unfull_chunk", kind="bool", default=False, aliases=("lmcache.save_unfull_chunk",)),
    ExtraKey(name="none_hash_seed", kind="str", max_len=32, doc="the peer's PYTHONHASHSEED"),
    ExtraKey(name="connections", kind="int", default=4, low=1, high=MAX_CONNECTIONS),
    ExtraKey(name="timeout_s", kind="float", default=10.0, low=0.0, low_open=True, high=MAX_TIMEOUT_S,
             doc="deadline of one whole lm:// operation (EXIST, GET, PUT and its confirmation, HEALTH)"),
    ExtraKey(name="lookup_timeout_s", kind="float", default=5.0, low=0.0, low_open=True, high=MAX_TIMEOUT_S,
             doc="how long a request waits for its lookup before it runs without the hit"),
    ExtraKey(name="peer_backoff_s", kind="float", default=10.0, low=0.0, high=3600.0,
             doc="after a missed deadline, how long the peer counts as unhealthy (calls fail fast)"),
    ExtraKey(name="verify_payload", kind="bool",
             doc="store a digest beside each chunk and refuse a chunk whose payload disagrees; "
                 "default true in blake3 mode, false in the peer modes (vllm, builtin, sha256)"),
    ExtraKey(name="max_local_cpu_size", kind="float", default=5.0, aliases=("lmcache.max_local_cpu_size",),
             low=0.0, low_open=True, high=MAX_LOCAL_CPU_GB,
             doc="GB of pinned host memory for chunks on their way to the store (LMCache's key and default)"),
    ExtraKey(name="force_store_wait", kind="bool", default=False,
             doc="when that memory is full, the step waits and every chunk is stored (LMCache's extra_config "
                 "key); false, the default: the step's chunks from there on are not stored"),
    ExtraKey(name="extra_config", kind="object", aliases=("lmcache.extra_config",),
             doc="LMCache's extra_config object; kvtool reads its force_store_wait"),
    ExtraKey(name="valkey_enable_ttl", kind="bool", default=False, doc="valkey:// only: write every key with an expiry"),
    ExtraKey(name="valkey_ttl_sec", kind="int", low=1, high=10 * 365 * 86400,
             doc="that expiry in seconds; default 86400, as LMCache's"),
)


class LMCacheSettings(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """kv_connector_extra_config of the LMCacheConnector."""

    host: str | None = None  # default KVTOOL_LMCACHE_HOST or 127.0.0.1
    port: int | None = None  # default KVTOOL_LMCACHE_PORT or 65432
    remote_url: str | None = None  # lm://HOST:PORT, an alternative to host/port
    hash_algo: str = "blake3"  # vllm (alias sha256_cbor) | builtin | blake3 | sha256
    chunk_tokens: int | None = None  # default 256 in vllm/builtin mode, the block size in blake3 mode
    model_name: str | None = None  # default the --model string, as vLLM puts it in the key
    world_size: int | None = None  # the engine's tensor-parallel size, as vLLM's parallel config gives it
    worker_id: int | None = None  # the engine's tensor-parallel rank
    kv_dtype: str | None = None  # default the engine's KV dtype
    offload_prompt_only: bool = True
    save_unfull_chunk: bool = False
    none_hash_seed: str | None = None  # the peer's PYTHONHASHSEED; unset = vLLM >= 0.29's default
    connections: int = 4
    timeout_s: float = 10.0  # per whole operation
    lookup_timeout_s: float = 5.0  # a request runs without its hit once its lookup took this long
    peer_backoff_s: float = 10.0  # a peer that missed a deadline fails fast for this long
    verify_payload: bool | None = None  # a digest object beside each chunk (payload_digest.py); None: on in blake3 mode
    max_local_cpu_size: float = 5.0  # GB of pinned buffers for chunks on their way to the store (store_staging.py)
    force_store_wait: bool = False  # those buffers full: wait (every chunk stored) instead of not storing
    extra_config: dict | None = None  # LMCache's extra_config: its force_store_wait, folded into the field above
    valkey_enable_ttl: bool = False  # valkey:// only: write every key with an expiry
    valkey_ttl_sec: int | None = None  # that expiry; default 86400 s, as LMCache's


def check_host(host: str, where: str) -> str:
    """A host name or address, refused with one line if it cannot be one."""
    if not 1 <= len(host) <= MAX_HOST_CHARS or not _HOST.fullmatch(host):
        shown = host if len(host) <= 40 else host[:37] + "..."
        raise ConfigError(
            f"{where}: host {shown!r} is not a host name or address (1 to {MAX_HOST_CHARS} characters "
            "of letters, digits, '.', '-', ':')"
        )
    return host


def parse_hash_algo(extra: dict) -> str:
    """The key mode the extra config asks for: blake3 (kvtool's own), vllm (sha256_cbor too),
    builtin or sha256. Raises ConfigError (one line naming the key) as parse_settings does for
    an unknown key or a value outside its range."""
    s = _parse(extra, f"invalid {CONNECTOR} config")
    return "vllm" if s.hash_algo == "sha256_cbor" else s.hash_algo


_noticed: set[str] = set()
_noticed_lock = threading.Lock()


def _parse(extra: dict, where: str) -> LMCacheSettings:
    """The declared keys' values, after LMCache's own keys (lmcache_config_keys.py): each key
    accepted without effect is logged once per process."""
    ours, notices = split_lmcache_keys(extra, where)
    s = LMCacheSettings(**parse_extra(CONNECTOR, LMCACHE_KEYS, ours))  # type: ignore[arg-type]
    if s.extra_config is not None:
        wait, inner = _force_store_wait(s, where)
        s = msgspec.structs.replace(s, force_store_wait=wait, extra_config=None)
        notices += [f"lmcache.extra_config's {k} is LMCache's own setting and has no effect in kvtool" for k in inner]
    for line in notices:
        with _noticed_lock:
            new = line not in _noticed
            _noticed.add(line)
        if new:
            logger.warning("kv_connector_extra_config: %s", line)
    return s


def parse_settings(
    extra: dict, model_name: str, kv_dtype: str, block_size: int, tp: TPRank | None = None,
    identity_digest: str | None = None,
) -> tuple[LMCacheSettings, LMCacheKeySettings]:
    """Decode and check the extra config; the settings and the key settings they imply.

    The key's world_size and worker_id are the engine's tensor-parallel size and rank `tp`, as
    LMCache takes them from vLLM's parallel config; an explicit value that disagrees is refused.
    With `tp` None (no engine yet: a config check) the explicit values, else 1 and 0, are used.
    In blake3 mode the keys carry `identity_digest` (the engine's make_identity_digest) and
    verify_payload defaults to true; the peer modes key exactly as the peer does, without it,
    and default verify_payload to false. The returned settings' verify_payload is a bool.

    Raises ConfigError (one line naming the key) for an unknown key, a value outside its
    range, a bad remote_url or host, a chunk size that is not a multiple of the block size,
    or a world_size / worker_id other than the engine's.
    """
    where = f"invalid {CONNECTOR} config"
    s = _parse(extra, where)
    if s.remote_url:
        # Every scheme is checked here (store.py); lm:// also fills host and port.
        address = store_address(s.remote_url, save_unfull_chunk=s.save_unfull_chunk,
                                valkey_enable_ttl=s.valkey_enable_ttl, valkey_ttl_sec=s.valkey_ttl_sec)
        if address.scheme == "lm":
            (host, port), = address.nodes
            s = msgspec.structs.replace(s, host=host, port=port)
    elif s.valkey_enable_ttl or s.valkey_ttl_sec is not None:
        raise ConfigError(f"{where}: valkey_enable_ttl / valkey_ttl_sec need a valkey:// remote_url")
    host = check_host(s.host or os.environ.get("KVTOOL_LMCACHE_HOST") or DEFAULT_HOST, where)
    env_port = os.environ.get("KVTOOL_LMCACHE_PORT")
    if s.port is not None:
        port = s.port
    elif env_port:
        if not env_port.isdigit() or not 1 <= int(env_port) <= 65535:
            raise ConfigError("KVTOOL_LMCACHE_PORT is not a port number (1 to 65535)")
        port = int(env_port)
    else:
        port = DEFAULT_PORT
    algo = "vllm" if s.hash_algo == "sha256_cbor" else s.hash_algo
    chunk = s.chunk_tokens or (block_size if algo == "blake3" else 256)
    if chunk % block_size:
        raise ConfigError(f"{where}: chunk_tokens {chunk} is not a multiple of the block size {block_size}")
    world_size, worker_id = _rank_of(s, tp, where)
    key_settings = LMCacheKeySettings(
        model_name=s.model_name or model_name,
        world_size=world_size,
        worker_id=worker_id,
        kv_dtype=s.kv_dtype or kv_dtype,
        chunk_tokens=chunk,
        hash_algo=algo,
        none_hash_seed=s.none_hash_seed,
        save_unfull_chunk=s.save_unfull_chunk,
        identity_digest=identity_digest if algo == "blake3" else None,
    )
    # kvtool is the only writer of blake3 keys, so nothing stops it checking every payload there.
    verify_payload = s.verify_payload if s.verify_payload is not None else algo == "blake3"
    if verify_payload:
        try:  # the digest's key is the chunk's with one more tag: the longest must still fit
            check_request_tags({DIGEST_TAG[0]: DIGEST_TAG[1]}, key_settings)
        except InputError as e:
            raise ConfigError(f"{where}: verify_payload: {e}") from None
    return (msgspec.structs.replace(s, host=host, port=port, chunk_tokens=chunk, world_size=world_size,
                                    worker_id=worker_id, verify_payload=verify_payload), key_settings)


def _force_store_wait(s: LMCacheSettings, where: str) -> tuple[bool, list[str]]:
    """LMCache's extra_config as vLLM passes it (`lmcache.extra_config`): its force_store_wait, the
    one key of it kvtool honours, and the names of the others (LMCache's own, without effect
    here). Given both ways, force_store_wait must agree."""
    inner = dict(s.extra_config or {})
    wait = inner.pop("force_store_wait", None)
    others = sorted(str(k)[:80] for k in inner)
    if wait is None:
        return s.force_store_wait, others
    if not isinstance(wait, bool):
        raise ConfigError(f"{where}: extra_config.force_store_wait must be true or false")
    if s.force_store_wait and not wait:
        raise ConfigError(f"{where}: force_store_wait is given twice, as true and in extra_config as false")
    return wait, others


def _rank_of(s: LMCacheSettings, tp: TPRank | None, where: str) -> tuple[int, int]:
    """(world_size, worker_id) of the keys: the engine's; an explicit value must agree with it."""
    if tp is None:
        world_size = s.world_size if s.world_size is not None else 1
        worker_id = s.worker_id if s.worker_id is not None else 0
        if worker_id >= world_size:
            raise ConfigError(f"{where}: worker_id {worker_id} must be below world_size {world_size}")
        return world_size, worker_id
    if s.world_size is not None and s.world_size != tp.size:
        raise ConfigError(
            f"{where}: world_size {s.world_size} disagrees with the engine's tensor-parallel size {tp.size}; "
            "leave world_size unset: it is taken from the engine, as LMCache takes it from vLLM"
        )
    if s.worker_id is not None and s.worker_id != tp.rank:
        raise ConfigError(
            f"{where}: worker_id {s.worker_id} disagrees with the engine's tensor-parallel rank {tp.rank} "
            f"(of {tp.size}); leave worker_id unset: each rank keys its own KV shard"
        )
    return tp.size, tp.rank
