"""LMCache's own lm:// client, driven standalone (run by the PEER interpreter, as a file path).

It builds what LMCache builds inside vLLM (see `lmcache_objects.py`), with
`CreateConnector("lm://HOST:PORT", ...)` (an `LMCServerConnector` wrapped in
`InstrumentedRemoteConnector`), then makes one put or get with it, or a batch of them. Tests use
it to prove interop in both directions.

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

import json
import os
import sys

from lmcache_objects import Peer, answer, kv_shape, parse_shape_dtype, read_payload

USAGE = (
    "usage: lmcache_client.py put HOST PORT KEY SHAPE DTYPE FILE\n"
    "       lmcache_client.py get HOST PORT KEY OUTFILE\n"
    "       lmcache_client.py batch HOST PORT MANIFEST\n"
)
# The allocator must hold the largest object a get may fetch; the key names the dtype only.
GET_BYTES = 32 * 1024**2


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
    return argv[0], f"lm://{argv[1]}:{port}", argv[3:]


def _put(url, args):
    key, shape_arg, dtype_arg, path = args
    shape, dtype = parse_shape_dtype(shape_arg, dtype_arg, _fail)
    payload = read_payload(path, shape, dtype, _fail)
    peer = Peer(url, dtype, kv_shape(shape), len(payload), chunk_size=256)
    stored = peer.put(key, shape, dtype, payload)
    peer.close()
    return {"stored": stored}, 0 if stored else 1


def _get(url, args):
    import torch

    key, path = args
    peer = Peer(url, torch.bfloat16, kv_shape(()), GET_BYTES)
    header = peer.get(key, path)
    peer.close()
    return header, 0


def _batch(url, args):
    import torch

    (manifest_path,) = args
    with open(manifest_path) as f:
        manifest = json.load(f)
    puts, gets = manifest.get("put", []), manifest.get("get", [])
    largest = max([os.path.getsize(p["file"]) for p in puts] + [GET_BYTES])
    peer = Peer(url, torch.bfloat16, kv_shape(()), 2 * largest, chunk_size=256)
    stored = []
    for item in puts:
        shape, dtype = parse_shape_dtype(",".join(map(str, item["shape"])), item["dtype"], _fail)
        payload = read_payload(item["file"], shape, dtype, _fail)
        stored.append(peer.put(item["key"], shape, dtype, payload))
    got = [peer.get(item["key"], item["file"]) for item in gets]
    peer.close()
    return {"stored": stored, "got": got}, 0 if all(stored) else 1


def main():
    command, url, rest = _parse_args(sys.argv[1:])
    answer(lambda: {"put": _put, "get": _get, "batch": _batch}[command](url, rest))


if __name__ == "__main__":
    main()
