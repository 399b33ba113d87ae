"""Reading Hugging Face model directories: config, tokenizer, weight files, and their digests.

A directory holds:

    config.json                     architecture and sizes (classic or transformers-5 form, both read)
    generation_config.json          bos/eos as generation uses them (optional)
    tokenizer.json, tokenizer_config.json, chat_template.jinja    (see tokenizer.py)
    model.safetensors                        one file, or
    model.safetensors.index.json + shards    sharded weights (weight_map: tensor name -> file)

`open_model_dir` reads everything but the weights; `models.build_model` loads those. Weights may
be absent: a directory written with --config-only serves --load-format dummy.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3
import msgspec

from kvtool.engine.errors import ModelError
from kvtool.engine.kv.dtypes import canonical_dtype
from kvtool.engine.models.quantization import WeightQuantization, parse_quantization
from kvtool.engine.models.rope import parse_rope
from kvtool.engine.models.tokenizer import Tokenizer

SUPPORTED_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM",
                           "Phi3ForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
_ARCHITECTURE_BY_MODEL_TYPE = {"gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM", "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM",
                               "phi3": "Phi3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                               "qwen3_moe": "Qwen3MoeForCausalLM"}
# Models with recurrent layers (Mamba, Gated DeltaNet, short convolutions, linear attention), whose
# per-sequence state is not a sequence of KV blocks: nothing of it can be paged, prefix-cached or
# offloaded by block. Also recognised by their config's layer_types.
RECURRENT_ARCHITECTURES = (
    "BambaForCausalLM", "FalconH1ForCausalLM", "FalconMambaForCausalLM", "GraniteMoeHybridForCausalLM",
    "JambaForCausalLM", "KimiLinearForCausalLM", "Lfm2ForCausalLM", "Lfm2MoeForCausalLM", "Mamba2ForCausalLM",
    "MambaForCausalLM", "MiniMaxText01ForCausalLM", "NemotronHForCausalLM", "Plamo2ForCausalLM",
    "Qwen3NextForCausalLM", "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration", "RecurrentGemmaForCausalLM", "RwkvForCausalLM", "Zamba2ForCausalLM",
)
_RECURRENT_LAYER_TYPES = ("linear_attention", "mamba", "mamba2", "conv", "recurrent", "gated_deltanet")
# max_position_embeddings when config.json leaves it out: the transformers config class's default.
_DEFAULT_MAX_POSITIONS = {"Qwen3ForCausalLM": 32768, "Qwen2ForCausalLM": 32768, "Qwen3MoeForCausalLM": 32768,
                          "MistralForCausalLM": 4096 * 32, "MixtralForCausalLM": 4096 * 32,
                          "Gemma2ForCausalLM": 8192, "Gemma3ForCausalLM": 131072}
# The RoPE types Phi-3 runs with: its long-context configs (Phi-3-mini-128k, Phi-3.5-mini) name longrope.
_PHI3_ROPE_TYPES = ("default", "longrope")
INDEX_FILE = "model.safetensors.index.json"


class MoeConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The mixture-of-experts MLPs of Mixtral and Qwen3-MoE (see `moe.py`)."""

    num_experts: int
    top_k: int  # experts per token (num_experts_per_tok)
    expert_intermediate_size: int  # each expert's gate/up rows (Mixtral: intermediate_size)
    # Renormalise the top-k routing weights to sum to one: always in Mixtral, Qwen3-MoE's
    # norm_topk_prob otherwise.
    norm_topk_prob: bool
    # The layers with an MoE block; the others have a dense MLP of intermediate_size (Qwen3-MoE's
    # mlp_only_layers and decoder_sparse_step; every layer in Mixtral).
    sparse_layers: list[int]


