"""What an engine is: its device, dtype and KV cache dtype from the settings, and the identity stored KV is stamped with.

One derivation for every caller: the engine, `inspect --model` and the connectors' tests.
"""

from __future__ import annotations

import hashlib
import json

import torch

from kvtool.engine.connectors.base import EngineIdentity
from kvtool.engine.core.hashing import resolve_none_hash_seed
from kvtool.engine.errors import ConfigError
from kvtool.engine.kv.dtypes import FP8_KV_DTYPES
from kvtool.engine.kv.groups import KVCacheLayout
from kvtool.engine.kv.pages import DTYPE_NAMES, DTYPES, KVGeometry
from kvtool.engine.kv.scales import KVScales, read_kv_scales
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


def resolve_kv_dtype(kv_cache_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """The KV pages' dtype for vLLM's --kv-cache-dtype: the model's (`auto` or its own name), or
    an fp8 one (`fp8` and `fp8_e4m3`: e4m3, as on CUDA; `fp8_e5m2`). Raises ConfigError, one
    line, for the rest."""
    model = DTYPE_NAMES[dtype]
    if kv_cache_dtype in ("auto", model):
        return dtype
    if kv_cache_dtype in FP8_KV_DTYPES:
        return DTYPES[FP8_KV_DTYPES[kv_cache_dtype]]
    if kv_cache_dtype in ("bfloat16", "float16", "float32"):
        why = "the KV cache is kept in the model's dtype or in fp8"
    else:
        why = "only fp8, fp8_e4m3 and fp8_e5m2 caches are supported (no int8, Intel Gaudi or MLA caches)"
    raise ConfigError(f"--kv-cache-dtype {kv_cache_dtype}: {why} (this engine's: auto, {model}, fp8, fp8_e4m3 "
                      f"or fp8_e5m2)")


def kv_cache_scales(params: EngineParams, model_dir, kv_dtype: torch.dtype) -> KVScales | None:
    """An fp8 cache's scales: the checkpoint's (1.0 where it has none, and for dummy weights;
    the starting values when --calculate-kv-scales replaces them); None for a cache in the
    model's dtype."""
    from kvtool.engine.models.model_dir import weight_files

    if DTYPE_NAMES[kv_dtype] not in FP8_KV_DTYPES.values():
        return None
    num_layers = model_dir.config.num_layers
    if params.load_format == "dummy" or params.calculate_kv_scales:
        return KVScales.ones(num_layers)
    return read_kv_scales(weight_files(model_dir.path)[0], num_layers)


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
    kv_torch_dtype = resolve_kv_dtype(params.kv_cache_dtype, dtype)
    kv_dtype = DTYPE_NAMES[kv_torch_dtype]
    scales = kv_cache_scales(params, model_dir, kv_torch_dtype)
    return EngineIdentity(
        model_name=params.model if params.model is not None else DEFAULT_MODEL_NAME,
        architecture=cfg.architecture,
        config_digest=config_digest(cfg),
        weights_digest=weights_digest(model_dir, params.load_format, params.seed),
        rope_digest=_rope_digest(cfg, params.max_model_len or cfg.max_position_embeddings),
        sliding_window=cfg.sliding_window or 0,
        weight_quantization=identity_name(cfg.quantization),  # an FP8 checkpoint's method and scheme
        kv_dtype=kv_dtype,
        kv_quantization="none" if scales is None else scales.describe(),
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


def layout_for_model(model_path, params: EngineParams) -> KVCacheLayout:
    """The KV cache groups an engine with these params would run."""
    from kvtool.engine.kv.cache_size import kv_cache_layout
    from kvtool.engine.models.model_dir import open_model_dir

    config = open_model_dir(model_path).config
    return kv_cache_layout(params, config, params.max_model_len or config.max_position_embeddings)


def identity_for_model(model_path, params: EngineParams) -> EngineIdentity:
    """The identity an engine with these params would have, without loading weights into a model."""
    from kvtool.engine.models.model_dir import open_model_dir

    model_dir = open_model_dir(model_path)
    device = resolve_device(params.device)
    return engine_identity(params, model_dir, resolve_dtype(params.dtype, device), device.type)
