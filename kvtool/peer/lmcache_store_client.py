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

import sys

from lmcache_objects import Peer, answer, kv_shape, parse_shape_dtype, read_payload

USAGE = (
    "usage: lmcache_store_client.py put URL KEY SHAPE DTYPE FILE\n"
    "       lmcache_store_client.py get URL KEY OUTFILE\n"
)


def _fail(message):
    sys.stderr.write(f"lmcache_store_client: {message}\n{USAGE}")
    sys.exit(2)


def _put(url, key, args):
    shape_arg, dtype_arg, path = args
    shape, dtype = parse_shape_dtype(shape_arg, dtype_arg, _fail)
    payload = read_payload(path, shape, dtype, _fail)
    peer = Peer(url, dtype, kv_shape(shape), len(payload))
    stored = peer.put(key, shape, dtype, payload)
    peer.close()
    return {"stored": stored}, 0 if stored else 1


def _get(url, key, args):
    import torch

    (path,) = args
    # The allocator must hold the largest object we may fetch; RedisConnector allocates the
    # shape its metadata names.
    peer = Peer(url, torch.float32, kv_shape(()), 32 * 1024**2)
    header = peer.get(key, path)
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
    answer(lambda: (_put if command == "put" else _get)(url, key, rest))


if __name__ == "__main__":
    main()
