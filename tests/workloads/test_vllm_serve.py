"""vLLM's arms of `kvtool bench serve` against a stand-in `vllm` package with the surface the driver
uses (AsyncEngineArgs, AsyncLLM.from_engine_args with stat loggers, generate streaming DELTA
outputs, StatLoggerBase, KVTransferConfig, current_platform): the driver gets kvtool's prompts,
output lengths, arrival times and engine sizes, its rows come back as the same records and
figures as kvtool's arms, vLLM's statistics prove the hits, and the process it leaves running
(vLLM's engine core) neither holds the run up nor outlives it. The real vLLM runs only on a GPU
machine."""

import json
import os

import pytest

from kvtool.engine.params import EngineParams
from kvtool.workloads.arms import make_builtin_arm
from kvtool.workloads.serve_arrivals import parse_request_rates
from kvtool.workloads.serve_bench import ServeSettings, run_serve
from kvtool.workloads.trace import TraceLine, TraceRequest
from kvtool.workloads.vllm_serve import VLLMArmFailed, run_vllm_arm

FAKE_VLLM = '''
import asyncio, enum, json, os, subprocess, sys
__version__ = "0.0-test"

class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2

class SamplingParams:
    def __init__(self, max_tokens, temperature, ignore_eos, detokenize, output_kind):
        assert temperature == 0.0 and ignore_eos and not detokenize and output_kind is RequestOutputKind.DELTA
        self.max_tokens = max_tokens
'''
FAKE_ASYNC_LLM = '''
import asyncio, json, os, subprocess, sys, types

class _Completion:
    def __init__(self, ids): self.token_ids = ids

class _Output:
    def __init__(self, ids, cached, finished):
        self.outputs, self.num_cached_tokens, self.finished = [_Completion(ids)], cached, finished

class _Prefix:
    def __init__(self, queries, hits): self.queries, self.hits = queries, hits

class AsyncLLM:
    def __init__(self, args, loggers):
        if os.environ.get("FAKE_VLLM_FAIL"):
            raise RuntimeError("no GPU here")
        # As vLLM's engine core: a process of its own that outlives this one unless killed.
        core = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
        with open(os.environ["FAKE_VLLM_CORE"], "w") as f:
            f.write(str(core.pid))
        self.args = args.kw
        cache = types.SimpleNamespace(num_gpu_blocks=args.kw["num_gpu_blocks_override"],
                                      block_size=args.kw["block_size"])
        self.vllm_config = types.SimpleNamespace(cache_config=cache)
        self.loggers = [factory(self.vllm_config, 0) for factory in loggers]
        self.seen = set()
        ktc = args.kw.get("kv_transfer_config")
        with open(os.environ["FAKE_VLLM_SEEN"], "a") as f:
            f.write(json.dumps({"engine_args": {k: v for k, v in args.kw.items() if k != "kv_transfer_config"},
                                "kv_transfer_config": vars(ktc) if ktc is not None else None}) + "\\n")

    @classmethod
    def from_engine_args(cls, args, stat_loggers=None):
        return cls(args, stat_loggers or [])

    async def generate(self, prompt, params, request_id):
        ids = prompt["prompt_token_ids"]
        with open(os.environ["FAKE_VLLM_SEEN"], "a") as f:
            f.write(json.dumps({"request": request_id, "prompt": ids, "salt": prompt["cache_salt"],
                                "max_tokens": params.max_tokens}) + "\\n")
        key = (prompt["cache_salt"], tuple(ids[:16]))
        cached = 16 if key in self.seen and len(ids) > 16 else 0
        self.seen.add(key)
        external = cached if self.args.get("kv_transfer_config") else 0
        stats = types.SimpleNamespace(num_waiting_reqs=1, prefix_cache_stats=_Prefix(len(ids), cached - external),
                                      connector_prefix_cache_stats=_Prefix(len(ids), external))
        prompt_stats = types.SimpleNamespace(total=len(ids), computed=len(ids) - cached,
                                             local_cache_hit=cached - external, external_kv_transfer=external)
        iteration = types.SimpleNamespace(prompt_token_stats=prompt_stats)
        for logger in self.loggers:
            logger.record(scheduler_stats=stats, iteration_stats=iteration, mm_cache_stats=None, engine_idx=0)
        for k in range(params.max_tokens):
            await asyncio.sleep(0.001)
            yield _Output([(sum(ids) + k) % 97], cached, k == params.max_tokens - 1)
'''
FAKE_MODULES = {
    "__init__.py": FAKE_VLLM,
    "sampling_params.py": "from vllm import RequestOutputKind\n",
    "engine/__init__.py": "",
    "engine/arg_utils.py": "class AsyncEngineArgs:\n    def __init__(self, **kw):\n        self.kw = kw\n",
    "v1/__init__.py": "",
    "v1/engine/__init__.py": "",
    "v1/engine/async_llm.py": FAKE_ASYNC_LLM,
    "v1/metrics/__init__.py": "",
    "v1/metrics/loggers.py": (
        "import abc\nclass StatLoggerBase(abc.ABC):\n"
        "    @abc.abstractmethod\n    def __init__(self, vllm_config, engine_index=0): ...\n"
        "    @abc.abstractmethod\n"
        "    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0): ...\n"
        "    @abc.abstractmethod\n    def log_engine_initialized(self): ...\n"),
    "platforms/__init__.py": "class _P:\n    def get_device_name(self): return 'none'\ncurrent_platform = _P()\n",
    "config.py": "class KVTransferConfig:\n    def __init__(self, **kw):\n        self.__dict__.update(kw)\n",
}


