"""LMCache's own lm:// client, driven standalone (run by the PEER interpreter, as a file path).

It builds what LMCache builds inside vLLM: an `LMCacheEngineConfig`, a `LocalCPUBackend` that
allocates the memory objects, and `CreateConnector("lm://HOST:PORT", ...)` (an
`LMCServerConnector` wrapped in `InstrumentedRemoteConnector`) on an asyncio loop of its own,
then makes one put or get with it. Tests use it to prove interop in both directions.

Usage:
    lmcache_client.py put HOST PORT KEY SHAPE DTYPE FILE
        Store FILE's bytes under KEY as a KV_2LTD memory object of SHAPE (comma-separated ints,
        e.g. 2,28,16,1024) and DTYPE (a torch dtype name, e.g. bfloat16). LMCache's put is
        fire-and-forget, so an EXIST on the same connector confirms it. Prints
        {"stored": bool}; exit 0 when stored, 1 when not.
    lmcache_client.py get HOST PORT KEY OUTFILE
        Fetch KEY. On a hit, writes the payload bytes to OUTFILE and prints
        {"hit": true, "shape": [...], "dtype": "bfloat16", "fmt": "KV_2LTD", "fmt_code": 1,
         "length": n}; on a miss prints {"hit": false} and writes nothing. Exit 0 either way.

    lmcache_client.py batch HOST PORT MANIFEST
        Run many puts and gets with one connector (one import of LMCache, e.g. every rank's
        chunks of a tensor-parallel writer). MANIFEST is a JSON file
        {"put": [{"key", "shape", "dtype", "file"}, ...], "get": [{"key", "file"}, ...]}; puts
        run first, each confirmed by an EXIST. Prints {"stored": [bool, ...], "got": [answer of
        get, ...]}; exit 0 when every put was stored, 1 when not.

Only the JSON line goes to stdout; LMCache's logs go to stderr. Exit 2 on bad usage.
"""

import asyncio
import json
import math
import os
import sys
import threading

USAGE = (
    "usage: lmcache_client.py put HOST PORT KEY SHAPE DTYPE FILE\n"
    "       lmcache_client.py get HOST PORT KEY OUTFILE\n"
    "       lmcache_client.py batch HOST PORT MANIFEST\n"
)


def _fail(message):
    sys.stderr.write(f"lmcache_client: {message}\n{USAGE}")
    sys.exit(2)


def _parse_args(argv):
    if len(argv) < 1 or argv[0] not in ("put", "get", "batch"):
        _fail("expected a sub-command, put, get or batch")
    want = {"put": 7, "get": 5, "batch": 4}[argv[0]]
    if len(argv) != want:
        _fail(f"{argv[0]} takes {want - 1} arguments, got {len(argv) - 1}")
    try:
        port = int(argv[2])
    except ValueError:
        _fail(f"PORT must be an integer, got {argv[2]!r}")
    if argv[0] == "batch":
        return argv[0], argv[1], port, None, [argv[3]]
    return argv[0], argv[1], port, argv[3], argv[4:]


