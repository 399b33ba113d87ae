"""verify-keys without a peer: pairing our keys with LMCache's, exit status, geometry, token files, rendering."""

from __future__ import annotations

import io
import json

import msgspec
import pytest
from rich.console import Console

from kvtool.commands.verify_keys import build_rows, exit_status, read_token_file, read_token_sequences, render_table
from kvtool.engine.connectors.lmcache.keys import LMCacheKeySettings, make_chunk_keys
from kvtool.engine.connectors.lmcache.probe import ChunkGeometry, ChunkProbe, chunk_problem
from kvtool.engine.connectors.lmcache.stores.protocol import ChunkHeader, MemoryFormat
from kvtool.engine.errors import ConfigError, PeerError
from kvtool.peer.compare import KeyComparison, compare_keys, compare_with_peer, lmcache_request

SETTINGS = LMCacheKeySettings("Qwen/Qwen3-0.6B", chunk_tokens=16, save_unfull_chunk=True)
SEQUENCES = [list(range(40)), list(range(100, 133))]


def peer_keys(sequences, settings=SETTINGS) -> list[list[tuple[int, int, str]]]:
    """What an agreeing peer answers: our own keys as `(start, end, key)`."""
    return [[(c.start, c.end, c.key) for c in make_chunk_keys(s, settings)] for s in sequences]


def comparison_of(theirs) -> KeyComparison:
    ours = [make_chunk_keys(s, SETTINGS) for s in SEQUENCES]
    return KeyComparison(lmcache_hash_func="sha256_cbor", lmcache_none_hash=0, sequences=compare_keys(ours, theirs))


def test_identical_keys_agree_and_exit_0():
    comparison = comparison_of(peer_keys(SEQUENCES))
    assert comparison.all_agree and comparison.num_disagreeing == 0
    assert [len(s) for s in comparison.sequences] == [3, 3]
    rows = build_rows([make_chunk_keys(s, SETTINGS) for s in SEQUENCES], comparison)
    assert all(r.agrees and r.lmcache_key == r.key for r in rows)
    assert exit_status(rows) == 0


def test_a_tampered_key_disagrees_and_exits_1():
    theirs = peer_keys(SEQUENCES)
    start, end, key = theirs[1][1]
    theirs[1][1] = (start, end, key.replace("Qwen/Qwen3-0.6B", "Qwen/Qwen3-8B"))
    comparison = comparison_of(theirs)
    assert not comparison.all_agree and comparison.num_disagreeing == 1
    bad = comparison.sequences[1][1]
    assert (bad.start, bad.end, bad.agrees) == (16, 32, False)
    assert bad.key != bad.lmcache_key and bad.lmcache_key.startswith("Qwen/Qwen3-8B@")
    rows = build_rows([make_chunk_keys(s, SETTINGS) for s in SEQUENCES], comparison)
    assert [r.agrees for r in rows] == [True, True, True, True, False, True]
    assert exit_status(rows) == 1


def test_a_peer_with_another_model_name_disagrees_everywhere():
    other = msgspec.structs.replace(SETTINGS, model_name="Qwen/Qwen3-8B")
    comparison = comparison_of(peer_keys(SEQUENCES, other))
    assert comparison.num_disagreeing == 6


def test_missing_and_extra_chunks_disagree():
    theirs = peer_keys(SEQUENCES)
    extra = (40, 41, "Qwen/Qwen3-0.6B@1@0@abc@bfloat16")
    theirs[0] = theirs[0][:2]  # LMCache did not key the partial chunk
    theirs[1] = theirs[1] + [extra]  # LMCache keyed one more
    comparison = comparison_of(theirs)
    first, second = comparison.sequences
    assert (first[2].key is not None, first[2].lmcache_key, first[2].agrees) == (True, None, False)
    assert (second[3].key, second[3].lmcache_key, second[3].agrees) == (None, extra[2], False)
    assert (second[3].start, second[3].end) == (40, 41)


def test_moved_chunk_bounds_disagree():
    theirs = peer_keys(SEQUENCES)
    start, end, key = theirs[0][2]
    theirs[0][2] = (start, end - 1, key)
    assert comparison_of(theirs).num_disagreeing == 1


