"""GPU benchmarks of kvtool's CUDA paths, each figure with its floor and, where asked, vLLM beside it.

Usage: python scripts/gpu-bench.py SECTION [SECTION ...] [--out results.jsonl] [--quick]
           [--engines kvtool,vllm] [--vllm-site DIR] [--tiles FILE] [--invariance-arms]

Sections:
  env         GPU, versions, the SDPA backend torch picks for prefill shapes
  kernels     Triton split-KV decode (TB/s of K+V read); kvtool's prefill kernel (on Hopper the Gluon
              one) and the Triton one, causal and over a cached prefix, beside cuDNN SDPA (TFLOP/s);
              the fused MoE experts at 1 to 2048 tokens (TB/s of the routed experts' weights)
  prefill     Qwen3-8B cold prefill TTFT at 2k/8k/32k (the last layer for the sampled row alone, the
              default, and for every row, alternating), and HF transformers on the same shapes
  hit         Qwen3-8B full-prefix hit from the CPU tier: TTFT and H2D rate; partial hits with and
              without `layerwise`; cold prefills storing to the tier with and without layerwise saves
  hit-layers  Qwen3-8B full hits at 8k/16k/24k/32k, whole-block loads against loads in groups of
              layers (pitched copies, the default) with the one-token step eager and from its
              graphs (the default), two alternating passes each: TTFT and the host time of the step
  decode      batch-1 TPOT with CUDA graphs and eager, Qwen3-8B and Qwen3-0.6B (--quick: Qwen3-0.6B)
  throughput  Qwen3-0.6B, 256 sequences, input and output lengths U[100, 1024], ignore_eos, greedy
              (the workload of `kvtool bench throughput`; --quick: 64 sequences)
  models      other architectures with the default settings: Qwen2.5-7B (cold prefill 8k, batch-1
              TPOT), Qwen3-8B in bf16 and as a block-wise FP8 checkpoint (the same two), Qwen3-30B-A3B
              (batch-1 TPOT, throughput on the `throughput` workload), Gemma 3 4B's text model (cold
              prefill 8k and 32k, TPOT, KV bytes per token of a 32k context beside the bound of a
              cache whose local layers keep their window only); --quick: Qwen2.5-7B, the MoE, Gemma
  tiles       every candidate tile of the row-invariant GEMM on Qwen3-8B's and Qwen3-0.6B's decode
              shapes at 1/8/64 rows from CUDA graphs: bits against the configured tiles', the
              fastest beside them, the one-row GEMV and cuBLAS (--quick: Qwen3-8B's projections, 1 row)
  fp8-tiles   every candidate tile of the FP8 checkpoint GEMM (`fp8_gemm`) on Qwen3-8B's block-wise
              FP8 projections at 1/64/256/8192 rows from CUDA graphs: bits against the configured
              tiles', the fastest beside them, cuBLAS's bf16 product of the same shape, and for a
              weight whose K is split the fastest tiles unsplit (--quick: 1 and 8192 rows)
  fp8-kernels the FP8 GEMM's Gluon (Hopper) and Triton kernels on Qwen3-8B's block-wise projections
              at 256/1024/8192 rows from CUDA graphs, their bits against each other, beside cuBLAS's
              bf16 product and its block-scaled FP8 one (torch._scaled_mm)
  prefill-tiles  every launch of the Triton prefill kernel (row blocks, warps, tiles in flight) on
              Gemma 3 4B's global and sliding-window attention at 32k from CUDA graphs: bits against
              the default launch's, the fastest beside it, the Gluon kernel the layer runs on
              Hopper, torch's SDPA (--quick: 8k)
  profile     where decode steps spend their GPU time, batch-invariant (the default) and not:
              torch.profiler over 64 decode steps of Qwen3-8B at batch 1 (2k context) and of
              Qwen3-0.6B at batch 256 (512-token prompts) and of Gemma 3 4B at batch 1, the kernels
              by total time (printed; one row per case and mode with the summed kernel time per
              step); --models picks cases by preset; --quick: the first case only
  lm          lm:// GET into the pages (LMCacheConnector) over 1 and 4 connections, against a
              local in-memory server in a separate process (tests/support/memory_lm_server.py); beside it,
              in the same run, the client's socket reads alone (1 and 4 reader processes, no
              engine, no GPU copy)

--kv-cache-dtype fp8 (or fp8_e5m2) runs every engine of both arms with an fp8 KV cache (vLLM's
flag, passed to vLLM too): each row's metric and measure then end in " [KV fp8]", and the
CPU-tier hit floors count its bytes (half of bf16's).

Every result is one JSON line in --out (engine, metric, value, unit, floor, ratio, command
details) and one row of the table printed at the end. Models are presets built from their configs
with dummy (random) weights.

Engines (--engines, default kvtool): `vllm` runs vLLM's offline API (`vllm.LLM`) in a process of
its own per section and model (scripts/gpu-bench-vllm.py), on the same workload objects as
kvtool's arm: the same prompt token ids, greedy, EOS ignored, the same output lengths, passed
as JSON. It covers `prefill` (prefix caching off), `hit` (full hits from vLLM's
OffloadingConnector CPU tier, 256-token offload blocks, the GPU prefix cache reset before each),
`decode` (graphs on), `throughput` and `models` (Qwen2.5-7B and Qwen3-30B-A3B; the MoE model
needs vLLM's `_moe_C` kernels, which the anchor pack leaves out: unpack them into the site's
`vllm/` folder). The vLLM site (an unpacked vLLM pack, put first on the child's PYTHONPATH) is
--vllm-site or $KVTOOL_VLLM_SITE; without either the child imports the vLLM of the environment. Rows with the same `measure` are one figure of both engines, and the
last table sets them side by side. vLLM's logs go to vllm-SECTION-MODEL.log beside --out (or in
the temporary folder).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

RESULTS: list[dict] = []
OUT: Path | None = None
QUICK = False
ENGINES: tuple[str, ...] = ("kvtool",)
VLLM_SITE: str | None = None
KV_CACHE_DTYPE = "auto"  # --kv-cache-dtype: every engine's, in both arms
INVARIANCE_ARMS = False  # --invariance-arms: decode runs graphs + async scheduling, invariant and not, only
VLLM_ARM = Path(__file__).resolve().parent / "gpu-bench-vllm.py"
VLLM_TIMEOUT_S = 1200  # one vLLM process: start-up, compile, graphs and the section's requests

# Floors: the ceilings measured on an H200 (HBM copy rate, host-to-device copy rate, bf16 matrix
# rate); BENCHMARKS.md gives each figure's floor ratio.
HBM_TBS = 4.1
H2D_GBS = 55.0
PEAK_TFLOPS = 790.0
# lm:// loads measured per connection count (after one warm-up); the median is reported.
LM_RUNS = 5


def record(section: str, metric: str, value: float, unit: str, floor: float | None = None, *,
           engine: str = "kvtool", **detail) -> None:
    """One result row; `measure` in detail names a figure that both engines' arms report."""
    if KV_CACHE_DTYPE != "auto":
        metric += f" [KV {KV_CACHE_DTYPE}]"
        if "measure" in detail:
            detail["measure"] += f" [KV {KV_CACHE_DTYPE}]"
    row = {"section": section, "engine": engine, "metric": metric, "value": round(value, 4), "unit": unit}
    if floor is not None:
        row["floor"] = round(floor, 4)
        # For times the ratio is measured / floor; for rates it is floor / measured (>= 1 is slower).
        row["ratio_to_floor"] = round(value / floor if unit in ("ms", "s") else floor / value, 3) if value else None
    row.update(detail)
    RESULTS.append(row)
    if OUT is not None:
        with OUT.open("a") as f:
            f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)


def model_dir(preset: str) -> str:
    from kvtool.engine.presets.catalog import create_model_dir

    root = Path(tempfile.gettempdir()) / "kvtool-bench-models"
    d = root / preset
    if not (d / "config.json").exists():
        root.mkdir(parents=True, exist_ok=True)
        create_model_dir(d, preset=preset, config_only=True)
    return str(d)


def make_engine(preset: str, **kw):
    from kvtool.engine.engine import LLMEngine
    from kvtool.engine.params import EngineParams

    params = dict(model=model_dir(preset), load_format="dummy", device="cuda", dtype="bfloat16",
                  kv_cache_dtype=KV_CACHE_DTYPE)
    params.update(kw)
    return LLMEngine(EngineParams(**params))


def tokens(n: int, seed: int = 0) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(1000, 150000) for _ in range(n)]


def sync():
    import torch

    torch.cuda.synchronize()


# ---- workloads: one object per measure, run by kvtool's arm and sent to vLLM's as token ids ----

WARM_PROMPT_SEED = 99


def warm_prompt() -> list[int]:
    return tokens(512, WARM_PROMPT_SEED)


def prefill_workload(lengths) -> dict[int, list[list[int]]]:
    """Cold prompts per length: the first of each is dropped from the median."""
    return {n: [tokens(n, rep) for rep in range(4 if n < 32768 else 3)] for n in lengths}


def hit_workload(lengths) -> dict[int, list[int]]:
    """One prompt of n + 1 tokens per length: stored once, then n tokens come back from the tier."""
    return {n: tokens(n + 1, 1000 + n) for n in lengths}


DECODE_OUTPUT_TOKENS = 128


def decode_workload() -> tuple[list[int], list[list[int]]]:
    """Batch-1 decode: a warm-up prompt, then three 2k prompts, 128 output tokens each."""
    return tokens(256, 1), [tokens(2048, rep + 2) for rep in range(3)]


def throughput_workload(num_seqs: int):
    """`kvtool bench throughput`'s workload (its defaults but the count) for Qwen3-0.6B."""
    from kvtool.workloads.throughput import ThroughputSettings, make_workload

    vocab_size = json.loads((Path(model_dir("qwen3-0.6b")) / "config.json").read_text())["vocab_size"]
    return make_workload(ThroughputSettings(num_seqs=num_seqs), vocab_size)


# ---- vLLM's arm -------------------------------------------------------------------------------


def end_session(proc: subprocess.Popen, wait_s: float = 60.0) -> None:
    """Kill the vLLM arm's session (the arm and vLLM's engine-core process) and wait until none of
    it is left and its GPU memory is free for whatever runs next."""
    from kvtool.workloads.process_session import end_session as end

    held = end(proc, wait_s)
    if held is not None:
        raise SystemExit(f"gpu-bench: after vLLM's arm, {held}")


def gpu_processes() -> str:
    """nvidia-smi's compute processes (pid, name, memory), for a vLLM arm that found the GPU taken."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return f"(nvidia-smi: {e})"
    return "; ".join(line.strip() for line in out.splitlines() if line.strip()) or "none"


def release_gpu_memory() -> None:
    """Give the memory kvtool's closed engines left in torch's cache back to the driver: vLLM
    starts only if the share of the GPU it is told to take is free."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        print(f"# GPU memory free before vLLM's arm: {free / 2**30:.1f} of {total / 2**30:.1f} GiB; "
              f"processes: {gpu_processes()}", flush=True)


