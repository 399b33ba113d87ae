"""LMCache's own keys in kv_connector_extra_config, as LMCache's vLLM adapter takes them.

vLLM hands kv_connector_extra_config to LMCache's adapter, which sets every `lmcache.<field>` on
its LMCacheEngineConfig and logs a warning for a field its configuration does not have, then
runs on; it also reads `discard_partial_chunks`, `skip_last_n_tokens` and
`lmcache.max_tokens_per_load` itself. So a config written for vLLM + LMCache runs unchanged
here too (`split_lmcache_keys`):

- the keys kvtool honours pass through, under LMCache's spelling or kvtool's (settings.py);
- LMCache keys with a kvtool equivalent are translated to it: `lmcache.save_decode_cache`
  (offload_prompt_only, inverted), `lmcache.lookup_timeout_ms` (lookup_timeout_s),
  `lmcache.blocking_timeout_secs` (timeout_s), `discard_partial_chunks` (save_unfull_chunk off);
- a key whose value would change the bytes on the wire is refused unless it has the value
  kvtool writes (`lmcache.remote_serde`: only "naive"; a store shared with peers must not mix
  serialisations);
- every other field of LMCache's configuration (its local CPU and disk tiers, layerwise
  transfers, blending, P/D, the controller, ...) and the adapter's other keys are accepted with
  a notice that they do nothing in kvtool, `lmcache.mp.*` (LMCache's multi-process connector's)
  likewise, and an `lmcache.` key that is no field at all with LMCache's own warning (and the
  close spelling, if any).

Keys without the `lmcache.` prefix that are none of these stay kvtool's own and are checked by
settings.py, an unknown one refused.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Mapping

from kvtool.engine.errors import ConfigError

PREFIX = "lmcache."

# The fields of LMCache 0.5.6's LMCacheEngineConfig (lmcache/v1/config.py, _CONFIG_DEFINITIONS);
# tests/engine/connectors/lmcache/test_lmcache_config_keys.py checks them against the peer's.
LMCACHE_CONFIG_FIELDS: tuple[str, ...] = (
    "chunk_size", "local_cpu", "max_local_cpu_size", "local_cpu_use_hugepages", "reserve_local_cpu_size",
    "local_disk", "local_disk_path_sharding", "max_local_disk_size", "remote_url", "remote_serde", "use_layerwise",
    "save_decode_cache", "pre_caching_hash_algorithm", "enable_blending", "blend_recompute_ratios",
    "blend_thresholds", "blend_check_layers", "blend_min_tokens", "blend_special_str", "retrieve_locations",
    "store_location", "enable_p2p", "p2p_host", "p2p_init_ports", "p2p_lookup_ports", "mp_host", "mp_port",
    "enable_controller", "lmcache_instance_id", "controller_pull_url", "controller_reply_url",
    "lmcache_worker_ports", "lmcache_worker_ids", "lmcache_worker_heartbeat_delay_time",
    "lmcache_worker_heartbeat_time", "enable_pd", "pd_role", "pd_buffer_size", "pd_buffer_device", "pd_peer_host",
    "pd_peer_init_port", "pd_peer_alloc_port", "pd_peer_query_port", "pd_proxy_host", "pd_proxy_port",
    "pd_allocation_timeout_sec", "pd_shutdown_timeout_sec", "pd_condition_poll_interval_sec", "pd_max_prefill_len",
    "pd_backend_mode", "pd_skip_proxy_notification", "pd_bidirectional", "transfer_channel", "nixl_backends",
    "nixl_buffer_size", "nixl_buffer_device", "gds_path", "gds_path_sharding", "gds_buffer_size", "maru_path",
    "maru_pool_size", "use_gds", "gds_backend", "audit_actual_remote_url", "internal_api_server_host",
    "extra_config", "save_unfull_chunk", "blocking_timeout_secs", "external_lookup_client", "py_enable_gc",
    "cache_policy", "numa_mode", "enable_async_loading", "internal_api_server_enabled",
    "internal_api_server_port_start", "priority_limit", "internal_api_server_include_index_list",
    "internal_api_server_socket_path_prefix", "runtime_plugin_locations", "storage_plugins",
    "remote_storage_plugins", "lookup_timeout_ms", "min_retrieve_tokens", "hit_miss_ratio",
    "lookup_server_worker_ids", "enable_scheduler_bypass_lookup", "script_allowed_imports", "run_script_api_enabled",
    "enable_lazy_memory_allocator", "lazy_memory_initial_ratio", "lazy_memory_expand_trigger_ratio",
    "lazy_memory_step_ratio", "lazy_memory_safe_size", "enable_chunk_statistics",
    "chunk_statistics_auto_start_statistics", "chunk_statistics_auto_exit_timeout_hours",
    "chunk_statistics_auto_exit_target_unique_chunks", "chunk_statistics_strategy", "enable_kv_events",
    "use_gpu_connector_v3", "pin_timeout_sec", "pin_check_interval_sec", "remote_config_url", "app_id",
    "enable_hidden_state_cache", "max_hidden_state_cpu_size", "hidden_state_layers", "hidden_states_retrieve_mode",
)

# Keys LMCache's vLLM adapter reads from kv_connector_extra_config besides its config's fields.
ADAPTER_KEYS: tuple[str, ...] = ("discard_partial_chunks", "skip_last_n_tokens", "lmcache.max_tokens_per_load")

# The LMCache fields kvtool honours under LMCache's spelling (settings.py declares them as aliases).
HONOURED: tuple[str, ...] = ("chunk_size", "max_local_cpu_size", "remote_url", "pre_caching_hash_algorithm",
                             "save_unfull_chunk", "extra_config")

# Fields whose value decides the bytes on the wire: only the value kvtool writes is accepted.
WIRE_VALUES: dict[str, str] = {"remote_serde": "naive"}


def split_lmcache_keys(extra: Mapping[str, object], where: str) -> tuple[dict[str, object], list[str]]:
    """(the extra config kvtool's settings parse, notices): LMCache keys translated to kvtool's,
    those without effect taken out, each with one notice line. Raises ConfigError (one line) for
    a wire value kvtool does not write, a translated key of the wrong type, or a translated key
    that disagrees with kvtool's own spelling given beside it."""
    out: dict[str, object] = {}
    notices: list[str] = []
    translated: dict[str, tuple[str, object]] = {}
    for key, value in extra.items():
        field = key[len(PREFIX):] if key.startswith(PREFIX) else None
        if key in ADAPTER_KEYS:
            if key == "discard_partial_chunks":
                if not isinstance(value, bool):
                    raise ConfigError(f"{where}: discard_partial_chunks must be true or false")
                if value:
                    translated[key] = ("save_unfull_chunk", False)
                continue
            notices.append(f"{key} is read by LMCache's vLLM adapter and has no effect in kvtool")
            continue
        if field is None or field in HONOURED:
            out[key] = value
            continue
        if field in WIRE_VALUES:
            if value != WIRE_VALUES[field]:
                raise ConfigError(f"{where}: {key} {str(value)[:40]!r} is not supported: kvtool reads and writes "
                                  f"LMCache's {WIRE_VALUES[field]!r} serialisation only")
            continue
        if field == "save_decode_cache":
            translated[key] = ("offload_prompt_only", not _bool(key, value, where))
        elif field == "lookup_timeout_ms":
            translated[key] = ("lookup_timeout_s", _positive(key, value, where) / 1000.0)
        elif field == "blocking_timeout_secs":
            translated[key] = ("timeout_s", _positive(key, value, where))
        elif field in LMCACHE_CONFIG_FIELDS:
            notices.append(f"{key} is LMCache's own setting and has no effect in kvtool")
        elif field.startswith("mp."):
            notices.append(f"{key} is a key of LMCache's multi-process connector and has no effect here")
        else:
            close = difflib.get_close_matches(field, LMCACHE_CONFIG_FIELDS, n=1, cutoff=0.75)
            hint = f" (did you mean {PREFIX}{close[0]}?)" if close else ""
            notices.append(f"{key} is not a key of LMCache's configuration{hint}; ignored, as LMCache ignores it")
    for key, (name, value) in translated.items():
        if name == "save_unfull_chunk":
            # LMCache discards a partial chunk when either says so, whatever the other says.
            out.pop(PREFIX + name, None)
        elif name in out and out[name] != value:
            raise ConfigError(f"{where}: {key} and {name} disagree ({name} would be {value!r} by {key})")
        out[name] = value
    return out, notices


def _bool(key: str, value: object, where: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{where}: {key} must be true or false")
    return value


def _positive(key: str, value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{where}: {key} must be a number > 0")
    return float(value)
