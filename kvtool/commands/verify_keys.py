"""verify-keys: the LMCache keys kvtool computes for a token sequence, to compare with a peer's.

Three checks, each a finding when it fails (exit 1), never an error:

* our keys alone (`make_chunk_keys`);
* `--against-lmcache`: the same tokens and settings through LMCache's own `ChunkedTokenDatabase`
  (with vLLM's hashing) in the peer interpreter, compared key by key (`compare_with_peer`);
* `--peer lm://HOST:PORT`: which keys a running LMCache server holds, and whether each stored
  chunk's geometry fits the model (`probe_chunks`).

In blake3 mode the keys are those of an engine with the same flags: where that engine keeps
several KV cache groups (`kv.groups`), one key per group per chunk, in a chain of the group's
own (`identity_digest.make_group_key_settings`, the connector's), each chunk one group's `[2, slots, ...]`.

The command's logic lives here; `cli.py` registers `verify_keys`. Importing this module has no
side effects.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import msgspec
import typer
from msgspec import UNSET, UnsetType
from rich.table import Table

from kvtool.commands import render
from kvtool.commands.options import JsonOpt, ModelOpt
from kvtool.commands.token_files import read_token_file, read_token_sequences  # noqa: F401 (re-exported)
from kvtool.engine.connectors.lmcache.keys import ChunkKey, LMCacheKeySettings, make_chunk_keys
from kvtool.engine.errors import ConfigError, InputError, PeerError
from kvtool.engine.models.model_dir import ModelDir, open_model_dir
from kvtool.engine.presets.default_model import DEFAULT_MODEL_NAME, is_default_model_ready, resolve_model_path
from kvtool.peer.compare import KeyComparison, compare_with_peer, lmcache_request
from kvtool.peer.env import peer_python as default_peer_python

if TYPE_CHECKING:  # the probe needs torch, which only --peer and blake3 should import
    import torch

    from kvtool.engine.connectors.lmcache.probe import ChunkProbe
    from kvtool.engine.kv.identity import KVCacheLayout

# The hash modes a user picks from; LMCache's name for each that it has.
CLI_HASH_ALGOS = ("vllm", "builtin", "blake3")
_LMCACHE_HASH_ALGO = {"vllm": "sha256_cbor", "sha256_cbor": "sha256_cbor", "sha256": "sha256", "builtin": "builtin"}
# The connector of a writer of blake3 keys, whose KV cache groups `kv_cache_layout` decides.
BLAKE3_WRITER = ('{"kv_connector": "LMCacheConnector", "kv_role": "kv_both", '
                 '"kv_connector_extra_config": {"hash_algo": "blake3"}}')
# Importing LMCache and vLLM can take tens of seconds on a small busy machine; the hashing is fast.
PEER_TIMEOUT_S = 600.0
MAX_PEER_PROCESSES = 4  # at once; each holds torch, LMCache and vLLM (about 0.5 GB)
# A GET reads a whole chunk (the protocol has no header-only read) into one buffer of
# READ_HEADROOM x the largest expected chunk, at most MAX_READ_BYTES: a chunk up to that
# size is read and its header reported; a larger one is refused before its payload is read.
READ_HEADROOM = 4
MAX_READ_BYTES = 1 << 30


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


# ----------------------------------------------------------------------------- on an lm:// server


# ----------------------------------------------------------------------------- the report


class ChunkGroup(msgspec.Struct, frozen=True, kw_only=True):
    """The KV cache group whose chunk a row keys (blake3 keys of a writer with several groups)."""

    index: int  # in the writer's layout (kv.groups)
    kind: str  # full_attention or sliding_window (vLLM's KVCacheSpecKind)
    sliding_window: int | None  # None for full attention
    layers: list[int]  # the model's layers in the group's slots


class ChunkRow(msgspec.Struct, kw_only=True):
    """One chunk of `kvtool verify-keys --json` (scripts rely on these names).

    `start`, `end` and `key` are always there. The other fields appear only with the flag that
    fills them, `sequence` only when the token file holds several sequences, and `group` only
    for blake3 keys of a writer with several KV cache groups (a row per group per chunk).
    """

    sequence: int | UnsetType = UNSET  # index of the sequence in the token file (JSON Lines)
    start: int
    end: int
    key: str | None  # kvtool's key; None only where LMCache keyed a chunk kvtool did not
    group: ChunkGroup | UnsetType = UNSET  # the KV cache group the key and the chunk are of
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
                    from kvtool.engine.connectors.lmcache.probe import ChunkProbe

                    probe = ChunkProbe(present=False, shape=None, dtype=None, fits=None, problem=None)
                row.present, row.shape, row.dtype = probe.present, probe.shape, probe.dtype
                row.fits, row.problem = probe.fits, probe.problem
        rows.extend(seq_rows)
    return rows


def build_group_rows(
    ours: Sequence[Sequence[Sequence[ChunkKey]]], layout: KVCacheLayout, probes: dict[str, ChunkProbe] | None = None
) -> list[ChunkRow]:
    """The report rows of a writer with several KV cache groups: `ours[g]` is group g's keys of
    each sequence; chunk by chunk, a row per group in group order."""
    by_group = []
    for g, (group, group_keys) in enumerate(zip(layout.groups, ours)):
        rows = build_rows(group_keys, probes=probes)
        ref = ChunkGroup(index=g, kind=group.kind, sliding_window=group.sliding_window, layers=list(group.layers))
        for row in rows:
            row.group = ref
        by_group.append(rows)
    return [row for chunk_rows in zip(*by_group) for row in chunk_rows]


def exit_status(rows: Sequence[ChunkRow]) -> int:
    """1 when a key disagrees with LMCache's or a present chunk does not fit; else 0."""
    return 1 if any(r.agrees is False or r.fits is False for r in rows) else 0