def run_vllm(section: str, preset: str, llm: dict, jobs: list[dict]) -> tuple[dict, dict[str, list[dict]]]:
    """Runs scripts/gpu-bench-vllm.py on one spec; returns its startup line and each job's results."""
    log_dir = OUT.parent if OUT is not None else Path(tempfile.gettempdir())
    log_path = log_dir / f"vllm-{section}-{preset}.log"
    env = dict(os.environ)
    if VLLM_SITE:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (VLLM_SITE, env.get("PYTHONPATH")) if p)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        if KV_CACHE_DTYPE != "auto":
            llm = {**llm, "kv_cache_dtype": KV_CACHE_DTYPE}
        json.dump({"model": model_dir(preset), "llm": llm, "jobs": jobs}, f)
        spec = f.name
    rows_path = Path(spec).with_suffix(".rows.jsonl")
    release_gpu_memory()
    code = None
    try:
        with log_path.open("w") as log:
            # A session of its own: whatever vLLM leaves running (its engine-core process) is
            # killed with it once the arm has exited or run out of time.
            proc = subprocess.Popen([sys.executable, str(VLLM_ARM), spec, str(rows_path)], stdout=log,
                                    stderr=log, stdin=subprocess.DEVNULL, env=env, start_new_session=True)
            try:
                code = proc.wait(timeout=VLLM_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pass
            finally:
                end_session(proc)
        lines = rows_path.read_text().splitlines() if rows_path.exists() else []
    finally:
        os.unlink(spec)
        rows_path.unlink(missing_ok=True)
    if code != 0:
        tail = log_path.read_text().splitlines()[-40:]
        print("\n".join(line[:400] for line in tail), file=sys.stderr)
        print(f"# processes on the GPU now: {gpu_processes()}", file=sys.stderr)
        how = f"ran past {VLLM_TIMEOUT_S}s" if code is None else f"exited {code}"
        raise SystemExit(f"gpu-bench: vLLM's {section} arm ({preset}) {how}; log {log_path}")
    startup, results = {}, {}
    for line in lines:
        row = json.loads(line)
        if "startup" in row:
            startup = row["startup"]
        else:
            results[row["job"]] = row["results"]
    print(json.dumps({"vllm_startup": {"section": section, "preset": preset, **startup}}), flush=True)
    return startup, results


def vllm_engine(startup: dict) -> str:
    return f"vllm {startup.get('vllm', '?')}"


def requests_job(name: str, prompts: list[list[int]], max_tokens: int, **kw) -> dict:
    return {"name": name, "job": "requests", "prompts": prompts, "max_tokens": max_tokens, **kw}


# ---- env ----------------------------------------------------------------------------------------


def section_env():
    import torch
    import triton
    import transformers

    p = torch.cuda.get_device_properties(0)
    q = torch.randn(1, 32, 8192, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 8, 8192, 128, device="cuda", dtype=torch.bfloat16)
    from torch.nn.attention import SDPBackend

    choice = torch._fused_sdp_choice(q, k, k, is_causal=True, enable_gqa=True)
    info = {
        "gpu": p.name, "sms": p.multi_processor_count, "memory_gib": round(p.total_memory / 2**30, 1),
        "torch": torch.__version__, "triton": triton.__version__, "transformers": transformers.__version__,
        "sdpa_backend_prefill": SDPBackend(choice).name, "date": time.strftime("%Y-%m-%d"),
    }
    print(json.dumps({"env": info}), flush=True)
    if OUT is not None:
        with OUT.open("a") as f:
            f.write(json.dumps({"env": info}) + "\n")


# ---- kernels ------------------------------------------------------------------------------------


def section_kernels():
    import torch
    import torch.nn.functional as F
    from triton.testing import do_bench

    from kvtool.engine.kernels.attention.prefill import prefill_attention
    from kvtool.engine.kernels.attention.triton_ops import choose_num_splits, paged_decode
    from kvtool.engine.kernels.attention.triton_prefill import triton_prefill_attention

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    hq, hkv, d, bs, layers = 32, 8, 128, 16, 1
    for batch, ctx in ((64, 8192), (256, 2048), (8, 8192), (1, 32768)):
        width = ctx // bs
        nb = batch * width + 1
        pages = torch.randn((nb, 2, layers, bs, hkv, d), device="cuda", dtype=torch.bfloat16)
        table = torch.randperm(nb - 1, device="cuda")[: batch * width].view(batch, width).to(torch.int32)
        lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
        q = torch.randn((batch, hq, d), device="cuda", dtype=torch.bfloat16)
        out = torch.empty_like(q)
        splits = choose_num_splits(batch, hkv, ctx, sms)
        ms = do_bench(lambda: paged_decode(q, pages, 0, table, lens, d**-0.5, splits, out), warmup=50, rep=300,
                      return_mode="median")
        nbytes = batch * ctx * hkv * d * 2 * 2
        record("kernels", f"decode B={batch} ctx={ctx} (Hq32/Hkv8/D128, bs16)", nbytes / ms / 1e9, "TB/s",
               HBM_TBS, ms=round(ms, 4), splits=splits)
    for n in (8192, 32768):
        q = torch.randn((1, 32, n, 128), device="cuda", dtype=torch.bfloat16)
        k = torch.randn((1, 8, n, 128), device="cuda", dtype=torch.bfloat16)
        ms = do_bench(lambda: F.scaled_dot_product_attention(q, k, k, is_causal=True, enable_gqa=True), warmup=20,
                      rep=200, return_mode="median")
        flop = 2 * 32 * 128 * n * n
        record("kernels", f"cuDNN SDPA causal prefill S={n} (GQA 32/8)", flop / ms / 1e9, "TFLOP/s", PEAK_TFLOPS,
               ms=round(ms, 3))
        qt, kt = q[0].transpose(0, 1).contiguous(), k[0].transpose(0, 1).contiguous()
        cu = torch.tensor([0, n], device="cuda", dtype=torch.int32)
        out = torch.empty_like(qt)
        for name, kernel in (("kvtool", prefill_attention), ("Triton", triton_prefill_attention)):
            ms = do_bench(lambda: kernel(qt, kt, kt, cu, cu, n, d**-0.5, out), warmup=20, rep=200,
                          return_mode="median")
            record("kernels", f"{name} prefill causal S={n} (GQA 32/8)", flop / ms / 1e9, "TFLOP/s", PEAK_TFLOPS,
                   ms=round(ms, 3))
    # prefill over a cached prefix: 4 sequences of 2k queries over 8k keys
    qv = torch.randn((4 * 2048, 32, 128), device="cuda", dtype=torch.bfloat16)
    kv = torch.randn((4 * 8192, 8, 128), device="cuda", dtype=torch.bfloat16)
    cu_q = torch.arange(0, 5, device="cuda", dtype=torch.int32) * 2048
    cu_k = torch.arange(0, 5, device="cuda", dtype=torch.int32) * 8192
    ms = do_bench(lambda: prefill_attention(qv, kv, kv, cu_q, cu_k, 2048, d**-0.5), warmup=20, rep=200,
                  return_mode="median")
    flop = 4 * 2 * 32 * 128 * 2048 * (8192 - 1024) * 2  # QK^T + PV over the visible keys
    record("kernels", "kvtool prefill over a prefix, 4 x (2k over 8k)", flop / ms / 1e9, "TFLOP/s", PEAK_TFLOPS,
           ms=round(ms, 3))
    kernel_fused_moe()
    kernel_fp8_gemm()


# Qwen3-8B's projections (N, K): q/k/v, o_proj, gate/up, down_proj.
QWEN3_8B_PROJECTIONS = ((6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288))


def kernel_fp8_gemm(sweep: bool = False) -> None:
    """Qwen3-8B's projections over block-wise FP8 weights (`kernels.fp8_gemm`) beside the bf16
    products the default (batch-invariant) engine runs at the same row count: one decode row
    (weight bytes read per second) and an 8k prefill (TFLOP/s). With `sweep`, every tile
    configuration's time is printed too."""
    import torch
    from triton.testing import do_bench

    from kvtool.engine.kernels.fp8_gemm import config_for, fp8_mm
    from kvtool.engine.kernels.fp8_weight import Fp8Weight
    from kvtool.engine.kernels.row_invariant_gemm import linear
    from kvtool.engine.kernels.tiles import sm_count
    from kvtool.engine.models.quantization import WeightQuantization, quantize

    q = WeightQuantization(method="fp8", weight_strategy="block", weight_block_size=(128, 128))
    sms = sm_count(torch.device("cuda"))
    for n, k in QWEN3_8B_PROJECTIONS:
        dense = (torch.randn(n, k, device="cuda") / k**0.5).bfloat16()
        w = Fp8Weight(*quantize(dense, q), 128, 128)
        for m in (1, 8192):
            x = torch.randn(m, k, device="cuda").bfloat16()
            fp8_ms = do_bench(lambda: fp8_mm(x, w), warmup=20, rep=200, return_mode="median")
            bf16_ms = do_bench(lambda: linear(x, dense, row_invariant=True), warmup=20, rep=200, return_mode="median")
            if m == 1:
                record("kernels", f"FP8 GEMM 1 row, N={n} K={k}", n * k / fp8_ms / 1e9, "TB/s", HBM_TBS,
                       ms=round(fp8_ms, 4), bf16_ms=round(bf16_ms, 4), config=config_for(m, n, sms, k))
            else:
                flop = 2 * m * n * k
                record("kernels", f"FP8 GEMM {m} rows, N={n} K={k}", flop / fp8_ms / 1e9, "TFLOP/s",
                       2 * PEAK_TFLOPS, ms=round(fp8_ms, 3), bf16_ms=round(bf16_ms, 3), config=config_for(m, n, sms, k))
            if sweep:
                small = ((64, 16, 4, 4), (64, 32, 4, 4), (64, 64, 4, 4), (64, 128, 4, 3))
                large = ((128, 128, 8, 3), (128, 128, 8, 4), (128, 256, 8, 3), (64, 256, 4, 3))
                for cfg in small if m == 1 else large:
                    try:
                        ms = do_bench(lambda: fp8_mm(x, w, cfg), warmup=10, rep=100, return_mode="median")
                    except Exception as e:  # a tile too large for shared memory
                        print(f"# sweep N={n} K={k} M={m} {cfg}: {type(e).__name__}", flush=True)
                        continue
                    print(f"# sweep N={n} K={k} M={m} {cfg}: {ms:.4f} ms", flush=True)


def kernel_fused_moe() -> None:
    """One MoE block's experts (`kernels.fused_moe`, Qwen3-30B-A3B's shapes: 128 experts, top 8,
    hidden 2048, expert rows 768) replayed from a CUDA graph: the rate at which the experts the
    tokens were routed to are read."""
    import torch

    from kvtool.engine.kernels.fused_moe import fused_experts

    experts, k, hidden, inter = 128, 8, 2048, 768
    w13 = (torch.randn(experts, 2 * inter, hidden, device="cuda") / hidden**0.5).bfloat16()
    w2 = (torch.randn(experts, hidden, inter, device="cuda") / inter**0.5).bfloat16()
    for t in (1, 8, 64, 256, 2048):
        x = torch.randn(t, hidden, device="cuda").bfloat16()
        weights, ids = torch.randn(t, experts, device="cuda").softmax(-1).topk(k, -1)
        fused_experts(x, w13, w2, weights, ids)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fused_experts(x, w13, w2, weights, ids)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        graph.replay()
        start.record()
        for _ in range(50):
            graph.replay()
        end.record()
        sync()
        ms = start.elapsed_time(end) / 50
        touched = ids.unique().numel()
        nbytes = touched * 3 * inter * hidden * 2
        record("kernels", f"fused MoE experts, {t} tokens (Qwen3-30B-A3B shapes, {touched} experts routed to)",
               nbytes / ms / 1e9, "TB/s", HBM_TBS, ms=round(ms, 4))


# ---- prefill ------------------------------------------------------------------------------------

QWEN3_8B_FLOP_PER_TOKEN = 13.89e9
QWEN3_8B_ATTN_COEF = 294912


def prefill_floor_ms(n: int) -> float:
    return (QWEN3_8B_FLOP_PER_TOKEN * n + QWEN3_8B_ATTN_COEF * n * n) / (PEAK_TFLOPS * 1e12) * 1e3


def prefill_metric(n: int) -> str:
    return f"Qwen3-8B cold prefill TTFT {n // 1024}k"


def section_prefill():
    lengths = (8192,) if QUICK else (2048, 8192, 32768)
    work = prefill_workload(lengths)
    if "kvtool" in ENGINES:
        kvtool_prefill(work)
    if "vllm" in ENGINES:
        vllm_prefill(work)


def vllm_prefill(work: dict[int, list[list[int]]]) -> None:
    jobs = [requests_job("warm", [warm_prompt()], 1)]
    jobs += [requests_job(str(n), prompts, 1) for n, prompts in work.items()]
    startup, results = run_vllm("prefill", "qwen3-8b", {"enable_prefix_caching": False, "max_num_batched_tokens": 32768,
                                                        "max_model_len": 40960, "max_num_seqs": 8}, jobs)
    for n in work:
        ms = [(r["ttft_s"] or r["wall_s"]) * 1e3 for r in results[str(n)]]
        record("prefill", prefill_metric(n), statistics.median(ms[1:]), "ms", prefill_floor_ms(n),
               engine=vllm_engine(startup), measure=f"cold prefill {n // 1024}k",
               runs_ms=[round(t, 2) for t in ms])


def kvtool_prefill(work: dict[int, list[list[int]]]) -> None:
    from kvtool.engine.params import SamplingParams

    lengths = tuple(work)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    hf_ms = hf_prefill(lengths)
    engine = make_engine("qwen3-8b", enable_prefix_caching=False, max_num_batched_tokens=32768,
                         num_gpu_blocks=2200, max_model_len=40960)
    engine.generate([warm_prompt()], one)  # warm-up: Triton compiles, cuBLAS handles
    # The last layer for the sampled row alone (the default) against every row, alternating on
    # one engine; both must give the same token (tests/cuda compare the bits).
    runner = engine.executor.worker.runner
    default = runner.sampled_rows_only
    arms = {"": default, ", last layer for every row": False} if default else {"": False}
    for n in lengths:
        times: dict[str, list[float]] = {arm: [] for arm in arms}
        for rep, prompt in enumerate(work[n]):
            outputs = []
            for arm, rows_only in arms.items():
                runner.sampled_rows_only = rows_only
                r = engine.generate([prompt], one)[0]
                times[arm].append(r.stats.ttft_s * 1e3)
                outputs.append(r.output_token_ids)
            assert outputs[0] == outputs[-1], (n, rep)
        for arm in arms:
            ms = statistics.median(times[arm][1:])
            measure = {"measure": f"cold prefill {n // 1024}k"} if arms[arm] == default else {}
            record("prefill", f"{prefill_metric(n)}{arm}", ms, "ms", prefill_floor_ms(n),
                   runs_ms=[round(t, 2) for t in times[arm]], hf_ms=hf_ms.get(n),
                   beats_hf=bool(hf_ms.get(n) and ms < hf_ms[n]), **measure)
    runner.sampled_rows_only = default
    engine.close()


def hf_prefill(lengths) -> dict[int, float]:
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(model_dir("qwen3-8b"))
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa").eval()
    out = {}
    with torch.inference_mode():
        for n in lengths:
            ids = torch.tensor([tokens(n, 7)], device="cuda")
            times = []
            for _ in range(3):
                sync()
                t0 = time.perf_counter()
                model(input_ids=ids, logits_to_keep=1, use_cache=False)
                sync()
                times.append((time.perf_counter() - t0) * 1e3)
            out[n] = round(statistics.median(times[1:]), 2)
            record("prefill", f"HF transformers prefill {n // 1024}k (Qwen3-8B, sdpa)", out[n], "ms", prefill_floor_ms(n),
                   engine=f"transformers {transformers.__version__}", measure=f"cold prefill {n // 1024}k",
                   runs_ms=[round(t, 2) for t in times])
    del model
    torch.cuda.empty_cache()
    return out


# ---- CPU-tier hits ------------------------------------------------------------------------------


def offload_ktc(cpu_bytes: int):
    from kvtool.engine.connectors.config import parse_kv_transfer_config

    return parse_kv_transfer_config(json.dumps({
        "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes_to_use": cpu_bytes, "block_size": 256},
    }))


