"""LMCache keys and chunk hashes against golden vectors of the real LMCache 0.5.6 + vLLM 0.33 peer.

The golden file (`tests/data/lmcache-keys.json`) was produced by LMCache's own
`ChunkedTokenDatabase` with vLLM's own hashing, each setting in a fresh CPython 3.11 process.
CPython's `hash()` is checked against the interpreter running these tests, in subprocesses
started with a fixed PYTHONHASHSEED.
"""

from __future__ import annotations

import ast
import json
import pathlib
import random
import subprocess
import sys
import time

import msgspec
import pytest

from kvtool.commands.verify_keys import build_key_report, read_token_file
from kvtool.engine.connectors.lmcache import keys
from kvtool.engine.connectors.lmcache.keys import (
    ChunkKey,
    LMCacheKey,
    LMCacheKeySettings,
    cpython_hash,
    format_chunk_hash,
    format_key,
    lmcache_dtype_str,
    make_chunk_hash,
    make_chunk_keys,
    make_none_hash_int,
    parse_key,
    tags_from_request_configs,
)
from kvtool.engine.errors import ConfigError, InputError

GOLDEN_PATH = pathlib.Path(__file__).resolve().parents[3] / "data" / "lmcache-keys.json"
GOLDEN = json.loads(GOLDEN_PATH.read_text())
SEQUENCES: dict[str, list[int]] = GOLDEN["token_sequences"]["tokens"]
MODEL = GOLDEN["model_name"]

# The function LMCache actually ran -> kvtool's mode.
EFFECTIVE_TO_ALGO = {
    "vllm.utils.hashing.sha256_cbor": "vllm",
    "vllm.utils.hashing.sha256": "sha256",
    "builtins.hash": "builtin",
}


def golden_entries() -> list[tuple[dict, dict]]:
    return [(case, result) for case in GOLDEN["cases"] for result in case["results"]]


def settings_for(case: dict, result: dict) -> LMCacheKeySettings:
    """The kvtool settings that describe the peer of one golden entry."""
    return LMCacheKeySettings(
        GOLDEN["model_name"],
        world_size=GOLDEN["world_size"],
        worker_id=GOLDEN["worker_id"],
        kv_dtype=GOLDEN["kv_dtype"],
        chunk_tokens=result["chunk_size"],
        hash_algo=EFFECTIVE_TO_ALGO[result["effective_hash_func"]],
        none_hash_seed=case["PYTHONHASHSEED"],
        save_unfull_chunk=result["save_unfull_chunk"],
        peer_has_vllm=case["vllm_version"] is not None,
    )