def render_table(rows: Sequence[ChunkRow], peer_url: str | None = None) -> Table:
    """The human form of the report: one line per chunk, a summary as the caption."""
    many = any(r.sequence is not UNSET for r in rows)
    grouped = any(r.group is not UNSET for r in rows)
    against = any(r.agrees is not UNSET for r in rows)
    probed = peer_url is not None
    any_differs = any(r.agrees is False for r in rows)
    any_problem = any(isinstance(r.problem, str) for r in rows)

    table = Table(show_edge=False)
    columns = (["seq"] if many else []) + ["start", "end"] + (["group"] if grouped else []) + ["key"]
    if against:
        columns += ["LMCache"] + (["LMCache key"] if any_differs else [])
    if probed:
        columns += ["present", "shape", "dtype", "fits"] + (["problem"] if any_problem else [])
    for name in columns:
        table.add_column(name, justify="right" if name in ("seq", "start", "end") else "left", overflow="fold")
    for r in rows:
        cells = ([str(r.sequence)] if many else []) + [str(r.start), str(r.end)]
        cells += ([_group_cell(r.group)] if grouped else []) + [r.key or "-"]
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


def _group_cell(group: ChunkGroup) -> str:
    kind = "full" if group.sliding_window is None else f"window {group.sliding_window}"
    return f"{group.index}: {kind}, layers {','.join(map(str, group.layers))}"


