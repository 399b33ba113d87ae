"""`kvtool verify-keys` against the real LMCache: its own ChunkedTokenDatabase and its own server.

Importing LMCache and vLLM costs a peer process most of its time, so the random-sequence check
runs every setting of one PYTHONHASHSEED in one peer process (`compare_many_with_peer`), and
the CLI runs against the real peer once, with a JSON Lines batch, while that check runs.
Everything else drives the CLI in this process (`run_kvtool`); one bad input runs in a real
process too.
"""

from __future__ import annotations

import json
import random
import subprocess
import uuid

import pytest
import torch

from kvtool.engine.connectors.lmcache.keys import LMCacheKeySettings, make_chunk_keys, make_none_hash_int
from kvtool.engine.connectors.lmcache.stores.lm_client import LMClient
from kvtool.engine.connectors.lmcache.stores.protocol import kv_chunk_header, tensor_buffer
from kvtool.peer.compare import compare_many_with_peer
from tests.conftest import kvtool_cmd
from tests.support.peer_server import free_port, require_peer_python

peer = pytest.mark.peer

SEEDS = (None, "0", "42")
# (model name, KV dtype, world size, worker id): every field of the key changes somewhere.
WRITERS = (
    ("Qwen/Qwen3-0.6B", "bfloat16", 1, 0),
    ("meta-llama/Llama-3.1-8B-Instruct", "float16", 2, 1),
    ("/srv/models/qwen3-8b", "float32", 4, 3),
    ("RedHatAI/Qwen3-8B-FP8-dynamic", "uint8", 1, 0),  # an fp8 KV cache, as vLLM allocates it
)
SEQUENCES_PER_SETTING = 11


def settings_grid() -> list[LMCacheKeySettings]:
    """20 settings: seeds x chunk sizes x save_unfull x hash modes (builtin only with a seed)."""
    grid = []
    for seed in SEEDS:
        for algo in ("vllm", "builtin"):
            if algo == "builtin" and seed is None:
                continue  # the peer's chain start is random: refused by LMCacheKeySettings
            for chunk_tokens in (16, 256):
                for save_unfull in (False, True):
                    model, dtype, world, worker = WRITERS[len(grid) % len(WRITERS)]
                    grid.append(
                        LMCacheKeySettings(
                            model, world_size=world, worker_id=worker, kv_dtype=dtype,
                            chunk_tokens=chunk_tokens, hash_algo=algo, none_hash_seed=seed,
                            save_unfull_chunk=save_unfull,
                        )
                    )
    return grid


def random_sequences(rng: random.Random, chunk_tokens: int, count: int) -> list[list[int]]:
    """Lengths at the chunk edges and at random in [1, 3000]; ids mostly vocabulary-sized."""
    lengths = [1, chunk_tokens - 1 or 2, chunk_tokens, chunk_tokens + 1, 3000]
    lengths += [rng.randint(1, 3000) for _ in range(count - len(lengths))]
    sequences = []
    for i, n in enumerate(lengths):
        top = 2**31 - 1 if i % 4 == 3 else 151_935  # large ids take longer CBOR heads
        sequences.append([rng.randint(0, top) for _ in range(n)])
    return sequences


