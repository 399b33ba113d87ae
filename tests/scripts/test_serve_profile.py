"""scripts/serve-profile: its summary of a profiler trace, and its pass-through of `kvtool bench
serve` where there is no CUDA device to profile (the report is bench serve's own)."""

import importlib.machinery
import importlib.util
import json
import subprocess
import sys

import pytest

from tests.conftest import REPO


def _module():
    loader = importlib.machinery.SourceFileLoader("serve_profile", str(REPO / "scripts" / "serve-profile"))
    spec = importlib.util.spec_from_loader("serve_profile", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _kernel(name, ts, dur, tid=7):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "tid": tid}


def test_the_summary_counts_busy_time_idle_gaps_kernels_and_copies():
    sp = _module()
    trace = {"traceEvents": [
        _kernel("gemm", 0, 1000), _kernel("gemm", 500, 1000),  # overlapping: 1.5 ms busy
        _kernel("attn", 4000, 500),  # a 2.5 ms gap before it
        _kernel("other_stream", 1500, 2000, tid=9),
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": 5000, "dur": 1000,
         "tid": 11, "args": {"bytes": 4096}},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 99999},  # host side: ignored
    ]}
    s = sp.summarise(trace)
    assert s["span_s"] == 0.006
    assert s["busy_s"] == 0.005  # [0, 3.5) ms, [4, 4.5), [5, 6)
    assert s["compute_busy_s"] == 0.002  # stream 7: 1.5 + 0.5 ms
    assert s["idle_gaps"] == {"over_1ms": 1, "seconds": 0.0025, "longest_s": 0.0025}
    assert s["kernels"][0] == ["gemm", 0.002, 2]
    assert s["copies"] == {"HtoD": {"seconds": 0.001, "bytes": 4096}}
    assert sp.summarise({"traceEvents": []})["busy_s"] == 0.0


@pytest.mark.slow
def test_without_cuda_it_runs_bench_serve_unprofiled(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("checks the pass-through on a machine without CUDA")
    trace = tmp_path / "chat.jsonl"
    make = [sys.executable, "-m", "kvtool.cli", "replay", "make-trace", "--kind", "multi-turn", "--num-conversations",
            "2", "--num-turns", "2", "--system-len", "32", "--history-len", "32", "--max-tokens", "2",
            "--out", str(trace)]
    assert subprocess.run(make, cwd=REPO, capture_output=True, text=True, check=False).returncode == 0
    out = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "serve-profile"), "--profile-out", str(tmp_path / "prof"),
         str(trace), "--preset", "tiny", "--load-format", "dummy", "--device", "cpu", "--arms", "prefix-cache",
         "--request-rate", "50", "--num-warmups", "0", "--kv-pressure", "1", "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=600, check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "no CUDA device here" in proc.stderr
    assert json.loads(out.read_text())["ok"] is True
    assert not (tmp_path / "prof").exists()