class GemmaConfig(msgspec.Struct, frozen=True, kw_only=True):
    """What a Gemma 2 or Gemma 3 text config adds to a dense decoder's (transformers' Gemma2Config
    and Gemma3TextConfig)."""

    # Attention scale: query_pre_attn_scalar ** -0.5 (not head_dim ** -0.5).
    query_pre_attn_scalar: float
    # The layers of local (sliding-window) attention, from layer_types or sliding_window_pattern;
    # the others attend globally.
    sliding_layers: list[int]
    # The local layers' RoPE (the global layers' is the config's rope_theta / rope_scaling; Gemma 2
    # rotates both kinds alike).
    local_rope_theta: float
    local_rope_scaling: dict[str, Any] | None
    # logits = tanh(logits / cap) * cap after the LM head; None: none (Gemma 2: 30).
    final_logit_softcapping: float | None = None
    # Attention scores soft-capped the same way before the mask (Gemma 2: 50); None: none.
    attn_logit_softcapping: float | None = None
    # An RMSNorm over each head of q and k before RoPE (Gemma 3).
    qk_norm: bool = True


class ModelConfig(msgspec.Struct, frozen=True, kw_only=True):
    """What kvtool needs from config.json, normalised across the two forms found in the wild.

    Classic form: `rope_theta`, `rope_scaling`, `torch_dtype`. Transformers-5 form:
    `rope_parameters` (theta and scaling in one dict), `dtype`.
    """

    architecture: str  # one of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    # None for plain RoPE; otherwise the normalised scaling dict of `rope.parse_rope`.
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    # Biases on q/k/v, and on o_proj too except in Qwen2 (whose config has no such key: its
    # q/k/v always have biases, its o_proj none).
    attention_bias: bool
    torch_dtype: str  # dtype the weights were saved in: "float32" | "bfloat16" | "float16"
    bos_token_id: int | None
    eos_token_ids: list[int]
    # The attention window (tokens) of every layer: Mistral's and Phi-3's configs carry one; None
    # for full attention. The engine runs such a model only at a --max-model-len the window does
    # not bind at (engine.py); part of the identity.
    sliding_window: int | None = None
    # config.json's quantization_config (FP8 checkpoints: `quantization`); None: unquantised.
    # Part of the identity (`quantization.identity_name`).
    quantization: WeightQuantization | None = None
    # Mixtral and Qwen3-MoE; None for a dense model.
    moe: MoeConfig | None = None
    # Gemma 2 and 3 (their sliding_window covers gemma.sliding_layers only); None for the others.
    gemma: GemmaConfig | None = None


@dataclass(frozen=True, slots=True)
class ModelDir:
    """An opened model directory. Created by `open_model_dir`; read-only afterwards."""

    path: Path
    config: ModelConfig
    tokenizer: Tokenizer
    generation_config: dict[str, Any]  # generation_config.json as read ({} when absent)


