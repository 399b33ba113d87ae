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


@pytest.mark.parametrize("unquoted", ["8G", "80m", "2k"])
def test_unquoted_sizes_are_malformed_json(unquoted):
    text = ('{"kv_connector":"OffloadingConnector","kv_role":"kv_both",'
            f'"kv_connector_extra_config":{{"cpu_bytes_to_use":{unquoted}}}}}')
    with pytest.raises(ConfigError, match="malformed JSON"):
        parse_kv_transfer_config(text)


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


@pytest.mark.parametrize(
    "text, needle",
    [
        ('{"kv_connector": "OffloadingConnector", "kv_role": ', "malformed JSON"),
        ('["OffloadingConnector"]', "Expected `object`, got `array`"),
        ('{"kv_connector":"OffloadingConnector","kv_role":"kv_both","kv_ip":"127.0.0.1"}', "unknown field `kv_ip`"),
        ('{"kv_connector":"OffloadingConnector","kv_role":"kv_both","kv_port":"x"}', "kv_port"),
        ('{"kv_connector":"OffloadingConnector","kv_role":"kv_both","kv_load_failure_policy":"retry"}', "kv_load_failure_policy"),
        ('{"kv_connector":"OffloadingConnector","kv_role":"kv_both","kv_connector_extra_config":{"a":' + "[" * 9 + "]" * 9 + "}}", "nested more than 8 levels"),
        ('{"kv_connector":"OffloadingConnector","kv_role":"kv_both","kv_connector_extra_config":{"a":' + "[" * 5000 + "]" * 5000 + "}}", "nested more than 8 levels"),
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
