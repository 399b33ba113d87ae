"""The real LMCache peer: locating its separate environment, and scripts that run inside it.

kvtool never imports lmcache or vllm. `env.py` finds the peer interpreter that `scripts/peer-env`
builds; `lmcache_keys.py`, `lmcache_client.py` and `lmcache_store_client.py` are stand-alone
scripts that interpreter runs by file path (the two clients share `lmcache_objects.py`), so tests
and `verify-keys` can compare kvtool against LMCache's own code.
"""
