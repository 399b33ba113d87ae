"""Our LMCache keys against the keys LMCache itself computes in the peer interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec

from kvtool.engine.connectors.lmcache.keys import ChunkKey, LMCacheKeySettings, make_chunk_keys
from kvtool.engine.errors import ConfigError, PeerError
from kvtool.peer.env import peer_env, peer_script

_LMCACHE_HASH_ALGO = {"vllm": "sha256_cbor", "sha256_cbor": "sha256_cbor", "sha256": "sha256", "builtin": "builtin"}
# Importing LMCache and vLLM can take tens of seconds on a small busy machine; the hashing is fast.
PEER_TIMEOUT_S = 600.0
MAX_PEER_PROCESSES = 4  # at once; each holds torch, LMCache and vLLM (about 0.5 GB)


class KeyAgreement(msgspec.Struct, frozen=True, kw_only=True):
    """Chunk i of one sequence as kvtool and LMCache key it."""

    start: int  # kvtool's chunk bounds (LMCache's when kvtool has no chunk i)
    end: int
    key: str | None  # kvtool's key; None when only LMCache keyed chunk i
    lmcache_key: str | None  # LMCache's key; None when only kvtool keyed chunk i
    agrees: bool  # both keyed chunk i, with the same bounds and the same key


class KeyComparison(msgspec.Struct, frozen=True, kw_only=True):
    """kvtool's keys against LMCache's for one setting, per sequence, chunk by chunk."""

    lmcache_hash_func: str  # the function LMCache resolved ("sha256_cbor"; "hash" is builtin)
    lmcache_none_hash: int  # the chain start LMCache used
    sequences: list[list[KeyAgreement]]  # one list per sequence, in chunk order

    @property
    def num_disagreeing(self) -> int:
        return sum(not chunk.agrees for chunks in self.sequences for chunk in chunks)

    @property
    def all_agree(self) -> bool:
        return self.num_disagreeing == 0


class _PeerAnswer(msgspec.Struct, frozen=True):
    """What `kvtool/peer/lmcache_keys.py` prints for one request."""

    keys: list[list[tuple[int, int, str]]]
    none_hash: int
    hash_func: str


def compare_keys(
    ours: Sequence[Sequence[ChunkKey]],
    theirs: Sequence[Sequence[tuple[int, int, str]]],
) -> list[list[KeyAgreement]]:
    """Pair kvtool's chunks with LMCache's `(start, end, key)` chunk by chunk, per sequence.

    Pure. A chunk only one side has (different counts) is paired with None and disagrees.
    Raises PeerError when the two sides hold different numbers of sequences.
    """
    if len(ours) != len(theirs):
        raise PeerError(f"LMCache answered for {len(theirs)} sequences, {len(ours)} were asked")
    result = []
    for our_chunks, their_chunks in zip(ours, theirs):
        rows = []
        for i in range(max(len(our_chunks), len(their_chunks))):
            mine = our_chunks[i] if i < len(our_chunks) else None
            peer = tuple(their_chunks[i]) if i < len(their_chunks) else None
            start, end = (mine.start, mine.end) if mine is not None else peer[:2]
            rows.append(
                KeyAgreement(
                    start=start,
                    end=end,
                    key=mine.key if mine is not None else None,
                    lmcache_key=peer[2] if peer is not None else None,
                    agrees=mine is not None and peer == (mine.start, mine.end, mine.key),
                )
            )
        result.append(rows)
    return result


def lmcache_request(sequences: Sequence[Sequence[int]], settings: LMCacheKeySettings) -> dict:
    """The `lmcache_keys.py` request that makes LMCache key `sequences` as `settings` describe.

    Raises ConfigError for kvtool's `blake3` mode, which LMCache does not have.
    """
    algo = settings.hash_algo
    if algo not in _LMCACHE_HASH_ALGO:
        raise ConfigError(
            f"--hash-algo {algo} is kvtool's own mode: LMCache has no such hash (its 'blake3' name "
            "falls back to the builtin hash), so there is nothing to compare against"
        )
    return {
        "sequences": [list(map(int, s)) for s in sequences],
        "chunk_size": settings.chunk_tokens,
        "save_unfull_chunk": settings.save_unfull_chunk,
        "hash_algo": _LMCACHE_HASH_ALGO[algo],
        "model_name": settings.model_name,
        "world_size": settings.world_size,
        "worker_id": settings.worker_id,
        "kv_dtype": settings.kv_dtype,
        "without_vllm": not settings.peer_has_vllm,
    }


# Runs `lmcache_keys.py`'s main() once per request in one interpreter: the requests share its
# PYTHONHASHSEED (fixed at start-up) and pay for importing LMCache and vLLM once. main() sends
# its answer to whatever fd 1 is when it starts, and points fd 1 at stderr while it works.
_PEER_DRIVER = """\
import sys
sys.path[0] = sys.argv[1].rpartition("/")[0]  # the script's folder, not the caller's cwd
import io, json, os, runpy, tempfile
keys_script = runpy.run_path(sys.argv[1])
requests = json.load(sys.stdin)
answers_out = os.fdopen(os.dup(1), "w")
answers = []
for request in requests:
    with tempfile.TemporaryFile("w+") as answer:
        os.dup2(answer.fileno(), 1)
        sys.stdin = io.StringIO(json.dumps(request))
        keys_script["main"]()
        answer.seek(0)
        answers.append(json.load(answer))
