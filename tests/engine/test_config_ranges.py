"""Hostile configs: every key has a declared range; a value outside it is one line naming the key.

Each case was an internal error, an allocator error or a silently accepted meaningless value.
"""

from __future__ import annotations

import json

import msgspec
import pytest

from kvtool.engine.config.sizes import machine_memory_bytes, parse_size
from kvtool.engine.connectors.config import parse_kv_transfer_config
from kvtool.engine.connectors.extra_keys import ExtraKey, parse_extra
from kvtool.engine.connectors.lmcache.settings import parse_settings as lmcache_settings
from kvtool.engine.connectors.offloading.disk.tier_identity import MAX_HEADER_BYTES, encode_header, make_block_header
from kvtool.engine.connectors.offloading.settings import parse_settings as offloading_settings
from kvtool.engine.errors import ConfigError
from kvtool.engine.params import EngineParams
from tests.support.tier_identity import make_test_identity


def refusal(call, *args, **kwargs) -> str:
    with pytest.raises(ConfigError) as e:
        call(*args, **kwargs)
    message = str(e.value)
    assert "\n" not in message and len(message) < 400, message
    return message


def lmcache(**extra):
    return lmcache_settings(extra, "Qwen/Qwen3-0.6B", "bfloat16", 16)


def offloading(**extra):
    return offloading_settings(extra, 16, kv_bytes_per_block=16 * 2 * 28 * 8 * 128 * 2)


@pytest.mark.parametrize(
    "extra, needle",
    [
        ({"timeout_s": -1}, "timeout_s must be a number > 0"),
        ({"timeout_s": 1e300}, "timeout_s must be a number > 0 and <= 600"),
        ({"timeout_s": 0}, "timeout_s must be a number > 0"),
        ({"connections": 10**9}, "connections must be an integer >= 1 and <= 64"),
        ({"host": "h" * 300}, "host must be a string of 1 to 253 characters"),
        ({"host": ""}, "host must be a string of 1 to 253"),
        ({"host": "127.0.0.1\0evil"}, "host must be a string"),
        ({"host": "a b"}, "is not a host name or address"),
        ({"port": 0}, "port must be an integer >= 1 and <= 65535"),
        ({"port": 70000}, "port must be an integer >= 1 and <= 65535"),
        ({"port": -1}, "port must be an integer >= 1 and <= 65535"),
        ({"chunk_tokens": 0}, "chunk_tokens must be an integer >= 1"),
        ({"remote_url": "lm://[::1:65432"}, "is not an lm://HOST:PORT URL"),
        ({"remote_url": "lm://127.0.0.1:0"}, "is not an lm://HOST:PORT URL"),
        ({"hash_algo": "md5"}, "hash_algo must be one of"),
        ({"lmcache.chunk_size": 256, "chunk_tokens": 256}, "chunk_tokens is given twice"),
        ({"worker_id": 3}, "worker_id 3 must be below world_size 1"),
        ({"timeout": 5}, "unknown key 'timeout' (did you mean timeout_s?)"),
    ],
)
def test_lmcache_values_outside_their_range_are_refused(extra, needle):
    assert needle in refusal(lmcache, **extra)


@pytest.mark.parametrize(
    "extra, needle",
    [
        ({"cpu_bytes_to_use": "9" * 5000 + "G"}, "cpu_bytes_to_use must be a size"),
        ({"cpu_bytes_to_use": "1" + "0" * 399 + ".5m"}, "cpu_bytes_to_use must be a size"),
        ({"cpu_bytes_to_use": 10**400}, "cpu_bytes_to_use must be a size"),
        ({"cpu_bytes_to_use": float("1e300")}, "cpu_bytes_to_use must be a size"),
        ({"cpu_bytes_to_use": "1T"} if machine_memory_bytes() < 1 << 40 else {"cpu_bytes_to_use": "1024T"},
         "does not fit this machine's memory"),
        ({"cpu_bytes_to_use": -5}, "cpu_bytes_to_use must be a size"),
        ({"cpu_bytes_to_use": 2.5}, "cpu_bytes_to_use must be a size"),
        ({"num_cpu_blocks": 10**12}, "num_cpu_blocks must be an integer >= 1 and <= 2147483648"),
        ({"num_cpu_blocks": 1 << 30}, "does not fit this machine's memory"),
        ({"offload_block_tokens": 2**40}, "offload_block_tokens must be an integer >= 1 and <= 1048576"),
        ({"offload_block_tokens": 0}, "offload_block_tokens must be an integer >= 1"),
        ({"block_size": 24}, "offload_block_tokens 24 is not a multiple of the block size 16"),
        ({"root_dir": "/tmp/a\0b"}, "root_dir must be a string"),
        ({"root_dir": ""}, "root_dir must be a string of 1 to 4096"),
        ({"fs_capacity_bytes": "80x"}, "fs_capacity_bytes must be a size"),
        ({"eviction_policy": "mru"}, "eviction_policy must be one of 'lru', 'arc'"),
        ({"group_idx": 1}, "group_idx must be an integer >= 0 and <= 0"),
        ({"layerwise": "yes"}, "layerwise must be true or false"),
        ({"root_dri": "kv-tier"},
         "unknown key 'root_dri' (did you mean root_dir?)"),
        ({"knobs": 1}, "unknown key 'knobs'; known keys: blocks_per_chunk, canonical_layout, cpu_bytes_to_use,"),
    ],
)
def test_offloading_values_outside_their_range_are_refused(extra, needle):
    assert needle in refusal(offloading, **extra)


