"""The redis-server processes kvtool starts keep the pages their allocator frees (`KV_MALLOC_CONF`),
so that serving a KV chunk does not fault its reply buffer in page by page again; checked on
real processes (the minor faults a large GET costs the server; redis-server writes its process
title over its environment, so /proc shows no variables)."""

import os
import shutil
import subprocess

import pytest
import redis

from kvtool.workloads.redis_server import KV_MALLOC_CONF, RedisServer, free_port, redis_binary, server_env

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")

VALUE_PAGES = 9216  # 37,748,736 bytes: a 256-token chunk of Qwen3-8B (KV_2LTD, bfloat16)


def _minor_faults(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])  # field 10, minflt


def _faults_per_get(server: RedisServer) -> float:
    client = redis.Redis(host="127.0.0.1", port=server.port)
    try:
        client.set("chunk", os.urandom(4096) * VALUE_PAGES)
        for _ in range(2):  # the allocator settles on its first replies
            assert len(client.get("chunk")) == 4096 * VALUE_PAGES
        before = _minor_faults(server.pid)
        for _ in range(4):
            client.get("chunk")
        return (_minor_faults(server.pid) - before) / 4
    finally:
        client.close()


def test_the_server_environment_sets_both_jemalloc_names_and_leaves_a_users_own(monkeypatch):
    monkeypatch.delenv("MALLOC_CONF", raising=False)
    monkeypatch.delenv("JE_MALLOC_CONF", raising=False)
    env = server_env()
    assert env["MALLOC_CONF"] == env["JE_MALLOC_CONF"] == KV_MALLOC_CONF
    assert "MALLOC_CONF" not in server_env("") and "JE_MALLOC_CONF" not in server_env(None)
    monkeypatch.setenv("MALLOC_CONF", "narenas:1")
    assert server_env()["MALLOC_CONF"] == "narenas:1" and server_env()["JE_MALLOC_CONF"] == KV_MALLOC_CONF


def test_a_large_get_costs_the_server_no_page_faults_per_page(tmp_path, monkeypatch):
    """With jemalloc (Debian's redis-server, or a build with its bundled copy), a GET of a KV chunk
    costs the server minor faults for at most about a quarter of its pages once freed pages are
    kept; with the allocator's defaults, in the same test, every reply faults its pages in again."""
    version = subprocess.run([redis_binary(), "--version"], capture_output=True, text=True).stdout
    if "malloc=jemalloc" not in version:
        pytest.skip(f"redis-server is not built with jemalloc: {version.strip()}")
    monkeypatch.delenv("MALLOC_CONF", raising=False)
    monkeypatch.delenv("JE_MALLOC_CONF", raising=False)
    faults = {}
    for name, conf in (("kept", KV_MALLOC_CONF), ("defaults", "")):
        server = RedisServer(free_port(), tmp_path / name, malloc_conf=conf).start()
        try:
            faults[name] = _faults_per_get(server)
        finally:
            server.stop()
    assert faults["kept"] < VALUE_PAGES / 3, faults
    assert faults["defaults"] > VALUE_PAGES * 0.9, faults
