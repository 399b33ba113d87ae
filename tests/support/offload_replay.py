"""Replay a sequence of requests through the OffloadingConnector's real scheduler half, and the
same sequence through vLLM 0.33's own CPU tier manager in the peer environment; and the configs
and prompts the OffloadingConnector's engine tests share.

A request is a list of chunk labels in prefix order ("d3.0", "d3.1", ...), one engine block
per chunk. Each request looks its prefix up, loads the hits, offers the rest for storing, has
every job reported done, and finishes; the replay records per request the number of hits, the
chunks stored and the chunks evicted (in eviction order). Both sides see the same calls in the
same order: lookup, load, store offer, completions, finish.
"""

from __future__ import annotations

import hashlib
import json
import subprocess

from kvtool.engine.connectors.base import ConnectorContext, EngineIdentity
from kvtool.engine.connectors.config import parse_kv_transfer_config
from kvtool.engine.connectors.offloading.connector import OffloadingConnector
from kvtool.engine.connectors.offloading.jobs import OffloadingCompletions
from kvtool.engine.core.messages import KVConnectorOutput, ScheduledRequest, SchedulerOutput
from kvtool.engine.kv.pages import KVGeometry
from kvtool.peer.env import peer_env

BLOCK_SIZE = 4
GEOMETRY = KVGeometry(num_layers=1, num_kv_heads=1, head_dim=4, block_size=BLOCK_SIZE, dtype="float32")


def offloading_config(**extra):
    """A parsed --kv-transfer-config of the OffloadingConnector (kv_both) with `extra` as its keys."""
    return parse_kv_transfer_config(json.dumps({"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                                                "kv_connector_extra_config": extra}))


def prompt(n: int, seed: int = 0) -> list[int]:
    """`n` prompt token ids, different for each seed."""
    return [(i * 31 + seed * 17) % 240 + 5 for i in range(n)]


def block_hash(label: str) -> bytes:
    return hashlib.sha256(label.encode()).digest()


class ChunkRequest:
    """What the scheduler half reads of a request: ids, hashes, token counts, block ids."""

    def __init__(self, request_id: str, labels: list[str]) -> None:
        self.request_id = request_id
        self.block_hashes = [block_hash(label) for label in labels]
        self.num_prompt_tokens = self.num_tokens = len(labels) * BLOCK_SIZE + 1
        self.num_computed_tokens = 0
        self.block_ids = list(range(len(labels) + 1))
        self.group_block_ids = [self.block_ids]
        self.cache_salt = None

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        return [0] * (end - start)


def make_half(**extra):
    """The OffloadingConnector's scheduler half on a toy geometry, with `extra` as its config."""
    config = offloading_config(**extra)
    identity = EngineIdentity(model_name="m", architecture="a", config_digest="c", weights_digest="w",
                              rope_digest="r", sliding_window=0, weight_quantization="none", kv_dtype="float32",
                              kv_quantization="none", geometry=GEOMETRY, block_hash_algo="sha256_cbor",
                              none_hash_seed="s")
    return OffloadingConnector.create_scheduler_half(ConnectorContext(config=config, identity=identity,
                                                                      none_hash=bytes(32)))


def replay_kvtool(half, requests: list[list[str]]) -> list[dict]:
    """Each request through `half`: {"hits", "stored", "evicted"} per request."""
    names = {block_hash(label) + bytes(4): label for labels in requests for label in labels}
    out = []
    for i, labels in enumerate(requests):
        req = ChunkRequest(f"r{i}", labels)
        hit_tokens, _ = half.get_num_new_matched_tokens(req, 0)
        half.update_state_after_alloc(req, req.block_ids, hit_tokens)
        scheduled = ScheduledRequest(request_id=req.request_id, token_ids=[0] * (req.num_tokens - hit_tokens),
                                     start=hit_tokens, new_block_ids=[], sample=True)
        meta = half.build_connector_meta(SchedulerOutput(step_id=i, scheduled=[scheduled]))
        evicted = half.slots.take_evicted()
        done = [job.job_id for job in meta.loads] + [job.job_id for job in meta.stores]
        half.update_connector_output(KVConnectorOutput(step_id=i, completions=OffloadingCompletions(finished_job_ids=done)))
        half.request_finished(req, [])
        out.append({"hits": hit_tokens // BLOCK_SIZE,
                    "stored": [names[job.key] for job in meta.stores if job.copy_from_pages],
                    "evicted": [names[key] for key in evicted]})
    return out


# Run by the peer interpreter: vLLM's CPUOffloadingManager, called as vLLM's scheduler half calls it.
_VLLM_REPLAY = r"""
import hashlib, json, sys
from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

key = lambda label: make_offload_key(hashlib.sha256(label.encode()).digest(), 0)


def replay(spec):
    manager = CPUOffloadingManager(num_chunks=spec["capacity"], cache_policy=spec["policy"],
                                   store_threshold=spec["store_threshold"],
                                   max_tracker_size=spec["max_tracker_size"])
    names = {key(label): label for labels in spec["requests"] for label in labels}
    out = []
    for i, labels in enumerate(spec["requests"]):
        ctx = ReqContext(req_id=f"r{i}")
        keys = [key(label) for label in labels]
        for position, k in enumerate(keys):
            ctx.set_offload_key_position(k, (position + 1) * spec["block_size"])
        manager.on_new_request(ctx)
        hits = 0
        while hits < len(keys) and manager.lookup(keys[hits], ctx) == LookupResult.HIT:
            hits += 1
        if hits:
            manager.prepare_load(keys[:hits], ctx)
        stored, evicted = [], []
        if keys[hits:]:
            result = manager.prepare_store(keys[hits:], ctx)
            if result is not None:
                stored, evicted = list(result.keys_to_store), list(result.evicted_keys)
        if hits:
            manager.complete_load(keys[:hits], ctx)
        if stored:
            manager.complete_store(stored, ctx)
        manager.on_request_finished(ctx)
        out.append({"hits": hits, "stored": [names[k] for k in stored], "evicted": [names[k] for k in evicted]})
    return out


print(json.dumps([replay(spec) for spec in json.load(sys.stdin)]))
"""


def vllm_spec(policy: str, capacity: int, requests: list[list[str]], store_threshold: int = 0,
              max_tracker_size: int = 64_000) -> dict:
    """One replay for `replay_vllm`: vLLM's manager with these settings, over `requests`."""
    return {"policy": policy, "capacity": capacity, "store_threshold": store_threshold,
            "max_tracker_size": max_tracker_size, "block_size": BLOCK_SIZE, "requests": requests}


def replay_vllm(python, specs: list[dict]) -> list[list[dict]]:
    """Each of `specs` (vllm_spec) through vLLM's CPUOffloadingManager, in one run of the peer
    interpreter `python` (importing vLLM takes a while)."""
    proc = subprocess.run([str(python), "-c", _VLLM_REPLAY], input=json.dumps(specs), env=peer_env(),
                          capture_output=True, text=True, timeout=600, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])
