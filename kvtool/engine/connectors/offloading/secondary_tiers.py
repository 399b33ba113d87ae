"""vLLM's `secondary_tiers` (TieringOffloadingSpec), mapped onto kvtool's one disk tier.

vLLM 0.33 builds each entry `{"type": ..., <the tier's own keys>}` with its SecondaryTierFactory
(tiering/factory.py): the built-in types are `fs`, `p2p`, `obj`, `kvcr` and `example`, and an
out-of-tree class comes with `module_path`. kvtool has one store below the CPU tier, its disk
tier, so it takes at most one entry, of type `fs`, which means the same as kvtool's `root_dir`
key: block files under that directory, each behind kvtool's identity header and refused when
it disagrees with the engine. vLLM's fs tier names its files by FileMapper's layout instead, so
the two engines do not read each other's files.

The fs tier's keys (tiering/fs/manager.py) and what kvtool does with them:

  root_dir          required: the disk tier's directory
  enable_kv_events  false by default, as in vLLM: the tier's STORAGE KV events are published
                    only when it is true (and KV events are on)
  locality          "LOCAL" or "REMOTE": carried on those events
  n_read_threads, n_write_threads, backpressure   refused (kvtool reads in the worker half and
                    writes from one background thread; it never drops a store under pressure)

Any other key is refused, as vLLM's fs tier refuses an unexpected keyword.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from kvtool.engine.connectors.extra_keys import ExtraKey, parse_extra
from kvtool.engine.errors import ConfigError

MAX_PATH_CHARS = 4096
VLLM_TIER_TYPES = ("fs", "p2p", "obj", "kvcr", "example")
BACKPRESSURE_REFUSAL = (
    "kvtool's disk tier never drops a store under pressure (a slow disk keeps CPU slots pinned until "
    "written, and stores that find no free slot are skipped)"
)

FS_TIER_KEYS: tuple[ExtraKey, ...] = (
    ExtraKey(name="type", kind="choice", choices=("fs",)),
    ExtraKey(name="root_dir", kind="str", max_len=MAX_PATH_CHARS, doc="the disk tier's directory (required)"),
    ExtraKey(name="enable_kv_events", kind="bool", default=False,
             doc="publish the tier's STORAGE KV events (when KV events are on)"),
    ExtraKey(name="locality", kind="choice", choices=("LOCAL", "REMOTE"), doc="carried on the tier's KV events"),
    ExtraKey(name="n_read_threads", kind="int", refused="kvtool's disk tier is read by the worker half itself"),
    ExtraKey(name="n_write_threads", kind="int", refused="kvtool's disk tier is written by one background thread"),
    ExtraKey(name="backpressure", kind="object", refused=BACKPRESSURE_REFUSAL),
    ExtraKey(name="module_path", kind="str", refused="kvtool loads no out-of-tree tier class"),
)


class FsTier(msgspec.Struct, frozen=True, kw_only=True):
    """The one `fs` secondary tier kvtool honours: its disk tier under `root_dir`."""

    root_dir: str
    enable_kv_events: bool = False
    locality: Literal["LOCAL", "REMOTE"] | None = None


def parse_secondary_tiers(connector: str, tiers: list) -> FsTier | None:
    """The disk tier `secondary_tiers` asks for, or None for an empty list.

    Raises ConfigError (one line naming `secondary_tiers`) for a non-object entry, a missing
    type, a type other than fs (vLLM's other built-in types are named as such), more than one
    entry, a missing root_dir, and any key FS_TIER_KEYS refuses or does not know.
    """
    if not tiers:
        return None
    where = f"{connector} secondary_tiers"
    if len(tiers) > 1:
        raise ConfigError(
            f"invalid {where} config: kvtool has one disk tier below its CPU tier, so it takes at most "
            f"one entry (of type fs), got {len(tiers)}"
        )
    entry = tiers[0]
    if not isinstance(entry, dict):
        raise ConfigError(f"invalid {where} config: each entry must be a JSON object, got {str(entry)[:60]!r}")
    tier_type = entry.get("type")
    if not tier_type:
        raise ConfigError(f"invalid {where} config: an entry needs a type (kvtool implements \"fs\")")
    if tier_type != "fs":
        kind = "vLLM's" if tier_type in VLLM_TIER_TYPES else "an out-of-tree"
        raise ConfigError(
            f"invalid {where} config: {kind} {str(tier_type)[:60]!r} tier is not supported; kvtool implements "
            f"only the fs tier (its disk tier)"
        )
    values = parse_extra(where, FS_TIER_KEYS, entry)
    if values["root_dir"] is None:
        raise ConfigError(f"invalid {where} config: the fs tier needs root_dir")
    return FsTier(root_dir=values["root_dir"], enable_kv_events=values["enable_kv_events"],
                  locality=values["locality"])
