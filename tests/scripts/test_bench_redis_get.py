"""scripts/bench-redis-get end to end in a tiny configuration: it starts its own redis-server, Redis
Cluster and LMCache server, measures every path once and LMCache's own connectors beside them,
prints the host and the table, writes one JSON line per row, and leaves no server behind. Rates
are not checked: they are a matter of the machine."""

import json
import subprocess
import sys

import pytest

from kvtool.workloads.process_session import session_members
from tests.conftest import REPO
from tests.support.peer_server import require_peer_python

STORES = ("lm", "redis", "redis-cluster", "valkey", "resp")


@pytest.mark.peer
@pytest.mark.slow
def test_every_path_is_measured_beside_the_socket_reads_and_lmcaches_connectors(tmp_path):
    require_peer_python()
    out = tmp_path / "rows.jsonl"
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "scripts" / "bench-redis-get"), "--layers", "2", "--kv-heads", "1",
         "--head-dim", "64", "--chunks", "2", "--repeats", "1", "--io-threads", "2", "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, start_new_session=True,
    )
    stdout, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 0, stderr[-4000:]
    assert session_members(proc.pid) == []  # every server and reader it started is gone
    assert "--io-threads 2" in stdout.splitlines()[0]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    by = {(r["measure"], r["store"], r["connections"]): r for r in rows}
    for store in STORES:
        for n in (1, 4):
            for measure in ("get", "pages"):
                row = by[(measure, store, n)]
                assert len(row["runs_gb_s"]) == 1 and row["chunks"] == 2
                assert ("of_lm" in row) == (store != "lm")
                assert ("of_socket_reads" in row) == (store != "redis-cluster")
    for n in (1, 4):
        assert {"server_cpu_cores", "server_minor_faults_per_chunk"} <= by[("socket", "redis-server", n)].keys()
        assert ("socket", "lm server", n) in by
    assert by[("lmcache", "redis", 4)]["connector"] == "RedisConnector"
    assert by[("lmcache", "resp", 8)]["connector"] == "RESPConnector"
    for row in (by[("lmcache", "redis", 4)], by[("lmcache", "resp", 8)]):
        assert {"kvtool_1_over_lmcache", "kvtool_4_over_lmcache"} <= row.keys()
    assert all(r["host"]["io_threads"] == 2 and r["host"]["redis_server"] for r in rows)


@pytest.mark.slow
def test_a_machine_without_the_peer_environment_measures_lm_against_the_in_memory_server(tmp_path):
    """The GPU machine's form (`--no-lmcache --lm-server memory`): every kvtool path and both socket
    baselines at the connection counts asked for, LMCache's connectors left out, nothing left running."""
    out = tmp_path / "rows.jsonl"
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "scripts" / "bench-redis-get"), "--layers", "2", "--kv-heads", "1",
         "--head-dim", "64", "--chunks", "2", "--repeats", "1", "--io-threads", "2", "--no-lmcache",
         "--lm-server", "memory", "--stores", "lm,redis,resp", "--connections", "2,8", "--out", str(out)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, start_new_session=True,
    )
    stdout, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 0, stderr[-4000:]
    assert session_members(proc.pid) == []
    by = {(r["measure"], r["store"], r["connections"]): r for r in map(json.loads, out.read_text().splitlines())}
    assert {n for _, _, n in by} == {2, 8}
    for store in ("lm", "redis", "resp"):
        for n in (2, 8):
            assert len(by[("get", store, n)]["runs_gb_s"]) == 1
    assert ("socket", "lm server", 8) in by and ("socket", "redis-server", 8) in by
    assert not any(measure == "lmcache" for measure, _, _ in by)