def expected_num_keys(n: int, settings: LMCacheKeySettings) -> int:
    cs = settings.chunk_tokens
    return -(-n // cs) if settings.save_unfull_chunk else n // cs


def run_cli(args: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(kvtool_cmd() + ["verify-keys", *map(str, args)], env=env, capture_output=True,
                          text=True, timeout=600)


# ----------------------------------------------------------------------------- against LMCache


@peer
def test_keys_equal_lmcache_for_random_sequences_and_through_the_cli(tmp_path, cli_env):
    require_peer_python()
    # The CLI's own run against the peer: a JSON Lines batch, builtin hashing under seed 42.
    cli_sequences = random_sequences(random.Random(7), 16, 6)
    batch = tmp_path / "batch.jsonl"
    batch.write_text("".join(json.dumps(s) + "\n" for s in cli_sequences))
    cli_args = ["--tokens", batch, "--against-lmcache", "--hash-algo", "builtin", "--none-hash-seed", "42",
                "--chunk-tokens", "16", "--save-unfull-chunk", "--model-name", "Qwen/Qwen3-0.6B", "--json"]
    cli = subprocess.Popen(kvtool_cmd() + ["verify-keys", *map(str, cli_args)], env=cli_env,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        rng = random.Random(20261129)
        grid = settings_grid()
        jobs = [(random_sequences(rng, s.chunk_tokens, SEQUENCES_PER_SETTING), s) for s in grid]
        comparisons = compare_many_with_peer(jobs, require_peer_python())
    finally:
        cli_out, cli_err = cli.communicate(timeout=600)

    assert len(grid) == 20 and sum(len(seqs) for seqs, _ in jobs) >= 200
    for (sequences, settings), comparison in zip(jobs, comparisons):
        label = f"{settings.hash_algo} seed={settings.none_hash_seed} cs={settings.chunk_tokens} " \
                f"unfull={settings.save_unfull_chunk}"
        bad = [(i, a) for i, chunks in enumerate(comparison.sequences) for a in chunks if not a.agrees]
        assert not bad, f"{label}: {len(bad)} keys differ, first {bad[0]}"
        assert comparison.lmcache_hash_func == ("sha256_cbor" if settings.hash_algo == "vllm" else "hash"), label
        assert comparison.lmcache_none_hash == make_none_hash_int(settings), label
        assert [len(c) for c in comparison.sequences] == [expected_num_keys(len(s), settings) for s in sequences]

    assert cli.returncode == 0, cli_err
    rows = json.loads(cli_out)
    settings = LMCacheKeySettings("Qwen/Qwen3-0.6B", chunk_tokens=16, hash_algo="builtin", none_hash_seed="42",
                                  save_unfull_chunk=True)
    assert rows == [
        {"sequence": i, "start": c.start, "end": c.end, "key": c.key, "lmcache_key": c.key, "agrees": True}
        for i, s in enumerate(cli_sequences)
        for c in make_chunk_keys(s, settings)
    ]
    assert sum(expected_num_keys(len(s), settings) for s in cli_sequences) == len(rows)


def test_blake3_is_refused_with_against_lmcache(tmp_path, run_kvtool):
    tokens = tmp_path / "t.json"
    tokens.write_text("[1, 2, 3]")
    code, out, err = run_kvtool(["verify-keys", "--tokens", tokens, "--hash-algo", "blake3", "--against-lmcache"])
    assert code == 2 and out == ""
    assert err.strip().splitlines() == [err.strip()] and "LMCache has no such hash" in err


# ----------------------------------------------------------------------------- on an LMCache server

TOKENS = list(range(1000, 1040))  # chunks [0, 16) and [16, 32) get keys; [32, 40) does not


def put_chunk(client: LMClient, key: str, shape: tuple[int, ...]) -> None:
    t = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    header = kv_chunk_header(t.shape, t.dtype)
    client.put(key, tensor_buffer(t), header.fmt, header.dtype_code, header.shape)


@pytest.fixture
def stored(lmcache_server, tiny_model_dir, tmp_path):
    """PUTs chunks for TOKENS under a model name of its own; returns (put, common CLI args)."""
    host, port, _ = lmcache_server
    model_name = f"kvtool-test/verify-{uuid.uuid4().hex[:12]}"
    keys = [c.key for c in make_chunk_keys(TOKENS, LMCacheKeySettings(model_name, kv_dtype="float32",
                                                                      chunk_tokens=16))]
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps(TOKENS))
    args = ["verify-keys", "--peer", f"lm://{host}:{port}", "--tokens", tokens, "--model", tiny_model_dir,
            "--model-name", model_name, "--kv-dtype", "float32", "--chunk-tokens", "16"]
    client = LMClient(host, port, connections=1)

    def put(index: int, shape: tuple[int, ...]) -> None:
        put_chunk(client, keys[index], shape)

    yield put, args, keys
    client.close()


GOOD = (2, 4, 16, 128)  # tiny preset: 4 layers, 2 KV heads x head_dim 64
WRONG_LAYERS = (2, 2, 16, 128)


@peer
def test_peer_reports_a_chunk_that_does_not_fit(stored, cli_env):
    put, args, keys = stored
    put(0, GOOD)
    put(1, WRONG_LAYERS)
    out = run_cli(args[1:] + ["--json"], cli_env)
    assert out.returncode == 1, out.stderr
    rows = json.loads(out.stdout)
    assert rows == [
        {"start": 0, "end": 16, "key": keys[0], "present": True, "shape": list(GOOD), "dtype": "float32",
         "fits": True, "problem": None},
        {"start": 16, "end": 32, "key": keys[1], "present": True, "shape": list(WRONG_LAYERS),
         "dtype": "float32", "fits": False, "problem": "layers 2, expected 4"},
    ]


@peer
def test_peer_with_only_fitting_chunks_exits_0(stored, run_kvtool):
    put, args, keys = stored
    put(0, GOOD)
    code, out, err = run_kvtool(args + ["--json"])
    assert code == 0, err
    rows = json.loads(out)
    assert [(r["present"], r["fits"], r["shape"]) for r in rows] == [(True, True, list(GOOD)), (False, None, None)]

    code, out, err = run_kvtool(args)
    assert code == 0, err
    assert "2x4x16x128" in out and "1 held by lm://" in out


@peer
def test_peer_chunk_too_large_to_read_does_not_fit(stored, run_kvtool):
    put, args, _ = stored
    put(0, (2, 4, 16, 128 * 8))  # 8x the expected bytes: over the read buffer
    put(1, (2, 4, 16, 128 * 3))  # 3x: read, and reported as it is
    code, out, err = run_kvtool(args + ["--json"])
    assert code == 1, err
    first, second = json.loads(out)
    assert (first["present"], first["fits"], first["shape"]) == (True, False, None)
    assert "announces 524288 bytes, the buffer holds 262144" in first["problem"]
    assert (second["fits"], second["shape"], second["problem"]) == (
        False, [2, 4, 16, 384], "KV hidden size 384, expected 128")


@peer
def test_peer_table_names_the_misfit(stored, run_kvtool):
    put, args, _ = stored
    put(1, (2, 4, 16, 128 * 2))
    code, out, err = run_kvtool(args)
    assert code == 1, err
    assert "problem" in out and "1 do not fit" in out  # a narrow table folds the problem text


def test_peer_finds_an_engines_blake3_chunks_only_with_its_model(make_engine, lmcache_server, tiny_model_dir,
                                                                  tmp_path, run_kvtool):
    """blake3 keys carry the writer's identity: verify-keys derives it from --model."""
    from kvtool.engine.connectors.config import parse_kv_transfer_config
    from kvtool.engine.params import SamplingParams
    from kvtool.engine.presets.catalog import create_model_dir

    host, port, _ = lmcache_server
    model_name = f"kvtool-test/blake3-{uuid.uuid4().hex[:12]}"
    engine = make_engine(kv_transfer_config=parse_kv_transfer_config(json.dumps({
        "kv_connector": "LMCacheConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"host": host, "port": port, "model_name": model_name}})))
    tiny_tokens = [t % 500 for t in TOKENS]  # the tiny model's vocabulary has 512 ids
    engine.generate([tiny_tokens], SamplingParams(max_tokens=1, temperature=0.0))
    engine.executor.worker.connector.flush()
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps(tiny_tokens))
    args = ["verify-keys", "--peer", f"lm://{host}:{port}", "--tokens", tokens, "--model-name", model_name,
            "--kv-dtype", "float32", "--chunk-tokens", "16", "--hash-algo", "blake3", "--json"]
    code, out, err = run_kvtool(args + ["--model", tiny_model_dir])
    assert code == 0, err
    rows = json.loads(out)
    assert [(r["present"], r["fits"]) for r in rows] == [(True, True), (True, True)]
    expected = make_chunk_keys(tiny_tokens, engine.scheduler.connector.key_settings)
    assert [r["key"] for r in rows] == [k.key for k in expected]

    other = tmp_path / "other"
    create_model_dir(other, preset="tiny", seed=1)
    code, out, err = run_kvtool(args + ["--model", other])
    assert code == 0, err
    assert [r["present"] for r in json.loads(out)] == [False, False]
    assert "another checkpoint" in err


def test_peer_finds_every_kv_cache_groups_blake3_chunks(make_engine, lmcache_server, tmp_path, run_kvtool):
    """A Gemma 3 engine stores a chunk per KV cache group (blake3 keys, a chain per group): verify-keys
    keys the same groups, finds each group's chunks and fits them to the layout's slots; the keys of
    a one-group engine (--disable-hybrid-kv-cache-manager) find none."""
    from kvtool.engine.connectors.config import parse_kv_transfer_config
    from kvtool.engine.params import SamplingParams
    from tests.support.window_models import window_model_dir

    host, port, _ = lmcache_server
    model_dir = window_model_dir(tmp_path, "tiny-gemma3")
    model_name = f"kvtool-test/groups-{uuid.uuid4().hex[:12]}"
    engine = make_engine(model=str(model_dir), kv_transfer_config=parse_kv_transfer_config(json.dumps({
        "kv_connector": "LMCacheConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"host": host, "port": port, "model_name": model_name}})))
    tiny_tokens = [t % 500 for t in TOKENS]
    engine.generate([tiny_tokens], SamplingParams(max_tokens=1, temperature=0.0))
    engine.executor.worker.connector.flush()
    layout = engine.kv_layout
    assert layout.num_groups == 3  # windowed layers 0,3 and 1,4; global layers 2,5
    expected = [[k.key for k in make_chunk_keys(tiny_tokens, s)] for s in engine.scheduler.connector.group_key_settings]
    tokens = tmp_path / "tokens.json"
    tokens.write_text(json.dumps(tiny_tokens))
    args = ["verify-keys", "--peer", f"lm://{host}:{port}", "--tokens", tokens, "--model", model_dir,
            "--model-name", model_name, "--kv-dtype", "float32", "--device", "cpu", "--chunk-tokens", "16",
            "--hash-algo", "blake3"]

    code, out, err = run_kvtool(args + ["--json"])
    assert code == 0, err
    rows = json.loads(out)
    groups = [{"index": g, "kind": group.kind, "sliding_window": group.sliding_window, "layers": list(group.layers)}
              for g, group in enumerate(layout.groups)]
    assert [(r["start"], r["group"]) for r in rows] == [(start, group) for start in (0, 16) for group in groups]
    assert [r["key"] for r in rows] == [expected[g][i] for i in range(2) for g in range(3)]
    assert all(r["present"] and r["fits"] and r["shape"] == [2, layout.num_slots, 16, 128] for r in rows)

    code, out, err = run_kvtool(args)
    assert code == 0, err
    assert "0: window" in out and "2: full," in out  # a narrow table folds the rest of the group's cell
    assert "6 keys of 3 KV cache groups; 6 held by" in out

    code, out, err = run_kvtool(args + ["--json", "--disable-hybrid-kv-cache-manager"])
    assert code == 0, err
    assert [(r["present"], "group" in r) for r in json.loads(out)] == [(False, False)] * 2
    assert "holds none of the 2 keys" in err


# ----------------------------------------------------------------------------- keys alone


def test_json_keys_from_each_token_file_form(tmp_path, run_kvtool):
    settings = LMCacheKeySettings("Qwen/Qwen3-0.6B", chunk_tokens=256, save_unfull_chunk=True)
    expected = [{"start": c.start, "end": c.end, "key": c.key} for c in make_chunk_keys(range(600), settings)]
    as_json, as_lines = tmp_path / "t.json", tmp_path / "t.txt"
    as_json.write_text(json.dumps(list(range(600)), indent=1))
    as_lines.write_text("".join(f"{t}\n" for t in range(600)))
    for tokens in (as_json, as_lines):
        code, out, err = run_kvtool(["verify-keys", "--tokens", tokens, "--model-name", "Qwen/Qwen3-0.6B",
                                     "--save-unfull-chunk", "--json"])
        assert code == 0, err
        assert json.loads(out) == expected
    # docs 5.4: list(range(600)), chunk 256, seed unset
    assert [r["key"].split("@")[3] for r in expected] == ["31375f4bc7c57397", "675fd98cddfd2fcd", "657144e4621aa68"]


def test_json_lines_batch_and_table(tmp_path, run_kvtool):
    batch = tmp_path / "b.jsonl"
    batch.write_text("[1, 2, 3, 4, 5]\n[6, 7, 8, 9]\n")
    base = ["verify-keys", "--tokens", batch, "--chunk-tokens", "4", "--hash-algo", "builtin",
            "--none-hash-seed", "0", "--world-size", "2", "--worker-id", "1", "--kv-dtype", "float16"]
    code, out, err = run_kvtool(base + ["--json"])
    assert code == 0, err
    rows = json.loads(out)
    assert [(r["sequence"], r["start"], r["end"]) for r in rows] == [(0, 0, 4), (1, 0, 4)]
    assert all(r["key"].startswith("HuggingFaceTB/SmolLM2-135M-Instruct@2@1@") and r["key"].endswith("@half")
               for r in rows)
    code, out, err = run_kvtool(base)
    assert code == 0, err
    assert "seq" in out and "2 keys" in out  # whole keys in a table: tests/peer/test_verify_keys_compare.py


def test_prompt_is_tokenized_with_the_model(tiny_model_dir, run_kvtool):
    from kvtool.engine.models.model_dir import open_model_dir

    prompt = "The quick brown fox jumps over the lazy dog, twice over."
    token_ids = open_model_dir(tiny_model_dir).tokenizer.encode(prompt)
    code, out, err = run_kvtool(["verify-keys", "--prompt", prompt, "--model", tiny_model_dir,
                                 "--chunk-tokens", "16", "--json"])
    assert code == 0, err
    # --model-name defaults to --model as given
    settings = LMCacheKeySettings(str(tiny_model_dir), chunk_tokens=16)
    assert json.loads(out) == [{"start": c.start, "end": c.end, "key": c.key}
                               for c in make_chunk_keys(token_ids, settings)]


# ----------------------------------------------------------------------------- bad input


def bad_input_cases(tmp_path, tiny_model_dir) -> dict[str, tuple[list, str]]:
    good = tmp_path / "good.json"
    good.write_text("[1, 2, 3]")
    malformed = tmp_path / "malformed.json"
    malformed.write_text("[1, 2,")
    bad_line = tmp_path / "bad.txt"
    bad_line.write_text("1\n2\nthree\n")
    tok = ["--tokens", good]
    return {
        "missing token file": (["--tokens", tmp_path / "nope.json"], "not found"),
        "malformed JSON": (["--tokens", malformed], "malformed JSON"),
        "malformed line": (["--tokens", bad_line], "line 3"),
        "both tokens and prompt": (tok + ["--prompt", "hi"], "exactly one of --tokens"),
        "neither tokens nor prompt": ([], "exactly one of --tokens"),
        "unknown hash algo": (tok + ["--hash-algo", "md5"], "--hash-algo must be one of"),
        "builtin without a seed": (tok + ["--hash-algo", "builtin"], "needs none_hash_seed"),
        "model name with @": (tok + ["--model-name", "a@b"], "contains '@'"),
        "bad lm url": (tok + ["--peer", "http://127.0.0.1:1", "--model", tiny_model_dir], "lm://HOST:PORT"),
        "lm url without port": (tok + ["--peer", "lm://127.0.0.1", "--model", tiny_model_dir], "lm://HOST:PORT"),
        "unreachable peer": (tok + ["--peer", f"lm://127.0.0.1:{free_port()}", "--model", tiny_model_dir,
                                    "--chunk-tokens", "2"], "--peer unreachable"),
        "unreachable peer, no keys": (tok + ["--peer", f"lm://127.0.0.1:{free_port()}", "--model", tiny_model_dir],
                                      "--peer unreachable"),
        "missing model dir": (tok + ["--peer", "lm://127.0.0.1:1", "--model", tmp_path / "no-model"], "not found"),
        "missing peer python": (tok + ["--against-lmcache", "--peer-python", tmp_path / "no-python"],
                                "peer interpreter"),
        "peer python alone": (tok + ["--peer-python", tmp_path / "no-python"], "only with --against-lmcache"),
        "empty prompt": (["--prompt", "", "--model", tiny_model_dir], "no tokens"),
        "bad kv dtype": (tok + ["--kv-dtype", "float13"], "float13"),
        "worker outside world": (tok + ["--world-size", "2", "--worker-id", "2"], "worker_id"),
    }


def test_bad_input_one_line_error(tmp_path, tiny_model_dir, run_kvtool):
    for name, (args, needle) in bad_input_cases(tmp_path, tiny_model_dir).items():
        code, out, err = run_kvtool(["verify-keys", *args])
        lines = err.strip().splitlines()
        assert code == 2, (name, code, err)
        assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], (name, err)
        assert "Traceback" not in err and out == "", name


def test_bad_input_in_a_real_process(tmp_path, cli_env):
    out = run_cli(["--tokens", tmp_path / "nope.json"], cli_env)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip().splitlines() == [f"error: token file {str(tmp_path / 'nope.json')!r} not found"]