def test_peer_answering_for_other_sequences_is_refused():
    with pytest.raises(PeerError, match="answered for 1 sequences, 2 were asked"):
        comparison_of(peer_keys(SEQUENCES[:1]))


def test_lmcache_request_names_lmcache_settings():
    settings = LMCacheKeySettings(
        "m", world_size=2, worker_id=1, kv_dtype="float16", chunk_tokens=16, hash_algo="builtin",
        none_hash_seed="0", save_unfull_chunk=True,
    )
    request = lmcache_request([[1, 2, 3]], settings)
    assert request == {
        "sequences": [[1, 2, 3]], "chunk_size": 16, "save_unfull_chunk": True, "hash_algo": "builtin",
        "model_name": "m", "world_size": 2, "worker_id": 1, "kv_dtype": "float16", "without_vllm": False,
    }
    assert lmcache_request([], SETTINGS)["hash_algo"] == "sha256_cbor"


def test_blake3_cannot_be_compared():
    with pytest.raises(ConfigError) as e:
        lmcache_request([[1]], msgspec.structs.replace(SETTINGS, hash_algo="blake3"))
    assert "LMCache has no such hash" in str(e.value) and "\n" not in str(e.value)


def test_missing_peer_interpreter_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="peer interpreter .* not found"):
        compare_with_peer([[1, 2]], SETTINGS, tmp_path / "no-python")


# ----------------------------------------------------------------------------- geometry

GEOMETRY = ChunkGeometry(num_layers=4, kv_hidden_size=128, dtype="float32")


def header(shape, dtype_code=4, fmt=MemoryFormat.KV_2LTD) -> ChunkHeader:
    itemsize = {2: 2, 3: 2, 4: 4, 6: 1}.get(dtype_code, 1)
    n = 1
    for d in shape:
        n *= d
    return ChunkHeader(int(fmt), dtype_code, tuple(shape), n * itemsize)


@pytest.mark.parametrize(
    "hdr, tokens, fragments",
    [
        (header((2, 4, 16, 128)), 16, None),
        (header((2, 4, 5, 128)), 5, None),
        (header((2, 2, 16, 128)), 16, ["layers 2, expected 4"]),
        (header((2, 4, 16, 64)), 16, ["KV hidden size 64, expected 128"]),
        (header((2, 4, 16, 128)), 8, ["tokens 16, expected 8"]),
        (header((2, 4, 16, 128), dtype_code=3), 16, ["dtype bfloat16, expected float32"]),
        (header((1, 4, 16, 128)), 16, ["K/V 1, expected 2"]),
        (header((4, 16, 128)), 16, ["has 3 dims"]),
        (header((2, 4, 16, 128), fmt=MemoryFormat.KV_T2D), 16, ["format KV_T2D, expected KV_2LTD"]),
        (header((2, 8, 16, 64), dtype_code=2), 16, ["layers 8", "KV hidden size 64", "dtype float16, expected float32"]),
    ],
)
def test_chunk_problem(hdr, tokens, fragments):
    problem = chunk_problem(hdr, tokens, GEOMETRY)
    if fragments is None:
        assert problem is None
    else:
        assert problem is not None and "\n" not in problem
        for fragment in fragments:
            assert fragment in problem


def test_geometry_numbers():
    assert GEOMETRY.shape(16) == (2, 4, 16, 128)
    assert GEOMETRY.num_bytes(16) == 2 * 4 * 16 * 128 * 4


# ----------------------------------------------------------------------------- token files


def test_jsonl_holds_one_sequence_per_line(tmp_path):
    f = tmp_path / "batch.jsonl"
    f.write_text("[1, 2, 3]\n\n[4]\n  [5, 6]  \n")
    assert read_token_sequences(f) == [[1, 2, 3], [4], [5, 6]]


