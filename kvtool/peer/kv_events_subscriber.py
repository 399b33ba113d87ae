"""A KV events subscriber run by the PEER interpreter: it decodes with vLLM's own classes.

    PEER_PYTHON kv_events_subscriber.py [--topic T]

It binds a SUB socket on a free loopback port (a publisher whose endpoint names a host connects
to it, vLLM's rule) and prints `{"endpoint": ...}`. Then it answers JSON commands on stdin, one
per line, with one JSON line on stdout:

- `{"op": "collect", "until_seq": N, "replay": ENDPOINT}`: receive batches until every sequence
  number 0..N is held, asking the replay endpoint for what the live stream missed.
- `{"op": "replay", "replay": ENDPOINT, "from_seq": S}`: fetch batches S.. by replay alone.

Each answer reports the sequence numbers received live and by replay, and the cache rebuilt
by applying every event in sequence order: `{medium: [block hash, ...]}` (ints as decimal
strings, bytes as hex). It also checks each payload: decoding with vLLM's `KVEventBatch` and
encoding again gives the very same bytes; and each BlockStored's hashes are the ones vLLM's own
`hash_block_tokens` computes from its parent, tokens and extra keys.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import msgspec
import zmq
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from vllm.utils.hashing import sha256_cbor
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.kv_cache_utils import hash_block_tokens, init_none_hash

END_SEQ = -1
TIMEOUT_S = 60.0


def _key(h) -> str:
    return h.hex() if isinstance(h, bytes) else str(h)


def _ext(full: bytes, like) -> object:
    return full if isinstance(like, bytes) else int.from_bytes(full, "big") & ((1 << 64) - 1)


class Cache:
    """The cache as the events describe it, plus the checks of each event."""

    def __init__(self) -> None:
        # medium -> {(group_idx, external hash)}: a hash is held once per KV cache group.
        self.media: dict[str, set] = {}
        # (medium, group_idx) -> [kv_cache_spec_kind, sliding window], as first announced
        self.groups: dict[tuple, list] = {}
        self.full: dict = {}  # external hash -> full 32-byte hash, as recomputed here
        self.errors: list[str] = []
        self.num_hash_checks = 0
        self.mismatched_reencodes = 0
        self.counts: dict[str, int] = {}

    def apply(self, seq: int, payload: bytes, decoder: msgspec.msgpack.Decoder) -> None:
        batch = decoder.decode(payload)
        if msgspec.msgpack.encode(batch) != payload:
            self.mismatched_reencodes += 1
        for event in batch.events:
            self.counts[type(event).__name__] = self.counts.get(type(event).__name__, 0) + 1
            if isinstance(event, BlockStored):
                self._check_hashes(seq, event)
                group = event.group_idx or 0
                spec = [event.kv_cache_spec_kind, event.kv_cache_spec_sliding_window]
                if self.groups.setdefault((event.medium, group), spec) != spec:
                    self.errors.append(f"seq {seq}: group {group} announced as {spec}, before as "
                                       f"{self.groups[event.medium, group]}")
                self.media.setdefault(event.medium, set()).update((group, h) for h in event.block_hashes)
            elif isinstance(event, BlockRemoved):
                held = self.media.setdefault(event.medium, set())
                group = event.group_idx or 0
                for h in event.block_hashes:
                    if (group, h) not in held:
                        self.errors.append(f"seq {seq}: BlockRemoved of {_key(h)} (group {group}) not held in "
                                           f"{event.medium}")
                    held.discard((group, h))
            elif isinstance(event, AllBlocksCleared):
                # vLLM sends it from the engine's own block pool (reset_prefix_cache).
                self.media["GPU"] = set()

    def _check_hashes(self, seq: int, event: BlockStored) -> None:
        if not event.token_ids:
            return
        if event.parent_block_hash is None:
            parent = kv_cache_utils.NONE_HASH
        else:
            parent = self.full.get(event.parent_block_hash)
            if parent is None:
                self.errors.append(f"seq {seq}: parent {_key(event.parent_block_hash)} never stored")
                return
        bs = event.block_size
        for i, h in enumerate(event.block_hashes):
            tokens = event.token_ids[i * bs : (i + 1) * bs]
            keys = event.extra_keys[i] if event.extra_keys else None
            # Events carry extra keys untagged; the hash takes the cache salt tagged.
            tagged = (("cache_salt", keys[0]),) if keys else None
            parent = hash_block_tokens(sha256_cbor, parent, tokens, tagged)
            if _ext(parent, h) != h:
                self.errors.append(f"seq {seq}: block {i} hash {_key(h)} is not vLLM's hash of its tokens")
            self.full[h] = parent
            self.num_hash_checks += 1

    def state(self) -> dict[str, list[str]]:
        """Per medium, the held hashes: group 0's as the hash, another group's as 'g<group>:<hash>'."""
        return {medium: sorted(_key(h) if g == 0 else f"g{g}:{_key(h)}" for g, h in held)
                for medium, held in self.media.items()}


def _replay(ctx: zmq.Context, endpoint: str, from_seq: int, topic: bytes) -> dict[int, bytes]:
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    try:
        sock.send_multipart((b"", from_seq.to_bytes(8, "big")))
        got: dict[int, bytes] = {}
        deadline = time.monotonic() + TIMEOUT_S
        while time.monotonic() < deadline:
            if not sock.poll(1000):
                continue
            _, frame_topic, seq_bytes, payload = sock.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if seq == END_SEQ:
                return got
            if frame_topic != topic:
                raise SystemExit(f"replayed batch {seq} has topic {frame_topic!r}")
            got[seq] = payload
        raise SystemExit(f"no end marker from the replay endpoint {endpoint} within {TIMEOUT_S:.0f} s")
    finally:
        sock.close(linger=0)


def _rebuild(batches: dict[int, bytes], live: list[int], replayed: list[int]) -> dict:
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    cache = Cache()
    for seq in sorted(batches):
        cache.apply(seq, batches[seq], decoder)
    return {
        "live_seqs": sorted(live), "replayed_seqs": sorted(replayed), "state": cache.state(),
        "errors": cache.errors, "num_hash_checks": cache.num_hash_checks,
        "mismatched_reencodes": cache.mismatched_reencodes, "counts": cache.counts,
        "groups": {str(g): spec for (medium, g), spec in sorted(cache.groups.items()) if medium == "GPU"},
        "media_groups": {medium: {str(g): spec for (m, g), spec in sorted(cache.groups.items()) if m == medium}
                         for medium in sorted({m for m, _ in cache.groups})},
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--topic", default="")
    args = parser.parse_args()
    topic = args.topic.encode()
    init_none_hash(sha256_cbor)
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.bind("tcp://127.0.0.1:*")
    print(json.dumps({"endpoint": sub.getsockopt_string(zmq.LAST_ENDPOINT)}), flush=True)
    live: dict[int, bytes] = {}
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "collect":
            until = cmd["until_seq"]
            deadline = time.monotonic() + TIMEOUT_S
            while any(s not in live for s in range(until + 1)) and time.monotonic() < deadline:
                if not sub.poll(500):
                    break  # the stream went quiet with batches missing (a slow joiner): replay them
                _, seq_bytes, payload = sub.recv_multipart()
                live[int.from_bytes(seq_bytes, "big")] = payload
            missing = [s for s in range(until + 1) if s not in live]
            replayed = _replay(ctx, cmd["replay"], missing[0], topic) if missing else {}
            batches = {**{s: p for s, p in replayed.items() if s in missing}, **live}
            result = _rebuild({s: p for s, p in batches.items() if s <= until}, list(live),
                              [s for s in replayed if s in missing])
        else:
            replayed = _replay(ctx, cmd["replay"], cmd["from_seq"], topic)
            result = _rebuild(replayed, [], list(replayed))
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