json.dump(answers, answers_out)
answers_out.close()
"""


def compare_with_peer(
    sequences: Sequence[Sequence[int]],
    settings: LMCacheKeySettings,
    peer_python: str | os.PathLike[str],
) -> KeyComparison:
    """kvtool's keys for `sequences` against LMCache's own, computed in one peer process.

    See `compare_many_with_peer`, which this calls with one job.
    """
    return compare_many_with_peer([(sequences, settings)], peer_python)[0]


def compare_many_with_peer(
    jobs: Sequence[tuple[Sequence[Sequence[int]], LMCacheKeySettings]],
    peer_python: str | os.PathLike[str],
) -> list[KeyComparison]:
    """kvtool's keys against LMCache's for each `(sequences, settings)` job, in job order.

    LMCache runs in `peer_python` (`kvtool.peer.peer_python()` is the peer environment) through
    `kvtool/peer/lmcache_keys.py`, with PYTHONHASHSEED set to `settings.none_hash_seed`, or unset
    when that is None. Jobs sharing a seed (and the presence of vLLM) share one process; the
    processes run side by side, at most MAX_PEER_PROCESSES at once.

    Raises ConfigError for a job LMCache cannot run (`blake3`), a missing interpreter, or a
    peer process that fails or times out (naming the last line it wrote to stderr); PeerError
    for an answer of the wrong shape.
    """
    python = Path(peer_python)
    if not python.exists():
        raise ConfigError(
            f"LMCache peer interpreter {str(python)!r} not found; build the peer environment "
            "with scripts/peer-env, or pass --peer-python"
        )
    requests = [lmcache_request(sequences, settings) for sequences, settings in jobs]
    groups: dict[tuple[str | None, bool], list[int]] = {}
    for i, (_, settings) in enumerate(jobs):
        groups.setdefault((settings.none_hash_seed, settings.peer_has_vllm), []).append(i)

    def run_group(item: tuple[tuple[str | None, bool], list[int]]) -> list[_PeerAnswer]:
        (seed, _), indices = item
        return _run_peer(python, [requests[i] for i in indices], seed)

    answers: list[_PeerAnswer | None] = [None] * len(jobs)
    with ThreadPoolExecutor(max_workers=max(1, min(len(groups), MAX_PEER_PROCESSES))) as pool:
        for (_, indices), group_answers in zip(groups.items(), pool.map(run_group, groups.items())):
            for i, answer in zip(indices, group_answers):
                answers[i] = answer

    comparisons = []
    for (sequences, settings), answer in zip(jobs, answers):
        ours = [make_chunk_keys(tokens, settings) for tokens in sequences]
        comparisons.append(
            KeyComparison(
                lmcache_hash_func=answer.hash_func,
                lmcache_none_hash=answer.none_hash,
                sequences=compare_keys(ours, answer.keys),
            )
        )
    return comparisons


def _run_peer(python: Path, requests: list[dict], seed: str | None) -> list[_PeerAnswer]:
    """Run the requests in one peer process; its answers, one per request."""
    env = peer_env()
    env.pop("PYTHONHASHSEED", None)
    if seed is not None:
        env["PYTHONHASHSEED"] = seed
    command = [str(python), "-c", _PEER_DRIVER, str(peer_script("lmcache_keys.py"))]
    with tempfile.TemporaryFile() as stdin, tempfile.TemporaryFile() as stdout, tempfile.TemporaryFile() as stderr:
        stdin.write(json.dumps(requests).encode())
        stdin.seek(0)
        # Files, not pipes: nothing to pump while several peers import side by side.
        try:
            proc = subprocess.run(command, stdin=stdin, stdout=stdout, stderr=stderr, env=env, timeout=PEER_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise ConfigError(f"LMCache peer {str(python)!r} did not answer in {PEER_TIMEOUT_S:.0f} s") from None
        except OSError as e:
            raise ConfigError(f"cannot run LMCache peer {str(python)!r}: {e}") from None
        stdout.seek(0)
        stderr.seek(0)
        out, err = stdout.read(), stderr.read().decode(errors="replace")
    if proc.returncode != 0:
        last = next((line.strip() for line in reversed(err.splitlines()) if line.strip()), "no message")
        raise ConfigError(f"LMCache peer {str(python)!r} failed (exit {proc.returncode}): {last}")
    try:
        answers = msgspec.json.decode(out, type=list[_PeerAnswer])
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise PeerError(f"LMCache peer answer is malformed: {e}") from None
    if len(answers) != len(requests):
        raise PeerError(f"LMCache peer answered {len(answers)} of {len(requests)} requests")
    return answers
