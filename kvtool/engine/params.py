"""Engine and sampling parameters: msgspec Structs named as vLLM names them."""

from __future__ import annotations

from typing import Literal

import msgspec

from kvtool.engine.connectors.config import KVTransferConfig
from kvtool.engine.errors import ConfigError, InputError
from kvtool.engine.kv_events_config import KVEventsConfig, parse_kv_events_config  # noqa: F401 (re-exported for the commands)


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
    # Schedule step N+1 while the device runs step N (vLLM's --async-scheduling); None: on for CUDA.
    async_scheduling: bool | None = None
    # No CUDA graphs: every decode step runs eagerly (vLLM's --enforce-eager).
    enforce_eager: bool = False
    # "auto": picked from data (device, dtype, head_dim, Triton); "reference": the torch SDPA path.
    attention_backend: Literal["auto", "reference"] = "auto"
    # vLLM's KV cache events (BlockStored / BlockRemoved / AllBlocksCleared over zmq); None: off.
    kv_events_config: KVEventsConfig | None = None

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"--block-size must be a positive power of two, got {self.block_size}")
        if self.num_gpu_blocks is not None and self.num_gpu_blocks <= 0:
            raise ConfigError(f"--num-gpu-blocks must be positive, got {self.num_gpu_blocks}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(
                f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.kv_cache_memory <= 0:
            raise ConfigError(f"--kv-cache-memory must be positive, got {self.kv_cache_memory}")
        if self.max_num_batched_tokens <= 0:
            raise ConfigError("--max-num-batched-tokens must be positive")
        if self.max_num_seqs <= 0:
            raise ConfigError("--max-num-seqs must be positive")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ConfigError("--max-model-len must be positive")


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
