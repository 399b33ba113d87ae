"""The disk-tier identity the unit tests write and compare headers with."""

from __future__ import annotations

import msgspec

from kvtool.engine.connectors.offloading.disk.tier_identity import KVIdentity, make_identity
from kvtool.engine.kv.pages import KVGeometry

GEOMETRY = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="bfloat16")


def make_test_identity(**overrides: object) -> KVIdentity:
    """A fixed identity over GEOMETRY; `overrides` replace any of its fields afterwards."""
    identity = make_identity(
        model_name="Qwen/Qwen3-0.6B",
        config_digest="cfg-a",
        weights_digest="weights-a",
        architecture="Qwen3ForCausalLM",
        geometry=GEOMETRY,
        offload_block_tokens=8,
        none_hash_seed="vllm-none-hash",
        rope_digest="rope-a",
        engine_id="engine-a",
    )
    return msgspec.structs.replace(identity, **overrides) if overrides else identity