@pytest.mark.parametrize(
    "text, expected",
    [
        ("[1, 2, 3]\n", [[1, 2, 3]]),
        ("[\n  1,\n  2\n]\n", [[1, 2]]),
        ("[1,\n 2]\n", [[1, 2]]),
        ("7\n8\n\n9\n", [[7, 8, 9]]),
    ],
)
def test_single_sequence_files(tmp_path, text, expected):
    f = tmp_path / "t"
    f.write_text(text)
    assert read_token_sequences(f) == expected
    assert read_token_file(f) == expected[0]


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("[1, 2]\n[3, x]\n", "line 2: malformed JSON"),
        ("[1, 2]\n[3, -4]\n", "line 2: token id -4 at $[1] is negative"),
        ("[1, 2]\n[]\n", "line 2: holds no token ids"),
        ("[1, 2]\n[1.5]\n", "line 2: Expected `int`"),
        ("[1, 2]\n3\n", "line 2"),
        ("[1, 2", "malformed JSON"),
        ("1\nx\n", "line 2"),
        ("", "holds no token ids"),
    ],
)
def test_bad_token_files(tmp_path, text, fragment):
    f = tmp_path / "t"
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        read_token_sequences(f)
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_missing_token_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        read_token_sequences(tmp_path / "nope")


# ----------------------------------------------------------------------------- report


def test_plain_rows_encode_as_start_end_key():
    rows = build_rows([make_chunk_keys(SEQUENCES[0], SETTINGS)])
    doc = json.loads(msgspec.json.encode(rows))
    assert doc == [{"start": c.start, "end": c.end, "key": c.key} for c in make_chunk_keys(SEQUENCES[0], SETTINGS)]


def test_rows_of_several_sequences_carry_their_index():
    rows = build_rows([make_chunk_keys(s, SETTINGS) for s in SEQUENCES])
    assert [r["sequence"] for r in json.loads(msgspec.json.encode(rows))] == [0, 0, 0, 1, 1, 1]


def test_probe_fields_appear_only_with_a_peer():
    chunks = make_chunk_keys(SEQUENCES[0], SETTINGS)
    probes = {
        chunks[0].key: ChunkProbe(present=True, shape=[2, 4, 16, 128], dtype="float32", fits=True, problem=None),
        chunks[1].key: ChunkProbe(present=True, shape=[2, 2, 16, 128], dtype="float32", fits=False,
                                  problem="layers 2, expected 4"),
    }
    rows = build_rows([chunks], probes=probes)
    doc = json.loads(msgspec.json.encode(rows))
    assert doc[0] == {"start": 0, "end": 16, "key": chunks[0].key, "present": True, "shape": [2, 4, 16, 128],
                      "dtype": "float32", "fits": True, "problem": None}
    assert doc[1]["fits"] is False and doc[1]["problem"] == "layers 2, expected 4"
    assert doc[2] == {"start": 32, "end": 40, "key": chunks[2].key, "present": False, "shape": None,
                      "dtype": None, "fits": None, "problem": None}
    assert exit_status(rows) == 1
    assert exit_status(build_rows([chunks], probes={k: v for k, v in probes.items() if v.fits})) == 0


def render(table) -> str:
    console = Console(width=250, record=True, file=io.StringIO())
    console.print(table)
    return console.export_text()


def test_table_shows_disagreements_and_misfits():
    theirs = peer_keys(SEQUENCES)
    theirs[0][1] = (16, 32, "Qwen/Qwen3-0.6B@1@0@abc@bfloat16")
    comparison = comparison_of(theirs)
    ours = [make_chunk_keys(s, SETTINGS) for s in SEQUENCES]
    probes = {ours[0][0].key: ChunkProbe(present=True, shape=[2, 2, 16, 128], dtype="float32", fits=False,
                                         problem="layers 2, expected 4")}
    text = render(render_table(build_rows(ours, comparison, probes), "lm://127.0.0.1:1"))
    assert "DIFFERS" in text and "Qwen/Qwen3-0.6B@1@0@abc@bfloat16" in text
    assert "2x2x16x128" in text and "layers 2, expected 4" in text
    assert "1 differ from LMCache's" in text and "1 held by lm://127.0.0.1:1, 1 do not fit" in text


def test_table_of_plain_keys_shows_every_key_whole():
    ours = make_chunk_keys(SEQUENCES[0], SETTINGS)
    text = render(render_table(build_rows([ours])))
    for chunk in ours:
        assert chunk.key in text
    assert "LMCache" not in text and "present" not in text