def assert_one_line_config_error(excinfo: pytest.ExceptionInfo, *fragments: str) -> None:
    message = str(excinfo.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message


# ----------------------------------------------------------------------------- golden vectors


def test_golden_file_covers_every_mode_and_setting():
    entries = golden_entries()
    assert len(entries) == GOLDEN["subset"]["kept"] == 60
    assert {r["effective_hash_func"] for _, r in entries} == set(EFFECTIVE_TO_ALGO)
    assert {r["chunk_size"] for _, r in entries} == {16, 256}
    assert {r["save_unfull_chunk"] for _, r in entries} == {False, True}


@pytest.mark.parametrize(
    ("case", "result"), golden_entries(), ids=[r["id"] for _, r in golden_entries()]
)
def test_golden_keys_reproduced_exactly(case, result):
    settings = settings_for(case, result)
    tokens = SEQUENCES[result["sequence"]]
    assert len(tokens) == result["num_tokens"]
    assert make_none_hash_int(settings) == result["none_hash_int"]
    chunks = make_chunk_keys(tokens, settings)
    assert [[c.start, c.end, c.key] for c in chunks] == result["keys"]
    for chunk in chunks:
        assert parse_key(chunk.key).chunk_hash == chunk.chunk_hash


@pytest.mark.parametrize("case", GOLDEN["cases"], ids=[c["case"] for c in GOLDEN["cases"]])
def test_golden_reference_none_hashes(case):
    algo_names = {"sha256_cbor": "vllm", "sha256": "sha256", "builtin": "builtin"}
    for name, expected in case["ref_none_hash"].items():
        settings = LMCacheKeySettings(
            MODEL, hash_algo=algo_names[name], none_hash_seed=case["PYTHONHASHSEED"]
        )
        assert make_none_hash_int(settings) == expected, name


def test_no_vllm_peer_gives_the_same_keys_for_every_algorithm_name():
    """Without vLLM every LMCache name falls back to builtin hash from 0: one kvtool setting."""
    (case,) = [c for c in GOLDEN["cases"] if c["vllm_version"] is None]
    for result in case["results"]:
        assert result["effective_hash_func"] == "builtins.hash"
        assert result["none_hash_int"] == 0


def test_tensor_tokens_give_the_same_keys_as_a_list():
    import torch
    settings = LMCacheKeySettings(MODEL, chunk_tokens=16, save_unfull_chunk=True)
    tokens = SEQUENCES["rand257_seed3"]
    assert make_chunk_keys(torch.tensor(tokens, dtype=torch.long), settings) == make_chunk_keys(
        tokens, settings
    )
    assert make_chunk_keys(tuple(tokens), settings) == make_chunk_keys(tokens, settings)


# ----------------------------------------------------------------------------- wire vectors


def test_wire_vector_key_strings():
    wire = GOLDEN["wire_vectors"]
    assert format_key(MODEL, 1, 0, 0x31375F4BC7C57397, "bfloat16") == wire["key_string"]
    tags = tags_from_request_configs({"lmcache.tag.user": "alice", "lmcache.ignored": 1})
    assert tags == {"user": "alice"}
    assert format_key(MODEL, 1, 0, 0xABC, "bfloat16", tags=tags) == wire["tagged_key_string"]
    layer_key = format_key(MODEL, 1, 0, 0x31375F4BC7C57397, "bfloat16", layer_id=3)
    assert layer_key == wire["layer_key_string"]


def test_wire_vector_keys_parse_and_round_trip():
    wire = GOLDEN["wire_vectors"]
    plain = parse_key(wire["key_string"])
    assert plain == LMCacheKey(
        model_name=MODEL,
        world_size=1,
        worker_id=0,
        chunk_hash=0x31375F4BC7C57397,
        dtype_str="bfloat16",
    )
    assert parse_key(wire["tagged_key_string"]).tags == (("user", "alice"),)
    assert parse_key(wire["layer_key_string"]).layer_id == 3
    for name in ("key_string", "tagged_key_string", "layer_key_string"):
        assert parse_key(wire[name]).to_string() == wire[name]


@pytest.mark.parametrize("name", ["client_put", "client_get", "client_exist", "client_health"])
def test_wire_vector_request_headers_carry_the_key_space_padded(name):
    header = bytes.fromhex(GOLDEN["wire_vectors"][name])
    assert len(header) == 36 + keys.MAX_KEY_BYTES
    key_field = header[36:]
    key = GOLDEN["wire_vectors"]["key_string"]
    assert key_field == key.encode("ascii").ljust(keys.MAX_KEY_BYTES, b" ")
    assert parse_key(key_field.decode("ascii")).to_string() == key


def test_worked_example_sha256_cbor():
    """Doc 5.4 and the golden worked example: NONE_HASH, the CBOR bytes, one chunk, its key."""
    example = GOLDEN["wire_vectors"]["worked_example_sha256_cbor"]
    seed = example["none_hash_seed"]
    assert keys._cbor(seed).hex() == example["cbor(seed)"] == "6e766c6c6d2d6e6f6e652d68617368"
    settings = LMCacheKeySettings(MODEL, chunk_tokens=16)
    none_hash = make_none_hash_int(settings)
    assert none_hash == example["NONE_HASH_int"] == 11230124004819357437 == 0x9BD96A485AD84EFD
    chunk_input = keys._cbor((none_hash, list(range(16)), ()))
    assert chunk_input.hex() == example["cbor((NONE_HASH_int, tokens, ()))"]
    assert chunk_input[:2] == bytes([0x83, 0x1B])  # a 3-array; the prefix as a 64-bit uint
    chunk_hash = make_chunk_hash(none_hash, range(16), "sha256_cbor")
    assert chunk_hash == example["chunk_hash_int"] == 1929637065022821361
    (chunk,) = make_chunk_keys(list(range(16)), settings)
    assert chunk == ChunkKey(0, 16, chunk_hash, example["key"])
    assert chunk.key == "Qwen/Qwen3-0.6B@1@0@1ac772afde1cd3f1@bfloat16"


def test_canonical_cbor_uses_shortest_unsigned_heads():
    """Prefixes are unsigned 64-bit: >= 2**63 must stay major type 0, never a bignum tag."""
    assert keys._cbor(2**63).hex() == "1b8000000000000000"
    assert keys._cbor(2**64 - 1).hex() == "1bffffffffffffffff"
    assert keys._cbor(2**32).hex() == "1b0000000100000000"
    assert keys._cbor(2**32 - 1).hex() == "1affffffff"
    assert keys._cbor(65535).hex() == "19ffff"
    assert keys._cbor(255).hex() == "18ff"
    assert keys._cbor(23).hex() == "17"
    assert keys._cbor(()).hex() == "80"
    assert keys._cbor(list(range(256)))[:3].hex() == "990100"
    assert keys._cbor(list(range(88)))[:2].hex() == "9858"
    assert keys._cbor("").hex() == "60"


def test_pickle_worked_example_sha256():
    """Doc 5.6: the pickle stream and first key of `sha256` mode, seed unset."""
    settings = LMCacheKeySettings(MODEL, chunk_tokens=16, hash_algo="sha256")
    assert make_none_hash_int(settings) == 462496962774574867
    (chunk,) = make_chunk_keys(list(range(16)), settings)
    assert chunk.key == "Qwen/Qwen3-0.6B@1@0@ea7cf6c7ac5b561c@bfloat16"


# Doc 7.6: list(range(600)), chunk 256, save_unfull_chunk=True; (hash_algo, seed, peer_has_vllm).
RANGE600_TABLE = [
    ("vllm", None, True, ["31375f4bc7c57397", "675fd98cddfd2fcd", "657144e4621aa68"]),
    ("sha256", None, True, ["b701f70261ef60eb", "5b7cf36349423bac", "da5c4ea23508aeec"]),
    ("vllm", "0", True, ["b8a960cfcc69e7a5", "cc309e143d545625", "664d96c3d347af0f"]),
    ("builtin", "0", True, ["5f05dec65811b7cc", "-adc333b9eaa0e45", "948c07b0205483b"]),
    ("sha256", "0", True, ["a8ff4c2f0c4657fa", "27d757e52fa4414b", "dcc7b646df97db6e"]),
    ("vllm", "42", True, ["bc2f72bd16a94d9", "e65635760d678d1e", "d5a9a9af2da37ced"]),
    ("builtin", "42", True, ["5b876ee5b19a889d", "1a4b3c2c9df2465a", "-34e883f253d2e022"]),
    ("sha256", "42", True, ["d22c44024e83c46d", "87ffd88b1fc5d56d", "29beb161e8c80ff0"]),
    ("builtin", None, False, ["2b763dd00afa89c8", "79e62c807b48385b", "3c73ec436a8fe985"]),
]


@pytest.mark.parametrize(("algo", "seed", "peer_has_vllm", "hexes"), RANGE600_TABLE)
def test_doc_range600_table(algo, seed, peer_has_vllm, hexes):
    settings = LMCacheKeySettings(
        MODEL,
        hash_algo=algo,
        none_hash_seed=seed,
        peer_has_vllm=peer_has_vllm,
        save_unfull_chunk=True,
    )
    chunks = make_chunk_keys(list(range(600)), settings)
    assert [(c.start, c.end) for c in chunks] == [(0, 256), (256, 512), (512, 600)]
    assert [c.key for c in chunks] == [f"Qwen/Qwen3-0.6B@1@0@{h}@bfloat16" for h in hexes]
    # Without save_unfull_chunk the partial chunk gets no key; the full ones are unchanged.
    full_only_settings = msgspec.structs.replace(settings, save_unfull_chunk=False)
    full_only = make_chunk_keys(list(range(600)), full_only_settings)
    assert full_only == chunks[:2]


@pytest.mark.parametrize(
    ("sequence", "counts"),
    [
        ("rand255_seed1", (0, 1, 15, 16)),
        ("rand256_seed2", (1, 1, 16, 16)),
        ("rand257_seed3", (1, 2, 16, 17)),
        ("range600", (2, 3, 37, 38)),
        ("rand1000_seed4", (3, 4, 62, 63)),
    ],
)
def test_chunk_counts(sequence, counts):
    """Doc 5.8's table of keys per sequence for (cs 256, cs 256 unfull, cs 16, cs 16 unfull)."""
    tokens = SEQUENCES[sequence]
    got = []
    for cs in (256, 16):
        for unfull in (False, True):
            settings = LMCacheKeySettings(MODEL, chunk_tokens=cs, save_unfull_chunk=unfull)
            chunks = make_chunk_keys(tokens, settings)
            for i, chunk in enumerate(chunks):
                assert (chunk.start, chunk.end) == (i * cs, min((i + 1) * cs, len(tokens)))
            got.append(len(chunks))
    assert tuple(got) == counts


def test_vllm_mode_differs_from_vllm_block_hashes():
    """LMCache chains the 64-bit fold, vLLM the full digest: chunk hashes are not block hashes."""
    (case,) = [c for c in GOLDEN["cases"] if c["case"] == "vllm_seed_unset"]
    block_hashes = case["vllm_block_hash_relation"]["vllm_block_hashes_bs256"]
    chunks = make_chunk_keys(list(range(600)), LMCacheKeySettings(MODEL))
    assert [format_chunk_hash(c.chunk_hash) for c in chunks] != [h[:16] for h in block_hashes]


# ----------------------------------------------------------------------------- CPython hash()


def _random_values(rng: random.Random) -> list:
    ints = [0, 1, -1, -2, 2**61 - 2, 2**61 - 1, 2**61, -(2**61 - 1), 2**63, 2**64 - 1, -(2**63)]
    ints += [2**200 + 5, -(2**200)]
    ints += [rng.randrange(-(2**70), 2**70) for _ in range(40)]
    ints += [rng.randrange(151936) for _ in range(20)]
    strs = ["", "0", "42", "12345", "vllm-none-hash", "a", "abcdefg", "abcdefgh", "abcdefghi"]
    for _ in range(40):
        strs.append("".join(chr(rng.randrange(32, 127)) for _ in range(rng.randrange(40))))
    strs += ["é" * 9, "日本語", "\U0001f642x"]  # CPython's 1-, 2- and 4-byte representations

    def nested(depth: int):
        roll = rng.random()
        if depth > 3 or roll < 0.4:
            return rng.randrange(-(2**64), 2**64)
        if roll < 0.6:
            return rng.choice(strs)
        return tuple(nested(depth + 1) for _ in range(rng.randrange(5)))

    tuples = [(), ((),), (0, (), ())] + [nested(0) for _ in range(40)]
    for _ in range(3):  # the shape LMCache hashes: (prefix, tokens, ())
        tuples.append((rng.randrange(2**64), tuple(rng.randrange(151936) for _ in range(256)), ()))
    return ints + strs + tuples


def _hash_in_subprocess(values: list, seed: int) -> list[int]:
    script = (
        "import ast, json, sys; "
        "print(json.dumps([hash(v) for v in ast.literal_eval(sys.stdin.read())]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        input=repr(values),
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": str(seed)},
    )
    return json.loads(out.stdout)


@pytest.mark.skipif(
    sys.hash_info.width != 64 or sys.hash_info.algorithm != "siphash13",
    reason="needs a 64-bit CPython >= 3.11 (SipHash-1-3) as the reference",
)
@pytest.mark.parametrize("seed", [0, 42, 12345])
def test_cpython_hash_matches_the_interpreter(seed):
    values = _random_values(random.Random(seed))
    assert [ast.literal_eval(repr(v)) for v in values] == values  # survives the trip to the child
    expected = _hash_in_subprocess(values, seed)
    got = [cpython_hash(v, seed) for v in values]
    mismatches = [(v, e, g) for v, e, g in zip(values, expected, got) if e != g]
    assert not mismatches


def test_cpython_hash_known_values():
    """Independent of the interpreter: doc 5.2 and 5.5 constants (CPython 3.11.7)."""
    assert cpython_hash(()) == 5740354900026072187
    assert cpython_hash(-1) == -2
    assert cpython_hash(2**61 - 1) == 0
    assert cpython_hash("0", 0) == 5313149338359954478
    assert cpython_hash("42", 42) == 866561823186450123
    assert cpython_hash("", 12345) == 0
    with pytest.raises(TypeError):
        cpython_hash(1.5)


# ----------------------------------------------------------------------------- refusals


def test_builtin_without_seed_is_refused():
    with pytest.raises(ConfigError) as excinfo:
        LMCacheKeySettings(MODEL, hash_algo="builtin")
    assert_one_line_config_error(excinfo, "none_hash_seed", "PYTHONHASHSEED", "random")


def test_builtin_with_empty_seed_or_without_vllm_is_accepted():
    empty_seed = LMCacheKeySettings(MODEL, hash_algo="builtin", none_hash_seed="")
    assert make_none_hash_int(empty_seed) == 0  # hash("") is 0 under any key
    no_vllm = LMCacheKeySettings(MODEL, hash_algo="builtin", peer_has_vllm=False)
    assert make_none_hash_int(no_vllm) == 0


@pytest.mark.parametrize("seed", ["random", "-1", "4294967296", "0x2a", " 42"])
def test_builtin_seed_python_would_refuse_is_refused(seed):
    with pytest.raises(ConfigError) as excinfo:
        LMCacheKeySettings(MODEL, hash_algo="builtin", none_hash_seed=seed)
    assert_one_line_config_error(excinfo, "PYTHONHASHSEED")


@pytest.mark.parametrize("algo", ["vllm", "sha256_cbor", "sha256", "blake3"])
def test_peer_without_vllm_needs_builtin(algo):
    with pytest.raises(ConfigError) as excinfo:
        LMCacheKeySettings(MODEL, hash_algo=algo, peer_has_vllm=False)
    assert_one_line_config_error(excinfo, "peer_has_vllm", "'builtin'")


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        ({"hash_algo": "xxhash"}, "hash_algo"),
        ({"kv_dtype": "float17"}, "float17"),
        ({"kv_dtype": "fp8"}, "uint8"),
        ({"world_size": 0}, "world_size"),
        ({"worker_id": 1}, "worker_id"),
        ({"chunk_tokens": 0}, "chunk_tokens"),
        ({"model_name": "org@name/model"}, "'@'"),
        ({"model_name": " Qwen"}, "whitespace"),
        ({"model_name": ""}, "empty"),
        ({"model_name": "m" * 121}, "150"),
    ],
)
def test_bad_settings_are_refused(fields, fragment):
    with pytest.raises(ConfigError) as excinfo:
        LMCacheKeySettings(**{"model_name": MODEL, **fields})
    assert_one_line_config_error(excinfo, fragment)


