"""Building a model from a directory: pick the class from config.architecture, then load the
safetensors weights (one file or sharded) straight onto the device, or make dummy weights there.

Every safetensors header is checked against the model before a byte of tensor data is read: a
truncated or corrupt file, an unexpected or duplicate tensor, a shape mismatch and a missing tensor
are each refused with a one-line ModelError naming the file and the tensor.

A checkpoint may store several of the model's projections as one tensor (Phi-3's qkv_proj,
gate_up_proj: `CausalLM.packed_modules`); each part's rows are read into its own parameter.

An FP8 checkpoint (config.quantization) stores linear weights as float8_e4m3fn with a scale
tensor each. On a GPU with FP8 tensor cores (one rank, bf16/fp16) the projections that compute
in FP8 (`fp8_linear.fp8_projections`) keep the weight and scale as stored; every other FP8 weight
is dequantised as it is read (`quantization.dequantize`), before its parts or its rank's slice
are taken, so the model holds dense weights in its dtype.

A tensor-parallel rank (`tp` of size > 1) builds its Megatron shard (`parallel`): it checks the
headers against the FULL shapes as every rank does, then reads only its slice of each sharded
tensor (safetensors' get_slice; of each part of a stored one), and its dummy weights are the slices of exactly the tensors
one rank would make with the same seed, so a sharded dummy model computes what the whole one does.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from kvtool.engine.errors import ConfigError, ModelError
from kvtool.engine.kv.scales import is_attention_scale
from kvtool.engine.models.fp8_linear import Fp8Linear, fp8_projections
from kvtool.engine.models.gemma import Gemma2ForCausalLM, Gemma3ForCausalLM
from kvtool.engine.models.layers import CausalLM, RotaryEmbedding
from kvtool.engine.models.llama import LlamaForCausalLM
from kvtool.engine.models.mistral import MistralForCausalLM
from kvtool.engine.models.mixtral import MixtralForCausalLM
from kvtool.engine.models.model_dir import ModelConfig, ModelDir, weight_files
from kvtool.engine.models.parallel import RankHeads, rank_heads, shard_slices
from kvtool.engine.models.qwen2 import Qwen2ForCausalLM
from kvtool.engine.models.phi3 import Phi3ForCausalLM
from kvtool.engine.models.quantization import FP8_DTYPE, dequantize, match_scales, scale_owner
from kvtool.engine.models.qwen3 import Qwen3ForCausalLM
from kvtool.engine.models.qwen3_moe import Qwen3MoeForCausalLM
from kvtool.engine.models.shard_layout import TPRank, check_tp_fits

__all__ = [
    "CausalLM", "MODEL_CLASSES", "RankHeads", "build_model", "checkpoint_layout", "checkpoint_shapes",
    "iter_checkpoint_tensors", "iter_dummy_tensors", "parameter_shapes", "rank_heads", "read_safetensors_header",
    "shard_slices",
]

MODEL_CLASSES: dict[str, type[CausalLM]] = {
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}

_SAFETENSORS_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1}
_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
# Buffers some older checkpoints carry; we recompute them. (A tied model's saved lm_head copy is
# skipped in _load_safetensors.)
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def build_model(
    source: ModelDir | ModelConfig,
    device: torch.device | str,
    dtype: torch.dtype,
    load_format: str = "auto",
    seed: int = 0,
    tp: TPRank = TPRank(),
    max_model_len: int | None = None,
) -> CausalLM:
    """Create the model for `source` on `device` in `dtype`, in eval mode without gradients.

    load_format "auto" reads the directory's safetensors (a ModelDir is required); "dummy" fills
    every parameter with random values made on `device` from a generator seeded with `seed`, so
    the same seed on the same device gives the same model. The model runs its modules' own
    forwards until `fast_paths.apply_fast_paths` chooses its fast ones. Raises ModelError for an
    unsupported architecture or any weight-file problem (one line naming the file and tensor).

    With `tp` of size > 1 it builds rank tp.rank's shard; the default process group of
    torch.distributed must be initialised with tp.size ranks (ConfigError otherwise, or when
    the model's heads do not split into tp.size ranks).

    RoPE is computed for sequences of up to `max_model_len` tokens (None: max_position_embeddings);
    only longrope's frequencies depend on it (`rope`). A sliding window as long as that or longer
    never binds: the attention blocks then attend without one.
    """
    config = source.config if isinstance(source, ModelDir) else source
    device = torch.device(device)
    cls = _model_class(config)
    if tp.size > 1:
        _check_tp_group(config, tp)
    slices = shard_slices(config, tp)
    with torch.device("meta"):
        model = cls(config, tp)
    fp8 = fp8_projections(model, config, device, dtype, tp)
    _materialize(model, device, dtype, max_model_len)
    longest = max_model_len or config.max_position_embeddings
    if config.sliding_window is not None and config.sliding_window >= longest:
        for module in model.modules():
            if getattr(module, "sliding_window", None) is not None:
                module.sliding_window = None
    model.eval()
    params = dict(model.named_parameters())
    with torch.no_grad():
        if load_format == "dummy":
            for name, value in iter_dummy_tensors(config, device, seed):
                if name in slices:
                    dim, start, count = slices[name]
                    value = value.narrow(dim, start, count)
                if name in fp8:
                    fp8[name].load_dense(value)
                else:
                    params[name].copy_(value)
        elif load_format == "auto":
            if not isinstance(source, ModelDir):
                raise ModelError("--load-format auto needs a model directory with safetensors weights")
            _load_safetensors(source.path, config, params, device, slices, fp8)
        else:
            raise ModelError(f"unknown load format {load_format!r} (auto or dummy)")
    return model


def _check_tp_group(config: ModelConfig, tp: TPRank) -> None:
    check_tp_fits(config.num_heads, config.num_kv_heads, tp.size)
    import torch.distributed as dist

    if not dist.is_initialized():
        raise ConfigError(f"tensor-parallel rank {tp.rank} of {tp.size}: torch.distributed is not initialised")
    if (dist.get_world_size(), dist.get_rank()) != (tp.size, tp.rank):
        raise ConfigError(
            f"tensor-parallel rank {tp.rank} of {tp.size} built in process group rank "
            f"{dist.get_rank()} of {dist.get_world_size()}"
        )


def _materialize(model: CausalLM, device: torch.device, dtype: torch.dtype, max_model_len: int | None) -> None:
    # Allocate each meta parameter directly (uninitialised; it is filled right after). Unlike
    # Module.to_empty this runs no meta-tensor op, which would import torch's compiler stack.
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            empty = torch.empty(param.shape, dtype=FP8_DTYPE if param.dtype == FP8_DTYPE else dtype, device=device)
            setattr(module, name, torch.nn.Parameter(empty, requires_grad=False))
        if isinstance(module, RotaryEmbedding):
            module.reset_inv_freq(device, max_model_len)


def _model_class(config: ModelConfig) -> type[CausalLM]:
    cls = MODEL_CLASSES.get(config.architecture)
    if cls is None:
        raise ModelError(
            f"unsupported architecture {config.architecture!r} (supported: {', '.join(MODEL_CLASSES)})"
        )
    return cls


def parameter_shapes(config: ModelConfig, tp: TPRank = TPRank()) -> dict[str, tuple[int, ...]]:
    """HF weight name -> shape of every parameter the model for `config` has, in module order;
    with `tp`, of rank tp.rank's shard (built on the meta device: no memory, no process group)."""
    cls = _model_class(config)
    with torch.device("meta"):
        model = cls(config, tp)
    return {name: tuple(p.shape) for name, p in model.named_parameters()}


def checkpoint_layout(config: ModelConfig) -> list[tuple[str, list[str]]]:
    """(stored name, the parameters it holds by rows) of every tensor a checkpoint of the model
    for `config` stores, in module order; a packed tensor (`CausalLM.packed_modules`) stands where
    its first part does, every other parameter is stored alone under its own name."""
    packed = {parts[0]: (stored, parts) for stored, parts in _model_class(config).packed_modules.items()}
    layout = []
    in_packed: set[str] = set()
    for name in parameter_shapes(config):
        if name in in_packed:
            continue
        module, _, attr = name.rpartition(".")
        parent, _, leaf = module.rpartition(".")
        if leaf in packed:
            stored, parts = packed[leaf]
            names = [f"{parent}.{part}.{attr}" for part in parts]
            in_packed.update(names)
            layout.append((f"{parent}.{stored}.{attr}", names))
        else:
            layout.append((name, [name]))
    return layout


def checkpoint_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Stored name -> shape of every tensor a checkpoint of the model for `config` stores, in
    `checkpoint_layout` order."""
    shapes = parameter_shapes(config)
    return {stored: (sum(shapes[p][0] for p in parts), *shapes[parts[0]][1:]) for stored, parts in checkpoint_layout(config)}


def iter_checkpoint_tensors(config: ModelConfig, device: torch.device | str, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """`iter_dummy_tensors` as a checkpoint stores them: (stored name, tensor) in `checkpoint_layout`
    order, packed parts concatenated. What a random model directory is written from."""
    values = iter_dummy_tensors(config, device, seed)
    ready: dict[str, torch.Tensor] = {}
    for stored, parts in checkpoint_layout(config):
        while not all(p in ready for p in parts):
            name, value = next(values)
            ready[name] = value
        yield stored, torch.cat([ready.pop(p) for p in parts]) if len(parts) > 1 else ready.pop(parts[0])


def iter_dummy_tensors(config: ModelConfig, device: torch.device | str, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, float32 tensor) for every parameter, drawn in module order from one seeded generator.

    Scales are chosen so a random model behaves like a trained one numerically: matrices
    ~ N(0, 1/fan_in) (logits and attention scores of order one, so RoPE and masking errors show
    in the outputs), norm weights ~ 1 + N(0, 0.1^2) (a mis-loaded norm shows too), biases ~ N(0, 0.1^2).
    """
    device = torch.device(device)
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, shape in parameter_shapes(config).items():
        values = torch.randn(shape, generator=generator, device=device, dtype=torch.float32)
        if name.endswith("norm.weight"):
            # Gemma's norms scale by (1 + weight): the same spread around one.
            values = 0.1 * values if config.gemma is not None else 1.0 + 0.1 * values
        elif name.endswith(".bias"):
            values = 0.1 * values
        else:
            values = values / math.sqrt(shape[-1])
        yield name, values


def read_safetensors_header(path: Path) -> dict[str, dict[str, Any]]:
    """Tensor name -> {dtype, shape, data_offsets} of one safetensors file, checked against its size.

    Reads only the header. Raises ModelError naming the file (and the tensor) when the file is
    truncated, its header is not valid JSON, or a tensor's byte range does not fit its shape.
    """
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            prefix = fh.read(8)
            if len(prefix) < 8:
                raise ModelError(f"{path}: truncated safetensors file ({size} bytes, no header)")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > size - 8:
                raise ModelError(
                    f"{path}: truncated safetensors file (header of {header_len} bytes, file of {size} bytes)"
                )
            raw = fh.read(header_len)
    except OSError as e:
        raise ModelError(f"{path}: cannot be read ({e.strerror})") from None
    try:
        header = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise ModelError(f"{path}: corrupt safetensors header (not valid JSON)") from None
    if not isinstance(header, dict):
        raise ModelError(f"{path}: corrupt safetensors header (not a JSON object)")
    header.pop("__metadata__", None)
    data_bytes = size - 8 - header_len
    for name, info in header.items():
        try:
            dtype, shape, (start, end) = info["dtype"], info["shape"], info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ModelError(f"{path}: corrupt safetensors header entry for tensor {name!r}") from None
        if end > data_bytes:
            raise ModelError(
                f"{path}: truncated safetensors file: tensor {name!r} needs bytes {start}..{end} "
                f"of the data but only {data_bytes} are present"
            )
        itemsize = _SAFETENSORS_ITEMSIZE.get(dtype)
        if itemsize is not None and end - start != math.prod(shape) * itemsize:
            raise ModelError(f"{path}: corrupt safetensors header: tensor {name!r} has {end - start} bytes for shape {shape}")
    return header


def _load_safetensors(
    root: Path,
    config: ModelConfig,
    params: dict[str, torch.nn.Parameter],
    device: torch.device,
    slices: dict[str, tuple[int, int, int]],
    fp8: dict[str, Fp8Linear],
) -> None:
    files, weight_map = weight_files(root)
    full_shapes = parameter_shapes(config) if slices else {n: tuple(p.shape) for n, p in params.items()}
    # Stored name -> the parameters it holds by rows, for tensors that hold several.
    packed = {stored: parts for stored, parts in checkpoint_layout(config) if len(parts) > 1}
    # Check every header against the model before reading tensor data.
    found: dict[str, Path] = {}  # parameter name -> the file holding it
    headers: dict[Path, dict[str, dict[str, Any]]] = {}
    for path in files:
        headers[path] = read_safetensors_header(path)
    fp8_scales = match_scales(config.quantization, headers)  # FP8 weight -> (file, its scale)
    for path, header in headers.items():
        for name, info in header.items():
            if config.quantization is not None and scale_owner(name) is not None:
                continue  # checked by match_scales, read with its weight
            if is_attention_scale(name):
                continue  # an attention scale (kv/scales.py): an fp8 cache reads the K/V ones
            parts = packed.get(name, [name])
            if parts[0] not in params:
                if name.endswith(_IGNORED_SUFFIXES) or (name == "lm_head.weight" and config.tie_word_embeddings):
                    continue
                raise ModelError(f"{path}: unexpected tensor {name!r} (not a parameter of {config.architecture})")
            for part in parts:
                if part in found:
                    also = "" if part == name else f" holds {part!r}, which"
                    raise ModelError(f"{path}: tensor {name!r}{also} is also in {found[part].name}")
            if info["dtype"] not in _FLOAT_DTYPES and name not in fp8_scales:
                raise ModelError(f"{path}: tensor {name!r} has dtype {info['dtype']}, expected a float type")
            expected = [sum(full_shapes[p][0] for p in parts), *full_shapes[parts[0]][1:]]
            if list(info["shape"]) != expected:
                raise ModelError(
                    f"{path}: tensor {name!r} has shape {list(info['shape'])}, config.json implies {expected}"
                )
            if weight_map is not None and weight_map.get(name) not in (None, path.name):
                raise ModelError(f"{path}: tensor {name!r} is here but the index places it in {weight_map[name]}")
            found.update((part, path) for part in parts)
    missing = [name for name in params if name not in found]
    if missing:
        where = ", ".join(p.name for p in files)
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        stored = next((s for s, parts in packed.items() if missing[0] in parts), missing[0])
        raise ModelError(f"{root}: tensor {stored!r}{more} is missing from the weights ({where})")

    # Read each file straight onto the device; copy_ converts to the model's dtype.
    open_device = f"cuda:{device.index or 0}" if device.type == "cuda" else device.type
    scales = _read_scales(fp8_scales, open_device)
    for path, header in headers.items():
        try:
            with safe_open(str(path), framework="pt", device=open_device) as f:
                for name in header:
                    if name in packed:
                        if found.get(packed[name][0]) == path:
                            _read_parts(_stored(f, name, scales, config), packed[name], params, full_shapes, slices)
                        continue
                    if found.get(name) != path:
                        continue
                    if name in fp8:  # kept in FP8 as stored (a dense one quantised)
                        if name in scales:
                            fp8[name].load(f.get_tensor(name), scales[name])
                        else:
                            fp8[name].load_dense(f.get_tensor(name).to(torch.float32))
                    elif name in slices:
                        params[name].copy_(_read_slice(_stored(f, name, scales, config), *slices[name]))
                    elif name in scales:
                        params[name].copy_(_stored(f, name, scales, config))
                    else:
                        params[name].copy_(f.get_tensor(name))
        except ModelError:
            raise
        except Exception as e:  # safetensors raises its own error types for unreadable data
            raise ModelError(f"{path}: cannot be read as safetensors ({str(e).splitlines()[0]})") from None


def _read_scales(fp8_scales: dict[str, tuple[Path, str]], open_device: str) -> dict[str, torch.Tensor]:
    """FP8 weight name -> its scale tensor, read before the weights (a scale may sit in another shard)."""
    scales = {}
    for weight, (path, name) in fp8_scales.items():
        try:
            with safe_open(str(path), framework="pt", device=open_device) as f:
                scales[weight] = f.get_tensor(name)
        except Exception as e:  # safetensors raises its own error types for unreadable data
            raise ModelError(f"{path}: cannot be read as safetensors ({str(e).splitlines()[0]})") from None
    return scales


def _stored(f: Any, name: str, scales: dict[str, torch.Tensor], config: ModelConfig) -> Any:
    """The stored tensor `name`, sliceable by rows and columns: safetensors' lazy slice, or for an
    FP8 weight the whole tensor dequantised (float32)."""
    if name in scales:
        return dequantize(f.get_tensor(name), scales[name], config.quantization)
    return f.get_slice(name)


def _read_parts(stored: Any, parts: list[str], params: dict[str, torch.nn.Parameter],
                full_shapes: dict[str, tuple[int, ...]], slices: dict[str, tuple[int, int, int]]) -> None:
    """Each part's rows of a stored tensor (`_stored`) into its parameter: all of them, or where
    the part is sharded (column-parallel, by rows) the rank's rows of that part only."""
    at = 0
    for part in parts:
        _, start, count = slices.get(part, (0, 0, full_shapes[part][0]))
        params[part].copy_(stored[at + start : at + start + count])
        at += full_shapes[part][0]


def _read_slice(stored: Any, dim: int, start: int, count: int) -> torch.Tensor:
    """Rows (dim 0) or columns (dim 1) [start, start + count) of a stored tensor (`_stored`);
    of a lazy slice, reading only those."""
    return stored[start : start + count] if dim == 0 else stored[:, start : start + count]
