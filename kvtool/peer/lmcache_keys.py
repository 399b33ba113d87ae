"""LMCache chunk keys computed by LMCache itself (run by the PEER interpreter, as a file path).

Reads one JSON request on stdin and writes one JSON answer on stdout; everything LMCache logs
goes to stderr. The caller fixes `PYTHONHASHSEED` in this process's environment: vLLM reads it
when the token database initialises NONE_HASH, so each seed setting needs its own process.

Request (unknown fields are refused):
    {"sequences": [[int, ...], ...],      token ids, one list per prompt (required)
     "chunk_size": 256,                   LMCache `chunk_size`
     "save_unfull_chunk": false,          LMCache `save_unfull_chunk`
     "hash_algo": "sha256_cbor",          LMCache `pre_caching_hash_algorithm` ("builtin", "sha256", ...)
     "model_name": "Qwen/Qwen3-0.6B",     key fields: model, world size, worker id, KV dtype
     "world_size": 1, "worker_id": 0, "kv_dtype": "bfloat16",
     "without_vllm": false,               imitate a peer with no vLLM installed (NONE_HASH 0)
     "request_configs": null}             optional; `lmcache.tag.*` entries become key tags
Answer:
    {"keys": [[[start, end, key_string], ...] per sequence],
     "none_hash": int,                    the chain start LMCache used (after folding)
     "hash_func": str}                    the function LMCache resolved (e.g. "sha256_cbor", "hash")

Exit status: 0 success, 2 bad request.
"""

import json
import os
import sys

_DEFAULTS = {
    "chunk_size": 256,
    "save_unfull_chunk": False,
    "hash_algo": "sha256_cbor",
    "model_name": "Qwen/Qwen3-0.6B",
    "world_size": 1,
    "worker_id": 0,
    "kv_dtype": "bfloat16",
    "without_vllm": False,
    "request_configs": None,
}


def _fail(message):
    sys.stderr.write(f"lmcache_keys: {message}\n")
    sys.exit(2)


def _read_request():
    try:
        request = json.loads(sys.stdin.read())
    except json.JSONDecodeError as e:
        _fail(f"request is not JSON: {e}")
    if not isinstance(request, dict) or "sequences" not in request:
        _fail('request must be an object with "sequences"')
    unknown = set(request) - set(_DEFAULTS) - {"sequences"}
    if unknown:
        _fail(f"unknown request fields: {sorted(unknown)}")
    seqs = request["sequences"]
    if not isinstance(seqs, list) or not all(
        isinstance(s, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in s) for s in seqs
    ):
        _fail('"sequences" must be a list of lists of ints')
    return {**_DEFAULTS, **request}


def main():
    request = _read_request()
    # Only our JSON may reach stdout: point fd 1 at stderr while LMCache imports and logs.
    answer_fd = os.dup(1)
    os.dup2(2, 1)

    if request["without_vllm"]:
        sys.modules["vllm"] = None  # every `import vllm...` now fails, as on a host without vLLM

    import torch
    from lmcache.v1 import token_database
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.token_database import ChunkedTokenDatabase

    kv_dtype = getattr(torch, request["kv_dtype"], None)
    if not isinstance(kv_dtype, torch.dtype):
        _fail(f"unknown kv_dtype {request['kv_dtype']!r}")
    chunk_size = request["chunk_size"]
    config = LMCacheEngineConfig.from_defaults(
        chunk_size=chunk_size,
        save_unfull_chunk=request["save_unfull_chunk"],
        pre_caching_hash_algorithm=request["hash_algo"],
    )
    metadata = LMCacheMetadata(
        model_name=request["model_name"],
        world_size=request["world_size"],
        local_world_size=request["world_size"],
        worker_id=request["worker_id"],
        local_worker_id=request["worker_id"],
        kv_dtype=kv_dtype,
        kv_shape=(1, 2, chunk_size, 1, 1),  # geometry does not enter the keys
        chunk_size=chunk_size,
    )
    db = ChunkedTokenDatabase(config, metadata)

    keys = []
    for tokens in request["sequences"]:
        chunks = db.process_tokens(tokens=tokens, request_configs=request["request_configs"])
        keys.append([[start, end, key.to_string()] for start, end, key in chunks])
    answer = {
        "keys": keys,
        "none_hash": token_database.NONE_HASH,
        "hash_func": getattr(db.hash_func, "__name__", repr(db.hash_func)),
    }
    sys.stdout.flush()
    with os.fdopen(answer_fd, "w") as out:
        json.dump(answer, out)
        out.write("\n")


if __name__ == "__main__":
    main()
