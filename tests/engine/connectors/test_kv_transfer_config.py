"""--kv-transfer-config: vLLM's JSON parses unchanged; every refusal has a clear one-line message."""

import pytest

from kvtool.engine.connectors.config import parse_human_int, parse_kv_transfer_config
from kvtool.engine.errors import ConfigError

VLLM_EXAMPLES = [
    '{"kv_connector":"OffloadingConnector","kv_role":"kv_both","kv_connector_extra_config":{"cpu_bytes_to_use":8589934592}}',
    '{"kv_connector":"OffloadingConnector","kv_role":"kv_both","kv_connector_extra_config":{"cpu_bytes_to_use":"8G"}}',
    '{"kv_connector":"OffloadingConnector","kv_role":"kv_both","kv_connector_extra_config":{"cpu_bytes_to_use":1000000000,"block_size":64,"eviction_policy":"arc"}}',
    '{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both"}',
    '{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both","kv_connector_extra_config":{"lmcache.pre_caching_hash_algorithm":"sha256_cbor"}}',
]


@pytest.mark.parametrize("text", VLLM_EXAMPLES)
def test_vllm_documents_parse_unchanged(text):
    cfg = parse_kv_transfer_config(text)
    assert cfg is not None and cfg.kv_role == "kv_both"
    assert cfg.kv_load_failure_policy == "fail"


def test_sizes_are_json_strings_with_vllm_suffixes():
    cfg = parse_kv_transfer_config(
        '{"kv_connector":"OffloadingConnector","kv_role":"kv_both",'
        '"kv_connector_extra_config":{"cpu_bytes_to_use":"8G","fs_capacity_bytes":"80m","root_dir":"/tmp/8G"}}'
    )
    extra = cfg.kv_connector_extra_config
    assert extra == {"cpu_bytes_to_use": "8G", "fs_capacity_bytes": "80m", "root_dir": "/tmp/8G"}
    assert parse_human_int("8G") == 8 * 2**30
    assert parse_human_int("80m") == 80_000_000
    assert parse_human_int("1.5g") == 1_500_000_000
    with pytest.raises(ConfigError, match="decimals are not allowed"):
        parse_human_int("1.5G")


@pytest.mark.parametrize(
    "unquoted, value",
    [("8G", 8 * 2**30), ("80m", 80_000_000), ("2k", 2000), ("1.5g", 1_500_000_000), ("512K", 512 * 2**10),
     ("2.01k", 2009), ("1T", 2**40), ("3t", 3 * 10**12)],
)
def test_unquoted_sizes_expand_as_vllm_expands_them(unquoted, value):
    text = ('{"kv_connector":"OffloadingConnector","kv_role":"kv_both",'
            f'"kv_connector_extra_config":{{"cpu_bytes_to_use":{unquoted},"root_dir":"/tmp/{unquoted}"}}}}')
    extra = parse_kv_transfer_config(text).kv_connector_extra_config
    # The bare token is a number; the same letters inside a string are left alone.
    assert extra == {"cpu_bytes_to_use": value, "root_dir": f"/tmp/{unquoted}"}


def test_decimal_with_binary_suffix_gets_vllms_reason():
    with pytest.raises(ConfigError, match=r"Decimals are not allowed with binary suffixes like G\. Did you mean to use 1\.5g"):
        parse_kv_transfer_config('{"kv_connector":"OffloadingConnector","kv_role":"kv_both",'
                                 '"kv_connector_extra_config":{"cpu_bytes_to_use":1.5G}}')


def test_all_keys_accepted():
    cfg = parse_kv_transfer_config(
        '{"kv_connector":"LMCacheConnector","kv_role":"kv_consumer","engine_id":"e1",'
        '"kv_load_failure_policy":"recompute","kv_buffer_device":"cuda","kv_port":15000,'
        '"enable_permute_local_kv":false,"kv_connector_extra_config":{"a":1,"b":"x","c":true,"d":1.5}}'
    )
    assert cfg.engine_id == "e1" and cfg.kv_load_failure_policy == "recompute" and cfg.is_kv_consumer


@pytest.mark.parametrize("text", [None, "", "None"])
def test_absent_means_no_connector(text):
    assert parse_kv_transfer_config(text) is None


