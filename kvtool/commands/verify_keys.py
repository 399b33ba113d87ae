"""verify-keys: the LMCache keys kvtool computes for a token sequence, to compare with a peer's.

Three checks, each a finding when it fails (exit 1), never an error:

* our keys alone (`make_chunk_keys`);
* `--against-lmcache`: the same tokens and settings through LMCache's own `ChunkedTokenDatabase`
  (with vLLM's hashing) in the peer interpreter, compared key by key (`compare_with_peer`);
* `--peer lm://HOST:PORT`: which keys a running LMCache server holds, and whether each stored
  chunk's geometry fits the model (`probe_chunks`).

The command's logic lives here; `cli.py` registers `verify_keys`. Importing this module has no
side effects.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Annotated, Optional

import msgspec
import torch
import typer
from msgspec import UNSET, UnsetType
from rich.table import Table

from kvtool.commands import render
from kvtool.commands.options import JsonOpt, ModelOpt
from kvtool.engine.connectors.lmcache.keys import ChunkKey, LMCacheKeySettings, make_chunk_keys
from kvtool.engine.connectors.lmcache.wire import (
    ChunkHeader,
    LMClient,
    MemoryFormat,
    parse_lm_url,
    tensor_buffer,
    torch_dtype_from_code,
)
from kvtool.engine.default_model import is_default_model_ready
from kvtool.engine.engine import DEFAULT_MODEL_NAME, resolve_model_path
from kvtool.engine.errors import ConfigError, InputError, PeerError
from kvtool.engine.model_dir import ModelConfig, ModelDir, open_model_dir
from kvtool.peer import peer_env, peer_script
from kvtool.peer import peer_python as default_peer_python


_TOKEN_LINE = re.compile(r"[0-9]+")

# The hash modes a user picks from; LMCache's name for each that it has.
CLI_HASH_ALGOS = ("vllm", "builtin", "blake3")
_LMCACHE_HASH_ALGO = {"vllm": "sha256_cbor", "sha256_cbor": "sha256_cbor", "sha256": "sha256", "builtin": "builtin"}
# Importing LMCache and vLLM takes 10-60 s on a small busy machine; the hashing itself is fast.
PEER_TIMEOUT_S = 600.0
MAX_PEER_PROCESSES = 4  # at once; each holds torch, LMCache and vLLM (about 0.5 GB)
# A GET reads a whole chunk (the protocol has no header-only read) into one buffer of
# READ_HEADROOM x the largest expected chunk, at most MAX_READ_BYTES: a chunk up to that
# size is read and its header reported; a larger one is refused before its payload is read.
READ_HEADROOM = 4
MAX_READ_BYTES = 1 << 30


# ----------------------------------------------------------------------------- token files


def read_token_file(path: str | os.PathLike[str]) -> list[int]:
    """Token ids from a file: a JSON array of non-negative ints, or one such int per line.

    A file whose first non-blank character is `[` is read as JSON; anything else as lines
    (blank lines and surrounding whitespace are ignored). Raises ConfigError (one line) for a
    missing or unreadable file, malformed JSON, a value that is not a non-negative integer
    (naming its index or line), or a file with no token ids.
    """
    file = Path(path)
    text = _read_text(file)
    if text.lstrip().startswith("["):
        token_ids = _decode_json_tokens(text, file)
    else:
        token_ids = _decode_line_tokens(text, file)
    if not token_ids:
        raise ConfigError(f"token file {str(file)!r} holds no token ids")
    return token_ids


def read_token_sequences(path: str | os.PathLike[str]) -> list[list[int]]:
    """One or more token sequences from a file.

    A file whose first non-blank line is a whole JSON array and which has further non-blank
    lines is JSON Lines: one JSON array of ints per line, one sequence each. Any other file is
    one sequence, read as `read_token_file` reads it (a JSON array, which may span lines, or
    one int per line). Raises ConfigError (one line, naming the line) as `read_token_file`
    does, and for a JSON Lines line that is not an array of non-negative ints or is empty.
    """
    file = Path(path)
    text = _read_text(file)
    lines = [(n, line) for n, line in enumerate(text.splitlines(), start=1) if line.strip()]
    if len(lines) > 1 and lines[0][1].lstrip().startswith("[") and _is_int_array(lines[0][1]):
        return [_decode_json_line(line, file, n) for n, line in lines]
    return [read_token_file(file)]


def _read_text(file: Path) -> str:
    try:
        return file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"token file {str(file)!r} not found") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read token file {str(file)!r}: {e}") from None


def _is_int_array(line: str) -> bool:
    try:
        msgspec.json.decode(line, type=list[int])
    except (msgspec.ValidationError, msgspec.DecodeError):
        return False
    return True


def _decode_json_tokens(text: str, file: Path) -> list[int]:
    try:
        # msgspec's int refuses bools and floats, so `true` or `1.0` is an error, not a token.
        values = msgspec.json.decode(text, type=list[int])
    except msgspec.ValidationError as e:
        raise ConfigError(
            f"token file {str(file)!r}: {e} (expected a JSON array of ints)"
        ) from None
    except msgspec.DecodeError as e:
        raise ConfigError(f"token file {str(file)!r}: malformed JSON ({e})") from None
    for index, value in enumerate(values):
        if value < 0:
            raise ConfigError(
                f"token file {str(file)!r}: token id {value} at $[{index}] is negative"
            )
    return values


def _decode_json_line(line: str, file: Path, line_no: int) -> list[int]:
    where = f"token file {str(file)!r} line {line_no}"
    try:
        values = msgspec.json.decode(line, type=list[int])
    except msgspec.ValidationError as e:
        raise ConfigError(f"{where}: {e} (JSON Lines: one JSON array of ints per line)") from None
    except msgspec.DecodeError as e:
        raise ConfigError(f"{where}: malformed JSON ({e})") from None
    if not values:
        raise ConfigError(f"{where}: holds no token ids")
    for index, value in enumerate(values):
        if value < 0:
            raise ConfigError(f"{where}: token id {value} at $[{index}] is negative")
    return values


def _decode_line_tokens(text: str, file: Path) -> list[int]:
    token_ids = []
    for line_no, line in enumerate(text.splitlines(), start=1):
        field = line.strip()
        if not field:
            continue
        if not _TOKEN_LINE.fullmatch(field):
            raise ConfigError(
                f"token file {str(file)!r} line {line_no}: {field[:40]!r} is not a non-negative "
                "integer (expected a JSON array or one token id per line)"
            )
        token_ids.append(int(field))
    return token_ids


def build_key_report(tokens: Sequence[int], settings: LMCacheKeySettings) -> list[dict]:
    """One `{"start", "end", "key"}` dict per chunk that gets a key, in chunk order.

    The keys are exactly those `make_chunk_keys` gives (and a peer with these settings
    writes). Raises what `make_chunk_keys` raises.
    """
    return [
        {"start": chunk.start, "end": chunk.end, "key": chunk.key}
        for chunk in make_chunk_keys(tokens, settings)
    ]


# ----------------------------------------------------------------------------- against LMCache


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


# ----------------------------------------------------------------------------- on an lm:// server


class ChunkGeometry(msgspec.Struct, frozen=True, kw_only=True):
    """The KV_2LTD chunk a model writes: `[2, num_layers, num_tokens, kv_hidden_size]`."""

    num_layers: int
    kv_hidden_size: int  # KV heads of one rank x head_dim
    element_size: int  # bytes per element of the KV dtype

    def shape(self, num_tokens: int) -> tuple[int, int, int, int]:
        return (2, self.num_layers, num_tokens, self.kv_hidden_size)

    def num_bytes(self, num_tokens: int) -> int:
        return 2 * self.num_layers * num_tokens * self.kv_hidden_size * self.element_size


class ChunkProbe(msgspec.Struct, frozen=True, kw_only=True):
    """What an lm:// server holds under one key, checked against the expected geometry."""

    present: bool  # EXIST said so and the GET found it
    shape: list[int] | None  # as stored; None when absent or unreadable
    dtype: str | None  # torch dtype name as stored; None when absent, unreadable or untyped
    fits: bool | None  # None when absent
    problem: str | None  # why it does not fit (or could not be read); None when it fits


