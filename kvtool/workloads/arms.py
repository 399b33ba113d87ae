"""Arms: a name, the KV transfer config an engine runs with, and what serves its reuse pass.

Built-in arms:

    none          no connector and no local prefix cache: every token is computed (the reference)
    prefix-cache  no connector; hits come from the engine's own prefix cache
    cpu           OffloadingConnector, CPU tier only; the local prefix cache is emptied before a
                  reuse pass, so hits come from the CPU tier
    disk          OffloadingConnector with a disk tier (`root_dir`); the engine is rebuilt before
                  a reuse pass, so its CPU tier is empty and hits come from disk
    lmcache       LMCacheConnector on an LMCache server (`lm://HOST:PORT`); the local prefix cache
                  is emptied before a reuse pass, so hits come from the server
    redis         LMCacheConnector on a redis-server started for the run (`redis://`, LMCache's
                  RedisConnector layout); hits come from Redis, as for lmcache
    redis-cluster the same on a three-master Redis Cluster started for the run (`redis-cluster://`)
    redis-sentinel the same on a master and replica watched by a Redis Sentinel started for the run
                  (`redis-sentinel://`)
    hf            Hugging Face transformers on the same weights (`kvtool bench` only)

Any other arm is `NAME=JSON`, a vLLM KVTransferConfig document; it is treated like `cpu`
(prefix cache emptied before a reuse pass, hits counted as tokens loaded by the connector), or
like `disk` when it is an OffloadingConnector with a `root_dir`.
A `NAME=JSON` whose name is a built-in one replaces that arm's config.
"""

from __future__ import annotations

import contextlib
import json
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import msgspec

from kvtool.engine.connectors.config import KVTransferConfig, parse_kv_transfer_config
from kvtool.engine.connectors.registry import resolve_connector
from kvtool.engine.errors import ConfigError

# The arms' redis-servers send replies from a second thread (`--io-threads 2`, the main thread
# and one more). Redis 7 hands writes to its I/O threads only while at least twice their number
# of clients wait for replies, so two threads are what the connector's 4 connections engage.
REDIS_ARM_ARGS: tuple[str, ...] = ("--io-threads", "2")
BUILTIN_ARMS: tuple[str, ...] = ("none", "prefix-cache", "cpu", "disk", "lmcache", "redis", "redis-cluster",
                                  "redis-sentinel", "hf")
# Built-in arms whose store is a Redis started for the run (redis_server.py), by name.
REDIS_ARMS: tuple[str, ...] = ("redis", "redis-cluster", "redis-sentinel")
REFERENCE_ARM = "none"

# What serves an arm's reuse pass, and so which counter proves its hits ("server": a running
# OpenAI-compatible server, whose usage reports cached prompt tokens).
Reuse = Literal["none", "prefix-cache", "connector", "hf", "server"]

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]*")


class Arm(msgspec.Struct, frozen=True, kw_only=True):
    """One arm of a replay or a benchmark."""

    name: str
    # vLLM's KVTransferConfig JSON; None = no connector.
    kv_transfer_config: str | None = None
    # None: the engine option as given; the reference arm forces False.
    enable_prefix_caching: bool | None = None
    reuse: Reuse
    # The arm's KV outlives its engine (a disk tier, a remote store), so a restart keeps it.
    survives_restart: bool = False
    # `kvtool bench ttft`: rebuild the engine before each measured pass.
    rebuild_before_reuse: bool = False

    def parsed_config(self) -> KVTransferConfig | None:
        return parse_kv_transfer_config(self.kv_transfer_config)