HIT_CPU_BYTES = int(6.5 * 2**30)
HIT_REPEATS = 4  # full hits per length; the first is dropped from the median


def hit_metric(n: int) -> str:
    return f"Qwen3-8B full-prefix CPU-tier hit TTFT {n // 1024}k"


def hit_floor_ms(n: int) -> float:
    kv_per_token = 147456 // (2 if KV_CACHE_DTYPE.startswith("fp8") else 1)
    return n * kv_per_token / (H2D_GBS * 1e9) * 1e3 + 3.7


def section_hit():
    work = hit_workload((8192,) if QUICK else (2048, 8192, 32768))
    if "kvtool" in ENGINES:
        kvtool_hit(work)
    if "vllm" in ENGINES:
        vllm_hit(work)


def vllm_hit(work: dict[int, list[int]]) -> None:
    """vLLM's OffloadingConnector to CPU with 256-token offload blocks: each prompt computed and
    stored once, then sent again after `reset_prefix_cache()` so its n-token prefix comes back
    from the CPU tier."""
    ktc = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
           "kv_connector_extra_config": {"cpu_bytes_to_use": HIT_CPU_BYTES, "block_size": 256}}
    jobs = [requests_job("warm", [warm_prompt()], 1)]
    for n, p in work.items():
        jobs.append(requests_job(f"{n} store", [p], 1))
        jobs.append(requests_job(f"{n} hit", [p] * HIT_REPEATS, 1, reset_prefix_cache=True, sleep_s=1.0))
    startup, results = run_vllm("hit", "qwen3-8b", {"enable_prefix_caching": True, "max_num_batched_tokens": 32768,
                                                    "max_model_len": 40960, "max_num_seqs": 8,
                                                    "kv_transfer_config": ktc}, jobs)
    for n in work:
        hits = results[f"{n} hit"]
        ms = [(r["ttft_s"] or r["wall_s"]) * 1e3 for r in hits]
        cached = [r["num_cached_tokens"] for r in hits]
        same = all(r["output_token_ids"] == results[f"{n} store"][0]["output_token_ids"] for r in hits)
        record("hit", hit_metric(n), statistics.median(ms[1:]), "ms", hit_floor_ms(n), engine=vllm_engine(startup),
               measure=f"cpu-tier full hit {n // 1024}k", runs_ms=[round(t, 2) for t in ms], num_cached_tokens=cached,
               all_hit=all(c is not None and c >= n for c in cached), same_token_as_cold=same,
               cold_store_ms=round((results[f"{n} store"][0]["ttft_s"] or 0) * 1e3, 2))


