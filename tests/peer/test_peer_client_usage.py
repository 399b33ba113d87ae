"""The peer client scripts refuse bad usage with one line and exit status 2, before any LMCache work."""

from __future__ import annotations

import subprocess

import pytest

from kvtool.peer.env import peer_env, peer_script
from tests.support.peer_server import require_peer_python

peer = pytest.mark.peer


def run(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(require_peer_python()), str(peer_script(script)), *args], stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, env=peer_env(), timeout=120)


@peer
@pytest.mark.parametrize(("script", "args", "message"), [
    ("lmcache_client.py", ["put", "127.0.0.1", "x", "k", "2,1,1,4", "float32", "f"], "PORT must be an integer, got 'x'"),
    ("lmcache_client.py", ["get", "127.0.0.1", "1"], "get takes 4 arguments, got 2"),
    ("lmcache_client.py", ["fetch"], "expected a sub-command, put, get or batch"),
    ("lmcache_store_client.py", ["put", "redis://127.0.0.1:1", "k", "2,1,1", "float32", "f"],
     "SHAPE must have 4 dims (KV_2LTD)"),
    ("lmcache_store_client.py", ["put", "redis://127.0.0.1:1", "k", "2,1,1,4", "float33", "f"],
     "unknown DTYPE 'float33'"),
])
def test_bad_usage_is_one_line_and_exit_2(script, args, message):
    proc = run(script, *args)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.splitlines()[0] == f"{script.removesuffix('.py')}: {message}"


@peer
@pytest.mark.parametrize("script", ["lmcache_client.py", "lmcache_store_client.py"])
def test_a_payload_file_of_the_wrong_size_or_missing_is_refused(script, tmp_path):
    where = ["127.0.0.1", "1"] if script == "lmcache_client.py" else ["redis://127.0.0.1:1"]
    short = tmp_path / "short.bin"
    short.write_bytes(b"\0" * 31)
    proc = run(script, "put", *where, "k", "2,1,1,4", "float32", str(short))
    assert proc.returncode == 2
    assert proc.stderr.splitlines()[0].endswith("holds 31 bytes, SHAPE (2, 1, 1, 4) of torch.float32 needs 32")
    proc = run(script, "put", *where, "k", "2,1,1,4", "float32", str(tmp_path / "missing.bin"))
    assert proc.returncode == 2
    assert "cannot read" in proc.stderr.splitlines()[0] and "No such file or directory" in proc.stderr
