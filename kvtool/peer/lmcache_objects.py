"""LMCache's own storage objects, as the peer client scripts drive them (PEER interpreter only).

`lmcache_client.py` (lm://) and `lmcache_store_client.py` (any `remote_url`) are run by file
path, so their directory is first on `sys.path` and they import this module by its bare name. It
builds what LMCache builds inside vLLM: an `LMCacheEngineConfig`, a `LocalCPUBackend` that
allocates the memory objects, and `CreateConnector(url, ...)` on an asyncio loop of its own;
then puts (confirmed by `exists` on the same connector: LMCache's put is fire-and-forget) and
gets of KV_2LTD memory objects, and the scripts' one-JSON-line answer on stdout.
"""

import asyncio
import concurrent.futures
import json
import math
import os
import sys
import threading

# How long `close` waits for the connector's own close (RedisConnector's never returns).
CLOSE_TIMEOUT_S = 5.0


class Peer:
    """LMCache's config, CPU backend and the connector for `url`, with an event loop in a thread.

    `num_bytes` sizes the backend's allocator (room for one object with headroom: LMCache's
    default of 5 GB is far more than a chunk); `chunk_size` defaults to `kv_shape[2]`.
    """

    def __init__(self, url, kv_dtype, kv_shape, num_bytes, chunk_size=None):
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache.v1.storage_backend.connector import CreateConnector
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

        cpu_gb = max(0.0625, 2 * num_bytes / 1024**3)
        self.config = LMCacheEngineConfig.from_defaults(
            chunk_size=chunk_size or kv_shape[2], local_cpu=False, max_local_cpu_size=cpu_gb, remote_url=url,
            remote_serde="naive",
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
        """The connector's close, bounded: RedisConnector's waits, on the loop, for a job executor
        that needs the loop and never returns; then it is left to `answer`'s `os._exit`."""
        future = asyncio.run_coroutine_threadsafe(self.connector.close(), self.loop)
        try:
            future.result(timeout=CLOSE_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()

    def put(self, key_str, shape, dtype, payload):
        """Store `payload` under the key as a KV_2LTD object of `shape`; True when `exists` says so."""
        import torch
        from lmcache.utils import parse_cache_key
        from lmcache.v1.memory_management import MemoryFormat

        key = parse_cache_key(key_str)
        memory_obj = self.backend.allocate(shape, dtype, MemoryFormat.KV_2LTD)
        if memory_obj is None:
            raise RuntimeError("LocalCPUBackend could not allocate the memory object")
        # Fill the object through its tensor: `byte_array` is a ctypes view whose "<B" format
        # memoryview refuses slice assignment.
        source = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        memory_obj.tensor.view(torch.uint8).reshape(-1).copy_(source)
        self.run(self.connector.put(key, memory_obj))  # (the wrapper's put releases memory_obj)
        # Same connector, same socket: the EXIST reply proves the fire-and-forget PUT was stored.
        return bool(self.run(self.connector.exists(key)))

    def get(self, key_str, path):
        """Fetch the key; on a hit write its payload to `path`. The answer's header (see USAGE)."""
        from lmcache.utils import parse_cache_key

        memory_obj = self.run(self.connector.get(parse_cache_key(key_str)))
        if memory_obj is None:
            return {"hit": False}
        data = bytes(memory_obj.byte_array)
        fmt = memory_obj.get_memory_format()
        header = {
            "hit": True,
            "shape": list(memory_obj.get_shape()),
            "dtype": str(memory_obj.get_dtype()).removeprefix("torch."),
            "fmt": fmt.name,
            "fmt_code": int(fmt.value),
            "length": len(data),
        }
        with open(path, "wb") as f:
            f.write(data)
        memory_obj.ref_count_down()
        return header


def kv_shape(shape):
    """LMCacheMetadata's (num_layers, 2, chunk_size, kv_heads, head_dim) for a KV_2LTD shape."""
    if len(shape) == 4:
        return (shape[1], 2, shape[2], 1, shape[3])
    return (1, 2, 256, 1, 1)


def parse_shape_dtype(shape_arg, dtype_arg, fail):
    """SHAPE (comma-separated ints, 4 dims) and DTYPE (a torch dtype name), or `fail(message)`."""
    import torch

    try:
        shape = torch.Size(int(d) for d in shape_arg.split(","))
    except ValueError:
        fail(f"SHAPE must be comma-separated ints, got {shape_arg!r}")
    if len(shape) != 4:
        fail("SHAPE must have 4 dims (KV_2LTD)")
    dtype = getattr(torch, dtype_arg, None)
    if not isinstance(dtype, torch.dtype):
        fail(f"unknown DTYPE {dtype_arg!r}")
    return shape, dtype


def read_payload(path, shape, dtype, fail):
    """The bytes of `path`, which must hold exactly a `dtype` tensor of `shape`, or `fail(message)`."""
    import torch

    try:
        with open(path, "rb") as f:
            payload = f.read()
    except OSError as e:
        fail(f"cannot read {path}: {e.strerror}")
    need = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if len(payload) != need:
        fail(f"{path} holds {len(payload)} bytes, SHAPE {tuple(shape)} of {dtype} needs {need}")
    return payload


def answer(run):
    """Call `run()` -> (answer, status) with stdout pointed at stderr (LMCache logs while it imports
    and works), print the answer as one JSON line on the real stdout, and exit with `status`
    (`os._exit`: LMCache's connector threads may still be waiting, see `Peer.close`)."""
    answer_fd = os.dup(1)
    os.dup2(2, 1)
    os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
    reply, status = run()
    sys.stdout.flush()
    with os.fdopen(answer_fd, "w") as out:
        json.dump(reply, out)
        out.write("\n")
    sys.stderr.flush()
    os._exit(status)
