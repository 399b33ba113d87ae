"""LMCache's own remote connector fetching chunks, timed (run by the PEER interpreter, as a file path,
for scripts/bench-redis-get).

Usage:
    bench-redis-get-lmcache.py URL SHAPE DTYPE KEY...
        Builds LMCache's CPU backend and `CreateConnector(URL, ...)` (RedisConnector for redis://,
        RESPConnector for resp://) as `lmcache_objects.Peer` does, for KV_2LTD chunks of SHAPE
        (comma-separated ints, [2, L, chunk tokens, hidden]) and DTYPE (a torch dtype name), and
        prints {"lmcache": VERSION, "connector": CLASS, "redis_py": VERSION, "redis_py_parser":
        "hiredis" or "python"}. Then, for each line on stdin, fetches every
        KEY as LMCache's RemoteBackend.batched_get_blocking does (one `batched_get` where the
        connector has it, else one `get` per key, all submitted at once), checks that each is a
        hit of the chunk's size, releases the memory objects, and prints [start, end] (monotonic
        seconds). Every KEY must exist: LMCache 0.5.6's native GET of a missing key never returns.

`lmcache_objects` (kvtool/peer) must be importable: the caller puts its directory on PYTHONPATH.
Only the JSON lines go to stdout; LMCache's logs go to stderr. On a failure it prints
{"error": MESSAGE} and exits 1.
"""

import asyncio
import json
import math
import os
import sys
import time


def main():
    url, shape_arg, dtype_arg, *keys = sys.argv[1:]
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # LMCache logs while it imports and works
    try:
        from importlib.metadata import version

        from lmcache.utils import parse_cache_key
        from lmcache_objects import Peer, kv_shape, parse_shape_dtype

        def fail(message):
            raise ValueError(message)

        shape, dtype = parse_shape_dtype(shape_arg, dtype_arg, fail)
        chunk_bytes = math.prod(shape) * dtype.itemsize
        # Room for every chunk of a round at once (the backend allocates each as it arrives).
        peer = Peer(url, dtype, kv_shape(shape), chunk_bytes * len(keys))
        lm_keys = [parse_cache_key(k) for k in keys]
        connector = peer.connector
    except Exception as e:
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}), file=out, flush=True)
        os._exit(1)
    name = type(getattr(connector, "_connector", connector)).__name__  # inside LMCache's instrumenting wrapper
    try:
        import hiredis  # noqa: F401  (redis-py parses replies with it when it is installed)

        parser = "hiredis"
    except ImportError:
        parser = "python"
    print(json.dumps({"lmcache": version("lmcache"), "connector": name, "redis_py": version("redis"),
                      "redis_py_parser": parser}), file=out, flush=True)

    for _ in sys.stdin:
        t0 = time.monotonic()
        if connector.support_batched_get():
            objs = peer.run(connector.batched_get(lm_keys))
        else:
            futures = [asyncio.run_coroutine_threadsafe(connector.get(k), peer.loop) for k in lm_keys]
            objs = [f.result() for f in futures]
        t1 = time.monotonic()
        sizes = [None if o is None else len(o.byte_array) for o in objs]
        for o in objs:
            if o is not None:
                o.ref_count_down()
        if sizes != [chunk_bytes] * len(keys):
            print(json.dumps({"error": f"expected {len(keys)} hits of {chunk_bytes} bytes, got {sizes}"}),
                  file=out, flush=True)
            os._exit(1)
        print(json.dumps([t0, t1]), file=out, flush=True)
    os._exit(0)  # RedisConnector's close never returns (lmcache_objects.Peer.close)


if __name__ == "__main__":
    main()
