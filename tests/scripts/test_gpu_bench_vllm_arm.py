"""scripts/gpu-bench.py's vllm arm against a stand-in `vllm` package: the child gets kvtool's
workload as token ids, its rows come back in kvtool's row shape with the same measure, and a
process it leaves running (vLLM's engine core) neither holds the run up nor outlives it."""

import json
import os
import subprocess
import sys

from tests.conftest import REPO

FAKE_VLLM = '''
import json, os
__version__ = "0.0-test"
class SamplingParams:
    def __init__(self, max_tokens, temperature, ignore_eos, detokenize):
        assert temperature == 0.0 and ignore_eos and not detokenize
        self.max_tokens = max_tokens
class _Metrics:
    def __init__(self, n):
        self.first_token_latency, self.first_token_ts, self.last_token_ts = 0.01, 1.0, 1.0 + 0.002 * (n - 1)
class _Completion:
    def __init__(self, n): self.token_ids = [7] * n
class _Output:
    def __init__(self, n):
        self.outputs, self.metrics, self.num_cached_tokens = [_Completion(n)], _Metrics(n), 0
class LLM:
    def __init__(self, **kw):
        # As vLLM's engine core: a process of its own that inherits stdout and outlives this one.
        import subprocess, sys
        core = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
        with open(os.environ["FAKE_VLLM_CORE"], "w") as f:
            f.write(str(core.pid))
        self.kw = kw
    def reset_prefix_cache(self): pass
    def generate(self, prompts, sps, use_tqdm=False):
        with open(os.environ["FAKE_VLLM_SEEN"], "a") as f:
            f.write(json.dumps([[p["prompt_token_ids"] for p in prompts], [s.max_tokens for s in sps]]) + "\\n")
        return [_Output(s.max_tokens) for s in sps]
'''


def _gone(pid: int) -> bool:
    """Whether process `pid` has ended (a zombie not yet reaped by init counts as ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_the_vllm_arm_runs_kvtools_workload_and_reports_kvtools_row_shape(tmp_path):
    site = tmp_path / "site"
    (site / "vllm" / "inputs").mkdir(parents=True)
    (site / "vllm" / "platforms").mkdir()
    (site / "vllm" / "__init__.py").write_text(FAKE_VLLM)
    (site / "vllm" / "inputs" / "__init__.py").write_text("def TokensPrompt(prompt_token_ids):\n"
                                                          "    return {'prompt_token_ids': prompt_token_ids}\n")
    (site / "vllm" / "platforms" / "__init__.py").write_text(
        "class _P:\n    def get_device_name(self): return 'none'\ncurrent_platform = _P()\n")
    seen, out = tmp_path / "seen.jsonl", tmp_path / "out" / "rows.jsonl"
    core = tmp_path / "core.pid"
    env = {**os.environ, "FAKE_VLLM_SEEN": str(seen), "FAKE_VLLM_CORE": str(core)}
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu-bench.py"), "throughput", "--quick",
                           "--engines", "vllm", "--vllm-site", str(site), "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    # The engine-core stand-in, still running when the arm exited, is gone with it.
    pid = int(core.read_text())
    assert _gone(pid)

    from kvtool.workloads.throughput import ThroughputSettings, make_workload

    seqs = make_workload(ThroughputSettings(num_seqs=64), 151936)  # Qwen3-0.6B's vocabulary
    passes = [json.loads(line) for line in seen.read_text().splitlines()]
    assert len(passes) == 3  # one warm-up pass, two timed
    for prompts, max_tokens in passes:
        assert prompts == [s.prompt_token_ids for s in seqs]
        assert max_tokens == [s.output_len for s in seqs]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["engine"] for r in rows] == ["vllm 0.0-test"]
    assert rows[0]["section"] == "throughput" and rows[0]["unit"] == "tok/s"
    assert rows[0]["measure"] == "qwen3-0.6b throughput 64 seqs"
    assert rows[0]["output_tokens"] == sum(s.output_len for s in seqs)
