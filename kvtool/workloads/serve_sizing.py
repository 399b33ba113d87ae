"""How big the caches of `kvtool bench serve` are, from the trace: the pressure on the device.

    working set     the trace's distinct prompt tokens, counted by block as a prefix cache sees
                    them: a block (its whole prefix included) is counted once however many
                    prompts share it, a prompt's last partial block by its length
    device cache    --kv-pressure P: working set / P tokens in whole blocks, rounded down, so that
                    the device holds at most a P-th of what the trace reuses and the tiers, not
                    the device cache, serve most of the reuse; at least the blocks the longest
                    request needs (prompt + output), or the run is refused
    CPU tier        --cpu-tier-size: bytes, or `auto` (room for the working set and a quarter
                    more); the CPU tiers of kvtool's cpu and disk arms and vLLM's offload arm
                    all get the same bytes
    disk tier       room for the working set and a quarter more (`fs_capacity_bytes`): each run
                    stores its own blocks (a salt of its own), and those of earlier runs are
                    evicted rather than fill the disk
"""

from __future__ import annotations

import math

import msgspec
import torch

from kvtool.engine.errors import ConfigError

# `--cpu-tier-size auto`: the working set and a quarter more.
AUTO_CPU_TIER_RATIO = 1.25
# The disk tier's capacity, in working sets.
DISK_TIER_RATIO = 1.25


class CacheSizes(msgspec.Struct, kw_only=True):
    block_size: int
    working_set_tokens: int
    num_gpu_blocks: int
    kv_capacity_tokens: int  # num_gpu_blocks * block_size
    kv_pressure: float  # working set / device capacity, as run
    longest_request_tokens: int  # prompt + max_tokens
    kv_bytes_per_token: int  # every layer's K and V, over every rank
    cpu_tier_bytes: int
    cpu_tier_tokens: int
    disk_tier_bytes: int


def working_set_tokens(prompts: list[list[int]], block_size: int) -> int:
    """Distinct prompt tokens of `prompts`, by prefix block (see the module docstring)."""
    seen: set[int] = set()
    total = 0
    for prompt in prompts:
        key = 0
        for start in range(0, len(prompt), block_size):
            block = tuple(prompt[start:start + block_size])
            key = hash((key, block))
            if key not in seen:
                seen.add(key)
                total += len(block)
    return total


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Bytes of KV one token takes over the whole model (every layer's K and V, all heads)."""
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * dtype.itemsize


def size_caches(prompts: list[list[int]], max_tokens: list[int], *, block_size: int, kv_pressure: float | None,
                num_gpu_blocks: int | None, bytes_per_token: int, cpu_tier_bytes: int | None) -> CacheSizes:
    """The device and CPU tier sizes for a trace. `num_gpu_blocks` (the engine flag) wins over
    `kv_pressure`; `cpu_tier_bytes` None means `auto`.

    Raises ConfigError when the device cache would not hold the longest request.
    """
    ws = working_set_tokens(prompts, block_size)
    longest = max(len(p) + k for p, k in zip(prompts, max_tokens))
    needed = -(-longest // block_size)
    if num_gpu_blocks is None:
        if kv_pressure is None or not (kv_pressure >= 1 and math.isfinite(kv_pressure)):
            raise ConfigError(f"--kv-pressure must be a number >= 1, got {kv_pressure}")
        num_gpu_blocks = max(1, math.floor(ws / (kv_pressure * block_size)))
        if num_gpu_blocks < needed:
            raise ConfigError(
                f"--kv-pressure {kv_pressure:g} leaves the device cache {num_gpu_blocks} blocks "
                f"({num_gpu_blocks * block_size} tokens) for a working set of {ws} tokens, but the trace's longest "
                f"request needs {needed} ({longest} tokens with its output); lower --kv-pressure, or use a trace "
                "with more conversations or documents"
            )
    elif num_gpu_blocks < needed:
        raise ConfigError(f"--num-gpu-blocks {num_gpu_blocks} is fewer than the trace's longest request needs "
                          f"({needed} blocks: {longest} tokens with its output)")
    if cpu_tier_bytes is None:
        cpu_tier_bytes = math.ceil(ws * AUTO_CPU_TIER_RATIO) * bytes_per_token
    capacity = num_gpu_blocks * block_size
    return CacheSizes(
        block_size=block_size, working_set_tokens=ws, num_gpu_blocks=num_gpu_blocks, kv_capacity_tokens=capacity,
        kv_pressure=round(ws / capacity, 3), longest_request_tokens=longest, kv_bytes_per_token=bytes_per_token,
        cpu_tier_bytes=cpu_tier_bytes, cpu_tier_tokens=cpu_tier_bytes // bytes_per_token,
        disk_tier_bytes=math.ceil(ws * DISK_TIER_RATIO) * bytes_per_token,
    )
