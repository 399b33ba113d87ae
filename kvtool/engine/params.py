"""Engine and sampling parameters: msgspec Structs named as vLLM names them."""

from __future__ import annotations

from typing import Literal

import msgspec

from kvtool.engine.connectors.config import KVTransferConfig
from kvtool.engine.errors import ConfigError, InputError
from kvtool.engine.sizes import MAX_SIZE_BYTES, check_fits_memory

MAX_BLOCK_SIZE = 1024
MAX_SEED = 2**64 - 1
MAX_NUM_BLOCKS = 2**31 - 1
MAX_TOKENS = 2**24  # context lengths and per-step token budgets
MAX_NUM_SEQS = 2**16
# The --model string names the model in disk-tier headers and LMCache keys: a path at most.
MAX_MODEL_CHARS = 4096


class EngineParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Everything that shapes an engine. Flag names match vLLM's (`--block-size` -> block_size)."""

    # The --model string as given (it also names the model in LMCache keys); None = embedded default.
    model: str | None = None
    # "auto" reads safetensors; "dummy" builds random weights from config.json alone.
    load_format: Literal["auto", "dummy"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # auto: float32 on CPU, bfloat16 on CUDA. The KV pages use the model dtype.
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
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
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    kv_transfer_config: KVTransferConfig | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.block_size <= MAX_BLOCK_SIZE or self.block_size & (self.block_size - 1):
            raise ConfigError(
                f"--block-size must be a power of two between 1 and {MAX_BLOCK_SIZE}, got {self.block_size}"
            )
        _check_range("--seed", self.seed, 0, MAX_SEED)
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
        if self.max_model_len is not None:
            _check_range("--max-model-len", self.max_model_len, 1, MAX_TOKENS)
        if self.model is not None and not 1 <= len(self.model) <= MAX_MODEL_CHARS:
            raise ConfigError(f"--model must be 1 to {MAX_MODEL_CHARS} characters, got {len(self.model)}")


def _check_range(flag: str, value: int, low: int, high: int) -> None:
    if not low <= value <= high:
        shown = str(value) if len(str(value)) <= 40 else f"a {len(str(value))}-digit number"
        raise ConfigError(f"{flag} must be between {low} and {high}, got {shown}")


class SamplingParams(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Per-request sampling, as vLLM's SamplingParams (the subset kvtool supports)."""

    max_tokens: int = 16
    # 0 means greedy (argmax).
    temperature: float = 1.0
    top_p: float = 1.0
    # 0 or -1 disables top-k.
    top_k: int = 0
    # Same seed, same output; None draws from the engine's generator.
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    # Number of top logprobs to return per output token (None: no logprobs).
    logprobs: int | None = None

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise InputError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise InputError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InputError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise InputError(f"top_k must be -1, 0 or positive, got {self.top_k}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise InputError(f"logprobs must be between 0 and 20, got {self.logprobs}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0