def test_model_name_length_limit_is_the_worst_case_key():
    """A model that fits with 16 hex digits is accepted; builtin's 17 characters need one less."""
    LMCacheKeySettings("m" * 120)
    with pytest.raises(ConfigError):
        LMCacheKeySettings("m" * 120, hash_algo="builtin", none_hash_seed="0")
    LMCacheKeySettings("m" * 119, hash_algo="builtin", none_hash_seed="0")


def test_settings_decode_strictly_from_json():
    settings = msgspec.json.decode(
        b'{"model_name": "Qwen/Qwen3-0.6B", "hash_algo": "sha256_cbor", "none_hash_seed": "0"}',
        type=LMCacheKeySettings,
    )
    assert make_none_hash_int(settings) == 5625442194607170974
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(b'{"model_name": "m", "chunk_size": 16}', type=LMCacheKeySettings)
    with pytest.raises(ConfigError):
        msgspec.json.decode(b'{"model_name": "m", "hash_algo": "builtin"}', type=LMCacheKeySettings)


def test_bad_tokens_are_refused():
    settings = LMCacheKeySettings(MODEL, chunk_tokens=4)
    with pytest.raises(InputError):
        make_chunk_keys([1, 2, 3, 4.0], settings)
    with pytest.raises(InputError):
        make_chunk_keys([1, 2, -3, 4], settings)
    assert make_chunk_keys([], settings) == []


