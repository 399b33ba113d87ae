"""Runs in the peer environment: vLLM 0.33's own prefix-hit search over KV cache groups, for
tests/engine/kv/test_kv_cache_groups.py to compare with kvtool's (`core.kv_blocks`).

Reads one JSON object on stdin: {"block_size": bs, "cases": [{"windows": [window or null per
group], "num_blocks": n, "num_hashes": h, "cached": [[block index cached, per group]],
"max_length": blocks}]}. For each case it builds vLLM's coordinator (`get_kv_cache_coordinator`)
over one group per window, puts each listed block into its pool's prefix cache under vLLM's
hash-and-group key, and asks `find_longest_cache_hit`. Prints one JSON list: per case, the hit
length in blocks and each group's table as block indices (-1: the null block).
"""

import inspect
import json
import sys

import torch
from vllm.v1.core.kv_cache_coordinator import get_kv_cache_coordinator
from vllm.v1.core.kv_cache_utils import BlockHash, make_block_hash_with_group_id
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec


def main() -> None:
    doc = json.loads(sys.stdin.read())
    bs = doc["block_size"]
    out = []
    for case in doc["cases"]:
        common = dict(block_size=bs, num_kv_heads=1, head_size=8, dtype=torch.float32)
        groups = [KVCacheGroupSpec([f"layer{i}"], FullAttentionSpec(**common) if w is None
                                   else SlidingWindowSpec(sliding_window=w, **common))
                  for i, w in enumerate(case["windows"])]
        config = KVCacheConfig(num_blocks=case["num_blocks"], kv_cache_tensors=[], kv_cache_groups=groups)
        args = dict(kv_cache_config=config, max_model_len=1 << 16, max_in_flight_tokens=1 << 16, use_eagle=False,
                    enable_caching=True, enable_kv_cache_events=False, dcp_world_size=1, pcp_world_size=1,
                    scheduler_block_size=bs, hash_block_size=bs)
        params = inspect.signature(get_kv_cache_coordinator).parameters
        coordinator = get_kv_cache_coordinator(**{k: v for k, v in args.items() if k in params})
        pool = coordinator.block_pool
        hashes = [BlockHash(bytes([i + 1]) * 32) for i in range(case["num_hashes"])]
        index_of = {}
        for g, cached in enumerate(case["cached"]):
            for i in cached:
                block = pool.free_block_queue.popleft()
                key = make_block_hash_with_group_id(hashes[i], g)
                block.set_block_hash(key)
                pool.cached_block_hash_to_block.insert(key, block)
                index_of[block.block_id] = i
        tables, length = coordinator.find_longest_cache_hit(hashes, case["max_length"] * bs)[:2]
        out.append({"length": length // bs,
                    "tables": [[-1 if b.is_null else index_of[b.block_id] for b in t] for t in tables]})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