def _summary(rows: Sequence[ChunkRow], against: bool, peer_url: str | None) -> str:
    parts = [f"{sum(r.key is not None for r in rows)} keys"]
    num_groups = len({r.group.index for r in rows if r.group is not UNSET})
    if num_groups:
        parts[0] += f" of {num_groups} KV cache groups"
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
    "--hash-algo", help="vllm (LMCache sha256_cbor), builtin (needs --none-hash-seed) or blake3 (kvtool only: "
    "its keys also carry --model's identity, so they are --model's, at --kv-dtype and --world-size).",
)]
NoneHashSeedOpt = Annotated[Optional[str], typer.Option(
    "--none-hash-seed", show_default=False, help="The peer's PYTHONHASHSEED. Default: unset.",
)]
SaveUnfullOpt = Annotated[bool, typer.Option(
    "--save-unfull-chunk", help="Also key a trailing partial chunk (LMCache save_unfull_chunk).",
)]
KVDtypeOpt = Annotated[Optional[str], typer.Option(
    "--kv-dtype", show_default=False,
    help="torch dtype of the KV cache (fp8 caches: uint8). Default: bfloat16; with --peer, what kvtool serve "
    "stores on --device (float32 on CPU, bfloat16 on CUDA).",
)]
DeviceOpt = Annotated[str, typer.Option(
    "--device", help="The writer's device (auto, cpu or cuda): with --peer and no --kv-dtype it sets the KV dtype; "
    "with blake3, the KV cache groups (one on CUDA so far).",
)]
MaxModelLenOpt = Annotated[Optional[int], typer.Option(
    "--max-model-len", show_default=False,
    help="blake3: the writer's --max-model-len (default: the model's), which decides whether a sliding window "
    "binds, and so the KV cache groups.",
)]
DisableHybridOpt = Annotated[Optional[bool], typer.Option(
    "--disable-hybrid-kv-cache-manager/--no-disable-hybrid-kv-cache-manager", show_default=False,
    help="blake3: the writer's flag. The keys are those of an engine with the same --model, --device, "
    "--max-model-len and this flag: one key per KV cache group per chunk where it keeps several groups.",
)]
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
    kv_dtype: KVDtypeOpt = None,
    device: DeviceOpt = "auto",
    max_model_len: MaxModelLenOpt = None,
    disable_hybrid_kv_cache_manager: DisableHybridOpt = None,
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
    fits when it is KV_2LTD [2, layers, tokens, KV heads x head_dim] of --model in --kv-dtype
    itself (not only its element size), with the KV heads of rank --worker-id of an N-way
    tensor-parallel writer under --world-size N (its head shard, as the engine splits them).

    blake3 keys are those of an engine with the same --model, --device, --max-model-len and
    --disable-hybrid-kv-cache-manager. Where it keeps several KV cache groups (a model with
    sliding-window layers), each chunk has a key and a row per group, with "group" ({"index",
    "kind", "sliding_window", "layers"}), and a held chunk has the groups' slots as its layers.

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
    if device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"--device must be auto, cpu or cuda, got {device!r}")
    if kv_dtype is None:
        kv_dtype = serve_kv_dtype(device) if peer is not None else "bfloat16"
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
        from kvtool.engine.connectors.lmcache.stores.protocol import parse_lm_url

        parse_lm_url(peer)
    show_progress = not json_out and render.stderr.is_terminal

    needs_model = prompt is not None or peer is not None or hash_algo == "blake3"
    model_dir = _open_model(model, show_progress) if needs_model else None
    layout, group_settings = None, [settings]
    if hash_algo == "blake3":
        layout, group_settings = blake3_group_key_settings(
            model_dir, model, settings, max_model_len, disable_hybrid_kv_cache_manager)
    if tokens is not None:
        sequences = read_token_sequences(tokens)
    else:
        sequences = [model_dir.tokenizer.encode(prompt)]
        if not sequences[0]:
            raise InputError("--prompt gives no tokens")
    # ours[g][i]: KV cache group g's chunk keys of sequence i (one group but for a grouped blake3 writer).
    ours = [[make_chunk_keys(seq, s) for seq in sequences] for s in group_settings]

    comparison = None
    if against_lmcache:
        with render.progress_bar("LMCache peer: importing LMCache and vLLM", enabled=show_progress) as bar:
            bar("", 0.0)
            comparison = compare_with_peer(sequences, settings, peer_python or default_peer_python())
    probes = None
    if peer is not None:
        from kvtool.engine.connectors.lmcache.probe import make_chunk_geometry, probe_chunks
        from kvtool.engine.connectors.lmcache.stores.lm_client import LMClient

        geometry = make_chunk_geometry(model_dir.config, kv_dtype, world_size, worker_id, layout)
        wanted = [(c.key, c.end - c.start) for group_keys in ours for chunks in group_keys for c in chunks]
        with LMClient.from_url(peer, connections=1) as client:
            try:
                probes = probe_chunks(client, wanted, geometry)
            except PeerError as e:  # only the EXIST round, which any reachable server answers
                raise ConfigError(f"--peer unreachable: {e}") from None

    rows = build_rows(ours[0], comparison, probes) if len(ours) == 1 else build_group_rows(ours, layout, probes)
    for seq, chunks in zip(sequences, ours[0]):
        if not chunks:
            render.info(short_sequence_hint(len(seq), settings))
    if probes is not None and rows and not any(r.present for r in rows):
        render.info(peer_miss_hint(len(rows), peer, settings))
    if json_out:
        render.print_json(rows)
    else:
        render.stdout.print(render_table(rows, peer))
    code = exit_status(rows)
    if code:
        raise typer.Exit(code)