# ----------------------------------------------------------------------------- key strings


def test_hex_formatting():
    assert format_chunk_hash(-0xADC333B9EAA0E45) == "-adc333b9eaa0e45"
    assert format_chunk_hash(-(2**63)) == "-8000000000000000"
    assert format_chunk_hash(0x0657144E4621AA68) == "657144e4621aa68"  # no zero padding
    assert format_chunk_hash(0xABC) == "abc"
    assert format_chunk_hash(0) == "0"
    assert format_chunk_hash(2**64 - 1) == "ffffffffffffffff"
    key = format_key(MODEL, 1, 0, -0x34E883F253D2E022, "bfloat16")
    assert key == "Qwen/Qwen3-0.6B@1@0@-34e883f253d2e022@bfloat16"
    assert parse_key(key).chunk_hash == -0x34E883F253D2E022


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [
        ("float16", "half"),
        ("half", "half"),
        ("bfloat16", "bfloat16"),
        ("float32", "float"),
        ("float64", "double"),
        ("uint8", "uint8"),
        ("int64", "int64"),
        ("bool", "bool"),
        ("float8_e4m3fn", "fp8_e4m3fn"),
        ("float8_e5m2fnuz", "fp8_e5m2fnuz"),
        ("torch.float16", "half"),
    ],
)
def test_dtype_strings(dtype, expected):
    assert lmcache_dtype_str(dtype) == expected