def make_chunk_geometry(config: ModelConfig, kv_dtype: str, world_size: int = 1) -> ChunkGeometry:
    """The chunk geometry of a model config (`ModelConfig`) for a KV dtype name.

    With world_size N the writer is taken to be N-way tensor parallel: each rank holds
    max(1, num_kv_heads // N) heads, as vLLM shards them. Raises ConfigError for a dtype torch
    does not know.
    """
    dtype = getattr(torch, kv_dtype, None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError(f"--kv-dtype {kv_dtype!r} is not a torch dtype")
    num_kv_heads = max(1, config.num_kv_heads // world_size)
    return ChunkGeometry(
        num_layers=config.num_layers,
        kv_hidden_size=num_kv_heads * config.head_dim,
        element_size=dtype.itemsize,
    )


def geometry_problem(header: ChunkHeader, num_tokens: int, geometry: ChunkGeometry) -> str | None:
    """Why a stored chunk (`wire.ChunkHeader`) does not fit `geometry`; None when it fits.

    Checks the memory format (KV_2LTD), the shape `[2, layers, tokens, KV hidden size]` and the
    element size, and names every field that differs with the value expected and found.
    """
    problems = []
    if header.fmt != MemoryFormat.KV_2LTD:
        try:
            name = MemoryFormat(header.fmt).name
        except ValueError:
            name = str(header.fmt)
        problems.append(f"format {name}, expected KV_2LTD")
    shape = tuple(header.shape)
    want = geometry.shape(num_tokens)
    if len(shape) != 4:
        problems.append(f"shape {list(shape)} has {len(shape)} dims, expected {list(want)}")
    else:
        for label, expected, found in zip(("K/V", "layers", "tokens", "KV hidden size"), want, shape):
            if expected != found:
                problems.append(f"{label} {found}, expected {expected}")
    try:
        element_size = torch_dtype_from_code(header.dtype_code).itemsize
    except PeerError as e:
        problems.append(str(e))
    else:
        if element_size != geometry.element_size:
            problems.append(f"element size {element_size} bytes, expected {geometry.element_size}")
    return "; ".join(problems) or None


def probe_chunks(
    client: LMClient, chunks: Sequence[tuple[str, int]], geometry: ChunkGeometry
) -> dict[str, ChunkProbe]:
    """Ask an `LMClient`'s server about each `(key, num_tokens)`: EXIST for all, GET each present one.

    Every GET reads into one preallocated buffer of READ_HEADROOM x the largest expected chunk
    (at most MAX_READ_BYTES). A chunk that cannot be read (too large, malformed reply, lost
    connection) is a finding: present, does not fit, the reason in `problem`.

    Raises ConfigError when a chunk of this geometry exceeds MAX_READ_BYTES, and PeerError when
    the EXIST requests (or, with no keys to ask, a HEALTH request) fail: the server is
    unreachable or misbehaves.
    """
    wanted = dict(chunks)  # key -> tokens; keys shared by several sequences are asked once
    if not wanted:
        if not client.health():  # nothing to ask, but a bad address is still an error
            raise PeerError(f"{client.url}: HEALTH failed (unreachable or unhealthy)")
        return {}
    largest = geometry.num_bytes(max(wanted.values()))
    if largest > MAX_READ_BYTES:
        raise ConfigError(
            f"a chunk of this model is {largest} bytes, over the {MAX_READ_BYTES}-byte read cap; "
            "use a smaller --chunk-tokens"
        )
    keys = list(wanted)
    present = client.exist_many(keys)
    buffer = tensor_buffer(torch.empty(min(READ_HEADROOM * largest, MAX_READ_BYTES), dtype=torch.uint8))
    result = {}
    for key, exists in zip(keys, present):
        if not exists:
            result[key] = ChunkProbe(present=False, shape=None, dtype=None, fits=None, problem=None)
            continue
        try:
            header = client.get_into(key, buffer)
        except PeerError as e:
            result[key] = ChunkProbe(present=True, shape=None, dtype=None, fits=False, problem=str(e))
            continue
        if header is None:
            result[key] = ChunkProbe(
                present=False, shape=None, dtype=None, fits=None, problem="gone between EXIST and GET"
            )
            continue
        try:
            dtype = str(torch_dtype_from_code(header.dtype_code)).removeprefix("torch.")
        except PeerError:
            dtype = None
        problem = geometry_problem(header, wanted[key], geometry)
        result[key] = ChunkProbe(
            present=True, shape=list(header.shape), dtype=dtype, fits=problem is None, problem=problem
        )
    return result


# ----------------------------------------------------------------------------- the report


class ChunkRow(msgspec.Struct, kw_only=True):
    """One chunk of `kvtool verify-keys --json` (scripts rely on these names).

    `start`, `end` and `key` are always there. The other fields appear only with the flag that
    fills them, and `sequence` only when the token file holds several sequences.
    """

    sequence: int | UnsetType = UNSET  # index of the sequence in the token file (JSON Lines)
    start: int
    end: int
    key: str | None  # kvtool's key; None only where LMCache keyed a chunk kvtool did not
    # --against-lmcache
    lmcache_key: str | None | UnsetType = UNSET  # LMCache's key for this chunk
    agrees: bool | UnsetType = UNSET
    # --peer
    present: bool | UnsetType = UNSET
    shape: list[int] | None | UnsetType = UNSET
    dtype: str | None | UnsetType = UNSET
    fits: bool | None | UnsetType = UNSET  # None when not present
    problem: str | None | UnsetType = UNSET


def build_rows(
    ours: Sequence[Sequence[ChunkKey]],
    comparison: KeyComparison | None = None,
    probes: dict[str, ChunkProbe] | None = None,
) -> list[ChunkRow]:
    """The report rows, sequence by sequence and chunk by chunk."""
    many = len(ours) > 1
    rows = []
    for i, chunks in enumerate(ours):
        if comparison is not None:
            agreements = comparison.sequences[i]
            seq_rows = [
                ChunkRow(start=a.start, end=a.end, key=a.key, lmcache_key=a.lmcache_key, agrees=a.agrees)
                for a in agreements
            ]
        else:
            seq_rows = [ChunkRow(start=c.start, end=c.end, key=c.key) for c in chunks]
        for row in seq_rows:
            if many:
                row.sequence = i
            if probes is not None:
                probe = probes.get(row.key) if row.key is not None else None
                if probe is None:
                    probe = ChunkProbe(present=False, shape=None, dtype=None, fits=None, problem=None)
                row.present, row.shape, row.dtype = probe.present, probe.shape, probe.dtype
                row.fits, row.problem = probe.fits, probe.problem
        rows.extend(seq_rows)
    return rows


def exit_status(rows: Sequence[ChunkRow]) -> int:
    """1 when a key disagrees with LMCache's or a present chunk does not fit; else 0."""
    return 1 if any(r.agrees is False or r.fits is False for r in rows) else 0


def render_table(rows: Sequence[ChunkRow], peer_url: str | None = None) -> Table:
    """The human form of the report: one line per chunk, a summary as the caption."""
    many = any(r.sequence is not UNSET for r in rows)
    against = any(r.agrees is not UNSET for r in rows)
    probed = peer_url is not None
    any_differs = any(r.agrees is False for r in rows)
    any_problem = any(isinstance(r.problem, str) for r in rows)

    table = Table(show_edge=False)
    columns = (["seq"] if many else []) + ["start", "end", "key"]
    if against:
        columns += ["LMCache"] + (["LMCache key"] if any_differs else [])
    if probed:
        columns += ["present", "shape", "dtype", "fits"] + (["problem"] if any_problem else [])
    for name in columns:
        table.add_column(name, justify="right" if name in ("seq", "start", "end") else "left", overflow="fold")
    for r in rows:
        cells = ([str(r.sequence)] if many else []) + [str(r.start), str(r.end), r.key or "-"]
        if against:
            cells.append("agrees" if r.agrees else "[red]DIFFERS[/red]")
            if any_differs:
                cells.append("" if r.agrees else (r.lmcache_key or "-"))
        if probed:
            cells += [
                "yes" if r.present else "no",
                "x".join(map(str, r.shape)) if r.shape else "-",
                r.dtype or "-",
                "-" if r.fits is None else ("yes" if r.fits else "[red]NO[/red]"),
            ]
            if any_problem:
                cells.append(r.problem or "")
        table.add_row(*cells)
    table.caption = _summary(rows, against, peer_url)
    return table


def _summary(rows: Sequence[ChunkRow], against: bool, peer_url: str | None) -> str:
    parts = [f"{sum(r.key is not None for r in rows)} keys"]
    if against:
        differ = sum(r.agrees is False for r in rows)
        parts.append(f"{differ} differ from LMCache's" if differ else "all equal to LMCache's")
    if peer_url is not None:
        present = sum(r.present is True for r in rows)
        misfit = sum(r.fits is False for r in rows)
        parts.append(f"{present} held by {peer_url}" + (f", {misfit} do not fit" if misfit else ""))
    return "; ".join(parts)


# ----------------------------------------------------------------------------- the command

TokensOpt = Annotated[Optional[Path], typer.Option(
    "--tokens", show_default=False,
    help="Token ids: a JSON array, one id per line, or JSON Lines (one JSON array per line, one sequence each).",
)]
PromptOpt = Annotated[Optional[str], typer.Option(
    "--prompt", show_default=False, help="Text, tokenized with --model's tokenizer.",
)]
ModelNameOpt = Annotated[Optional[str], typer.Option(
    "--model-name", show_default=False,
    help="Model name in the keys (the peer's vLLM --model string). Default: --model as given, or "
    f"{DEFAULT_MODEL_NAME} for the default model.",
)]
ChunkTokensOpt = Annotated[int, typer.Option("--chunk-tokens", help="LMCache chunk_size.")]
HashAlgoOpt = Annotated[str, typer.Option(
    "--hash-algo", help="vllm (LMCache sha256_cbor), builtin (needs --none-hash-seed) or blake3 (kvtool only).",
)]
NoneHashSeedOpt = Annotated[Optional[str], typer.Option(
    "--none-hash-seed", show_default=False, help="The peer's PYTHONHASHSEED. Default: unset.",
)]
SaveUnfullOpt = Annotated[bool, typer.Option(
    "--save-unfull-chunk", help="Also key a trailing partial chunk (LMCache save_unfull_chunk).",
)]
KVDtypeOpt = Annotated[str, typer.Option("--kv-dtype", help="torch dtype of the KV cache (fp8 caches: uint8).")]
WorldSizeOpt = Annotated[int, typer.Option("--world-size", help="The writer's world size (PP x TP).")]
WorkerIdOpt = Annotated[int, typer.Option("--worker-id", help="The writer's global rank.")]
AgainstOpt = Annotated[bool, typer.Option(
    "--against-lmcache",
    help="Also key the tokens with LMCache's own ChunkedTokenDatabase in the peer environment; exit 1 if any differs.",
)]
PeerPythonOpt = Annotated[Optional[Path], typer.Option(
    "--peer-python", show_default=False,
    help="Interpreter of the LMCache peer environment, for --against-lmcache. Default: scripts/peer-env's.",
)]
PeerOpt = Annotated[Optional[str], typer.Option(
    "--peer", show_default=False,
    help="lm://HOST:PORT of an LMCache server: which keys it holds, and whether each held chunk fits --model; "
    "exit 1 if one does not, 2 if the server cannot be reached.",
)]


def verify_keys(
    tokens: TokensOpt = None,
    prompt: PromptOpt = None,
    model: ModelOpt = None,
    model_name: ModelNameOpt = None,
    chunk_tokens: ChunkTokensOpt = 256,
    hash_algo: HashAlgoOpt = "vllm",
    none_hash_seed: NoneHashSeedOpt = None,
    save_unfull_chunk: SaveUnfullOpt = False,
    kv_dtype: KVDtypeOpt = "bfloat16",
    world_size: WorldSizeOpt = 1,
    worker_id: WorkerIdOpt = 0,
    against_lmcache: AgainstOpt = False,
    peer_python: PeerPythonOpt = None,
    peer: PeerOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Print the LMCache keys of token sequences; check them against LMCache, or on a server.

    --json prints a list of {"start", "end", "key"} objects, one per chunk. --against-lmcache
    adds "lmcache_key" and "agrees"; --peer adds "present", "shape", "dtype", "fits" and
    "problem"; a token file of several sequences (JSON Lines) adds "sequence". A held chunk
    fits when it is KV_2LTD [2, layers, tokens, KV heads x head_dim] of --model, with
    --kv-dtype's element size (--world-size N: N-way tensor parallel, 1/N of the KV heads).

    Exit status: 0 when every key equals LMCache's and every held chunk fits; 1 when a key
    differs or a held chunk does not fit; 2 for bad usage or input, including a --peer server
    that cannot be reached and a peer environment that cannot run.

    Examples:
      kvtool verify-keys --prompt "What is the capital of France?"
      kvtool verify-keys --tokens ids.json --model-name Qwen/Qwen3-0.6B --json
      kvtool verify-keys --tokens batch.jsonl --against-lmcache --hash-algo builtin --none-hash-seed 0
      kvtool verify-keys --tokens ids.json --model ./Qwen3-0.6B --peer lm://127.0.0.1:65432
    """
    if (tokens is None) == (prompt is None):
        raise ConfigError("give exactly one of --tokens FILE and --prompt TEXT")
    if hash_algo not in CLI_HASH_ALGOS:
        raise ConfigError(f"--hash-algo must be one of {', '.join(CLI_HASH_ALGOS)}, got {hash_algo!r}")
    if peer_python is not None and not against_lmcache:
        raise ConfigError("--peer-python is used only with --against-lmcache")
    settings = LMCacheKeySettings(
        model_name if model_name is not None else model or DEFAULT_MODEL_NAME,
        world_size=world_size,
        worker_id=worker_id,
        kv_dtype=kv_dtype,
        chunk_tokens=chunk_tokens,
        hash_algo=hash_algo,
        none_hash_seed=none_hash_seed,
        save_unfull_chunk=save_unfull_chunk,
    )
    if against_lmcache:
        lmcache_request([], settings)  # refuses blake3 before any work
    if peer is not None:
        parse_lm_url(peer)
    show_progress = not json_out and render.stderr.is_terminal

    model_dir = _open_model(model, show_progress) if prompt is not None or peer is not None else None
    if tokens is not None:
        sequences = read_token_sequences(tokens)
    else:
        sequences = [model_dir.tokenizer.encode(prompt)]
        if not sequences[0]:
            raise InputError("--prompt gives no tokens")
    ours = [make_chunk_keys(seq, settings) for seq in sequences]

    comparison = None
    if against_lmcache:
        with render.progress_bar("LMCache peer: importing LMCache and vLLM", enabled=show_progress) as bar:
            bar("", 0.0)
            comparison = compare_with_peer(sequences, settings, peer_python or default_peer_python())
    probes = None
    if peer is not None:
        geometry = make_chunk_geometry(model_dir.config, kv_dtype, world_size)
        wanted = [(c.key, c.end - c.start) for chunks in ours for c in chunks]
        with LMClient.from_url(peer, connections=1) as client:
            try:
                probes = probe_chunks(client, wanted, geometry)
            except PeerError as e:  # only the EXIST round, which any reachable server answers
                raise ConfigError(f"--peer unreachable: {e}") from None

    rows = build_rows(ours, comparison, probes)
    if json_out:
        render.print_json(rows)
    else:
        render.stdout.print(render_table(rows, peer))
    code = exit_status(rows)
    if code:
        raise typer.Exit(code)


def _open_model(model: str | None, show_progress: bool) -> ModelDir:
    """--model's directory, or the embedded default (converted on first use)."""
    if model is None and not is_default_model_ready():
        with render.progress_bar("converting the default model", enabled=show_progress) as bar:
            return open_model_dir(resolve_model_path(None, progress=bar))
    return open_model_dir(resolve_model_path(model))