def blake3_group_key_settings(
    model_dir: ModelDir, model: str | None, settings: LMCacheKeySettings, max_model_len: int | None,
    disable_hybrid_kv_cache_manager: bool | None,
) -> tuple[KVCacheLayout, list[LMCacheKeySettings]]:
    """The KV cache groups of an engine on `model_dir` with LMCache's connector in blake3 mode and
    these flags, at the settings' KV dtype and world size, and the key settings of each group's
    chunks (`identity_digest.make_group_key_settings`, the connector's); one group: the settings with the
    engine's identity digest, as before groups.

    Raises the engine's ConfigError for flags it refuses.
    """
    from kvtool.engine.connectors.config import parse_kv_transfer_config
    from kvtool.engine.connectors.lmcache.identity_digest import make_group_key_settings
    from kvtool.engine.connectors.lmcache.identity_digest import make_identity_digest
    from kvtool.engine.kv.identity import identity_for_model, layout_for_model
    from kvtool.engine.params import EngineParams

    # The identity's device and dtype are not in its digest; the KV dtype and world size are the flags'.
    engine = EngineParams(model=model, device="cpu", max_model_len=max_model_len,
                          disable_hybrid_kv_cache_manager=disable_hybrid_kv_cache_manager,
                          kv_transfer_config=parse_kv_transfer_config(BLAKE3_WRITER))
    identity = identity_for_model(model_dir.path, engine)
    identity = msgspec.structs.replace(identity, kv_dtype=settings.kv_dtype, tp_size=settings.world_size)
    settings = msgspec.structs.replace(settings, identity_digest=make_identity_digest(identity))
    layout = layout_for_model(model_dir.path, engine)
    return layout, make_group_key_settings(settings, identity, layout)


def writer_device(device: str) -> torch.device:
    """--device as the writer's torch device; auto: CUDA where this machine has it, as `kvtool serve` picks."""
    import torch  # only --peer and blake3 get here, and both need torch anyway

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device)


def serve_kv_dtype(device: str) -> str:
    """The KV dtype `kvtool serve --device DEVICE` stores (its --dtype auto): float32 on CPU, else bfloat16."""
    return "float32" if writer_device(device).type == "cpu" else "bfloat16"


def short_sequence_hint(num_tokens: int, settings: LMCacheKeySettings) -> str:
    """Why a sequence got no key: it is shorter than one chunk."""
    return (
        f"hint: the sequence has {num_tokens} tokens, fewer than one chunk: a chunk needs "
        f"{settings.chunk_tokens} tokens (--chunk-tokens), so no chunk gets a key; use a longer prompt, "
        "a smaller --chunk-tokens (the writer's chunk_size) or --save-unfull-chunk"
    )


def peer_miss_hint(num_keys: int, peer: str, settings: LMCacheKeySettings) -> str:
    """What was compared when a server holds none of the keys."""
    return (
        f"hint: {peer} holds none of the {num_keys} keys. Compared keys for model name "
        f"{settings.model_name!r}, KV dtype {settings.kv_dtype} (LMCache's {settings.dtype_str!r}), "
        f"chunks of {settings.chunk_tokens} tokens, hash {settings.hash_algo}, world size {settings.world_size}, "
        f"worker {settings.worker_id}; each must match the writer (kvtool serve stores float32 on CPU, "
        "bfloat16 on CUDA): see --model-name, --kv-dtype, --device, --chunk-tokens, --hash-algo"
        + ("; blake3 keys also carry --model's weights and config (so another checkpoint's chunks never match) "
           "and the writer's KV cache groups (see --max-model-len, --disable-hybrid-kv-cache-manager)"
           if settings.hash_algo == "blake3" else "")
    )


def _open_model(model: str | None, show_progress: bool) -> ModelDir:
    """--model's directory, or the embedded default (converted on first use)."""
    if model is None and not is_default_model_ready():
        with render.progress_bar("converting the default model", enabled=show_progress) as bar:
            return open_model_dir(resolve_model_path(None, progress=bar))
    return open_model_dir(resolve_model_path(model))