def test_dtype_strings_from_torch_dtypes():
    import torch
    assert lmcache_dtype_str(torch.float16) == "half"
    assert lmcache_dtype_str(torch.bfloat16) == "bfloat16"
    assert lmcache_dtype_str(torch.float32) == "float"
    assert lmcache_dtype_str(torch.float8_e4m3fn) == "fp8_e4m3fn"


def test_parse_accepts_what_the_peer_treats_as_the_same_key():
    canonical = "Qwen/Qwen3-0.6B@1@0@31375f4bc7c57397@bfloat16"
    for variant in (
        "Qwen/Qwen3-0.6B@1@0@31375F4BC7C57397@bfloat16",
        "Qwen/Qwen3-0.6B@1@0@0031375f4bc7c57397@bfloat16",
    ):
        assert parse_key(variant).to_string() == canonical
    assert parse_key(canonical.ljust(150)).to_string() == canonical
    assert parse_key("health@1@0@0@half").chunk_hash == 0


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("org@Qwen3@1@0@abc@bfloat16", "model name 'org@Qwen3' contains '@'"),
        ("m" * 140 + "@1@0@abc@bfloat16", "150"),
        ("Qwen@1@0@abc@float16", "float16"),
        ("Qwen@1@0@abc", "at least 5"),
        ("Qwen@x@0@abc@half", "world size"),
        ("Qwen@1@y@abc@half", "worker id"),
        ("Qwen@1@0@xyz@half", "hexadecimal"),
        ("Qwen@1@0@0x1@half", "hexadecimal"),
        ("Qwen@1@0@abc@half@user", "tag%value"),
    ],
)
def test_parse_refusals(text, fragment):
    with pytest.raises(ConfigError) as excinfo:
        parse_key(text)
    assert_one_line_config_error(excinfo, fragment)


