"""What an engine is: its device and dtype from the settings, and the identity stored KV is stamped with.

One derivation for every caller: the engine, `inspect --model` and the connectors' tests.
"""

from __future__ import annotations

import hashlib
import json

import torch

from kvtool.engine.connectors.base import EngineIdentity
from kvtool.engine.core.hashing import resolve_none_hash_seed
from kvtool.engine.errors import ConfigError
from kvtool.engine.kv.pages import DTYPE_NAMES, DTYPES, KVGeometry
from kvtool.engine.params import EngineParams
from kvtool.engine.presets.default_model import DEFAULT_MODEL_NAME


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda was asked for but no CUDA device is available")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def _rope_digest(config, max_model_len: int) -> str:
    doc = {"rope_theta": config.rope_theta, "rope_scaling": config.rope_scaling}
    scaling = config.rope_scaling or {}
    if scaling.get("rope_type") == "longrope":  # its factors follow the engine's length (models/rope.py)
        doc["longrope_long"] = max_model_len > scaling["original_max_position_embeddings"]
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()[:16]


def engine_identity(params: EngineParams, model_dir, dtype: torch.dtype, device_type: str) -> EngineIdentity:
    """The identity stored KV is stamped with and checked against: the one derivation of it."""
    from kvtool.engine.models.model_dir import config_digest, weights_digest
    from kvtool.engine.models.quantization import identity_name

    cfg = model_dir.config
    kv_dtype = DTYPE_NAMES[dtype]
    return EngineIdentity(
        model_name=params.model if params.model is not None else DEFAULT_MODEL_NAME,
        architecture=cfg.architecture,
        config_digest=config_digest(cfg),
        weights_digest=weights_digest(model_dir, params.load_format, params.seed),
        rope_digest=_rope_digest(cfg, params.max_model_len or cfg.max_position_embeddings),
        sliding_window=cfg.sliding_window or 0,
        weight_quantization=identity_name(cfg.quantization),  # an FP8 checkpoint's method and scheme
        kv_dtype=kv_dtype,
        kv_quantization="none",
        geometry=KVGeometry(
            num_layers=cfg.num_layers,
            num_kv_heads=cfg.num_kv_heads,
            head_dim=cfg.head_dim,
            block_size=params.block_size,
            dtype=kv_dtype,
        ),
        block_hash_algo="sha256_cbor",
        none_hash_seed=resolve_none_hash_seed(),
        engine_id=params.kv_transfer_config.engine_id if params.kv_transfer_config else "",
        device_type=device_type,
        model_num_kv_heads=cfg.num_kv_heads,
    )


def identity_for_model(model_path, params: EngineParams) -> EngineIdentity:
    """The identity an engine with these params would have, without loading weights into a model."""
    from kvtool.engine.models.model_dir import open_model_dir

    model_dir = open_model_dir(model_path)
    device = resolve_device(params.device)
    return engine_identity(params, model_dir, resolve_dtype(params.dtype, device), device.type)