def cache_dir() -> Path:
    """The per-user cache: $KVTOOL_CACHE_DIR, else ${XDG_CACHE_HOME:-~/.cache}/kvtool. Not created here."""
    explicit = os.environ.get("KVTOOL_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "kvtool"


def open_model_dir(path: str | os.PathLike[str]) -> ModelDir:
    """Read config.json, generation_config.json and the tokenizer of a directory.

    Weights are not touched (see `weight_files` and `models.build_model`). Raises ModelError with
    a one-line message naming the file for: a missing directory, missing or invalid config.json,
    an unsupported architecture or RoPE type, inconsistent sizes, and tokenizer problems.
    """
    root = Path(path)
    if not root.exists():
        raise ModelError(f"{root}: model directory not found")
    if not root.is_dir():
        raise ModelError(f"{root}: not a directory (--model takes a Hugging Face model directory)")
    raw = _read_json(root / "config.json", required=True)
    gen = _read_json(root / "generation_config.json", required=False)
    config = parse_config(raw, gen, where=root / "config.json")
    tokenizer = Tokenizer.from_dir(root)
    highest_id = max(tokenizer.backend.get_vocab(with_added_tokens=True).values(), default=-1)
    if highest_id >= config.vocab_size:
        raise ModelError(
            f"{root / 'tokenizer.json'}: token id {highest_id} is outside config.json's vocab_size {config.vocab_size}"
        )
    if not config.eos_token_ids and tokenizer.eos_token_id is not None:
        config = msgspec.structs.replace(config, eos_token_ids=[tokenizer.eos_token_id])
    if config.bos_token_id is None and tokenizer.bos_token_id is not None:
        config = msgspec.structs.replace(config, bos_token_id=tokenizer.bos_token_id)
    return ModelDir(path=root, config=config, tokenizer=tokenizer, generation_config=gen)


def parse_config(raw: dict[str, Any], generation: dict[str, Any] | None = None, where: Path | str = "config.json") -> ModelConfig:
    """Normalise a config.json dict (either form) into a ModelConfig. Raises ModelError naming `where`."""
    generation = generation or {}
    archs = raw.get("architectures")
    if isinstance(archs, list) and archs:
        arch = archs[0]
    else:
        arch = _ARCHITECTURE_BY_MODEL_TYPE.get(raw.get("model_type", ""), raw.get("model_type"))
    recurrent = sorted({t for t in raw.get("layer_types") or [] if isinstance(t, str)} & set(_RECURRENT_LAYER_TYPES))
    if arch in RECURRENT_ARCHITECTURES or recurrent:
        layers = f"its {', '.join(recurrent)} layers" if recurrent else "its recurrent layers"
        raise ModelError(
            f"{where}: {arch} is not supported: {layers} keep a per-sequence state that is not block-addressed, so "
            f"it cannot be paged, prefix-cached or offloaded by block"
        )
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelError(
            f"{where}: unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )

    def get(key: str, kind: type | tuple[type, ...], default: Any = ...) -> Any:
        value = raw.get(key, default)
        if value is ...:
            raise ModelError(f"{where}: missing required key {key!r}")
        if value is not None and (not isinstance(value, kind) or isinstance(value, bool) and kind is not bool):
            raise ModelError(f"{where}: {key!r} has the wrong type ({type(value).__name__}: {value!r})")
        return value

    hidden = get("hidden_size", int)
    num_heads = get("num_attention_heads", int)
    num_kv_heads = get("num_key_value_heads", int, None) or num_heads
    # Llama derives head_dim from the hidden size; Qwen3's config class defaults it to 128.
    # (Qwen3-MoE's has no default: hidden_size / num_heads, as Llama's.)
    default_head_dim = {"Qwen3ForCausalLM": 128, "Gemma2ForCausalLM": 256, "Gemma3ForCausalLM": 256}.get(
        arch, hidden // max(num_heads, 1))
    head_dim = get("head_dim", int, None) or default_head_dim
    for key, value in (("hidden_size", hidden), ("num_attention_heads", num_heads),
                       ("num_key_value_heads", num_kv_heads), ("head_dim", head_dim)):
        if value <= 0:
            raise ModelError(f"{where}: {key!r} must be positive, got {value}")
    if num_heads % num_kv_heads:
        raise ModelError(f"{where}: num_attention_heads={num_heads} is not a multiple of num_key_value_heads={num_kv_heads}")
    if head_dim % 2:
        raise ModelError(f"{where}: head_dim={head_dim} must be even for rotary embeddings")
    gemma_arch = arch in ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
    activation = raw.get("hidden_activation") or raw.get("hidden_act") if gemma_arch else get("hidden_act", str, "silu")
    if activation != ("gelu_pytorch_tanh" if gemma_arch else "silu"):
        raise ModelError(f"{where}: unsupported hidden activation {activation!r} for {arch} "
                         f"(only {'gelu_pytorch_tanh' if gemma_arch else 'silu'})")
    if get("mlp_bias", bool, False):
        raise ModelError(f"{where}: mlp_bias=true is not supported")
    # Mistral's and Mixtral's configs apply `sliding_window` when set (null: full attention); Qwen's
    # only with use_sliding_window, which is refused.
    # (An absent key is transformers' default window: 4096 for Mistral, none for Mixtral.)
    mistral_window = None
    if arch == "MistralForCausalLM":
        mistral_window = get("sliding_window", int, 4096)
    elif arch == "MixtralForCausalLM":
        mistral_window = get("sliding_window", int, None)
    qwen_window = get("sliding_window", int, None) if get("use_sliding_window", bool, False) else None
    layer_types = get("layer_types", list, None) or []
    windowed = arch in ("MistralForCausalLM", "MixtralForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM")
    if qwen_window is not None or (not windowed and any(t != "full_attention" for t in layer_types)):
        raise ModelError(f"{where}: sliding-window attention is not supported")
    if mistral_window is not None and mistral_window <= 0:
        raise ModelError(f"{where}: 'sliding_window' must be positive, got {mistral_window}")
    sliding_window = mistral_window
    if arch == "Phi3ForCausalLM":
        # transformers and vLLM apply Phi-3's window to every layer, without use_sliding_window;
        # 0 means none, as vLLM reads it.
        sliding_window = get("sliding_window", int, None) or None
        _refuse_phi3_rope(raw, where)
    gemma = None
    if gemma_arch:
        gemma, sliding_window = _parse_gemma(arch, raw, get, where)
        raw = _gemma_global_rope(arch, raw)

    rope_theta, rope_scaling = parse_rope(raw, where)
    dtype_name = raw.get("dtype", raw.get("torch_dtype")) or "float32"
    dtype = canonical_dtype(dtype_name)
    if dtype is None:
        raise ModelError(f"{where}: unsupported dtype {dtype_name!r}")

    bos = generation.get("bos_token_id", raw.get("bos_token_id"))
    eos = generation.get("eos_token_id")
    if eos is None:
        eos = raw.get("eos_token_id")
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    if not all(isinstance(i, int) for i in eos_ids) or (bos is not None and not isinstance(bos, int)):
        raise ModelError(f"{where}: bos_token_id/eos_token_id must be integers")

    num_layers = get("num_hidden_layers", int)
    return ModelConfig(
        architecture=arch,
        vocab_size=get("vocab_size", int),
        hidden_size=hidden,
        intermediate_size=get("intermediate_size", int),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(get("rms_norm_eps", (int, float), 1e-5 if arch == "Phi3ForCausalLM" else 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=get("max_position_embeddings", int, _DEFAULT_MAX_POSITIONS.get(arch, 2048)),
        tie_word_embeddings=get("tie_word_embeddings", bool, gemma_arch),
        attention_bias=arch == "Qwen2ForCausalLM" or get("attention_bias", bool, False),
        torch_dtype=dtype,
        bos_token_id=bos,
        eos_token_ids=eos_ids,
        sliding_window=sliding_window,
        quantization=parse_quantization(raw.get("quantization_config"), where),
        moe=_parse_moe(arch, get, num_layers, where),
        gemma=gemma,
    )


def _gemma_global_rope(arch: str, raw: dict[str, Any]) -> dict[str, Any]:
    """raw with its global layers' RoPE where `parse_rope` reads it (Gemma 3 in transformers 5
    keeps one rope_parameters dict per layer type; the classic form has it at the top level, and
    Gemma 2 has one RoPE, default theta 10000, as `parse_rope` reads any model's)."""
    if arch == "Gemma2ForCausalLM":
        return raw
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        return {**raw, "rope_parameters": {"rope_theta": 1_000_000.0, **(params["full_attention"] or {})}}
    return {"rope_theta": 1_000_000.0, **raw}


def _parse_gemma(arch: str, raw: dict[str, Any], get: Any, where: Path | str) -> tuple[GemmaConfig, int | None]:
    """Gemma 2's or 3's keys with the defaults of transformers' Gemma2Config / Gemma3TextConfig:
    (GemmaConfig, window)."""
    gemma2 = arch == "Gemma2ForCausalLM"
    if get("use_bidirectional_attention", bool, False):
        raise ModelError(f"{where}: use_bidirectional_attention=true is not supported")
    num_layers = get("num_hidden_layers", int)
    types = get("layer_types", list, None)
    if types is None:
        pattern = 2 if gemma2 else get("sliding_window_pattern", int, 6)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    if len(types) != num_layers or any(t not in ("sliding_attention", "full_attention") for t in types):
        raise ModelError(f"{where}: layer_types must name sliding_attention or full_attention for each of "
                         f"{num_layers} layers")
    window = get("sliding_window", int, 4096)
    if window is not None and window <= 0:
        raise ModelError(f"{where}: 'sliding_window' must be positive, got {window}")
    params = raw.get("rope_parameters")
    if gemma2:
        local_raw = raw
    elif isinstance(params, dict) and "sliding_attention" in params:
        local_raw = {**raw, "rope_parameters": {"rope_theta": 10_000.0, **(params["sliding_attention"] or {})}}
    else:
        local_raw = {"rope_theta": get("rope_local_base_freq", (int, float), 10_000.0)}
    local_theta, local_scaling = parse_rope(local_raw, where)
    final_cap = get("final_logit_softcapping", (int, float), 30.0 if gemma2 else None)
    # transformers' Gemma 3 attention reads no attn_logit_softcapping (its configs carry null).
    attn_cap = get("attn_logit_softcapping", (int, float), 50.0) if gemma2 else None
    gemma = GemmaConfig(query_pre_attn_scalar=float(get("query_pre_attn_scalar", (int, float), 256)),
                        sliding_layers=[i for i, t in enumerate(types) if t == "sliding_attention"] if window else [],
                        local_rope_theta=local_theta, local_rope_scaling=local_scaling,
                        final_logit_softcapping=float(final_cap) if final_cap else None,
                        attn_logit_softcapping=float(attn_cap) if attn_cap else None, qk_norm=not gemma2)
    return gemma, window


def _parse_moe(arch: str, get: Any, num_layers: int, where: Path | str) -> MoeConfig | None:
    """The MoE keys of a Mixtral or Qwen3-MoE config (None for the dense architectures), with
    the defaults of transformers' config classes. Qwen3-MoE's public configs name the expert
    count num_experts; transformers 5 writes num_local_experts for both."""
    if arch not in ("MixtralForCausalLM", "Qwen3MoeForCausalLM"):
        return None
    mixtral = arch == "MixtralForCausalLM"
    num_experts = get("num_local_experts", int, None) or get("num_experts", int, 8 if mixtral else 128)
    top_k = get("num_experts_per_tok", int, 2 if mixtral else 8)
    if mixtral:
        expert_size, norm_topk, sparse = get("intermediate_size", int), True, list(range(num_layers))
    else:
        expert_size, norm_topk = get("moe_intermediate_size", int, 768), get("norm_topk_prob", bool, False)
        step, dense = get("decoder_sparse_step", int, 1), get("mlp_only_layers", list, None) or []
        if step <= 0:
            raise ModelError(f"{where}: 'decoder_sparse_step' must be positive, got {step}")
        sparse = [i for i in range(num_layers) if i not in dense and (i + 1) % step == 0]
    if not 0 < top_k <= num_experts or expert_size <= 0:
        raise ModelError(f"{where}: num_experts_per_tok={top_k} must be in [1, {num_experts}] experts of "
                         f"positive size (got {expert_size})")
    return MoeConfig(num_experts=num_experts, top_k=top_k, expert_intermediate_size=expert_size,
                     norm_topk_prob=norm_topk, sparse_layers=sparse)


def _refuse_phi3_rope(raw: dict[str, Any], where: Path | str) -> None:
    """Phi-3 runs with plain RoPE or longrope, as transformers' Phi-3 does."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        return  # parse_rope refuses it
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in _PHI3_ROPE_TYPES:
        hint = " ('su' is longrope's old name: rename it)" if rope_type == "su" else ""
        raise ModelError(f"{where}: Phi3ForCausalLM with {rope_type!r} RoPE is not supported "
                         f"(supported: {', '.join(_PHI3_ROPE_TYPES)}){hint}")


def _read_json(path: Path, required: bool) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise ModelError(f"{path}: missing (not a Hugging Face model directory?)")
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ModelError(f"{path}: invalid JSON ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise ModelError(f"{path}: expected a JSON object")
    return data


def weight_files(path: Path) -> tuple[list[Path], dict[str, str] | None]:
    """The safetensors files of a directory and, when sharded, the index's tensor -> file map.

    Returns (files sorted by name, weight_map or None). Raises ModelError when there are no weights,
    the index is malformed, or it names a file that does not exist.
    """
    path = Path(path)
    index_path = path / INDEX_FILE
    if index_path.is_file():
        index = _read_json(index_path, required=True)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ModelError(f"{index_path}: 'weight_map' must map tensor names to file names")
        for name, file in weight_map.items():
            if "/" in file or not (path / file).is_file():
                raise ModelError(f"{index_path}: tensor {name!r} is listed in {file!r}, which is missing")
        return sorted((path / f for f in set(weight_map.values())), key=lambda p: p.name), dict(weight_map)
    files = sorted(path.glob("*.safetensors"), key=lambda p: p.name)
    if not files:
        raise ModelError(f"{path}: no *.safetensors weight files (use --load-format dummy for random weights)")
    return files, None


def config_digest(config: ModelConfig) -> str:
    """sha256 hex of the config's canonical JSON (sorted keys): part of every cache identity.

    A dense, unquantised config leaves `moe` and `quantization` out, so its digest is what it was
    before MoE models and FP8 checkpoints were read.
    """
    doc = msgspec.to_builtins(config)
    for optional in ("moe", "quantization", "gemma"):
        if doc[optional] is None:
            del doc[optional]
    return hashlib.sha256(msgspec.json.encode(doc, order="sorted")).hexdigest()


def weights_digest(model_dir: ModelDir, load_format: str = "auto", seed: int = 0) -> str:
    """Identity of the weights an engine will run: "dummy-seed-N" for random weights, else blake3.

    The blake3 digest covers every safetensors file's bytes: one digest per file, then a digest
    over the sorted "name:digest" lines. Per-file digests are remembered in
    <cache>/weights-digests.json, keyed by (path, size, mtime), so each file is read once.
    Raises ModelError when the directory has no weights.
    """
    if load_format == "dummy":
        return f"dummy-seed-{seed}"
    files, _ = weight_files(model_dir.path)
    memo_path = cache_dir() / "weights-digests.json"
    try:
        memo = json.loads(memo_path.read_text(encoding="utf-8"))
        if not isinstance(memo, dict):
            memo = {}
    except (OSError, ValueError):
        memo = {}
    lines = []
    changed = False
    for f in files:
        st = f.stat()
        key = f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}"
        digest = memo.get(key)
        if not isinstance(digest, str):
            h = blake3.blake3(max_threads=blake3.blake3.AUTO)
            h.update_mmap(f)
            digest = memo[key] = h.hexdigest()
            changed = True
        lines.append(f"{f.name}:{digest}\n")
    if changed:
        # Forget files that are gone or rewritten since (test directories, new downloads).
        memo = {k: v for k, v in memo.items() if _is_current_key(k)}
        _write_json_atomic(memo_path, memo)
    return blake3.blake3("".join(lines).encode()).hexdigest()


def _is_current_key(key: str) -> bool:
    path, size, mtime_ns = key.rsplit("|", 2)
    try:
        st = os.stat(path)
    except OSError:
        return False
    return f"{st.st_size}|{st.st_mtime_ns}" == f"{size}|{mtime_ns}"


def make_temp_dir_beside(target: Path) -> Path:
    """An empty directory next to `target`, to be renamed onto it once complete (same filesystem).

    Its mode is a model directory's usual 0755, not mkdtemp's private 0700.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.tmp-"))
    os.chmod(tmp, 0o755)
    return tmp


def _write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    # A lost update only costs a recomputation; a torn file would cost a wrong digest, so rename.
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(data, fh)
        os.replace(tmp, path)
    except OSError:
        # A read-only cache costs a recomputation next time, never a wrong digest.
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
