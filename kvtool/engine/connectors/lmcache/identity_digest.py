"""The engine identity that kvtool's own (`blake3`) LMCache keys carry.

A key names its model only by the `--model` string (`model@world@worker@hash@dtype`), so in
the peer modes a chunk written by another checkpoint or config under the same name is a hit.
In `blake3` mode kvtool is the only writer and the key is its own: the chain start folds in
`make_identity_digest` of the writer (keys.py, `make_none_hash_int`), so such a chunk has
another key and is a miss, never a load. The key's format and length do not change.

The digest covers what decides a chunk's bytes, as the disk tier's identity header does:
architecture, config, weights, rope, sliding window, weight and KV quantization, KV dtype, the
whole model's KV geometry (layers, KV heads, head dim), the chunk layout and byte order, and
the tensor- and pipeline-parallel sizes. It leaves out what does not: the model name, world
size and worker id (key fields already), the tensor-parallel rank (the scheduler half keys
every chunk as rank 0 and each rank swaps in its own worker id, so the digest must be the
same on every rank), the block size (a chunk is KV_2LTD whatever the pages' block size), the
engine's prefix-cache hash settings, the engine id and the device. Identical engines get the
same digest in every process and after every restart.

With several KV cache groups (`kv.groups`) each group's chunks are objects of their own: a group's
digest (`make_group_digests`) also covers its index, the number of groups, its layers, its window
and the slots per block, so each group's keys form a chain of their own: another group's chunk,
or a one-group engine's, has another key and is a miss. One group keeps the engine's digest, so
the keys of a one-group engine are what they were before groups.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import blake3
import msgspec

from kvtool.engine.errors import ConfigError

if TYPE_CHECKING:  # base imports torch (kv_pages); this module needs only the identity's fields
    from kvtool.engine.connectors.base import EngineIdentity
    from kvtool.engine.connectors.lmcache.keys import LMCacheKeySettings
    from kvtool.engine.kv.groups import KVCacheLayout

# Bumped if the chunk bytes of an unchanged engine ever change meaning: old keys then miss.
CHUNK_FORMAT = "KV_2LTD/1"


def make_identity_digest(identity: EngineIdentity) -> str:
    """blake3 hex of the identity fields a chunk's bytes depend on (the module docstring lists them).

    Pure; the same for every tensor-parallel rank of one engine.
    """
    g = identity.geometry
    fields = {
        "architecture": identity.architecture,
        "config_digest": identity.config_digest,
        "weights_digest": identity.weights_digest,
        "rope_digest": identity.rope_digest,
        "sliding_window": identity.sliding_window,
        "weight_quantization": identity.weight_quantization,
        "kv_dtype": identity.kv_dtype,
        "kv_quantization": identity.kv_quantization,
        "num_layers": g.num_layers,
        # The model's KV heads, not this rank's shard: ranks differ only in their worker id.
        "num_kv_heads": identity.model_num_kv_heads or g.num_kv_heads,
        "head_dim": g.head_dim,
        "chunk_format": CHUNK_FORMAT,
        "byte_order": sys.byteorder,
        "tp_size": identity.tp_size,
        "pp_size": identity.pp_size,
    }
    return blake3.blake3(msgspec.json.encode(fields, order="sorted")).hexdigest()


def make_group_digests(identity: EngineIdentity, layout: KVCacheLayout) -> list[str]:
    """The identity digest of each KV cache group's keys, in group order (the module docstring
    says what it covers); one group: [make_identity_digest(identity)].

    Pure; the same for every tensor-parallel rank of one engine.
    """
    base = make_identity_digest(identity)
    if layout.num_groups == 1:
        return [base]
    return [
        blake3.blake3(msgspec.json.encode({
            "identity_digest": base,
            "kv_cache_group": g,
            "num_groups": layout.num_groups,
            "layers": list(group.layers),
            "sliding_window": group.sliding_window,
            "num_slots": layout.num_slots,
        }, order="sorted")).hexdigest()
        for g, group in enumerate(layout.groups)
    ]


def make_group_key_settings(key_settings: LMCacheKeySettings, identity: EngineIdentity,
                            layout: KVCacheLayout) -> list[LMCacheKeySettings]:
    """The key settings of each KV cache group's chunks of an engine with this identity and layout,
    in group order: blake3 keys carry the group's own identity digest; the peer modes key as
    LMCache does, for the one group the engine keeps with them (`verify-keys` keys the same way).

    Raises ConfigError for a peer mode with several groups.
    """
    if key_settings.identity_digest is None:
        if layout.num_groups != 1:
            raise ConfigError(f"LMCache hash_algo {key_settings.hash_algo!r} keys one KV cache group, "
                              f"as LMCache in vLLM; this engine has {layout.describe()}")
        return [key_settings]
    return [msgspec.structs.replace(key_settings, identity_digest=d) for d in make_group_digests(identity, layout)]