def test_format_refusals():
    with pytest.raises(ConfigError, match="'@'"):
        format_key("a@b", 1, 0, 1, "bfloat16")
    with pytest.raises(ConfigError, match="dtype"):
        format_key(MODEL, 1, 0, 1, "float16")
    with pytest.raises(ConfigError, match="tag"):
        format_key(MODEL, 1, 0, 1, "half", tags={"a@b": "x"})
    with pytest.raises(ConfigError, match="tag"):
        format_key(MODEL, 1, 0, 1, "half", tags={"user": "x@y"})


def test_tags_enter_every_key_in_order():
    settings = LMCacheKeySettings(MODEL, chunk_tokens=256)
    tags = tags_from_request_configs({"lmcache.tag.user": "alice", "other": 1, "lmcache.tag.n": 7})
    chunks = make_chunk_keys(list(range(600)), settings, tags=tags)
    assert [c.key for c in chunks] == [
        "Qwen/Qwen3-0.6B@1@0@31375f4bc7c57397@bfloat16@user%alice@n%7",
        "Qwen/Qwen3-0.6B@1@0@675fd98cddfd2fcd@bfloat16@user%alice@n%7",
    ]
    assert parse_key(chunks[0].key).tags == (("user", "alice"), ("n", "7"))


def test_key_fields_follow_settings():
    settings = LMCacheKeySettings("/models/llama", world_size=2, worker_id=1, kv_dtype="float16")
    (chunk,) = make_chunk_keys(list(range(256)), settings)
    parsed = parse_key(chunk.key)
    assert (parsed.model_name, parsed.world_size, parsed.worker_id, parsed.dtype_str) == (
        "/models/llama",
        2,
        1,
        "half",
    )
    # The chunk hash does not depend on the key fields.
    (default_chunk,) = make_chunk_keys(list(range(256)), LMCacheKeySettings(MODEL))
    assert chunk.chunk_hash == default_chunk.chunk_hash


