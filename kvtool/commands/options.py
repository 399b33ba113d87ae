"""Options shared by the commands, named as vLLM names them, as Annotated aliases.

`with_engine_options` adds the engine flags to a command and hands it one EngineParams.
"""

import functools
import inspect
from pathlib import Path
from typing import Annotated, Optional

import typer

from kvtool.engine.connectors.config import apply_kv_offloading_flags, parse_human_int, parse_kv_transfer_config
from kvtool.engine.errors import ConfigError
from kvtool.engine.params import EngineParams, parse_kv_events_config

ModelOpt = Annotated[
    Optional[str],
    typer.Option("--model", help="Model directory (Hugging Face format). Default: the embedded SmolLM2-135M-Instruct."),
]
KVTransferConfigOpt = Annotated[
    Optional[str],
    typer.Option("--kv-transfer-config", help="vLLM's KVTransferConfig JSON, e.g. '{\"kv_connector\":\"OffloadingConnector\",\"kv_role\":\"kv_both\"}'."),
]
KVEventsConfigOpt = Annotated[
    Optional[str],
    typer.Option("--kv-events-config", help="vLLM's KVEventsConfig JSON, e.g. '{\"enable_kv_cache_events\":true,\"endpoint\":\"tcp://*:5557\"}'."),
]
KVOffloadingSizeOpt = Annotated[
    Optional[float],
    typer.Option("--kv-offloading-size", help="vLLM's shortcut: GiB of KV offload buffer in total over tensor-parallel ranks; with the native backend, an OffloadingConnector of that cpu_bytes_to_use (replacing a --kv-transfer-config connector)."),
]
KVOffloadingBackendOpt = Annotated[
    str,
    typer.Option("--kv-offloading-backend", help="native (OffloadingConnector) or lmcache (LMCacheConnectorV1); only with --kv-offloading-size."),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON document on stdout instead of a table.")]

_ENGINE_OPTIONS: list[tuple[str, object, object]] = [
    ("model", None, ModelOpt),
    ("kv_transfer_config", None, KVTransferConfigOpt),
    ("kv_events_config", None, KVEventsConfigOpt),
    ("kv_offloading_size", None, KVOffloadingSizeOpt),
    ("kv_offloading_backend", "native", KVOffloadingBackendOpt),
    ("load_format", "auto", Annotated[str, typer.Option("--load-format", help="auto (safetensors) or dummy (random weights from config.json).")]),
    ("device", "auto", Annotated[str, typer.Option("--device", help="auto, cpu or cuda.")]),
    ("dtype", "auto", Annotated[str, typer.Option("--dtype", help="auto (float32 on CPU, bfloat16 on CUDA), float32, bfloat16, float16.")]),
    ("kv_cache_dtype", "auto", Annotated[str, typer.Option("--kv-cache-dtype", help="The KV cache's dtype, vLLM's flag: auto (the model's dtype) or that dtype by name, or fp8 (= fp8_e4m3) / fp8_e5m2 with the checkpoint's k/v scales (1.0 where it has none).")]),
    ("calculate_kv_scales", False, Annotated[bool, typer.Option("--calculate-kv-scales", help="fp8 KV cache: each layer's K/V scales from its first K/V (max |x| / 200 for K, / 100 for V), as vLLM's flag; not with a KV connector.")]),
    ("seed", 0, Annotated[int, typer.Option("--seed", help="Seed for dummy weights and unseeded sampling.")]),
    ("max_model_len", None, Annotated[Optional[int], typer.Option("--max-model-len", help="Context length (default: the model's).")]),
    ("block_size", 16, Annotated[int, typer.Option("--block-size", help="Tokens per KV block.")]),
    ("num_gpu_blocks", None, Annotated[Optional[int], typer.Option("--num-gpu-blocks", help="Exact number of KV blocks.")]),
    ("gpu_memory_utilization", 0.9, Annotated[float, typer.Option("--gpu-memory-utilization", help="Fraction of device memory for weights + KV (CUDA).")]),
    ("kv_cache_memory", "2G", Annotated[str, typer.Option("--kv-cache-memory", help="Bytes of KV pages on CPU (vLLM suffixes: 512M = 512 MiB, 2G = 2 GiB, 500m = 500 MB).")]),
    ("enable_prefix_caching", True, Annotated[bool, typer.Option("--enable-prefix-caching/--no-enable-prefix-caching", help="Reuse KV of shared prompt prefixes.")]),
    ("disable_hybrid_kv_cache_manager", None, Annotated[Optional[bool], typer.Option("--disable-hybrid-kv-cache-manager/--no-disable-hybrid-kv-cache-manager", help="KV cache groups, as vLLM's flag: on, one group for every layer of a model with sliding-window and global layers (windows as masks over a cache that keeps every token); off, a group per kind of layer, refused with a KV connector that does not move every group (LMCache's in its peer key modes); unset, groups where it can.")]),
    ("max_num_batched_tokens", 2048, Annotated[int, typer.Option("--max-num-batched-tokens", help="Token budget of one engine step (chunked prefill).")]),
    ("max_num_seqs", 256, Annotated[int, typer.Option("--max-num-seqs", help="Most requests running at once.")]),
    ("enforce_eager", False, Annotated[bool, typer.Option("--enforce-eager", help="No CUDA graphs: run every decode step eagerly.")]),
    ("batch_invariant", True, Annotated[bool, typer.Option("--batch-invariant/--no-batch-invariant", help="CUDA: a request's output does not depend on what it is batched with (default: on; off gains about 9% of decode throughput). The CPU path always is.")]),
    ("tensor_parallel_size", 1, Annotated[int, typer.Option("--tensor-parallel-size", "-tp", help="Ranks (worker processes) to split the model across: NCCL on CUDA, one GPU each; gloo on CPU.")]),
    ("async_scheduling", None, Annotated[Optional[bool], typer.Option("--async-scheduling/--no-async-scheduling", help="Schedule the next step while the device runs this one (default: on for CUDA).")]),
]
ENGINE_OPTION_NAMES = [name for name, _, _ in _ENGINE_OPTIONS]


def build_engine_params(**opts) -> EngineParams:
    """EngineParams from the raw flag values; raises ConfigError / InputError on bad values."""
    from kvtool.engine.errors import ConfigError

    for name, choices in (
        ("load_format", ("auto", "dummy")),
        ("device", ("auto", "cpu", "cuda")),
        ("dtype", ("auto", "float32", "bfloat16", "float16")),
    ):
        if opts[name] not in choices:
            flag = "--" + name.replace("_", "-")
            raise ConfigError(f"{flag} must be one of {', '.join(choices)}, got {opts[name]!r}")
    model = opts["model"]
    if model is not None and not Path(model).exists():
        from kvtool.engine.errors import ModelError

        raise ModelError(f"model directory not found: {model}")
    return EngineParams(
        model=model,
        load_format=opts["load_format"],
        device=opts["device"],
        dtype=opts["dtype"],
        kv_cache_dtype=opts["kv_cache_dtype"],
        calculate_kv_scales=opts["calculate_kv_scales"],
        seed=opts["seed"],
        max_model_len=opts["max_model_len"],
        block_size=opts["block_size"],
        num_gpu_blocks=opts["num_gpu_blocks"],
        gpu_memory_utilization=opts["gpu_memory_utilization"],
        kv_cache_memory=_size_flag("--kv-cache-memory", opts["kv_cache_memory"]),
        enable_prefix_caching=opts["enable_prefix_caching"],
        disable_hybrid_kv_cache_manager=opts["disable_hybrid_kv_cache_manager"],
        max_num_batched_tokens=opts["max_num_batched_tokens"],
        max_num_seqs=opts["max_num_seqs"],
        kv_transfer_config=_kv_transfer_config(opts),
        async_scheduling=opts["async_scheduling"],
        enforce_eager=opts["enforce_eager"],
        batch_invariant=opts["batch_invariant"],
        tensor_parallel_size=opts["tensor_parallel_size"],
        kv_events_config=parse_kv_events_config(opts["kv_events_config"]),
    )


def with_engine_options(fn):
    """Give a command every engine flag; it receives them as one `engine: EngineParams` argument."""
    sig = inspect.signature(fn, eval_str=True)
    own = [p for p in sig.parameters.values() if p.name != "engine"]
    takes_model_tag = "model_tag" in sig.parameters
    added = [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)
        for name, default, annotation in _ENGINE_OPTIONS
    ]

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        opts = {name: kwargs.pop(name) for name in ENGINE_OPTION_NAMES}
        # `serve MODEL` (vLLM's positional model) and --model name the same thing.
        positional = kwargs.pop("model_tag", None)
        if positional is not None:
            from kvtool.engine.errors import ConfigError

            if opts["model"] is not None and opts["model"] != positional:
                raise ConfigError(f"the model is given twice: {positional!r} and --model {opts['model']!r}")
            opts["model"] = positional
        kwargs["engine"] = build_engine_params(**opts)
        if takes_model_tag:
            kwargs["model_tag"] = positional
        return fn(*args, **kwargs)

    wrapper.__signature__ = sig.replace(parameters=own + added)
    del wrapper.__wrapped__  # typer must read the new signature, not the wrapped one
    return wrapper


def _kv_transfer_config(opts: dict):
    """--kv-transfer-config with vLLM's --kv-offloading-size / --kv-offloading-backend applied."""
    config, notice = apply_kv_offloading_flags(parse_kv_transfer_config(opts["kv_transfer_config"]),
                                               opts["kv_offloading_size"], opts["kv_offloading_backend"])
    if notice is not None:
        from kvtool.commands.render import warn

        warn(notice)
    return config


def _size_flag(flag: str, text: str) -> int:
    """A size flag's value (sizes.py rules); ConfigError naming the flag."""
    try:
        return parse_human_int(text)
    except ConfigError as e:
        raise ConfigError(f"{flag}: {e}") from None