def test_sizes_accept_integers_and_vllm_strings():
    assert offloading(cpu_bytes_to_use="80m", fs_capacity_bytes="2G").cpu_bytes_to_use == 80_000_000
    assert offloading(fs_capacity_bytes="2G").fs_capacity_bytes == 2 << 30
    assert offloading(cpu_bytes_to_use=1 << 20, block_size=32).offload_block_tokens == 32
    assert parse_size("1.5k") == 1500 and parse_size("7") == 7 and parse_size("1T") == 1 << 40
    for bad in ("1.5G", "-1", "1e9", "0x10", "2 G", "9" * 25, "1" + "0" * 19 + "T"):
        refusal(parse_size, bad)


@pytest.mark.parametrize(
    "doc, needle",
    [
        ({"kv_connector_module_path": ".."}, "is not a dotted Python module name"),
        ({"kv_connector_module_path": "a/b"}, "is not a dotted Python module name"),
        ({"engine_id": "e" * 70_000}, "engine_id must be 1 to 256 printable characters, got 70000"),
        ({"engine_id": ""}, "engine_id must be 1 to 256"),
        ({"engine_id": "a\nb"}, "engine_id must be 1 to 256 printable"),
        ({"kv_port": 0}, "kv_port must be between 1 and 65535"),
    ],
)
def test_transfer_config_fields_are_bounded(doc, needle):
    text = json.dumps({"kv_connector": "OffloadingConnector", "kv_role": "kv_both", **doc})
    assert needle in refusal(parse_kv_transfer_config, text)


def test_a_header_of_the_longest_accepted_strings_fits_what_a_reader_accepts():
    identity = make_test_identity(engine_id="\u4e00" * 256, model_name="m" * 4096)
    header = encode_header(make_block_header(identity, "ab" * 32, 8, 1024, "0" * 64))
    assert len(header) < MAX_HEADER_BYTES
    long_id = json.dumps({"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "engine_id": "x" * 256})
    assert parse_kv_transfer_config(long_id).engine_id == "x" * 256


@pytest.mark.parametrize(
    "params, needle",
    [
        ({"kv_cache_memory": 10**40}, "--kv-cache-memory must be between 1 and"),
        ({"kv_cache_memory": 0}, "--kv-cache-memory must be between 1 and"),
        ({"kv_cache_memory": (1 << 59), "device": "cpu"}, "does not fit this machine's memory"),
        ({"num_gpu_blocks": 10**12}, "--num-gpu-blocks must be between 1 and"),
        ({"seed": 2**64}, "--seed must be between 0 and 18446744073709551615"),
        ({"seed": -1}, "--seed must be between 0"),
        ({"block_size": 2048}, "--block-size must be a power of two between 1 and 1024"),
        ({"max_num_seqs": 10**9}, "--max-num-seqs must be between 1 and 65536"),
        ({"max_model_len": 10**12}, "--max-model-len must be between 1 and"),
        ({"max_num_batched_tokens": 0}, "--max-num-batched-tokens must be between 1 and"),
    ],
)
def test_engine_params_are_bounded(params, needle):
    assert needle in refusal(msgspec.convert, params, EngineParams)


def test_refused_keys_are_refused_before_values_and_left_out_of_the_known_keys():
    keys = (ExtraKey(name="size", kind="int", low=1), ExtraKey(name="tiers", kind="list"),
            ExtraKey(name="knobs", kind="object", default={}),
            ExtraKey(name="threads", kind="int", refused="one writer thread"))
    assert parse_extra("C", keys, {"tiers": [1], "knobs": {"a": 1}}) == {"size": None, "tiers": [1], "knobs": {"a": 1}}
    with pytest.raises(ConfigError, match="^invalid C config: threads is not supported: one writer thread$"):
        parse_extra("C", keys, {"size": 0, "threads": 4})
    with pytest.raises(ConfigError, match="unknown key 'workers'; known keys: knobs, size, tiers$"):
        parse_extra("C", keys, {"workers": 4})
    with pytest.raises(ConfigError, match=r"unknown key 'sizes' \(did you mean size\?\)$"):
        parse_extra("C", keys, {"sizes": 4})
    with pytest.raises(ConfigError, match="knobs must be a JSON object, got"):
        parse_extra("C", keys, {"knobs": [1]})


def test_kv_cache_dtype_takes_vllms_names_and_runs_the_models_own_and_fp8(run_kvtool, tiny_model_dir):
    """vLLM's --kv-cache-dtype: `auto`, the model's own dtype and the fp8 caches run; int8 and
    another float dtype are refused in one line saying why; a name vLLM does not have is refused
    naming them."""
    assert "got 'fp9'" in refusal(EngineParams, kv_cache_dtype="fp9")
    base = ["generate", "--model", tiny_model_dir, "--device", "cpu", "--kv-cache-memory", "64M", "--prompt", "hi",
            "--max-tokens", "2"]
    for value in ("auto", "float32", "fp8", "fp8_e4m3", "fp8_e5m2"):
        code, _, err = run_kvtool(base + ["--kv-cache-dtype", value])
        assert code == 0, err
    for value, why in (("int8", "only fp8, fp8_e4m3 and fp8_e5m2 caches are supported"),
                       ("bfloat16", "the KV cache is kept in the model's dtype or in fp8")):
        code, _, err = run_kvtool(base + ["--kv-cache-dtype", value])
        line = err.strip().splitlines()[-1]
        assert code != 0 and why in line and "(this engine's: auto, float32, fp8, fp8_e4m3 or fp8_e5m2)" in line, err