@pytest.fixture
def fake_site(tmp_path, monkeypatch):
    site = tmp_path / "site"
    for rel, text in FAKE_MODULES.items():
        path = site / "vllm" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    seen, core = tmp_path / "seen.jsonl", tmp_path / "core.pid"
    monkeypatch.setenv("FAKE_VLLM_SEEN", str(seen))
    monkeypatch.setenv("FAKE_VLLM_CORE", str(core))
    return site, seen, core


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_run_serve_drives_vllm_arms_on_kvtools_prompts_and_arrivals(fake_site, tiny_model_dir):
    site, seen, core = fake_site
    system = [40 + i % 50 for i in range(32)]
    lines = [TraceLine(line=i + 1, request=TraceRequest(id=f"r{i}", prompt_token_ids=system + [60 + i] * (8 + i),
                                                        max_tokens=3)) for i in range(6)]
    settings = ServeSettings(trace="t.jsonl", loads=parse_request_rates("50,inf"), max_concurrency=2, arrival_seed=0,
                             num_warmups=1, kv_pressure=1.0, cpu_tier_bytes=None)
    base = EngineParams(model=str(tiny_model_dir), device="cpu")
    report = run_serve(base, lines, settings, [make_builtin_arm("prefix-cache")], ["vllm", "vllm-offload"],
                       skipped=[], vllm_site=str(site), vllm_timeout_s=120)
    assert report.ok, report.failures
    assert [(a.name, a.engine) for a in report.arms] == [("prefix-cache", "kvtool"), ("vllm", "vllm"),
                                                          ("vllm-offload", "vllm")]
    startup = report.arms[1].vllm
    assert startup["vllm"] == "0.0-test" and startup["num_gpu_blocks"] == report.sizes.num_gpu_blocks + 1
    assert _gone(int(core.read_text()))  # the engine-core stand-in went with its arm

    rows = [json.loads(line) for line in seen.read_text().splitlines()]
    engines = [r for r in rows if "engine_args" in r]
    assert len(engines) == 2
    for e in engines:
        args = e["engine_args"]
        assert args["num_gpu_blocks_override"] == report.sizes.num_gpu_blocks + 1  # and its null block
        assert args["block_size"] == 16 and args["max_model_len"] == report.max_model_len
        assert args["enable_prefix_caching"] and args["skip_tokenizer_init"] and args["max_num_seqs"] == 256
    assert engines[0]["kv_transfer_config"] is None
    assert engines[1]["kv_transfer_config"] == {
        "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": report.sizes.cpu_tier_bytes}}
    sent = [r for r in rows if "request" in r]
    # One warm-up request, then every request of the trace at each load, twice (two arms).
    assert len(sent) == 2 * (1 + 2 * 6)
    trace_prompts = {tuple(e.request.prompt_token_ids) for e in lines}
    assert all(tuple(r["prompt"]) in trace_prompts and r["max_tokens"] == 3 for r in sent)
    assert len({r["salt"] for r in sent}) == 2 * 2 + 1  # a salt per arm and load, and the warm-up's

    kvtool_runs = {r.load: r for r in report.runs if r.arm == "prefix-cache"}
    for run in report.runs:
        assert run.figures.num_requests == 6 and run.figures.num_failed == 0
        assert run.figures.num_output_tokens == 6 * 3 and run.figures.ttft.num_samples == 6
        # Every arm got the same arrival times.
        assert [r.arrival_s for r in run.requests] == [r.arrival_s for r in kvtool_runs[run.load].requests]
        if run.engine == "vllm":
            assert run.outputs_equal is None and run.vllm_stats["num_scheduler_stats"] == 6
            s = run.sources
            assert s.device_cache + s.connector + s.computed == s.num_prompt_tokens
    offload = [r for r in report.runs if r.arm == "vllm-offload"]
    assert all(r.sources.cpu_tier == r.sources.connector == 5 * 16 and r.sources.device_cache == 0 for r in offload)
    plain = [r for r in report.runs if r.arm == "vllm"]
    assert all(r.sources.cpu_tier is None and r.sources.device_cache == 5 * 16 for r in plain)


def test_vllm_sources_without_vllms_prompt_token_breakdown():
    from kvtool.workloads.serve_bench import _vllm_sources
    from kvtool.workloads.serve_metrics import RequestTiming

    records = [RequestTiming(index=i, arrival_s=0.0, num_prompt_tokens=100, num_cached_tokens=64) for i in range(3)]
    with_breakdown = _vllm_sources(records, {"prompt_tokens": 300, "prompt_tokens_local_cache_hit": 100,
                                             "prompt_tokens_external_kv_transfer": 80, "connector_hits": 999}, True)
    assert (with_breakdown.computed, with_breakdown.device_cache, with_breakdown.cpu_tier) == (120, 100, 80)
    # Without it: the requests' cached tokens, less the connector's external hits.
    without = _vllm_sources(records, {"connector_hits": 50}, True)
    assert (without.computed, without.device_cache, without.cpu_tier, without.connector) == (108, 142, 50, 50)
    plain = _vllm_sources(records, {"connector_hits": 0}, False)
    assert (plain.computed, plain.device_cache, plain.cpu_tier) == (108, 192, None)


def test_a_failing_vllm_arm_is_reported_with_its_log(fake_site, monkeypatch):
    site, _, _ = fake_site
    monkeypatch.setenv("FAKE_VLLM_FAIL", "1")
    with pytest.raises(VLLMArmFailed, match=r"vLLM's vllm arm exited with status 1 \(log .*\): .*no GPU here"):
        run_vllm_arm("vllm", site, {"block_size": 16, "num_gpu_blocks_override": 9}, [[1, 2, 3]], [2],
                     [{"name": "inf", "arrivals": [0.0], "max_concurrency": None, "salt": "s"}], site=str(site),
                     num_warmups=0, timeout_s=60)
    assert not os.environ.get("PYTHONPATH", "").startswith(str(site))  # the site reached the child alone