class _Peer:
    """LMCache's config, CPU backend and lm:// connector, with an event loop in a thread."""

    def __init__(self, host, port, kv_dtype, kv_shape, num_bytes):
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache.v1.storage_backend.connector import CreateConnector
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

        url = f"lm://{host}:{port}"
        # Room for one object with headroom; the default of 5 GB is far more than one chunk.
        cpu_gb = max(0.0625, 2 * num_bytes / 1024**3)
        self.config = LMCacheEngineConfig.from_defaults(
            chunk_size=256,
            local_cpu=False,
            max_local_cpu_size=cpu_gb,
            remote_url=url,
            remote_serde="naive",
        )
        self.metadata = LMCacheMetadata(
            model_name="kvtool-interop",
            world_size=1,
            local_world_size=1,
            worker_id=0,
            local_worker_id=0,
            kv_dtype=kv_dtype,
            kv_shape=kv_shape,
        )
        self.backend = LocalCPUBackend(self.config, self.metadata, dst_device="cpu")
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.connector = CreateConnector(url, self.loop, self.backend, self.config, self.metadata)

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def close(self):
        self.run(self.connector.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()


def _put(host, port, key_str, args):
    import torch
    from lmcache.utils import parse_cache_key
    from lmcache.v1.memory_management import MemoryFormat

    shape_arg, dtype_arg, path = args
    try:
        shape = torch.Size(int(d) for d in shape_arg.split(","))
    except ValueError:
        _fail(f"SHAPE must be comma-separated ints, got {shape_arg!r}")
    dtype = getattr(torch, dtype_arg, None)
    if not isinstance(dtype, torch.dtype):
        _fail(f"unknown DTYPE {dtype_arg!r}")
    with open(path, "rb") as f:
        payload = f.read()
    itemsize = torch.empty((), dtype=dtype).element_size()
    if len(payload) != math.prod(shape) * itemsize:
        need = math.prod(shape) * itemsize
        _fail(f"{path} holds {len(payload)} bytes, SHAPE {tuple(shape)} of {dtype_arg} needs {need}")

    peer = _Peer(host, port, dtype, _kv_shape(shape), len(payload))
    key = parse_cache_key(key_str)
    memory_obj = peer.backend.allocate(shape, dtype, MemoryFormat.KV_2LTD)
    if memory_obj is None:
        raise RuntimeError("LocalCPUBackend could not allocate the memory object")
    # Fill the object through its tensor: `byte_array` is a ctypes view whose "<B" format
    # memoryview refuses slice assignment.
    source = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    memory_obj.tensor.view(torch.uint8).reshape(-1).copy_(source)
    peer.run(peer.connector.put(key, memory_obj))
    # Same connector, same socket: the EXIST reply proves the fire-and-forget PUT was stored.
    stored = peer.run(peer.connector.exists(key))  # (the wrapper's put released memory_obj)
    peer.close()
    return {"stored": bool(stored)}, 0 if stored else 1


def _get(host, port, key_str, args):
    import torch
    from lmcache.utils import parse_cache_key

    (path,) = args
    # The allocator must hold the largest object we may fetch; the key names the dtype only.
    peer = _Peer(host, port, torch.bfloat16, (1, 2, 256, 1, 1), 32 * 1024**2)
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


def _batch(host, port, _key, args):
    import torch
    from lmcache.utils import parse_cache_key
    from lmcache.v1.memory_management import MemoryFormat

    (manifest_path,) = args
    with open(manifest_path) as f:
        manifest = json.load(f)
    puts, gets = manifest.get("put", []), manifest.get("get", [])
    largest = max([os.path.getsize(p["file"]) for p in puts] + [32 * 1024**2])
    peer = _Peer(host, port, torch.bfloat16, (1, 2, 256, 1, 1), 2 * largest)
    stored = []
    for item in puts:
        dtype = getattr(torch, item["dtype"])
        with open(item["file"], "rb") as f:
            payload = f.read()
        shape = torch.Size(item["shape"])
        if len(payload) != math.prod(shape) * torch.empty((), dtype=dtype).element_size():
            _fail(f"{item['file']} does not hold a {item['dtype']} tensor of shape {list(shape)}")
        key = parse_cache_key(item["key"])
        memory_obj = peer.backend.allocate(shape, dtype, MemoryFormat.KV_2LTD)
        if memory_obj is None:
            raise RuntimeError("LocalCPUBackend could not allocate the memory object")
        memory_obj.tensor.view(torch.uint8).reshape(-1).copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
        peer.run(peer.connector.put(key, memory_obj))
        stored.append(bool(peer.run(peer.connector.exists(key))))  # same socket: the PUT landed
    got = []
    for item in gets:
        memory_obj = peer.run(peer.connector.get(parse_cache_key(item["key"])))
        if memory_obj is None:
            got.append({"hit": False})
            continue
        data = bytes(memory_obj.byte_array)
        got.append({
            "hit": True,
            "shape": list(memory_obj.get_shape()),
            "dtype": str(memory_obj.get_dtype()).removeprefix("torch."),
            "fmt": memory_obj.get_memory_format().name,
            "length": len(data),
        })
        with open(item["file"], "wb") as f:
            f.write(data)
        memory_obj.ref_count_down()
    peer.close()
    return {"stored": stored, "got": got}, 0 if all(stored) else 1


def _kv_shape(shape):
    """LMCacheMetadata's (num_layers, 2, chunk_size, kv_heads, head_dim) for a KV_2LTD shape."""
    if len(shape) == 4:
        return (shape[1], 2, shape[2], 1, shape[3])
    return (1, 2, 256, 1, 1)


def main():
    command, host, port, key, rest = _parse_args(sys.argv[1:])
    # Only our JSON may reach stdout: point fd 1 at stderr while LMCache imports and logs.
    answer_fd = os.dup(1)
    os.dup2(2, 1)
    os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
    answer, status = {"put": _put, "get": _get, "batch": _batch}[command](host, port, key, rest)
    sys.stdout.flush()
    with os.fdopen(answer_fd, "w") as out:
        json.dump(answer, out)
        out.write("\n")
    sys.exit(status)


if __name__ == "__main__":
    main()