def offloading_config(root_dir: str | Path | None = None, policy: str = "fail") -> str:
    extra = {"root_dir": str(root_dir)} if root_dir is not None else {}
    return json.dumps({"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                       "kv_load_failure_policy": policy, "kv_connector_extra_config": extra})


def lmcache_config(url: str, policy: str = "fail") -> str:
    return json.dumps({"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both",
                       "kv_load_failure_policy": policy, "kv_connector_extra_config": {"remote_url": url}})


def with_whole_stores(arm: Arm) -> Arm:
    """An LMCacheConnector arm whose steps wait for staging memory rather than leave chunks
    unstored (`force_store_wait`), where its own config does not say: a measurement that fills a
    store and then counts its hits needs every chunk of the fill in it."""
    if arm.kv_transfer_config is None:
        return arm
    doc = json.loads(arm.kv_transfer_config)
    if doc.get("kv_connector") not in ("LMCacheConnector", "LMCacheConnectorV1"):
        return arm
    extra = doc.setdefault("kv_connector_extra_config", {})
    if "force_store_wait" in extra:
        return arm
    extra["force_store_wait"] = True
    return msgspec.structs.replace(arm, kv_transfer_config=json.dumps(doc))


def make_builtin_arm(name: str, *, disk_root: str | Path | None = None, lmcache_url: str | None = None,
                     store_urls: dict[str, str] | None = None) -> Arm:
    """The built-in arm `name`. `disk` needs `disk_root`, `lmcache` needs `lmcache_url`, the Redis
    arms their URL in `store_urls`."""
    if name == "none":
        return Arm(name=name, enable_prefix_caching=False, reuse="none")
    if name == "prefix-cache":
        return Arm(name=name, enable_prefix_caching=True, reuse="prefix-cache")
    if name == "cpu":
        return Arm(name=name, kv_transfer_config=offloading_config(), reuse="connector")
    if name == "disk":
        if disk_root is None:
            raise ConfigError("the disk arm needs a directory for its tier")
        return Arm(name=name, kv_transfer_config=offloading_config(disk_root), reuse="connector",
                   survives_restart=True, rebuild_before_reuse=True)
    if name == "lmcache":
        if lmcache_url is None:
            raise ConfigError("the lmcache arm needs --lmcache-url lm://HOST:PORT (or the LMCache peer environment)")
        return Arm(name=name, kv_transfer_config=lmcache_config(lmcache_url), reuse="connector", survives_restart=True)
    if name in REDIS_ARMS:
        url = (store_urls or {}).get(name)
        if url is None:
            raise ConfigError(f"the {name} arm needs its store's URL")
        return Arm(name=name, kv_transfer_config=lmcache_config(url), reuse="connector", survives_restart=True)
    if name == "hf":
        return Arm(name=name, reuse="hf")
    raise ConfigError(f"unknown arm {name!r}; built-in arms are {', '.join(BUILTIN_ARMS)}, or give NAME=JSON")


def parse_arm_spec(spec: str) -> Arm:
    """`NAME=JSON` -> an arm running that KVTransferConfig. Raises ConfigError naming the problem."""
    name, sep, doc = spec.partition("=")
    name = name.strip()
    if not sep:
        raise ConfigError(f"arm {spec!r}: write NAME=JSON (a vLLM KVTransferConfig document)")
    if not _NAME.fullmatch(name):
        raise ConfigError(f"arm name {name!r}: use letters, digits and _ . + - only")
    if name in ("none", "hf"):
        raise ConfigError(f"arm {name!r} is built in and takes no config")
    try:
        ktc = parse_kv_transfer_config(doc)
    except ConfigError as e:
        raise ConfigError(f"arm {name!r}: {e}") from None
    if ktc is None or ktc.kv_connector is None:
        return Arm(name=name, kv_transfer_config=None, reuse="prefix-cache", enable_prefix_caching=True)
    outlives = _outlives_engine(ktc)
    # A local tier that outlives the engine (a disk tier) is proven by rebuilding the engine first.
    has_disk_tier = outlives and resolve_connector(ktc).hit_source(ktc, rebuilt=True) == "disk"
    return Arm(name=name, kv_transfer_config=doc, reuse="connector", survives_restart=outlives,
               rebuild_before_reuse=has_disk_tier)


def arm_from_config(name: str, doc: str) -> Arm:
    """An arm for a bare `--kv-transfer-config JSON`."""
    return parse_arm_spec(f"{name}={doc}")


def _outlives_engine(ktc: KVTransferConfig) -> bool:
    return resolve_connector(ktc).outlives_engine(ktc)


def hit_unit_tokens(arm: Arm, block_size: int) -> int:
    """The granularity at which the arm can serve a prefix: whole blocks, chunks or offload blocks
    (the connector's own answer).

    See `served_prefix_tokens` for how many tokens of a prompt that lets it serve.
    """
    ktc = arm.parsed_config()
    if ktc is None or ktc.kv_connector is None:
        return 1 if arm.reuse == "hf" else block_size
    return resolve_connector(ktc).hit_unit_tokens(ktc, block_size)


def served_prefix_tokens(arm: Arm, num_prompt_tokens: int, shared: int, unit: int) -> int:
    """Tokens of a prompt's first `shared` tokens the arm serves from its cache (0 for no reuse).

    A connector loads every whole unit it holds, the prompt's last one too: on a full hit only
    the last token is computed, over a last unit loaded whole. The local prefix cache (vLLM's
    rule) serves only the whole units before the last prompt token.
    """
    if arm.reuse == "connector":
        return min(shared, num_prompt_tokens) // unit * unit
    if arm.reuse in ("prefix-cache", "server"):
        return min(shared, num_prompt_tokens - 1) // unit * unit
    return 0


def hit_source(arm: Arm, rebuilt: bool) -> str | None:
    """Where the reuse pass's hits come from, for reports."""
    if arm.reuse == "none":
        return None
    if arm.reuse in ("prefix-cache", "hf", "server"):
        return arm.reuse
    ktc = arm.parsed_config()
    assert ktc is not None
    return resolve_connector(ktc).hit_source(ktc, rebuilt)


@contextlib.contextmanager
def open_arms(specs: list[str], *, lmcache_url: str | None = None) -> Iterator[list[Arm]]:
    """Arms for `specs` (built-in names or NAME=JSON), with what they need for the block.

    The built-in disk arm gets a temporary directory, removed afterwards; the built-in lmcache
    arm gets `lmcache_url`, or an LMCache server started from the peer environment and stopped
    afterwards (lmcache_server.py); the redis, redis-cluster and redis-sentinel arms get a
    redis-server, a three-master Redis Cluster, or a master, replica and sentinel, started on
    loopback and stopped afterwards (redis_server.py).
    Raises ConfigError for an unknown name or a bad spec.
    """
    from kvtool.workloads.lmcache_server import lmcache_server
    from kvtool.workloads.redis_server import redis_cluster, redis_sentinel, redis_server

    names = [s for s in specs if "=" not in s]
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(lmcache_server(lmcache_url)) if "lmcache" in names else lmcache_url
        disk_root = stack.enter_context(tempfile.TemporaryDirectory(prefix="kvtool-disk-tier-")) if "disk" in names else None
        store_urls = {}
        if "redis" in names:
            store_urls["redis"] = f"redis://127.0.0.1:{stack.enter_context(redis_server(REDIS_ARM_ARGS)).port}"
        if "redis-cluster" in names:
            store_urls["redis-cluster"] = stack.enter_context(redis_cluster(extra=REDIS_ARM_ARGS)).url
        if "redis-sentinel" in names:
            store_urls["redis-sentinel"] = stack.enter_context(redis_sentinel()).url
        yield [parse_arm_spec(s) if "=" in s else
               make_builtin_arm(s, disk_root=disk_root, lmcache_url=url, store_urls=store_urls) for s in specs]