# ----------------------------------------------------------------------------- blake3 mode


def test_blake3_mode_is_self_consistent_and_distinct():
    settings = LMCacheKeySettings(
        MODEL, hash_algo="blake3", chunk_tokens=16, save_unfull_chunk=True
    )
    tokens = SEQUENCES["rand257_seed3"]
    chunks = make_chunk_keys(tokens, settings)
    assert chunks == make_chunk_keys(tokens, settings)
    assert len(chunks) == 17
    prefix = make_none_hash_int(settings)
    for chunk in chunks:
        prefix = make_chunk_hash(prefix, tokens[chunk.start : chunk.end], "blake3")
        assert chunk.chunk_hash == prefix
    vllm = make_chunk_keys(tokens, msgspec.structs.replace(settings, hash_algo="vllm"))
    assert not {c.key for c in chunks} & {c.key for c in vllm}


def _identity(**kw):
    from kvtool.engine.connectors.base import EngineIdentity
    from kvtool.engine.kv.pages import KVGeometry

    fields = dict(model_name=MODEL, architecture="Qwen3ForCausalLM", config_digest="c", weights_digest="w",
                  rope_digest="r", sliding_window=0, weight_quantization="none", kv_dtype="float32",
                  kv_quantization="none", block_hash_algo="sha256_cbor", none_hash_seed="s", model_num_kv_heads=4,
                  geometry=KVGeometry(num_layers=2, num_kv_heads=4, head_dim=8, block_size=16, dtype="float32"))
    fields.update(kw)
    return EngineIdentity(**fields)


def test_identity_digest_covers_what_the_chunk_bytes_depend_on():
    from kvtool.engine.connectors.base import identity_of_rank
    from kvtool.engine.connectors.lmcache.identity_digest import make_identity_digest

    base = make_identity_digest(_identity())
    assert base == make_identity_digest(_identity())  # deterministic: shared across processes
    geometry = _identity().geometry
    for change in ({"weights_digest": "w2"}, {"config_digest": "c2"}, {"rope_digest": "r2"},
                   {"architecture": "LlamaForCausalLM"}, {"sliding_window": 4096}, {"kv_dtype": "bfloat16"},
                   {"kv_quantization": "fp8"}, {"weight_quantization": "awq"}, {"tp_size": 2}, {"pp_size": 2},
                   {"geometry": msgspec.structs.replace(geometry, num_layers=3)},
                   {"geometry": msgspec.structs.replace(geometry, head_dim=16)}):
        assert make_identity_digest(_identity(**change)) != base, change
    # Provenance, key fields and the page block size do not change a chunk's bytes.
    for same in ({"engine_id": "other"}, {"device_type": "cuda"}, {"model_name": "other"},
                 {"none_hash_seed": "t"}, {"geometry": msgspec.structs.replace(geometry, block_size=32)}):
        assert make_identity_digest(_identity(**same)) == base, same
    # Every rank of one engine has one digest: the scheduler half keys chunks as rank 0.
    tp2 = _identity(tp_size=2)
    assert len({make_identity_digest(identity_of_rank(tp2, 2, r)) for r in range(2)}) == 1


