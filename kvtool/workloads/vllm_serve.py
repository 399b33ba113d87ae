"""vLLM's arms of `kvtool bench serve`, run beside kvtool's on the same trace and arrival times.

    vllm           vLLM 0.26 with its prefix cache only
    vllm-offload   the same with its OffloadingConnector's CPU tier, `cpu_bytes_to_use` the bytes of
                   kvtool's CPU tier

Each arm is one process (vllm_serve_driver.py, which imports nothing of kvtool) running vLLM's
AsyncLLM, with the vLLM site (--vllm-site, an unpacked vLLM pack) first on its PYTHONPATH, in a
session of its own: when it ends, or runs out of time, the whole session is killed (vLLM's
engine-core process with it) and the GPU memory it held is waited for, so that the next arm
finds it free. vLLM's device cache gets kvtool's block size and block count (plus the one block
vLLM keeps back as its null block), its scheduler kvtool's limits, and its weights the same load
format (dummy weights are random in both engines, so their outputs are not compared).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

from kvtool.engine.errors import ConfigError, KVToolError
from kvtool.engine.params import EngineParams
from kvtool.workloads.process_session import end_session
from kvtool.workloads.serve_metrics import RequestTiming
from kvtool.workloads.serve_sizing import CacheSizes

VLLM_ARMS: tuple[str, ...] = ("vllm", "vllm-offload")
DRIVER = Path(__file__).resolve().with_name("vllm_serve_driver.py")
NEEDS = "the vLLM arms need a CUDA device and vLLM 0.26 (--vllm-site DIR, or an importable vllm)"
SESSION_END_S = 60.0
# vLLM's device cache is num_gpu_blocks_override whatever this share is; the share only has to be
# free when it starts, beside what this process (whose kvtool arms ran first) still holds.
GPU_MEMORY_UTILIZATION = 0.8
POLL_S = 1.0


class VLLMArmFailed(KVToolError):
    """A vLLM arm's process failed or ran out of time; the message quotes its log."""

    exit_code = 1


class VLLMRun(msgspec.Struct, kw_only=True):
    name: str
    records: list[RequestTiming]
    # vLLM's scheduler statistics summed over the run (vllm_serve_driver.py).
    stats: dict[str, int]


class VLLMArmResult(msgspec.Struct, kw_only=True):
    startup: dict
    runs: list[VLLMRun]
    log_path: str


def vllm_unavailable(site: str | None, device_type: str) -> str | None:
    """Why vLLM's arms cannot run here, in one line; None when they can.

    Raises ConfigError for a --vllm-site that holds no vllm package (a bad flag, not a skip).
    """
    if site is not None and not (Path(site) / "vllm").is_dir():
        raise ConfigError(f"--vllm-site {site}: no vllm package in it")
    import torch

    if not torch.cuda.is_available():
        return f"{NEEDS}: this machine has no CUDA device"
    if device_type != "cuda":
        return f"{NEEDS}: kvtool's arms run on --device {device_type} here, so the two would not compare"
    if site is None and importlib.util.find_spec("vllm") is None:
        return f"{NEEDS}: no vllm is importable here and no --vllm-site was given"
    return None


def vllm_engine_args(base: EngineParams, dtype: str, sizes: CacheSizes, max_model_len: int, cpu_tier: bool) -> dict:
    """AsyncEngineArgs keywords matching kvtool's arms (see the module docstring)."""
    args = {
        "load_format": "dummy" if base.load_format == "dummy" else "auto", "dtype": dtype, "seed": base.seed,
        "block_size": sizes.block_size, "num_gpu_blocks_override": sizes.num_gpu_blocks + 1,
        "enable_prefix_caching": True, "max_num_seqs": base.max_num_seqs,
        "max_num_batched_tokens": base.max_num_batched_tokens, "max_model_len": max_model_len,
        "gpu_memory_utilization": GPU_MEMORY_UTILIZATION, "enforce_eager": base.enforce_eager,
        "tensor_parallel_size": base.tensor_parallel_size, "skip_tokenizer_init": True,
    }
    if cpu_tier:
        args["kv_transfer_config"] = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                                      "kv_connector_extra_config": {"cpu_bytes_to_use": sizes.cpu_tier_bytes}}
    return args


def run_vllm_arm(name: str, model: Path, engine_args: dict, prompts: list[list[int]], max_tokens: list[int],
                 runs: list[dict], *, site: str | None, num_warmups: int, timeout_s: float,
                 progress: Callable[[int], None] | None = None) -> VLLMArmResult:
    """Run one vLLM arm over `runs` ({"name", "arrivals", "max_concurrency", "salt"} each).

    `progress` is called with the number of runs done so far. Raises VLLMArmFailed when the
    process exits with an error or runs past `timeout_s`.
    """
    log_path = Path(tempfile.gettempdir()) / f"kvtool-bench-serve-{name}-{os.getpid()}.log"
    env = dict(os.environ)
    if site:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(site).resolve()), env.get("PYTHONPATH")) if p)
    with tempfile.TemporaryDirectory(prefix="kvtool-bench-serve-vllm-") as tmp:
        spec_path, rows_path = Path(tmp) / "spec.json", Path(tmp) / "rows.jsonl"
        spec_path.write_text(json.dumps({"model": str(model), "engine_args": engine_args, "prompts": prompts,
                                         "max_tokens": max_tokens, "num_warmups": num_warmups, "runs": runs}))
        code = _run_session([sys.executable, str(DRIVER), str(spec_path), str(rows_path)], env, log_path, timeout_s,
                            rows_path, progress)
        lines = rows_path.read_text().splitlines() if rows_path.exists() else []
    if code != 0:
        tail = " | ".join(line.strip()[:300] for line in log_path.read_text(errors="replace").splitlines()[-6:])
        how = f"ran past {timeout_s:.0f} s" if code is None else f"exited with status {code}"
        raise VLLMArmFailed(f"vLLM's {name} arm {how} (log {log_path}): {tail}")
    startup: dict = {}
    done: list[VLLMRun] = []
    for line in lines:
        row = json.loads(line)
        if "startup" in row:
            startup = row["startup"]
        elif "run" in row:
            records = msgspec.convert(row["requests"], list[RequestTiming])
            done.append(VLLMRun(name=row["run"], records=records, stats=row["stats"]))
    if len(done) != len(runs):
        raise VLLMArmFailed(f"vLLM's {name} arm reported {len(done)} of {len(runs)} runs (log {log_path})")
    return VLLMArmResult(startup=startup, runs=done, log_path=str(log_path))


def _run_session(argv: list[str], env: dict, log_path: Path, timeout_s: float, rows_path: Path,
                 progress: Callable[[int], None] | None) -> int | None:
    """Run argv in a session of its own; its exit status, or None when it ran past timeout_s."""
    deadline = time.monotonic() + timeout_s
    with log_path.open("w") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)
        try:
            while True:
                try:
                    return proc.wait(timeout=POLL_S)
                except subprocess.TimeoutExpired:
                    pass
                if progress is not None and rows_path.exists():
                    progress(sum(1 for line in rows_path.read_text().splitlines() if line.startswith('{"run"')))
                if time.monotonic() > deadline:
                    return None
        finally:
            end_session(proc, SESSION_END_S)