def test_lax_fields_and_null_engine_id_as_pydantic_reads_them():
    cfg = parse_kv_transfer_config('{"kv_connector":"OffloadingConnector","kv_role":"kv_both","kv_port":"15000",'
                                   '"enable_permute_local_kv":"yes","engine_id":null}')
    assert (cfg.kv_port, cfg.enable_permute_local_kv, cfg.engine_id) == (15000, True, "kvtool-engine-0")


@pytest.mark.parametrize(
    "text, needle",
    [
        ('{"kv_connector": "OffloadingConnector", "kv_role": ', "malformed JSON"),
        ('["OffloadingConnector"]', "Expected `object`, got `array`"),
        ('{"kv_connector":"OffloadingConnector","kv_role":"kv_both","kv_ip":"127.0.0.1"}', "unknown field `kv_ip`"),
        ('{"kv_connector":"OffloadingConnector","kv_role":"kv_both","kv_port":"x"}', "kv_port must be an integer"),
        ("null", "Expected `object`, got `null`"),
        ("  ", "malformed JSON"),
        ('{"kv_connector":"OffloadingConnector","kv_role":"kv_both","kv_load_failure_policy":"retry"}', "kv_load_failure_policy"),
        ('{"kv_connector":"OffloadingConnector","kv_role":"kv_both","kv_connector_extra_config":{"a":' + "[" * 9 + "]" * 9 + "}}", "more than 8 levels deep"),
        ('{"kv_connector":"OffloadingConnector","kv_role":"kv_both","kv_connector_extra_config":{"a":' + "[" * 5000 + "]" * 5000 + "}}", "nested too deeply"),
        ('{"kv_connector":"OffloadingConnector","kv_role":"both"}', "unknown kv_role 'both'"),
        ('{"kv_connector":"OffloadingConnector"}', "kv_role is required"),
        ('{"kv_connector":"SharedStorageConnector","kv_role":"kv_both"}', "registered connectors: LMCacheConnector"),
    ],
)
def test_refusals_name_the_problem(text, needle):
    with pytest.raises(ConfigError) as e:
        parse_kv_transfer_config(text)
    msg = str(e.value)
    assert needle in msg
    assert "\n" not in msg


def test_kv_offloading_shortcut_flags_as_vllm_applies_them():
    from kvtool.engine.connectors.config import apply_kv_offloading_flags

    # Without a size the flags change nothing, whatever the backend.
    given = parse_kv_transfer_config('{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_consumer"}')
    assert apply_kv_offloading_flags(given, None, "lmcache") == (given, None)
    assert apply_kv_offloading_flags(None, None, "native") == (None, None)
    # native: an OffloadingConnector of size * 2**30 bytes (over all ranks), kv_both.
    cfg, notice = apply_kv_offloading_flags(None, 1.5, "native")
    assert (cfg.kv_connector, cfg.kv_role, notice) == ("OffloadingConnector", "kv_both", None)
    assert cfg.kv_connector_extra_config == {"cpu_bytes_to_use": 3 * 2**29}
    # It replaces a given connector, keeps the other extra keys, and says so.
    given = parse_kv_transfer_config('{"kv_connector":"OffloadingConnector","kv_role":"kv_producer",'
                                     '"kv_connector_extra_config":{"cpu_bytes_to_use":1G,"root_dir":"/t"}}')
    cfg, notice = apply_kv_offloading_flags(given, 8, "native")
    assert cfg.kv_role == "kv_both" and cfg.kv_connector_extra_config == {"cpu_bytes_to_use": 8 * 2**30, "root_dir": "/t"}
    assert "replaces kv_connector 'OffloadingConnector'" in notice
    cfg, notice = apply_kv_offloading_flags(parse_kv_transfer_config('{"kv_connector":"OffloadingConnector",'
                                                                     '"kv_role":"kv_both"}'), 8, "lmcache")
    assert (cfg.kv_connector, cfg.kv_role) == ("LMCacheConnectorV1", "kv_both") and "lmcache" in notice
    for size, backend, needle in ((0.0, "native", "positive number"), (-1.0, "native", "positive number"),
                                  (float("nan"), "native", "positive number"), (1.0, "disk", "native, lmcache")):
        with pytest.raises(ConfigError, match=needle):
            apply_kv_offloading_flags(None, size, backend)