def test_blake3_keys_with_an_identity_digest():
    tokens = SEQUENCES["rand257_seed3"]
    plain = LMCacheKeySettings(MODEL, hash_algo="blake3", chunk_tokens=16)
    a, b = (msgspec.structs.replace(plain, identity_digest=d) for d in ("a" * 64, "b" * 64))
    keys_a, keys_b = make_chunk_keys(tokens, a), make_chunk_keys(tokens, b)
    assert keys_a == make_chunk_keys(tokens, msgspec.structs.replace(plain, identity_digest="a" * 64))
    assert not {k.key for k in keys_a} & {k.key for k in keys_b}
    assert not {k.key for k in keys_a} & {k.key for k in make_chunk_keys(tokens, plain)}
    # Only the hash field differs: the key still parses as LMCache's, with the same fields.
    parsed = parse_key(keys_a[0].key)
    assert (parsed.model_name, parsed.world_size, parsed.worker_id, parsed.dtype_str) == (MODEL, 1, 0, "bfloat16")
    assert parsed.chunk_hash == keys_a[0].chunk_hash


@pytest.mark.parametrize("algo", ["vllm", "sha256", "builtin"])
def test_peer_modes_refuse_an_identity_digest(algo):
    with pytest.raises(ConfigError, match="byte for byte"):
        LMCacheKeySettings(MODEL, hash_algo=algo, none_hash_seed="0", identity_digest="a" * 64)


def test_connector_settings_carry_the_digest_in_blake3_mode_only():
    from kvtool.engine.connectors.lmcache.settings import parse_settings

    settings, key_settings = parse_settings({}, MODEL, "float32", 16, identity_digest="d" * 64)
    assert key_settings.identity_digest == "d" * 64 and settings.verify_payload is True
    settings, key_settings = parse_settings({"verify_payload": False}, MODEL, "float32", 16, identity_digest="d")
    assert key_settings.identity_digest == "d" and settings.verify_payload is False
    for algo in ("vllm", "builtin"):
        extra = {"hash_algo": algo, "none_hash_seed": "0"}
        settings, key_settings = parse_settings(extra, MODEL, "float32", 16, identity_digest="d")
        assert key_settings.identity_digest is None and settings.verify_payload is False
        settings, _ = parse_settings({**extra, "verify_payload": True}, MODEL, "float32", 16)
        assert settings.verify_payload is True


# ----------------------------------------------------------------------------- performance


@pytest.mark.parametrize(("algo", "seed"), [("vllm", None), ("builtin", "0")])
def test_hashing_32k_tokens_is_fast(algo, seed):
    """32k tokens should hash well under 100 ms; the bound here leaves room for a loaded machine."""
    settings = LMCacheKeySettings(MODEL, hash_algo=algo, none_hash_seed=seed)
    tokens = random.Random(0).choices(range(151936), k=32768)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        make_chunk_keys(tokens, settings)
        best = min(best, time.perf_counter() - start)
    assert best < 0.25


# ----------------------------------------------------------------------------- verify-keys helpers


def test_read_token_file_json_and_lines(tmp_path):
    json_file = tmp_path / "tokens.json"
    json_file.write_text(" [1, 2, 151935]\n")
    assert read_token_file(json_file) == [1, 2, 151935]
    lines_file = tmp_path / "tokens.txt"
    lines_file.write_text("1\n 2 \n\n151935\n")
    assert read_token_file(lines_file) == [1, 2, 151935]


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        ("[1, 2.0]", "int"),
        ("[1, true]", "int"),
        ('{"tokens": [1]}', "not a non-negative integer"),
        ("[1, -2]", "negative"),
        ("[1, 2", "malformed JSON"),
        ("1\n2 3\n", "line 2"),
        ("1\n-2\n", "line 2"),
        ("", "no token ids"),
        ("[]", "no token ids"),
    ],
)
def test_read_token_file_refusals(tmp_path, content, fragment):
    path = tmp_path / "tokens"
    path.write_text(content)
    with pytest.raises(ConfigError) as excinfo:
        read_token_file(path)
    assert_one_line_config_error(excinfo, fragment)


def test_read_token_file_missing(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        read_token_file(tmp_path / "absent.json")


def test_build_key_report_matches_golden():
    (case,) = [c for c in GOLDEN["cases"] if c["case"] == "vllm_seed_unset"]
    entry_id = "vllm_seed_unset:sha256_cbor:cs256:su1:range600"
    result = next(r for r in case["results"] if r["id"] == entry_id)
    report = build_key_report(SEQUENCES["range600"], settings_for(case, result))
    assert report == [{"start": s, "end": e, "key": k} for s, e, k in result["keys"]]
    assert json.loads(json.dumps(report)) == report
