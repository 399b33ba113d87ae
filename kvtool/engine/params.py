"""Engine and sampling parameters: msgspec Structs named as vLLM names them."""

from __future__ import annotations

import math
from typing import Literal

import msgspec

from kvtool.engine.connectors.config import KVTransferConfig
from kvtool.engine.errors import ConfigError, InputError
from kvtool.engine.events.config import KVEventsConfig, parse_kv_events_config  # noqa: F401 (re-exported for the commands)
from kvtool.engine.config.sizes import MAX_SIZE_BYTES, check_fits_memory

MAX_BLOCK_SIZE = 1024
MAX_SEED = 2**64 - 1
MAX_NUM_BLOCKS = 2**31 - 1
MAX_TOKENS = 2**24  # context lengths and per-step token budgets
MAX_NUM_SEQS = 2**16
MAX_TENSOR_PARALLEL_SIZE = 1024
# The --model string names the model in disk-tier headers and LMCache keys: a path at most.
MAX_MODEL_CHARS = 4096


# vLLM's --kv-cache-dtype values (its CacheDType) and "float16"/"float32", which name a model dtype.
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla",
                   "int8")


class EngineParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Everything that shapes an engine. Flag names match vLLM's (`--block-size` -> block_size)."""

    # The --model string as given (it also names the model in LMCache keys); None = embedded default.
    model: str | None = None
    # "auto" reads safetensors; "dummy" builds random weights from config.json alone.
    load_format: Literal["auto", "dummy"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # auto: float32 on CPU, bfloat16 on CUDA. The KV pages use it too unless kv_cache_dtype says fp8.
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # vLLM's --kv-cache-dtype: "auto" (the model's dtype) or that dtype spelled out, or an fp8
    # cache ("fp8"/"fp8_e4m3": e4m3, "fp8_e5m2") with the checkpoint's per-layer k/v scales (1.0
    # where it has none); the engine refuses the rest (int8, another float dtype) in one line.
    kv_cache_dtype: str = "auto"
    # vLLM's --calculate-kv-scales: an fp8 cache's per-layer scales from the first K/V each layer
    # stores (max |k| / 200, max |v| / 100) instead of the checkpoint's; ignored by other caches.
    calculate_kv_scales: bool = False
    seed: int = 0
    # None: the model's max_position_embeddings.
    max_model_len: int | None = None
    block_size: int = 16
    # Exact number of KV blocks; overrides the memory-based sizing below.
    num_gpu_blocks: int | None = None
    # Fraction of free device memory for weights + KV on CUDA.
    gpu_memory_utilization: float = 0.9
    # Bytes of KV pages on CPU.
    kv_cache_memory: int = 2 << 30
    enable_prefix_caching: bool = True
    # vLLM's --disable-hybrid-kv-cache-manager / --no-disable-hybrid-kv-cache-manager: True, one
    # full-attention KV cache group for every layer (windows as masks); False, a group per kind of
    # layer (`kv.groups`), refused where the engine cannot; None, groups where it can.
    disable_hybrid_kv_cache_manager: bool | None = None
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    kv_transfer_config: KVTransferConfig | None = None
    # Schedule step N+1 while the device runs step N (vLLM's --async-scheduling); None: on for CUDA.
    async_scheduling: bool | None = None
    # No CUDA graphs: every decode step runs eagerly (vLLM's --enforce-eager).
    enforce_eager: bool = False
    # CUDA: a request's tokens and logprobs do not depend on what it is batched with (row-invariant
    # GEMMs and fixed-tile decode attention in every step). On by default; its cost in offline
    # throughput is in BENCHMARKS.md. False keeps cuBLAS, the GEMV and batch-sized decode
    # splits. The CPU path is batch-invariant always.
    batch_invariant: bool = True
    # "auto": picked from data (device, dtype, head_dim, Triton); "reference": the torch SDPA path.
    attention_backend: Literal["auto", "reference"] = "auto"
    # vLLM's KV cache events (BlockStored / BlockRemoved / AllBlocksCleared over zmq); None: off.
    kv_events_config: KVEventsConfig | None = None
    # Worker processes, one rank each, that split the model Megatron-style (vLLM's -tp); 1: in-process.
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.block_size <= MAX_BLOCK_SIZE or self.block_size & (self.block_size - 1):
            raise ConfigError(
                f"--block-size must be a power of two between 1 and {MAX_BLOCK_SIZE}, got {self.block_size}"
            )
        _check_range("--seed", self.seed, 0, MAX_SEED)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)} (vLLM's names), "
                              f"got {self.kv_cache_dtype!r}")
        if self.num_gpu_blocks is not None:
            _check_range("--num-gpu-blocks", self.num_gpu_blocks, 1, MAX_NUM_BLOCKS)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(
                f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        _check_range("--kv-cache-memory", self.kv_cache_memory, 1, MAX_SIZE_BYTES)
        # Only the CPU engine allocates these bytes; on CUDA the KV cache is sized from free memory.
        if self.device != "cuda":
            check_fits_memory("--kv-cache-memory", self.kv_cache_memory)
        _check_range("--max-num-batched-tokens", self.max_num_batched_tokens, 1, MAX_TOKENS)
        _check_range("--max-num-seqs", self.max_num_seqs, 1, MAX_NUM_SEQS)
        _check_range("--tensor-parallel-size", self.tensor_parallel_size, 1, MAX_TENSOR_PARALLEL_SIZE)
        if self.max_model_len is not None:
            _check_range("--max-model-len", self.max_model_len, 1, MAX_TOKENS)
        if self.model is not None and not 1 <= len(self.model) <= MAX_MODEL_CHARS:
            raise ConfigError(f"--model must be 1 to {MAX_MODEL_CHARS} characters, got {len(self.model)}")


def _check_range(flag: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        shown = str(value) if len(str(value)) <= 40 else f"a {len(str(value))}-digit number"
        raise ConfigError(f"{flag} must be between {low} and {high}, got {shown}")


# vLLM raises temperatures in (0, MIN_TEMPERATURE) to it: smaller ones overflow float32 logits.
MIN_TEMPERATURE = 1e-2
MAX_TEMPERATURE = 2.0
MAX_SEED = 2**64 - 1
MAX_LOGIT_BIAS = 100.0
# Bounds that keep one request's host-side work small (vLLM has none this tight; no real request needs more).
MAX_STOP_ENTRIES = 64
MAX_BAD_WORDS = 256
MAX_LOGIT_BIAS_ENTRIES = 4096


class StructuredOutputsParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Constrained decoding, as vLLM's StructuredOutputsParams: exactly one field is set."""

    # A JSON schema (a dict, or its JSON text).
    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    # A Lark grammar (llguidance's dialect).
    grammar: str | None = None
    # Any JSON object (response_format {"type": "json_object"}).
    json_object: bool | None = None

    def __post_init__(self) -> None:
        kinds = [k for k in ("json", "regex", "choice", "grammar", "json_object") if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            raise InputError(
                "structured outputs need exactly one of json, regex, choice, grammar or json_object"
                + (f", got {', '.join(kinds)}" if kinds else "")
            )
        if self.choice is not None and not self.choice:
            raise InputError("a structured-output choice needs at least one string")


class SamplingParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Per-request sampling, as vLLM's SamplingParams (the subset kvtool supports).

    The logits of a step go through, in vLLM's order: the structured-output mask, bad words,
    logit_bias, min_tokens (EOS and stop_token_ids masked), the repetition penalty (prompt and
    output tokens), frequency and presence penalties (output tokens); greedy takes the argmax
    there. Otherwise: temperature, min_p, top_k, top_p, then a seeded draw.
    """

    max_tokens: int = 16
    # 0 means greedy (argmax); (0, 0.01) is raised to 0.01 as vLLM does.
    temperature: float = 1.0
    top_p: float = 1.0
    # 0 or -1 disables top-k.
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # Token id -> bias added to its logit (clamped to [-100, 100] as vLLM does).
    logit_bias: dict[int, float] | None = None
    # EOS and stop_token_ids cannot be sampled before this many output tokens.
    min_tokens: int = 0
    # Token id sequences that are never completed (vLLM's bad_words, tokenized).
    bad_words_token_ids: list[list[int]] = []
    structured_outputs: StructuredOutputsParams | None = None
    # Same seed, same output; None: the engine assigns one from its own generator.
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    # Number of top logprobs to return per output token (None: no logprobs).
    logprobs: int | None = None

    def __post_init__(self) -> None:
        _check_finite(self, ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"))
        if self.max_tokens < 1:
            raise InputError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise InputError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE
        if not 0.0 < self.top_p <= 1.0:
            raise InputError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise InputError(f"top_k must be -1, 0 or positive, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InputError(f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InputError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0.0 < self.repetition_penalty <= 100.0:
            raise InputError(f"repetition_penalty must be in (0, 100], got {self.repetition_penalty}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InputError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        if self.seed is not None and not 0 <= self.seed <= MAX_SEED:
            raise InputError(f"seed must be in [0, 2^64 - 1], got {self.seed}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise InputError(f"logprobs must be between 0 and 20, got {self.logprobs}")
        if len(self.stop) > MAX_STOP_ENTRIES or len(self.stop_token_ids) > MAX_STOP_ENTRIES:
            raise InputError(f"stop and stop_token_ids take at most {MAX_STOP_ENTRIES} entries each")
        if any(t < 0 for t in self.stop_token_ids):
            raise InputError("stop_token_ids must be non-negative token ids")
        if len(self.bad_words_token_ids) > MAX_BAD_WORDS:
            raise InputError(f"bad_words takes at most {MAX_BAD_WORDS} entries")
        if any(not ids or any(t < 0 for t in ids) for ids in self.bad_words_token_ids):
            raise InputError("bad_words must tokenize to non-empty lists of token ids")
        if self.logit_bias:
            if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
                raise InputError(f"logit_bias takes at most {MAX_LOGIT_BIAS_ENTRIES} entries")
            if any(t < 0 for t in self.logit_bias):
                raise InputError("logit_bias keys must be non-negative token ids")
            for v in self.logit_bias.values():
                if not math.isfinite(v):
                    raise InputError(f"logit_bias values must be finite numbers, got {v}")
            self.logit_bias = {t: min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, v)) for t, v in self.logit_bias.items()}

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def samples_from_history(self) -> bool:
        """Whether a sample depends on the output so far (penalties, a grammar, bad words,
        min_tokens): async scheduling then waits for the previous sample before the next step."""
        return bool(self.has_penalties or self.structured_outputs is not None or self.bad_words_token_ids
                    or self.min_tokens)

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def largest_token_id(self) -> int:
        """The largest token id the params name (-1 when none): the engine checks it against the vocabulary."""
        ids = [*self.stop_token_ids, *(self.logit_bias or {}), *(t for w in self.bad_words_token_ids for t in w)]
        return max(ids, default=-1)


def _check_finite(params: SamplingParams, names: tuple[str, ...]) -> None:
    for name in names:
        value = getattr(params, name)
        if not math.isfinite(value):
            raise InputError(f"{name} must be a finite number, got {value}")