def kvtool_hit(work: dict[int, list[int]]) -> None:
    from kvtool.engine.params import SamplingParams

    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    engine = make_engine("qwen3-8b", enable_prefix_caching=False, max_num_batched_tokens=32768, num_gpu_blocks=2200,
                         max_model_len=40960, kv_transfer_config=offload_ktc(HIT_CPU_BYTES))
    worker = engine.executor.worker.connector
    engine.generate([warm_prompt()], one)
    for n, p in work.items():  # n tokens in whole 256-token chunks are hits; 1 is computed
        engine.generate([p], one)
        engine.flush_connector()
        ttfts, rates = [], []
        for _ in range(HIT_REPEATS):
            before = engine.stats()
            b_bytes, b_s = before.bytes_loaded, before.load_s
            r = engine.generate([p], one)[0]
            after = engine.stats()
            assert r.stats.num_external_loaded_tokens == n, r.stats
            ttfts.append(r.stats.ttft_s * 1e3)
            rates.append((after.bytes_loaded - b_bytes) / (after.load_s - b_s) / 1e9)
        record("hit", hit_metric(n), statistics.median(ttfts[1:]), "ms", hit_floor_ms(n),
               measure=f"cpu-tier full hit {n // 1024}k", runs_ms=[round(t, 2) for t in ttfts])
        record("hit", f"H2D rate during CPU-tier load {n // 1024}k", statistics.median(rates[1:]), "GB/s", H2D_GBS,
               runs=[round(x, 1) for x in rates])
    # Partial hits: the first half from the tier, the second half computed; `layerwise` off and on
    # (loads go in groups of layers either way; with it the computed half is saved layer by layer).
    for n in ((8192,) if QUICK else (8192, 32768)):
        base = tokens(n // 2, 5000 + n)
        engine.generate([base + [1]], one)
        engine.flush_connector()
        for layerwise in (False, True):
            worker.layerwise = layerwise
            times = []
            for rep in range(4):
                r = engine.generate([base + tokens(n // 2, 6000 + rep + 10 * layerwise)], one)[0]
                assert r.stats.num_external_loaded_tokens == n // 2, r.stats
                times.append(r.stats.ttft_s * 1e3)
            record("hit", f"Qwen3-8B partial hit {n // 2048}k of {n // 1024}k TTFT, layerwise={layerwise}",
                   statistics.median(times[1:]), "ms", None, runs_ms=[round(t, 2) for t in times],
                   layerwise_possible=worker.transfers.can_copy_layerwise())
        worker.layerwise = True
        b_bytes, b_s = engine.stats().bytes_loaded, engine.stats().load_s
        r = engine.generate([base + [2]], one)[0]
        after = engine.stats()
        path = "pitched copies" if worker.transfers.can_copy_rows() else "zero-copy kernel"
        record("hit", f"layerwise full-hit load rate {n // 2048}k ({path})",
               (after.bytes_loaded - b_bytes) / (after.load_s - b_s) / 1e9, "GB/s", H2D_GBS,
               ttft_ms=round(r.stats.ttft_s * 1e3, 2))
        worker.layerwise = False
    # Saves: cold prefills whose blocks go to the tier, whole blocks after the step (copy engine)
    # vs layer by layer during the forward (zero-copy kernel); TTFT and the time until stored.
    for n in ((8192,) if QUICK else (8192, 32768)):
        for layerwise in (False, True):
            worker.layerwise = layerwise
            ttfts, stored = [], []
            for rep in range(4):
                t0 = time.perf_counter()
                r = engine.generate([tokens(n, 7000 + n + rep + 10 * layerwise)], one)[0]
                engine.flush_connector()
                stored.append((time.perf_counter() - t0) * 1e3)
                ttfts.append(r.stats.ttft_s * 1e3)
                assert r.stats.num_external_stored_tokens == n // 256 * 256, r.stats
            record("hit", f"Qwen3-8B cold prefill {n // 1024}k storing to the tier, layerwise saves={layerwise}: TTFT",
                   statistics.median(ttfts[1:]), "ms", None, runs_ms=[round(t, 2) for t in ttfts])
            record("hit", f"Qwen3-8B cold prefill {n // 1024}k, layerwise saves={layerwise}: request to stored",
                   statistics.median(stored[1:]), "ms", None, runs_ms=[round(t, 2) for t in stored])
        worker.layerwise = False
    engine.close()


def section_hit_layers():
    from kvtool.engine.connectors.offloading import worker as worker_module
    from kvtool.engine.params import SamplingParams

    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    engine = make_engine("qwen3-8b", enable_prefix_caching=False, max_num_batched_tokens=32768, num_gpu_blocks=2200,
                         max_model_len=40960, kv_transfer_config=offload_ktc(int(6.5 * 2**30)))
    worker, runner = engine.executor.worker.connector, engine.executor.worker.runner
    forward = runner._run_cuda
    host_ms: list[float] = []
    group_min = worker_module.LAYER_GROUP_LOAD_MIN_BLOCKS

    def timed(plan):
        t0 = time.perf_counter()
        out = forward(plan)
        host_ms.append((time.perf_counter() - t0) * 1e3)
        return out

    runner._run_cuda = timed
    engine.generate([tokens(512, 99)], one)
    # (load threshold, one-token prefill graphs): whole-block loads, layer groups with an eager
    # one-token forward, layer groups with the graphs (the default).
    graphs = runner.prefill_graphs
    arms = {"whole blocks": (1 << 62, graphs), "layer groups, eager forward": (group_min, None),
            "layer groups": (group_min, graphs)}
    for n in ((8192,) if QUICK else (8192, 16384, 24576, 32768)):
        p = tokens(n + 1, 1000 + n)
        expected = engine.generate([p], one)[0].output_token_ids
        engine.flush_connector()
        ttft: dict[str, list[float]] = {arm: [] for arm in arms}
        host: dict[str, list[float]] = {arm: [] for arm in arms}
        for arm in [*arms, *arms]:
            worker_module.LAYER_GROUP_LOAD_MIN_BLOCKS, runner.prefill_graphs = arms[arm]
            for rep in range(5):
                host_ms.clear()
                r = engine.generate([p], one)[0]
                assert r.stats.num_external_loaded_tokens == n and r.output_token_ids == expected, r.stats
                if rep:  # the first of each pass warms the other arm's path
                    ttft[arm].append(r.stats.ttft_s * 1e3)
                    host[arm].append(host_ms[0])
        for arm in arms:
            record("hit-layers", f"Qwen3-8B full hit {n // 1024}k TTFT, loads in {arm}",
                   statistics.median(ttft[arm]), "ms", None, runs_ms=[round(t, 2) for t in ttft[arm]],
                   forward_host_ms=round(statistics.median(host[arm]), 2),
                   layers_per_copy=worker.transfers.layers_per_copy)
    worker_module.LAYER_GROUP_LOAD_MIN_BLOCKS, runner.prefill_graphs = group_min, graphs
    engine.close()


# ---- decode -------------------------------------------------------------------------------------


DECODE_GOAL_MS = {"qwen3-8b": 6.0, "qwen3-0.6b": 2.0}


def decode_floor_ms(preset: str) -> float:
    """The weights read once per token at the HBM rate."""
    return {"qwen3-8b": 15.14e9, "qwen3-0.6b": 1.19e9}[preset] / (HBM_TBS * 1e12) * 1e3


def section_decode():
    warm, prompts = decode_workload()
    for preset in (("qwen3-0.6b",) if QUICK else ("qwen3-8b", "qwen3-0.6b")):
        if "kvtool" in ENGINES:
            kvtool_decode(preset, warm, prompts)
        if "vllm" in ENGINES:
            vllm_decode(preset, warm, prompts)


def vllm_decode(preset: str, warm: list[int], prompts: list[list[int]]) -> None:
    jobs = [requests_job("warm", [warm], DECODE_OUTPUT_TOKENS), requests_job("timed", prompts, DECODE_OUTPUT_TOKENS)]
    startup, results = run_vllm("decode", preset, {"enable_prefix_caching": False, "max_model_len": 8192,
                                                   "max_num_seqs": 8}, jobs)
    tpots = [r["tpot_s"] * 1e3 if r["tpot_s"] else (r["wall_s"] - (r["ttft_s"] or 0)) / (r["output_tokens"] - 1) * 1e3
             for r in results["timed"]]
    record("decode", f"{preset} TPOT batch 1 (2k context), graphs=True", statistics.median(tpots), "ms",
           decode_floor_ms(preset), engine=vllm_engine(startup), measure=f"{preset} TPOT batch 1",
           goal_ms=DECODE_GOAL_MS[preset], runs_ms=[round(t, 3) for t in tpots],
           output_tokens=[r["output_tokens"] for r in results["timed"]])


def default_batch_invariant() -> bool:
    import msgspec

    from kvtool.engine.params import EngineParams

    return next(f.default for f in msgspec.structs.fields(EngineParams) if f.name == "batch_invariant")


def kvtool_decode(preset: str, warm: list[int], prompts: list[list[int]]) -> None:
    from kvtool.engine.params import SamplingParams

    default_invariant = default_batch_invariant()
    sp = SamplingParams(max_tokens=DECODE_OUTPUT_TOKENS, temperature=0.0, ignore_eos=True)
    arms = ((True, True, False), (True, True, True), (True, False, False), (False, True, False))
    for graphs, async_scheduling, invariant in arms[:2] if INVARIANCE_ARMS else arms:
        engine = make_engine(preset, num_gpu_blocks=600, max_model_len=8192, enforce_eager=not graphs,
                             async_scheduling=async_scheduling, batch_invariant=invariant)
        engine.generate([warm], sp)
        tpots = []
        for prompt in prompts:
            r = engine.generate([prompt], sp)[0]
            tpots.append(r.stats.decode_s / (len(r.output_token_ids) - 1) * 1e3)
        floor = decode_floor_ms(preset)
        default = graphs and async_scheduling and invariant == default_invariant
        record("decode", f"{preset} TPOT batch 1 (2k context), graphs={graphs}, async={async_scheduling}, "
               f"batch_invariant={invariant}",
               statistics.median(tpots), "ms", floor, goal_ms=DECODE_GOAL_MS[preset],
               runs_ms=[round(t, 3) for t in tpots],
               **({"measure": f"{preset} TPOT batch 1"} if default else {}))
        if graphs and async_scheduling and not invariant:
            import torch

            g = engine.executor.worker.runner.graphs.graphs[1]
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(50):
                g.replay()
            end.record()
            sync()
            record("decode", f"{preset} graph replay alone, batch 1 (GPU time of one decode step)",
                   start.elapsed_time(end) / 50, "ms", floor)
        engine.close()


# ---- throughput ---------------------------------------------------------------------------------


THROUGHPUT_PASSES = 2  # timed passes after one warm-up pass; the faster counts


def throughput_metric(n: int) -> str:
    return f"Qwen3-0.6B offline throughput, {n} seqs in/out U[100,1024]"


def section_throughput():
    seqs = throughput_workload(64 if QUICK else 256)
    prompts = [s.prompt_token_ids for s in seqs]
    outs = [s.output_len for s in seqs]
    if "kvtool" in ENGINES:
        kvtool_throughput(prompts, outs)
    if "vllm" in ENGINES:
        vllm_throughput(prompts, outs)


def vllm_throughput(prompts: list[list[int]], outs: list[int]) -> None:
    job = {"name": "passes", "job": "batch", "prompts": prompts, "max_tokens": outs, "passes": 1 + THROUGHPUT_PASSES}
    startup, results = run_vllm("throughput", "qwen3-0.6b", {"enable_prefix_caching": False, "max_model_len": 4096,
                                                             "max_num_seqs": 256, "max_num_batched_tokens": 16384},
                                [job])
    timed = results["passes"][1:]
    best = min(timed, key=lambda r: r["wall_s"])
    n = len(prompts)
    record("throughput", throughput_metric(n), best["output_tokens"] / best["wall_s"], "tok/s", None,
           engine=vllm_engine(startup), measure=f"qwen3-0.6b throughput {n} seqs", output_tokens=best["output_tokens"],
           input_tokens=sum(map(len, prompts)), wall_s=round(best["wall_s"], 3),
           walls_s=[round(r["wall_s"], 3) for r in timed], warmup_s=round(results["passes"][0]["wall_s"], 3),
           num_cached_prompt_tokens=best["num_cached_tokens"])


def kvtool_throughput(prompts: list[list[int]], outs: list[int]) -> None:
    import gc

    import torch

    from kvtool.engine.params import SamplingParams

    n = len(prompts)
    ins = [len(p) for p in prompts]
    sps = [SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True) for o in outs]
    default_invariant = default_batch_invariant()
    arms = ((True, False), (True, True), (False, False))
    for async_scheduling, invariant in arms[:2] if INVARIANCE_ARMS else arms:
        engine = make_engine("qwen3-0.6b", max_model_len=4096, max_num_seqs=256, max_num_batched_tokens=16384,
                             enable_prefix_caching=False, async_scheduling=async_scheduling,
                             batch_invariant=invariant)
        engine.generate(prompts[:], [SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True) for o in outs])
        sync()
        walls = []
        for _ in range(THROUGHPUT_PASSES):
            t0 = time.perf_counter()
            results = engine.generate(prompts, sps)
            walls.append(time.perf_counter() - t0)
        wall = min(walls)
        total_out = sum(len(r.output_token_ids) for r in results)
        default = async_scheduling and invariant == default_invariant
        record("throughput", f"{throughput_metric(n)}, async={async_scheduling}, batch_invariant={invariant}",
               total_out / wall, "tok/s", None, goal=25000, output_tokens=total_out, input_tokens=sum(ins),
               wall_s=round(wall, 3), walls_s=[round(w, 3) for w in walls],
               graphs_replayed=sorted(engine.executor.worker.runner.graphs.replays),
               **({"measure": f"qwen3-0.6b throughput {n} seqs"} if default else {}))
        engine.close()
        # The next arm's engine sizes its KV pages from free memory: drop this one's first.
        del engine, results
        gc.collect()
        torch.cuda.empty_cache()


# ---- other architectures --------------------------------------------------------------------------


# (preset, what it is measured on): Qwen2.5-7B and the FP8 Qwen3-8B with the bf16 one beside it
# (prefill 8k, TPOT), Qwen3-30B-A3B (TPOT, throughput on the Qwen3-0.6B workload's lengths),
# Gemma 3 4B's text model (prefill 8k and 32k, TPOT, and its KV bytes per token of a 32k context).
MODEL_ROWS = (("qwen2.5-7b", ("prefill", "tpot")), ("qwen3-8b", ("prefill", "tpot")),
              ("qwen3-8b-fp8", ("prefill", "tpot")), ("qwen3-30b-a3b", ("tpot", "throughput")),
              ("gemma-3-4b", ("prefill", "prefill32k", "tpot", "kv_memory")))
# vLLM's arm: the FP8 rows compare with kvtool's bf16.
MODEL_VLLM = ("qwen2.5-7b", "qwen3-30b-a3b", "gemma-3-4b")
MODELS: set[str] | None = None  # --models: the rows to run
MODEL_ENGINE = {"max_model_len": 16384, "max_num_batched_tokens": 16384, "max_num_seqs": 256}
# Rows whose prompts need a longer context than MODEL_ENGINE's.
MODEL_ENGINE_FOR = {"gemma-3-4b": {"max_model_len": 40960, "max_num_batched_tokens": 32768, "max_num_seqs": 64}}


def section_models():
    warm, decode_prompts = decode_workload()
    prefill_prompts = prefill_workload((8192, 32768))
    seqs = throughput_workload(64 if QUICK else 256)
    work = {"prefill": prefill_prompts[8192], "prefill32k": prefill_prompts[32768], "tpot": decode_prompts,
            "throughput": ([s.prompt_token_ids for s in seqs], [s.output_len for s in seqs])}
    rows = MODEL_ROWS[:1] + MODEL_ROWS[3:] if QUICK else MODEL_ROWS
    for preset, measures in [(p, m) for p, m in rows if MODELS is None or p in MODELS]:
        if "kvtool" in ENGINES:
            kvtool_models(preset, measures, warm, work)
        if "vllm" in ENGINES and preset in MODEL_VLLM:
            vllm_models(preset, measures, warm, work)


def kvtool_models(preset: str, measures, warm: list[int], work: dict) -> None:
    from kvtool.engine.params import SamplingParams

    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    sp = SamplingParams(max_tokens=DECODE_OUTPUT_TOKENS, temperature=0.0, ignore_eos=True)
    engine = make_engine(preset, enable_prefix_caching=False, **{**MODEL_ENGINE, **MODEL_ENGINE_FOR.get(preset, {})})
    paths = engine.executor.worker.fast_paths
    detail = {"moe_experts": paths.moe_experts, "cuda_graphs": paths.cuda_graphs, "qkv_product": paths.gemm.qkv}
    engine.generate([warm], sp)
    for measure, n in (("prefill", 8192), ("prefill32k", 32768)):
        if measure in measures:
            ms = [engine.generate([p], one)[0].stats.ttft_s * 1e3 for p in work[measure]]
            record("models", f"{preset} cold prefill TTFT {n // 1024}k", statistics.median(ms[1:]), "ms", None,
                   measure=f"{preset} cold prefill {n // 1024}k", runs_ms=[round(t, 2) for t in ms], **detail)
    if "kv_memory" in measures:
        record_kv_memory(preset, engine)
    if "tpot" in measures:
        tpots = []
        for prompt in work["tpot"]:
            r = engine.generate([prompt], sp)[0]
            tpots.append(r.stats.decode_s / (len(r.output_token_ids) - 1) * 1e3)
        record("models", f"{preset} TPOT batch 1 (2k context)", statistics.median(tpots), "ms", None,
               measure=f"{preset} TPOT batch 1", runs_ms=[round(t, 3) for t in tpots], **detail)
    if "throughput" in measures:
        prompts, outs = work["throughput"]
        sps = [SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True) for o in outs]
        engine.generate(prompts, sps)
        walls = []
        for _ in range(THROUGHPUT_PASSES):
            t0 = time.perf_counter()
            results = engine.generate(prompts, sps)
            walls.append(time.perf_counter() - t0)
        total = sum(len(r.output_token_ids) for r in results)
        record("models", f"{preset} offline throughput, {len(prompts)} seqs in/out U[100,1024]", total / min(walls),
               "tok/s", None, measure=f"{preset} throughput {len(prompts)} seqs", output_tokens=total,
               walls_s=[round(w, 3) for w in walls], **detail)
    engine.close()


def record_kv_memory(preset: str, engine, context: int = 32768) -> None:
    """KV bytes per token a `context`-token sequence holds in kvtool's pages while it decodes
    (blocks taken from the pool, read after each step, times the bytes of a block), beside a
    full-attention cache's and the bound of one whose sliding-window layers keep only their
    window (global layers' share plus the local layers' window share)."""
    from kvtool.engine.params import SamplingParams

    cfg = engine.model_config
    pages = engine.executor.worker.kv_pages
    full = pages.geometry.bytes_per_token
    free = engine.stats().num_free_blocks
    rid = engine.add_request(tokens(context - 8, 11), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    held = []
    while engine.has_unfinished_requests():
        engine.step()
        if engine.has_unfinished_requests():
            held.append(free - engine.stats().num_free_blocks)
    engine.pop_result(rid)
    # The first step holds the whole prompt in every group (the prefill's own attention reads it);
    # a step after the last token holds nothing: the decoding steps are those in between.
    decoding = [h for h in held[1:] if h > 0]
    measured = max(decoding) * pages.block_bytes / context
    window = cfg.sliding_window or context
    local = len(cfg.gemma.sliding_layers) if cfg.gemma is not None else (cfg.num_layers if cfg.sliding_window else 0)
    bound = full * ((cfg.num_layers - local) + local * min(window, context) / context) / cfg.num_layers
    # The same in whole blocks: a window of W keys ending anywhere in a block spans up to
    # ceil((W - 1) / block size) + 1 blocks, the blocks vLLM's sliding-window manager keeps too.
    bs = pages.geometry.block_size
    window_blocks = min(-(-(window - 1) // bs) + 1, -(-context // bs))
    block_bound = full * ((cfg.num_layers - local) + local * window_blocks * bs / context) / cfg.num_layers
    record("models", f"{preset} KV bytes per token of a {context // 1024}k context, decoding", measured, "B", None,
           full_attention=full, windowed_bound=round(bound, 1), ratio_to_bound=round(measured / bound, 3),
           block_bound=round(block_bound, 1), ratio_to_block_bound=round(measured / block_bound, 3),
           layout=pages.layout.describe(), blocks_held=held, local_layers=local, layers=cfg.num_layers,
           sliding_window=window)


def vllm_models(preset: str, measures, warm: list[int], work: dict) -> None:
    jobs = [requests_job("warm", [warm], DECODE_OUTPUT_TOKENS)]
    if "prefill" in measures:
        jobs.append(requests_job("prefill", work["prefill"], 1))
    if "prefill32k" in measures:
        jobs.append(requests_job("prefill32k", work["prefill32k"], 1))
    if "tpot" in measures:
        jobs.append(requests_job("tpot", work["tpot"], DECODE_OUTPUT_TOKENS))
    if "throughput" in measures:
        prompts, outs = work["throughput"]
        jobs.append({"name": "throughput", "job": "batch", "prompts": prompts, "max_tokens": outs,
                     "passes": 1 + THROUGHPUT_PASSES})
    startup, results = run_vllm("models", preset, {"enable_prefix_caching": False, **MODEL_ENGINE,
                                                   **MODEL_ENGINE_FOR.get(preset, {})}, jobs)
    engine = vllm_engine(startup)
    for measure, n in (("prefill", 8192), ("prefill32k", 32768)):
        if measure in measures:
            ms = [(r["ttft_s"] or r["wall_s"]) * 1e3 for r in results[measure]]
            record("models", f"{preset} cold prefill TTFT {n // 1024}k", statistics.median(ms[1:]), "ms", None,
                   engine=engine, measure=f"{preset} cold prefill {n // 1024}k", runs_ms=[round(t, 2) for t in ms])
    if "tpot" in measures:
        tpots = [r["tpot_s"] * 1e3 if r["tpot_s"] else (r["wall_s"] - (r["ttft_s"] or 0)) / (r["output_tokens"] - 1) * 1e3
                 for r in results["tpot"]]
        record("models", f"{preset} TPOT batch 1 (2k context)", statistics.median(tpots), "ms", None, engine=engine,
               measure=f"{preset} TPOT batch 1", runs_ms=[round(t, 3) for t in tpots])
    if "throughput" in measures:
        timed = results["throughput"][1:]
        best = min(timed, key=lambda r: r["wall_s"])
        n = len(work["throughput"][0])
        record("models", f"{preset} offline throughput, {n} seqs in/out U[100,1024]",
               best["output_tokens"] / best["wall_s"], "tok/s", None, engine=engine,
               measure=f"{preset} throughput {n} seqs", output_tokens=best["output_tokens"],
               walls_s=[round(r["wall_s"], 3) for r in timed])


# ---- lm:// --------------------------------------------------------------------------------------

MEMORY_LM_SERVER = REPO / "tests" / "support" / "memory_lm_server.py"


def start_memory_lm_server() -> tuple[subprocess.Popen, int]:
    """The in-memory lm:// server the CUDA tests use (LMCache's own cannot be installed on the GPU
    machine), in a process of its own; returns it and the port it printed."""
    server = subprocess.Popen([sys.executable, str(MEMORY_LM_SERVER)], stdout=subprocess.PIPE, text=True)
    return server, int(server.stdout.readline())


def raw_key(i: int) -> str:
    """The key of the i-th chunk the socket-reads baseline stores."""
    return f"gpu-bench-raw@1@0@{i:x}@bfloat16"


def read_lm(port: int, length: int, first: int, step: int, chunks: int) -> None:
    """A reader of its own process: the lm:// client's socket reads (`connection.Connection`)
    with no engine, no other thread and no copy to the GPU. On each line of stdin it GETs the
    chunks first, first + step, ... (< chunks) into one buffer, every request sent at once, and
    prints the round's monotonic start and end."""
    from kvtool.engine.connectors.lmcache.stores.connection import Connection
    from kvtool.engine.connectors.lmcache.stores.protocol import Command, pack_request

    conn = Connection("127.0.0.1", port)
    payload = memoryview(bytearray(length))
    mine = range(first, chunks, step)
    requests = b"".join(pack_request(Command.GET, raw_key(i)) for i in mine)
    for _ in sys.stdin:
        t0 = time.monotonic()
        deadline = t0 + 60.0
        conn.send(deadline, requests)
        for _ in mine:
            reply = conn.recv_reply(deadline)
            assert (reply.code, reply.length) == (200, length), reply
            conn.recv_into(payload, deadline)
        print(json.dumps([t0, time.monotonic()]), flush=True)


def socket_reads_alone(port: int, conns: int, length: int, chunks: int) -> list[float]:
    """What the socket reads alone reach on this host, in the same run: `conns` reader processes
    (no GIL between them) GET the `chunks` stored chunks of `length` bytes, striped between
    them; a warm-up round, then LM_RUNS; GB/s of each round."""
    readers = [subprocess.Popen([sys.executable, __file__, "--read-lm", str(port), str(length), str(g), str(conns),
                                 str(chunks)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
               for g in range(conns)]
    try:
        rates = []
        for _ in range(1 + LM_RUNS):
            for r in readers:
                r.stdin.write("go\n")
                r.stdin.flush()
            spans = [json.loads(r.stdout.readline()) for r in readers]
            rates.append(chunks * length / (max(e for _, e in spans) - min(b for b, _ in spans)) / 1e9)
        return rates[1:]
    finally:
        for r in readers:
            r.kill()


def put_raw(port: int, length: int, chunks: int) -> None:
    """Store `chunks` chunks of `length` random bytes, each in memory of its own on the server,
    as the engine's chunks are."""
    import torch

    from kvtool.engine.connectors.lmcache.stores.lm_client import LMClient
    from kvtool.engine.connectors.lmcache.stores.protocol import kv_chunk_header

    payload = os.urandom(length)
    header = kv_chunk_header((2, 1, 1, length // 4), torch.bfloat16)
    with LMClient("127.0.0.1", port, connections=1) as client:
        assert client.put_many([(raw_key(i), payload, header) for i in range(chunks)]) == [True] * chunks


def section_lm():
    from kvtool.engine.connectors.config import parse_kv_transfer_config
    from kvtool.engine.params import SamplingParams

    server, port = start_memory_lm_server()
    try:
        # One chunk of 256 Qwen3-8B tokens, as the engine's loads below move 32 of.
        chunk_bytes = 2 * 36 * 256 * 8 * 128 * 2
        put_raw(port, chunk_bytes, 32)
        limits = {}
        for conns in (1, 4):
            rates = socket_reads_alone(port, conns, chunk_bytes, 32)
            limits[conns] = statistics.median(rates)
            record("lm", f"socket reads alone, 32 stored chunks of that size, {conns} reader process(es), median of {LM_RUNS}",
                   limits[conns], "GB/s", 4.0 * conns if conns == 1 else 13.6,
                   runs=[round(x, 2) for x in rates], chunk_bytes=chunk_bytes, chunks=32)
        one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        n = 8192
        for conns in (1, 4):
            ktc = parse_kv_transfer_config(json.dumps({
                "kv_connector": "LMCacheConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"host": "127.0.0.1", "port": port, "connections": conns,
                                              "chunk_tokens": 256},
            }))
            engine = make_engine("qwen3-8b", enable_prefix_caching=False, max_num_batched_tokens=16384,
                                 num_gpu_blocks=1200, max_model_len=40960, kv_transfer_config=ktc)
            p = tokens(n + 1, 77)
            engine.generate([p], one)
            engine.executor.worker.connector.flush()
            # A warm-up run, then the median of LM_RUNS: one run of a loaded socket path varies.
            rates, ttfts = [], []
            for _ in range(1 + LM_RUNS):
                b_bytes, b_s = engine.stats().bytes_loaded, engine.stats().load_s
                r = engine.generate([p], one)[0]
                after = engine.stats()
                assert r.stats.num_external_loaded_tokens == n, r.stats
                rates.append((after.bytes_loaded - b_bytes) / (after.load_s - b_s) / 1e9)
                ttfts.append(r.stats.ttft_s * 1e3)
            floor = 4.0 * conns if conns == 1 else 13.6
            record("lm", f"lm:// GET into pages, {conns} connection(s), 8k Qwen3-8B, median of {LM_RUNS}",
                   statistics.median(rates[1:]), "GB/s", floor, runs=[round(x, 2) for x in rates[1:]],
                   warm_up=round(rates[0], 2), median_of=LM_RUNS, min=round(min(rates[1:]), 2),
                   max=round(max(rates[1:]), 2), ttft_ms=round(statistics.median(ttfts[1:]), 1),
                   goal=3.7 if conns == 1 else 12.0, socket_reads_alone=round(limits[conns], 2),
                   of_socket_reads_alone=round(statistics.median(rates[1:]) / limits[conns], 3))
            engine.close()
    finally:
        server.kill()


# ---- tiles -------------------------------------------------------------------------------------

# Qwen3-0.6B's projections (N, K): q/k/v, o_proj, gate/up, down_proj; and both models' LM heads.
QWEN3_06B_PROJECTIONS = ((4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072))
LM_HEADS = ((151936, 4096), (151936, 1024))
TILE_ROWS = (1, 8, 64)


def tile_candidates(rows: int) -> list[tuple[int, int, int, int, int]]:
    """(BM, BN, BK, warps, stages) worth timing for `rows` rows: the smallest row tiles that hold
    them, every column width and K step."""
    bms = [bm for bm in (16, 64) if bm == 16 or bm <= rows]
    return [(bm, bn, bk, warps, stages) for bm in bms for bn in (16, 32, 64, 128) for bk in (64, 128, 256, 512)
            for warps in (4, 8) for stages in (3, 4) if bn * bk <= 32768 and (warps == 4 or bn >= 64)]


def bench(fn) -> float:
    """Milliseconds of one call of fn, replayed from a CUDA graph."""
    from triton.testing import do_bench_cudagraph

    return do_bench_cudagraph(fn, rep=25)


def fastest_tiles(product, default, candidates, label: str):
    """(fastest tiles, their ms, the default's ms, candidates whose bits differ): `product(cfg)`
    timed for the default tiles and each candidate whose output equals the default's bit for bit;
    a candidate too large for shared memory or registers is skipped with a line naming it."""
    import torch

    ref = product(default)
    default_ms = bench(lambda: product(default))
    best, best_ms, differ = default, default_ms, []
    for cfg in candidates:
        try:
            out = product(cfg)
            ms = bench(lambda: product(cfg))
        except Exception as e:  # a tile too large for shared memory or registers
            print(f"# {label} {cfg}: {type(e).__name__}", flush=True)
            continue
        if not torch.equal(out, ref):
            differ.append(cfg)
            continue
        if ms < best_ms:
            best, best_ms = cfg, ms
    return best, best_ms, default_ms, differ


def section_tiles():
    """Every candidate tile of the row-invariant GEMM (`row_invariant_gemm.triton_mm`) on the
    decode shapes of Qwen3-8B and Qwen3-0.6B at 1 to 64 rows, each replayed from a CUDA graph:
    its bits against the configured tiles' (they must be equal: only speed may differ), the
    fastest beside the configured one, the one-row GEMV (not invariant) and cuBLAS."""
    import torch
    import torch.nn.functional as F

    from kvtool.engine.kernels.gemv import gemv
    from kvtool.engine.kernels.row_invariant_gemm import config_for, triton_mm
    from kvtool.engine.kernels.tiles import sm_count

    sms = sm_count(torch.device("cuda"))
    shapes = [("8b", n, k) for n, k in QWEN3_8B_PROJECTIONS] + [("0.6b", n, k) for n, k in QWEN3_06B_PROJECTIONS]
    shapes += [("8b", *LM_HEADS[0]), ("0.6b", *LM_HEADS[1])]
    if QUICK:  # Qwen3-8B's projections at one row
        shapes = [s for s in shapes if s[0] == "8b" and s[1] <= 32768]
    for model, n, k in shapes:
        w = (torch.randn(n, k, device="cuda") / k**0.5).bfloat16()
        for rows in TILE_ROWS[:1] if QUICK else TILE_ROWS:
            x = torch.randn(rows, k, device="cuda").bfloat16()
            default = config_for(rows, n, sms, k)
            best, best_ms, default_ms, differ = fastest_tiles(lambda cfg: triton_mm(x, w, cfg), default,
                                                              tile_candidates(rows), f"tiles {model} N={n} K={k} M={rows}")
            extra = {"cublas_ms": round(bench(lambda: F.linear(x, w)), 4)}
            if rows == 1 and n <= 32768:
                extra["gemv_ms"] = round(bench(lambda: gemv(x, w)), 4)
            record("tiles", f"row-invariant GEMM {model} N={n} K={k}, {rows} rows", n * k * 2 / best_ms / 1e9, "TB/s",
                   HBM_TBS, n=n, k=k, rows=rows, ms=round(best_ms, 4), best=list(best), default=list(default),
                   default_ms=round(default_ms, 4), differing_bits=[list(c) for c in differ], **extra)


FP8_TILE_ROWS = (1, 64, 256, 8192)


def fp8_tile_candidates(rows: int, min_bm: int) -> list[tuple[int, int, int, int]]:
    """(BM, BN, warps, stages) worth timing for the FP8 GEMM at `rows` rows: row tiles of at least
    min_bm rows (`fp8_gemm.MIN_BM`: smaller ones round otherwise), larger ones only where the rows
    fill more than one."""
    bms = [bm for bm in (64, 128) if bm >= min_bm and (bm == min_bm or rows > min_bm)]
    return [(bm, bn, warps, stages) for bm in bms for bn in (32, 64, 128, 256) for warps in (4, 8)
            for stages in (3, 4) if not (bn == 256 and bm == 128 and warps == 4)]


def section_fp8_tiles():
    """Every candidate tile of the FP8 checkpoint GEMM (`fp8_gemm.fp8_mm`) on Qwen3-8B's
    projections as a block-wise FP8 checkpoint (128 x 128 weight scales) at 1 to 8192 rows, each
    replayed from a CUDA graph: its bits against the configured tiles' (they must be equal), the
    fastest beside the configured one, cuBLAS's bf16 product of the same shape (the bf16 model's
    prefill GEMM), and on Hopper from `fp8_gemm.HOPPER_MIN_ROWS` rows the warp-specialised kernel
    `fp8_mm` runs there (`hopper_ms`, and whether its bits are the configured tiles')."""
    import torch
    import torch.nn.functional as F

    from kvtool.engine.kernels import fp8_gemm
    from kvtool.engine.kernels.fp8_gemm import MIN_BM, config_for, fp8_mm
    from kvtool.engine.kernels.fp8_weight import Fp8Weight
    from kvtool.engine.kernels.gluon import gluon_module
    from kvtool.engine.kernels.tiles import sm_count
    from kvtool.engine.models.quantization import WeightQuantization, quantize

    sms = sm_count(torch.device("cuda"))
    block = WeightQuantization(method="fp8", weight_strategy="block", weight_block_size=(128, 128))
    for n, k in QWEN3_8B_PROJECTIONS:
        dense = torch.randn(n, k, device="cuda") / k**0.5
        w = Fp8Weight(*quantize(dense, block), 128, 128)
        w_bf16 = dense.bfloat16()
        for rows in (FP8_TILE_ROWS[0], FP8_TILE_ROWS[-1]) if QUICK else FP8_TILE_ROWS:
            x = torch.randn(rows, k, device="cuda").bfloat16()
            default = config_for(rows, n, sms, k)
            best, best_ms, default_ms, differ = fastest_tiles(lambda cfg: fp8_mm(x, w, cfg), default,
                                                              fp8_tile_candidates(rows, MIN_BM),
                                                              f"fp8-tiles N={n} K={k} M={rows}")
            bf16_ms = bench(lambda: F.linear(x, w_bf16))
            extra = {}
            hopper = gluon_module(fp8_gemm.HOPPER_FP8_GEMM)
            if rows >= fp8_gemm.HOPPER_MIN_ROWS and hopper is not None and hopper.usable(x, w):
                # what fp8_mm runs here on Hopper (cuBLAS or the warp-specialised kernel), and whether
                # its bits are the tiles'
                extra["hopper_ms"] = round(bench(lambda: fp8_mm(x, w)), 4)
                extra["hopper_equal"] = torch.equal(fp8_mm(x, w), fp8_mm(x, w, default))
            if fp8_gemm.k_split(n, k) > 1:  # what spreading K over parts costs or gains here, the same tiles
                split = fp8_gemm.k_split
                fp8_gemm.k_split = lambda n, k: 1
                try:
                    extra["unsplit_ms"] = round(bench(lambda: fp8_mm(x, w, best)), 4)
                finally:
                    fp8_gemm.k_split = split
            record("fp8-tiles", f"FP8 GEMM 8b N={n} K={k}, {rows} rows", 2 * rows * n * k / best_ms / 1e9, "TFLOP/s",
                   None, n=n, k=k, rows=rows, ms=round(best_ms, 4), best=list(best), default=list(default),
                   default_ms=round(default_ms, 4), differing_bits=[list(c) for c in differ],
                   bf16_cublas_ms=round(bf16_ms, 4), of_bf16_time=round(best_ms / bf16_ms, 3), **extra)


FP8_KERNEL_ROWS = (256, 1024, 8192)
# K groups in flight for the Gluon kernel at the most rows (32 KiB of shared memory each).
FP8_KERNEL_STAGES = (2, 3, 4, 5, 6)
def fp8_promotion(q, q_scale, w, kvtool_out, cublas_out, cublas_f32=None) -> dict:
    """Which arithmetic cuBLAS's block-scaled FP8 product folds each K group with: every group's
    product taken from cuBLAS's tensor-wise FP8 product of that group alone (unit scales, float32
    out: the tensor cores' own sum of the group), folded in K order by each candidate below, and
    the share of the rounded results equal to cuBLAS's block-scaled output and to kvtool's (and,
    where cuBLAS gives its block-scaled product in float32, the share of the unrounded sums equal
    to it: `cublas_f32`). A candidate equal to cuBLAS everywhere names the arithmetic kvtool's
    kernels would need for their rows to be cuBLAS's bits."""
    import torch

    def fma(x, y, z):  # one rounding of x * y + z (the float32 product is exact in float64)
        return (x.double() * y.double() + z.double()).float()

    # Candidate folds of a group's product p into the sum (each operation rounded to float32, an
    # fma once): kvtool's expression with and without a fused last step, the scales multiplied
    # first, and the weight's scale applied first.
    promotions = {
        "(p*sa)*sw+acc": lambda acc, p, sa, sw: acc + (p * sa) * sw,
        "fma(p*sa,sw,acc)": lambda acc, p, sa, sw: fma(p * sa, sw, acc),
        "p*(sa*sw)+acc": lambda acc, p, sa, sw: acc + p * (sa * sw),
        "fma(p,sa*sw,acc)": lambda acc, p, sa, sw: fma(p, sa * sw, acc),
        "(p*sw)*sa+acc": lambda acc, p, sa, sw: acc + (p * sw) * sa,
        "fma(p*sw,sa,acc)": lambda acc, p, sa, sw: fma(p * sw, sa, acc),
    }
    one = torch.ones((), device=q.device)
    k = q.shape[1]
    w_cols = w.scale.repeat_interleave(w.scale_rows, 0)[: w.data.shape[0]]  # [N, K groups]
    sums = {name: torch.zeros((q.shape[0], w.data.shape[0]), device=q.device) for name in promotions}
    for g in range(k // 128):
        cols = slice(g * 128, (g + 1) * 128)
        p = torch._scaled_mm(q[:, cols], w.data[:, cols].t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
        sa, sw = q_scale[:, g : g + 1], w_cols[:, g * 128 // w.scale_cols][None, :]
        for name, fold in promotions.items():
            sums[name] = fold(sums[name], p, sa, sw)
    out = {}
    for name, acc in sums.items():
        rounded = acc.to(cublas_out.dtype)
        out[name] = {"cublas": round((rounded == cublas_out).float().mean().item(), 6),
                     "kvtool": round((rounded == kvtool_out).float().mean().item(), 6)}
        if cublas_f32 is not None:
            out[name]["cublas_f32"] = round((acc == cublas_f32).float().mean().item(), 6)
    return out


def one_row_spreads(fp8_gemm, one, w, shipped) -> dict:
    """One row's product with its K spread over other numbers of parts (`parts_P_ms`), and for
    the weight's own spread with other numbers of groups in flight in the folding program
    (`fold_ahead_A_ms`); `*_equal`: the shipped bits (the fold's order never changes)."""
    import torch

    n, k = w.data.shape
    shipped_split, shipped_ahead = fp8_gemm.k_split, fp8_gemm.FOLD_AHEAD
    out = {}
    try:
        for parts in (1, 2, 4, 8, 12):
            if parts != shipped_split(n, k) and k % (fp8_gemm.GROUP * parts) == 0:
                fp8_gemm.k_split = lambda n_, k_, p=parts: p
                out[f"parts_{parts}_equal"] = torch.equal(fp8_gemm.fp8_mm(one, w), shipped)
                out[f"parts_{parts}_ms"] = round(bench(lambda: fp8_gemm.fp8_mm(one, w)), 4)
        fp8_gemm.k_split = shipped_split
        if shipped_split(n, k) > 1:
            for ahead in (4, 16, 32):
                fp8_gemm.FOLD_AHEAD = ahead
                out[f"fold_ahead_{ahead}_equal"] = torch.equal(fp8_gemm.fp8_mm(one, w), shipped)
                out[f"fold_ahead_{ahead}_ms"] = round(bench(lambda: fp8_gemm.fp8_mm(one, w)), 4)
    finally:
        fp8_gemm.k_split, fp8_gemm.FOLD_AHEAD = shipped_split, shipped_ahead
    return out


def section_fp8_kernels():
    """The FP8 checkpoint GEMM on Qwen3-8B's block-wise FP8 projections at a decode batch's, a
    chunk's and a prefill's row counts, each replayed from a CUDA graph with the activations'
    quantisation: what `fp8_mm` itself takes (`fp8_mm_ms`: cuBLAS's block-scaled product from
    `fp8_gemm.CUBLAS_MIN_ROWS` rows on Hopper), the Triton kernel with `config_for`'s tiles, the
    warp-specialised Gluon kernel (Hopper) and whether its bits are the Triton kernel's; beside them
    cuBLAS's bf16 product and cuBLAS's block-scaled FP8 product alone (`torch._scaled_mm` on the
    same quantised operands; `cublas_fp8_equal`: the share of its outputs equal to kvtool's), and
    for gate/up at 1024 rows which arithmetic cuBLAS folds each K group's product with
    (`fp8_promotion`). At one row, a decode step's product with its activations quantised inside it
    and apart (`fused_ms`, `unfused_ms`; the same for a weight whose K is spread over parts, which
    always quantises apart), the quantisation alone (`quantize_ms`), and `one_row_spreads`: K
    spread over other numbers of parts, the fold with other numbers of groups in flight. At the
    most rows the Gluon kernel is also timed with 2 to 6 K groups in flight (`gluon_stages_ms`; a
    setting whose bits differ says so)."""
    import torch
    import torch.nn.functional as F

    from kvtool.engine.kernels import fp8_gemm
    from kvtool.engine.kernels.fp8_weight import Fp8Weight
    from kvtool.engine.kernels.gluon import gluon_module
    from kvtool.engine.kernels.tiles import sm_count
    from kvtool.engine.models.quantization import WeightQuantization, quantize

    sms = sm_count(torch.device("cuda"))
    hopper = gluon_module(fp8_gemm.HOPPER_FP8_GEMM)
    block = WeightQuantization(method="fp8", weight_strategy="block", weight_block_size=(128, 128))
    for n, k in QWEN3_8B_PROJECTIONS:
        dense = torch.randn(n, k, device="cuda") / k**0.5
        w = Fp8Weight(*quantize(dense, block), 128, 128)
        w_bf16 = dense.bfloat16()
        one = torch.randn(1, k, device="cuda").bfloat16()  # a decode step's row: quantised in the product or apart
        shipped = fp8_gemm.fp8_mm(one, w)
        decode = {"ms": round(bench(lambda: fp8_gemm.fp8_mm(one, w)), 4)}
        shipped_fused = fp8_gemm.FUSED_QUANTIZE_ROWS
        try:
            for name, fused_rows in (("fused", 64), ("unfused", 0)):
                fp8_gemm.FUSED_QUANTIZE_ROWS = fused_rows
                decode[f"{name}_equal"] = torch.equal(fp8_gemm.fp8_mm(one, w), shipped)
                decode[f"{name}_ms"] = round(bench(lambda: fp8_gemm.fp8_mm(one, w)), 4)
        finally:
            fp8_gemm.FUSED_QUANTIZE_ROWS = shipped_fused
        decode["quantize_ms"] = round(bench(lambda: fp8_gemm.quantize_rows(one)), 4)
        decode.update(one_row_spreads(fp8_gemm, one, w, shipped))
        record("fp8-kernels", f"FP8 GEMM 8b N={n} K={k}, 1 row", decode["ms"] * 1e3, "us", None, n=n, k=k,
               rows=1, split=fp8_gemm.k_split(n, k), **decode)
        for rows in FP8_KERNEL_ROWS:
            x = torch.randn(rows, k, device="cuda").bfloat16()
            tiles = fp8_gemm.config_for(rows, n, sms, k)
            ours = fp8_gemm.fp8_mm(x, w, tiles)
            extra = {"triton_ms": round(bench(lambda: fp8_gemm.fp8_mm(x, w, tiles)), 4),
                     "fp8_mm_ms": round(bench(lambda: fp8_gemm.fp8_mm(x, w)), 4)}  # the kernel fp8_mm picks
            if hopper is not None and hopper.usable(x, w):
                out = torch.empty_like(ours)

                def gluon():
                    q, q_scale = fp8_gemm.quantize_rows(x)
                    return hopper.hopper_fp8_mm(q, q_scale, w, out)

                extra["gluon_equal"] = torch.equal(gluon(), ours)
                extra["gluon_ms"] = round(bench(gluon), 4)
                if rows == FP8_KERNEL_ROWS[-1]:  # the K groups in flight: the schedule only, never the bits
                    shipped, stages_ms = hopper.STAGES, {}
                    try:
                        for stages in FP8_KERNEL_STAGES:
                            hopper.STAGES = stages
                            if torch.equal(gluon(), ours):
                                stages_ms[stages] = round(bench(gluon), 4)
                            else:
                                stages_ms[stages] = "bits differ"
                    finally:
                        hopper.STAGES = shipped
                    extra["gluon_stages_ms"] = stages_ms
            extra["bf16_cublas_ms"] = round(bench(lambda: F.linear(x, w_bf16)), 4)
            q, q_scale = fp8_gemm.quantize_rows(x)
            a_scale = q_scale.t().contiguous().t()  # cuBLAS takes the activation scales column-major

            def cublas_fp8():
                return torch._scaled_mm(q, w.data.t(), scale_a=a_scale, scale_b=w.scale.t(), out_dtype=torch.bfloat16)

            try:
                extra["cublas_fp8_equal"] = round((cublas_fp8() == ours).float().mean().item(), 6)
                extra["cublas_fp8_ms"] = round(bench(cublas_fp8), 4)
                if rows == 1024 and fp8_gemm.k_split(n, k) == 1:
                    try:  # the block-scaled product unrounded, where cuBLAS gives it in float32
                        f32 = torch._scaled_mm(q, w.data.t(), scale_a=a_scale, scale_b=w.scale.t(),
                                               out_dtype=torch.float32)
                    except RuntimeError:
                        f32 = None
                    extra["promotions"] = fp8_promotion(q, q_scale, w, ours, cublas_fp8(), f32)
            except RuntimeError as e:  # a torch or cuBLAS without block-scaled FP8
                print(f"# fp8-kernels N={n} K={k}: cuBLAS block-scaled FP8: {str(e)[:160]}", flush=True)
            ms = extra["fp8_mm_ms"]
            record("fp8-kernels", f"FP8 GEMM 8b N={n} K={k}, {rows} rows", 2 * rows * n * k / ms / 1e9, "TFLOP/s",
                   None, n=n, k=k, rows=rows, split=fp8_gemm.k_split(n, k), tiles=list(tiles), **extra)


# Gemma 3 4B's attention (query heads, KV heads, head size, local layers' window) at a 32k prompt.
GEMMA3_4B_ATTENTION = (8, 4, 256, 1024)
PREFILL_TILE_LENGTH = 32768


def section_prefill_tiles():
    """Every launch of the Triton prefill kernel (`triton_prefill.launch_candidates`: row blocks,
    warps, K / V tiles in flight) on Gemma 3 4B's attention, a causal 32k prompt, for its global
    layers and its sliding-window ones, each replayed from a CUDA graph: its bits against the
    default launch's (they must be equal), the fastest beside the default, the Gluon kernel the
    layer runs on Hopper (`gluon_ms`), and torch's SDPA on the global layer's shape (FLOPs: the
    causal half of QK^T and PV, or the window's keys)."""
    import torch
    import torch.nn.functional as F

    from kvtool.engine.kernels.attention.prefill import prefill_attention, uses_hopper_kernel
    from kvtool.engine.kernels.attention.triton_prefill import (launch_candidates, launch_config,
                                                                triton_prefill_attention)

    hq, hkv, d, window = GEMMA3_4B_ATTENTION
    n = PREFILL_TILE_LENGTH // 4 if QUICK else PREFILL_TILE_LENGTH
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn((n, hq, d), generator=g, device="cuda").bfloat16()
    k, v = (torch.randn((n, hkv, d), generator=g, device="cuda").bfloat16() for _ in range(2))
    cu = torch.tensor([0, n], device="cuda", dtype=torch.int32)
    out = torch.empty_like(q)
    for layer, w in (("global", None), ("local", window)):
        keys = n * (n + 1) / 2 if w is None else sum(min(i + 1, w) for i in range(n))
        flop = 4 * hq * d * keys
        best, best_ms, default_ms, differ = fastest_tiles(
            lambda cfg: triton_prefill_attention(q, k, v, cu, cu, n, d**-0.5, out, w, None, cfg).clone(),
            launch_config(d, n), [c for c in launch_candidates(d) if c != launch_config(d, n)],
            f"prefill-tiles {layer} D={d} S={n}")
        extra = {}
        if uses_hopper_kernel(q):  # the kernel the layer runs on Hopper
            extra["gluon_ms"] = round(bench(lambda: prefill_attention(q, k, v, cu, cu, n, d**-0.5, out, w)), 3)
        if w is None:
            qs, ks, vs = (x.transpose(0, 1)[None] for x in (q, k, v))
            extra["sdpa_ms"] = round(bench(lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True,
                                                                                   enable_gqa=True)), 3)
        record("prefill-tiles", f"Triton prefill, Gemma 3 4B {layer} layer (Hq{hq}/Hkv{hkv}/D{d}"
               f"{'' if w is None else f', window {w}'}), S={n}", flop / best_ms / 1e9, "TFLOP/s", PEAK_TFLOPS,
               head_dim=d, window=w, ms=round(best_ms, 3), best=list(best), default=list(launch_config(d, n)),
               default_ms=round(default_ms, 3), differing_bits=[list(c) for c in differ], **extra)


def swept_tiles(path: Path, section: str = "tiles") -> dict[tuple[int, int], list[tuple[int, tuple]]]:
    """A `tiles` (or `fp8-tiles`) run's JSON lines as {(N, K): [(rows, fastest tiles), ...] by
    rows}, leaving out any product whose candidates' bits differed from its configured tiles'."""
    best: dict[tuple[int, int], list[tuple[int, tuple]]] = {}
    for line in path.read_text().splitlines():
        r = json.loads(line)
        if r.get("section") == section and "rows" in r and not r["differing_bits"]:
            best.setdefault((r["n"], r["k"]), []).append((r["rows"], tuple(r["best"])))
    for found in best.values():
        found.sort()
    return best


def swept_config(best: dict[tuple[int, int], list[tuple[int, tuple]]], m: int, n: int, k: int) -> tuple | None:
    """The tiles for an [m, k] x [n, k] product: those found at the fewest rows timed that hold m
    rows, None (the configured tiles) for a shape or a row count past what the sweep timed."""
    return next((cfg for rows, cfg in best.get((n, k), ()) if m <= rows), None)


def swept_launches(path: Path) -> dict[tuple[int, int], tuple]:
    """A `prefill-tiles` run's JSON lines as {(head size, window or 0): fastest launch}, leaving out
    any layer whose candidates' bits differed from the default launch's."""
    best = {}
    for line in path.read_text().splitlines():
        r = json.loads(line)
        if r.get("section") == "prefill-tiles" and "head_dim" in r and not r["differing_bits"]:
            best[(r["head_dim"], r["window"] or 0)] = tuple(r["best"])
    return best


def use_swept_tiles(path: Path) -> None:
    """--tiles FILE: kvtool's kernels take the fastest tiles a sweep in FILE found: the row-invariant
    GEMM `swept_config`'s (`tiles` rows), the FP8 GEMM the same way (`fp8-tiles` rows), the Triton
    prefill kernel its layer's launch for blocks of more than 64 rows (`prefill-tiles` rows).
    Every candidate gives the configured tiles' bits (the sweeps check that), so this changes the
    speed of the engines this run builds, never their output."""
    from kvtool.engine.kernels import row_invariant_gemm
    from kvtool.engine.kernels.attention import prefill

    best, fp8_best, launches = swept_tiles(path), swept_tiles(path, "fp8-tiles"), swept_launches(path)
    configured, configured_fp8 = row_invariant_gemm.triton_mm, row_invariant_gemm.fp8_mm
    configured_prefill = prefill.triton_prefill_attention

    def triton_mm(a, w, config=None):
        return configured(a, w, config or swept_config(best, a.shape[0], w.shape[0], w.shape[1]))

    def fp8_mm(x, w, config=None):
        return configured_fp8(x, w, config or swept_config(fp8_best, x.shape[0], *w.data.shape))

    def triton_prefill_attention(q, k, v, cu_q, cu_k, max_q, scale, out, window=None, softcap=None, config=None):
        if config is None and max_q > 64:
            config = launches.get((q.shape[-1], window or 0))
        return configured_prefill(q, k, v, cu_q, cu_k, max_q, scale, out, window, softcap, config)

    row_invariant_gemm.triton_mm, row_invariant_gemm.fp8_mm = triton_mm, fp8_mm
    prefill.triton_prefill_attention = triton_prefill_attention
    print(f"# tiles from {path}: {json.dumps({f'{n}x{k}': v for (n, k), v in best.items()})}; FP8: "
          f"{json.dumps({f'{n}x{k}': v for (n, k), v in fp8_best.items()})}; prefill: "
          f"{json.dumps({f'D{d} window {w}': v for (d, w), v in launches.items()})}", flush=True)


# ---- profile -----------------------------------------------------------------------------------

PROFILE_STEPS = 64
# (preset, batch, prompt length): one request's decode at 2k context, where batch-1 TPOT goes;
# 256 requests of 512 tokens, where the throughput workload's decode steps go.
# Gemma 3 4B at batch 1: its TPOT against vLLM's.
PROFILE_CASES = (("qwen3-8b", 1, 2048), ("qwen3-0.6b", 256, 512), ("gemma-3-4b", 1, 2048))


def section_profile():
    """torch.profiler over PROFILE_STEPS decode steps of each PROFILE_CASES batch, batch-invariant
    (the default) and not: each kernel's total and per-step time, the top ones printed, the summed
    kernel time per step recorded. --models: the cases of those presets; --quick: the first case alone."""
    import gc

    import torch
    from torch.profiler import ProfilerActivity, profile

    from kvtool.engine.params import SamplingParams

    sp = SamplingParams(max_tokens=PROFILE_STEPS + 1, temperature=0.0, ignore_eos=True)
    cases = [c for c in PROFILE_CASES if MODELS is None or c[0] in MODELS]
    for preset, batch, length in cases[:1] if QUICK else cases:
        prompts = [tokens(length, 5 + i) for i in range(batch)]
        for invariant in (True, False):
            engine = make_engine(preset, enable_prefix_caching=False, batch_invariant=invariant,
                                 max_model_len=4096, max_num_seqs=max(batch, 8))
            engine.generate(prompts, sp)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                engine.generate(prompts, sp)
            engine.close()
            rows = []
            for event in prof.key_averages():
                total_us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
                if total_us > 0:
                    rows.append((total_us, event.count, event.key))
            rows.sort(reverse=True)
            mode = "batch-invariant" if invariant else "--no-batch-invariant"
            # The prefill steps are in the totals too: one chunk of the batch's prompts beside 64 steps.
            kernels_us = sum(r[0] for r in rows if not r[2].startswith(("cudaGraph", "Memcpy", "Memset")))
            print(f"# profile {preset} batch {batch} {mode}: kernels {kernels_us / PROFILE_STEPS / 1e3:.3f} ms per step",
                  flush=True)
            for total_us, count, name in rows[:25]:
                print(f"#   {total_us / PROFILE_STEPS:9.1f} us/step  {count:6d}x  {name[:110]}", flush=True)
            record("profile", f"{preset} decode step kernel time, batch {batch} ({length}-token prompts, "
                   f"prefill included), {mode}", kernels_us / PROFILE_STEPS / 1e3, "ms", None,
                   top=[[round(t / PROFILE_STEPS, 1), c, n[:110]] for t, c, n in rows[:25]])
            del engine
            gc.collect()
            torch.cuda.empty_cache()


SECTIONS = {
    "env": section_env, "kernels": section_kernels, "prefill": section_prefill, "hit": section_hit,
    "hit-layers": section_hit_layers, "decode": section_decode, "throughput": section_throughput, "lm": section_lm,
    "models": section_models, "profile": section_profile, "tiles": section_tiles, "fp8-tiles": section_fp8_tiles,
    "prefill-tiles": section_prefill_tiles, "fp8-kernels": section_fp8_kernels,
}


VLLM_SECTIONS = ("prefill", "hit", "decode", "throughput", "models")


def side_by_side(rows: list[dict]) -> list[str]:
    """Table lines of each `measure` both kvtool and a baseline reported in this run: the baseline's
    time over kvtool's (or kvtool's rate over the baseline's), so > 1 means kvtool is faster."""
    by_measure: dict[str, dict[str, dict]] = {}
    for r in rows:
        if "measure" in r:
            by_measure.setdefault(r["measure"], {})[r["engine"]] = r
    lines = []
    for measure, engines in by_measure.items():
        ours = engines.get("kvtool")
        for engine, r in engines.items():
            if engine == "kvtool" or ours is None or not r["value"] or not ours["value"]:
                continue
            speed = r["value"] / ours["value"] if r["unit"] in ("ms", "s") else ours["value"] / r["value"]
            lines.append(f"| {measure} | {ours['value']} | {engine} | {r['value']} | {r['unit']} | {speed:.3f} |")
    return lines


def main() -> None:
    global OUT, QUICK, ENGINES, VLLM_SITE, MODELS, KV_CACHE_DTYPE, INVARIANCE_ARMS
    if len(sys.argv) == 7 and sys.argv[1] == "--read-lm":
        read_lm(*map(int, sys.argv[2:]))
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("sections", nargs="+", choices=list(SECTIONS))
    ap.add_argument("--out", type=Path)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--engines", default="kvtool",
                    help="comma-separated arms: kvtool, vllm (vllm runs in prefill, hit, decode and throughput)")
    ap.add_argument("--vllm-site", metavar="DIR", default=os.environ.get("KVTOOL_VLLM_SITE"),
                    help="an unpacked vLLM site folder, put first on the vLLM arm's PYTHONPATH "
                         "(default: $KVTOOL_VLLM_SITE; unset: the environment's own vLLM)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8", "fp8_e4m3", "fp8_e5m2"),
                    help="every engine's KV cache dtype, both arms (default: auto, the model's)")
    ap.add_argument("--models", help="comma-separated presets of the models and profile sections (default: all their rows)")
    ap.add_argument("--invariance-arms", action="store_true",
                    help="decode and throughput: only the default arms (graphs, async scheduling), "
                         "batch-invariant and not")
    ap.add_argument("--tiles", type=Path, metavar="FILE",
                    help="JSON lines of `tiles`, `fp8-tiles` and/or `prefill-tiles` runs: kvtool's row-invariant "
                         "GEMM, FP8 GEMM and Triton prefill kernel take the fastest tiles found there")
    a = ap.parse_args()
    MODELS = None if a.models is None else {m.strip() for m in a.models.split(",")}
    presets = dict.fromkeys([p for p, _ in MODEL_ROWS] + [c[0] for c in PROFILE_CASES])
    if MODELS is not None and MODELS - set(presets):
        ap.error(f"--models takes {', '.join(presets)}")
    engines = tuple(e.strip() for e in a.engines.split(",") if e.strip())
    if not engines or set(engines) - {"kvtool", "vllm"}:
        ap.error(f"--engines takes kvtool and/or vllm, got {a.engines!r}")
    if a.vllm_site and not (Path(a.vllm_site) / "vllm").is_dir():
        ap.error(f"--vllm-site {a.vllm_site}: no vllm package in it")
    if "vllm" in engines and not set(a.sections) & set(VLLM_SECTIONS):
        ap.error(f"the vllm arm runs in {', '.join(VLLM_SECTIONS)} only")
    OUT, QUICK, ENGINES, KV_CACHE_DTYPE, INVARIANCE_ARMS = a.out, a.quick, engines, a.kv_cache_dtype, a.invariance_arms
    if OUT is not None:
        OUT.parent.mkdir(parents=True, exist_ok=True)
    VLLM_SITE = str(Path(a.vllm_site).resolve()) if a.vllm_site else None
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if a.tiles is not None:
        use_swept_tiles(a.tiles)
    for name in a.sections:
        t0 = time.perf_counter()
        SECTIONS[name]()
        print(f"# section {name}: {time.perf_counter() - t0:.1f}s", flush=True)
    print("\n| section | engine | metric | value | unit | floor | ratio |")
    print("|---|---|---|---|---|---|---|")
    for r in RESULTS:
        print(f"| {r['section']} | {r['engine']} | {r['metric']} | {r['value']} | {r['unit']} | {r.get('floor', '')} | "
              f"{r.get('ratio_to_floor', '')} |")
    lines = side_by_side(RESULTS)
    if lines:
        print("\n| measure | kvtool | baseline | baseline's value | unit | kvtool speed / baseline's |")
        print("|---|---|---|---|---|---|")
        print("\n".join(lines))


if __name__ == "__main__":
    main()
