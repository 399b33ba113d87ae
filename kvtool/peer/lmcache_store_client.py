"""LMCache's own remote connectors for any `remote_url` (run by the PEER interpreter, as a file path).

Like `lmcache_client.py`, but for the URL schemes LMCache resolves itself with
`CreateConnector(url, ...)`: `redis://` (its `RedisConnector`), `redis-cluster://`
(`RedisClusterConnector`), `lm://` and the others. Tests use it to prove that kvtool and LMCache
read each other's chunks in Redis and Redis Cluster.

Usage:
    lmcache_store_client.py put URL KEY SHAPE DTYPE FILE
        Store FILE's bytes under KEY as a KV_2LTD memory object of SHAPE (comma-separated ints)
        and DTYPE (a torch dtype name). Prints {"stored": bool} (checked by LMCache's `exists`);
        exit 0 when stored, 1 when not.
    lmcache_store_client.py get URL KEY OUTFILE
        Fetch KEY. On a hit, writes the payload bytes to OUTFILE and prints
        {"hit": true, "shape": [...], "dtype": "float32", "fmt": "KV_2LTD", "fmt_code": 1,
         "length": n}; on a miss prints {"hit": false}. Exit 0 either way.

Only the JSON line goes to stdout; LMCache's logs go to stderr. Exit 2 on bad usage.
"""

import asyncio
import concurrent.futures
import json
import math
import os
import sys
import threading

USAGE = (
    "usage: lmcache_store_client.py put URL KEY SHAPE DTYPE FILE\n"
    "       lmcache_store_client.py get URL KEY OUTFILE\n"
)


def _fail(message):
    sys.stderr.write(f"lmcache_store_client: {message}\n{USAGE}")
    sys.exit(2)


class _Peer:
    """LMCache's config, CPU backend and the connector for `url`, with an event loop in a thread."""

    def __init__(self, url, kv_dtype, kv_shape, num_bytes):
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache.v1.storage_backend.connector import CreateConnector
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

        cpu_gb = max(0.0625, 2 * num_bytes / 1024**3)
        self.config = LMCacheEngineConfig.from_defaults(
            chunk_size=kv_shape[2], local_cpu=False, max_local_cpu_size=cpu_gb, remote_url=url, remote_serde="naive",
        )
        self.metadata = LMCacheMetadata(
            model_name="kvtool-interop", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
            kv_dtype=kv_dtype, kv_shape=kv_shape,
        )
        self.backend = LocalCPUBackend(self.config, self.metadata, dst_device="cpu")
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.connector = CreateConnector(url, self.loop, self.backend, self.config, self.metadata)

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def close(self):
        # RedisConnector.close() waits, on the loop, for a job executor that needs the loop:
        # it never returns. Give it a moment, then leave it; main() exits with os._exit.
        future = asyncio.run_coroutine_threadsafe(self.connector.close(), self.loop)
        try:
            future.result(timeout=5)
        except concurrent.futures.TimeoutError:
            pass


def _kv_shape(shape):
    """LMCacheMetadata's (num_layers, 2, chunk_size, kv_heads, head_dim) for a KV_2LTD shape."""
    return (shape[1], 2, shape[2], 1, shape[3])


def _put(url, key_str, args):
    import torch
    from lmcache.utils import parse_cache_key
    from lmcache.v1.memory_management import MemoryFormat

    shape_arg, dtype_arg, path = args
    try:
        shape = torch.Size(int(d) for d in shape_arg.split(","))
    except ValueError:
        _fail(f"SHAPE must be comma-separated ints, got {shape_arg!r}")
    if len(shape) != 4:
        _fail("SHAPE must have 4 dims (KV_2LTD)")
    dtype = getattr(torch, dtype_arg, None)
    if not isinstance(dtype, torch.dtype):
        _fail(f"unknown DTYPE {dtype_arg!r}")
    with open(path, "rb") as f:
        payload = f.read()
    need = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if len(payload) != need:
        _fail(f"{path} holds {len(payload)} bytes, SHAPE {tuple(shape)} of {dtype_arg} needs {need}")
    peer = _Peer(url, dtype, _kv_shape(shape), len(payload))
    key = parse_cache_key(key_str)
    memory_obj = peer.backend.allocate(shape, dtype, MemoryFormat.KV_2LTD)
    if memory_obj is None:
        raise RuntimeError("LocalCPUBackend could not allocate the memory object")
    source = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    memory_obj.tensor.view(torch.uint8).reshape(-1).copy_(source)
    peer.run(peer.connector.put(key, memory_obj))
    stored = peer.run(peer.connector.exists(key))
    peer.close()
    return {"stored": bool(stored)}, 0 if stored else 1


def _get(url, key_str, args):
    import torch
    from lmcache.utils import parse_cache_key

    (path,) = args
    # The allocator must hold the largest object we may fetch; RedisConnector allocates the
    # shape its metadata names.
    peer = _Peer(url, torch.float32, (1, 2, 256, 1, 1), 32 * 1024**2)
    key = parse_cache_key(key_str)
    memory_obj = peer.run(peer.connector.get(key))
    if memory_obj is None:
        peer.close()
        return {"hit": False}, 0
    data = bytes(memory_obj.byte_array)
    header = {
        "hit": True,
        "shape": list(memory_obj.get_shape()),
        "dtype": str(memory_obj.get_dtype()).removeprefix("torch."),
        "fmt": memory_obj.get_memory_format().name,
        "fmt_code": int(memory_obj.get_memory_format().value),
        "length": len(data),
    }
    with open(path, "wb") as f:
        f.write(data)
    memory_obj.ref_count_down()
    peer.close()
    return header, 0


def main():
    argv = sys.argv[1:]
    if not argv or argv[0] not in ("put", "get"):
        _fail("expected a sub-command, put or get")
    want = 6 if argv[0] == "put" else 4
    if len(argv) != want:
        _fail(f"{argv[0]} takes {want - 1} arguments, got {len(argv) - 1}")
    command, url, key, rest = argv[0], argv[1], argv[2], argv[3:]
    # Only our JSON may reach stdout: point fd 1 at stderr while LMCache imports and logs.
    answer_fd = os.dup(1)
    os.dup2(2, 1)
    os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
    answer, status = (_put if command == "put" else _get)(url, key, rest)
    sys.stdout.flush()
    with os.fdopen(answer_fd, "w") as out:
        json.dump(answer, out)
        out.write("\n")
    sys.stderr.flush()
    os._exit(status)  # LMCache's connector threads may still be waiting (see _Peer.close)


if __name__ == "__main__":
    main()
