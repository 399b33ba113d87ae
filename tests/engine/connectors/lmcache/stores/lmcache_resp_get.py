"""LMCache's own resp:// connector fetching one chunk (run by the PEER interpreter, as a file path).

Usage:
    lmcache_resp_get.py URL KEY SHAPE DTYPE OUTFILE
        SHAPE (comma-separated ints, KV_2LTD [2, L, 256, hidden]: LMCacheMetadata's default chunk
        of 256 tokens) and DTYPE (a torch dtype name) configure LMCache the way a peer of that
        geometry runs: its RESPConnector allocates that full-chunk shape and GETs the key into it. `exists` is asked first, as LMCache's remote
        backend does (LMCache 0.5.6's native GET of a missing key waits forever). On a hit, writes
        the payload bytes to OUTFILE and prints {"hit": true, "shape": [...], "dtype": "float32",
        "fmt": "KV_2LTD", "fmt_code": 1, "length": n}; else {"hit": false}.

`lmcache_objects` (kvtool/peer) must be importable: the caller puts its directory on PYTHONPATH.
Only the JSON line goes to stdout. Exit 2 on bad usage.
"""

import sys

from lmcache_objects import Peer, answer, kv_shape, parse_shape_dtype

CHUNK_TOKENS = 256
USAGE = "usage: lmcache_resp_get.py URL KEY SHAPE DTYPE OUTFILE\n"


def _fail(message):
    sys.stderr.write(f"lmcache_resp_get: {message}\n{USAGE}")
    sys.exit(2)


def _get(url, key, shape_arg, dtype_arg, path):
    import math

    from lmcache.utils import parse_cache_key

    shape, dtype = parse_shape_dtype(shape_arg, dtype_arg, _fail)
    if shape[2] != CHUNK_TOKENS:
        _fail(f"SHAPE must hold a chunk of {CHUNK_TOKENS} tokens, got {shape[2]}")
    num_bytes = math.prod(shape) * dtype.itemsize
    peer = Peer(url, dtype, kv_shape(shape), num_bytes)
    if not peer.run(peer.connector.exists(parse_cache_key(key))):
        return {"hit": False}, 0
    header = peer.get(key, path)
    peer.close()
    return header, 0


def main():
    argv = sys.argv[1:]
    if len(argv) != 5:
        _fail(f"expected 5 arguments, got {len(argv)}")
    answer(lambda: _get(*argv))


if __name__ == "__main__":
    main()
