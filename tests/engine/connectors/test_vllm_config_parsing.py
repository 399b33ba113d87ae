"""kvtool reads `--kv-transfer-config` and `--kv-events-config` as vLLM 0.33 reads them: the same
strings go through vLLM's own functions in the peer environment (`_expand_json_human_readable_numbers`,
the argparse types of `_compute_kwargs`, `FlexibleArgumentParser`) and through kvtool's, and
the results agree: the same expansion, the same accepted values, refusals where vLLM refuses."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from kvtool.commands.vllm_argv import rewrite_vllm_argv
from kvtool.engine.config.sizes import expand_json_human_readable_numbers
from kvtool.engine.connectors.config import parse_kv_transfer_config
from kvtool.engine.errors import ConfigError
from kvtool.engine.events.config import parse_kv_events_config
from kvtool.peer.env import is_peer_ready, peer_env, peer_python

pytestmark = pytest.mark.peer

PEER_SCRIPT = Path(__file__).resolve().parents[2] / "support" / "peer_vllm_config.py"
OFF = '"kv_connector":"OffloadingConnector","kv_role":"kv_both"'
TRANSFER_FIELDS = ("kv_connector", "kv_role", "kv_connector_extra_config", "kv_port", "enable_permute_local_kv",
                   "kv_load_failure_policy", "kv_connector_module_path")
EVENTS_FIELDS = ("enable_kv_cache_events", "publisher", "endpoint", "replay_endpoint", "buffer_steps", "hwm",
                 "max_queue_size", "topic")

EXPAND = [
    '{"cpu_bytes_to_use": 8G}', '{"a": 80m, "b": "80m", "c": [1k, 2K, 3g, 4G, 5t, 6T, 7M]}',
    '{"a": 1.5g, "b": 2.01k, "c": 0.5m, "d": 1.1234567891k}', '{"a": -8G}', '{"a": 1.5G}', '{"a": 2.5T}',
    '{"a": "x\\"9G", "b": 9G}', '{"a": 8Gb, "b": 8G8, "c": a8G, "d": 1e3k}', '{"8G": 8G}', '{"a": 8G',
    '{"a": "8G', "8G", "[1k,2k]", '{"a":12.5.5k}', '{"a": 08k}', "{}", "", '{"a": 1_000k}', '{"path":"/mnt/8G/1k"}',
]

TRANSFER = [
    # vLLM's offloading documents, with and without the bare size.
    "{%s,\"kv_connector_extra_config\":{\"cpu_bytes_to_use\":8589934592}}" % OFF,
    "{%s,\"kv_connector_extra_config\":{\"cpu_bytes_to_use\":8G}}" % OFF,
    "{%s,\"kv_connector_extra_config\":{\"cpu_bytes_to_use\":\"8G\"}}" % OFF,
    "{%s,\"kv_connector_extra_config\":{\"cpu_bytes_to_use\":80m,\"block_size\":64,\"eviction_policy\":\"arc\"}}" % OFF,
    "{%s,\"kv_connector_extra_config\":{\"spec_name\":\"TieringOffloadingSpec\",\"cpu_bytes_to_use\":10G,"
    "\"secondary_tiers\":[{\"type\":\"fs\",\"root_dir\":\"/mnt/kv_cache\"}]}}" % OFF,
    '{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both"}',
    '{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both",'
    '"kv_connector_extra_config":{"lmcache.pre_caching_hash_algorithm":"sha256_cbor"}}',
    # pydantic's lax mode on the typed fields.
    "{%s,\"kv_port\":\"15000\",\"enable_permute_local_kv\":\"yes\"}" % OFF,
    "{%s,\"kv_port\":15000.0,\"enable_permute_local_kv\":1}" % OFF,
    "{%s,\"kv_port\":\" 1_500 \",\"enable_permute_local_kv\":\"OFF\"}" % OFF,
    "{%s,\"kv_port\":true,\"enable_permute_local_kv\":0.0}" % OFF,
    "{%s,\"engine_id\":null,\"kv_load_failure_policy\":\"recompute\"}" % OFF,
    '{"kv_connector":null,"kv_role":null}', "{}", "", "None",
    # What vLLM refuses.
    "null", "  ", "[]", '"x"', "{%s,\"kv_ip\":\"127.0.0.1\"}" % OFF, '{"kv_connector":"OffloadingConnector"}',
    "{%s,\"kv_port\":15000.5}" % OFF, "{%s,\"kv_port\":\"1e4\"}" % OFF, "{%s,\"kv_port\":\"0x10\"}" % OFF,
    "{%s,\"enable_permute_local_kv\":\"maybe\"}" % OFF, "{%s,\"enable_permute_local_kv\":2}" % OFF,
    '{"kv_connector":5,"kv_role":"kv_both"}', "{%s,\"engine_id\":7}" % OFF,
    "{%s,\"kv_load_failure_policy\":\"FAIL\"}" % OFF, '{"kv_connector":"OffloadingConnector","kv_role":"both"}',
    "{%s,\"kv_connector_extra_config\":null}" % OFF, "{%s,\"kv_connector_extra_config\":[]}" % OFF,
    "{%s,\"kv_connector_extra_config\":{\"cpu_bytes_to_use\":1.5G}}" % OFF, '{"kv_role": "kv_both",}',
]

# vLLM accepts these when it parses the flag and fails (or misbehaves) only later; kvtool refuses
# them at once, in one line.
STRICTER = [
    '{"kv_connector":"SharedStorageConnector","kv_role":"kv_both"}',
    "{%s,\"kv_port\":-1}" % OFF,
    "{%s,\"kv_connector_module_path\":\"\"}" % OFF,
]

EVENTS = [
    '{"enable_kv_cache_events": true}', '{"enable_kv_cache_events": "yes", "hwm": 1k, "buffer_steps": "2_000"}',
    '{"enable_kv_cache_events": true, "publisher": "null", "topic": "kv", "max_queue_size": 100K}',
    '{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:5557", "replay_endpoint": "tcp://*:5558"}',
    "{}", "", "None", "null", '{"publisher": null}', '{"publisher": "kafka"}', '{"endpoints": "tcp://*:1"}',
    '{"hwm": 1.5K}', '{"enable_kv_cache_events": 2}',
]

ARGVS = [
    ["--kv-transfer-config.kv_connector", "OffloadingConnector", "--kv-transfer-config.kv_role", "kv_both",
     "--kv-transfer-config.kv_connector_extra_config.cpu_bytes_to_use", "8G"],
    ["--kv_transfer_config.kv_connector=OffloadingConnector", "--kv-transfer-config.kv_role=kv_both",
     "--kv-transfer-config.kv_connector_extra_config.cpu_bytes_to_use=80m",
     "--kv-transfer-config.kv_connector_extra_config.block_size", "64",
     "--kv-transfer-config.kv_connector_extra_config.eviction_policy", "arc"],
    # Values: JSON first, then a human-readable int, else the text; `+` splits on commas.
    ["--kv-transfer-config.kv_connector", "LMCacheConnectorV1", "--kv-transfer-config.kv_role", "kv_both",
     "--kv-transfer-config.kv_connector_extra_config.a", "1.5G",
     "--kv-transfer-config.kv_connector_extra_config.b", "[1, 2]",
     "--kv-transfer-config.kv_connector_extra_config.b", "[3]",
     "--kv-transfer-config.kv_connector_extra_config.c+", "x,y,z",
     "--kv-transfer-config.kv_connector_extra_config.d", '{"e": 1}',
     "--kv-transfer-config.kv_connector_extra_config.d.f", "2.01k",
     "--kv-transfer-config.kv_connector_extra_config.g", "true",
     "--kv-transfer-config.kv_connector_extra_config.h", "1_000",
     "--kv-transfer-config.kv_connector_extra_config.h", "12"],
    ["--kv-transfer-config.kv_connector_extra_config.tiers+", "fs"],
    # Underscores for dashes in the flag name, JSON and dotted forms together (the last one wins).
    ["--kv_transfer_config", '{"kv_connector":"OffloadingConnector","kv_role":"kv_both"}'],
    ["--kv-transfer-config", '{"kv_connector":"OffloadingConnector","kv_role":"kv_both"}',
     "--kv-transfer-config.kv_role", "kv_consumer"],
    ["--kv-transfer-config", "None"], ["--kv-transfer-config", ""],
    ["--kv-events-config.enable_kv_cache_events", "true", "--kv_events_config.hwm", "1k",
     "--kv-events-config.topic", "kv"],
    ["--kv-transfer-config=" + '{"kv_connector":"OffloadingConnector","kv_role":"kv_both",'
     '"kv_connector_extra_config":{"lmcache.x":1.5g}}'],
    # Refused.
    ["--kv-transfer-config.kv_connector", "OffloadingConnector"],
    ["--kv-transfer-config.kv_role"],
    ["--kv-transfer-config.kv_role", "both", "--kv-transfer-config.kv_connector", "OffloadingConnector"],
]


@pytest.fixture(scope="module")
def vllm():
    if not is_peer_ready():
        pytest.skip("the peer environment is not built (scripts/peer-env)")
    cases = {"expand": EXPAND, "transfer": TRANSFER + STRICTER, "events": EVENTS, "argvs": ARGVS}
    out = subprocess.run([str(peer_python()), str(PEER_SCRIPT)], input=json.dumps(cases), capture_output=True,
                         text=True, env=peer_env(), timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def ours(fn, *args):
    try:
        return fn(*args)
    except ConfigError as e:
        assert "\n" not in str(e)
        return ConfigError


def fields(config, names):
    return None if config is None else {n: getattr(config, n) for n in names}


def agree(theirs: dict, our_config, names, what) -> None:
    if "error" in theirs:
        assert our_config is ConfigError, f"vLLM refuses {what!r} ({theirs['error']}); kvtool accepts it"
    else:
        assert our_config is not ConfigError, f"vLLM accepts {what!r}; kvtool refuses it"
        assert fields(our_config, names) == theirs["config"], what


def test_size_expansion_is_vllms(vllm):
    for text, theirs in zip(EXPAND, vllm["expand"]):
        got = ours(expand_json_human_readable_numbers, text)
        if isinstance(theirs, dict):
            assert got is ConfigError, f"vLLM refuses {text!r} ({theirs['error']})"
        else:
            assert got == theirs, text


def test_kv_transfer_config_is_read_as_vllm_reads_it(vllm):
    for text, theirs in zip(TRANSFER, vllm["transfer"]):
        agree(theirs, ours(parse_kv_transfer_config, text), TRANSFER_FIELDS, text)


def test_kvtool_refuses_at_once_what_vllm_refuses_only_later(vllm):
    for text, theirs in zip(STRICTER, vllm["transfer"][len(TRANSFER):]):
        assert "config" in theirs, text
        assert ours(parse_kv_transfer_config, text) is ConfigError, text


def test_kv_events_config_is_read_as_vllm_reads_it(vllm):
    for text, theirs in zip(EVENTS, vllm["events"]):
        agree(theirs, ours(parse_kv_events_config, text), EVENTS_FIELDS, text)


def _our_argv(argv: list[str]):
    """kvtool's rewrite, then its parsers on the last value of each flag, as typer passes it."""
    args, _ = rewrite_vllm_argv(argv)
    values = {"--kv-transfer-config": None, "--kv-events-config": None}
    for i, arg in enumerate(args):
        if arg in values:
            values[arg] = args[i + 1]
        elif arg.split("=", 1)[0] in values:
            name, value = arg.split("=", 1)
            values[name] = value
    return (fields(parse_kv_transfer_config(values["--kv-transfer-config"]), TRANSFER_FIELDS),
            fields(parse_kv_events_config(values["--kv-events-config"]), EVENTS_FIELDS))


def test_dotted_and_underscored_flags_are_vllms(vllm):
    for argv, theirs in zip(ARGVS, vllm["argvs"]):
        got = ours(_our_argv, argv)
        if "error" in theirs:
            assert got is ConfigError, f"vLLM refuses {argv} ({theirs['error']})"
        else:
            assert got is not ConfigError, f"vLLM accepts {argv}"
            assert got == (theirs["parsed"]["kv_transfer_config"], theirs["parsed"]["kv_events_config"]), argv
