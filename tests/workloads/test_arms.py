"""Arm configs the measurements adjust: a fill that must leave every chunk in its store."""

import json

from kvtool.workloads.arms import lmcache_config, make_builtin_arm, parse_arm_spec, with_whole_stores


def test_lmcache_arms_fill_with_whole_stores_unless_their_config_says_otherwise():
    lm = make_builtin_arm("lmcache", lmcache_url="lm://127.0.0.1:1")
    extra = json.loads(with_whole_stores(lm).kv_transfer_config)["kv_connector_extra_config"]
    assert extra == {"remote_url": "lm://127.0.0.1:1", "force_store_wait": True}
    assert json.loads(lmcache_config("lm://127.0.0.1:1"))["kv_connector_extra_config"] == {"remote_url": "lm://127.0.0.1:1"}
    own = parse_arm_spec('mine={"kv_connector":"LMCacheConnector","kv_role":"kv_both",'
                         '"kv_connector_extra_config":{"remote_url":"lm://127.0.0.1:1","force_store_wait":false}}')
    assert with_whole_stores(own) == own
    for other in (make_builtin_arm("cpu"), make_builtin_arm("prefix-cache")):
        assert with_whole_stores(other) == other
