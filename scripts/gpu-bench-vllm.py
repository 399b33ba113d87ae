"""vLLM's arm of scripts/gpu-bench.py: one `vllm.LLM` on one spec, in a process of its own.

    python3 scripts/gpu-bench-vllm.py SPEC.json ROWS.jsonl

`gpu-bench.py --engines ...,vllm` writes SPEC and runs this with the vLLM site first on
PYTHONPATH; it imports nothing of kvtool. SPEC is a JSON object:

    {"model": DIR, "llm": {LLM keyword arguments}, "jobs": [JOB, ...]}

and every prompt in it is a list of token ids, the very ones kvtool's arm ran. A job is one of

    {"name": N, "job": "requests", "prompts": [[ids], ...], "max_tokens": K,
     "reset_prefix_cache": bool, "sleep_s": S}
        one `generate` per prompt, in order; with reset_prefix_cache the GPU prefix cache is
        dropped before each (a hit must then come from a connector); sleep_s first, once
    {"name": N, "job": "batch", "prompts": [[ids], ...], "max_tokens": [K, ...], "passes": P}
        P passes of one `generate` over all prompts (the caller drops its warm-up passes)

Every request is greedy with EOS ignored and fixed output lengths; tokenizer off, dummy
weights. ROWS gets one JSON line for the engine ({"startup": ...}) and one per job
({"job": N, "results": [...]}), each as soon as it is known; vLLM's logs go to stderr. Rows go
to a file, not to stdout: vLLM's engine-core process inherits stdout, and a reader waiting for
the end of a pipe would wait for that process too. TTFT is vLLM's
`first_token_latency`; TPOT is (last token time - first token time) / (output tokens - 1).
"""

import json
import os
import sys
import time

for _k, _v in {
    "VLLM_USE_FLASHINFER_SAMPLER": "0",  # the GPU image has no FlashInfer
    "VLLM_LOGGING_STREAM": "ext://sys.stderr",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}.items():
    os.environ.setdefault(_k, _v)

# What kvtool's arm gives its engine unless the spec says otherwise (dummy bf16 weights, CUDA
# graphs, async scheduling: vLLM's defaults on Hopper).
LLM_DEFAULTS = {"load_format": "dummy", "dtype": "bfloat16", "skip_tokenizer_init": True, "seed": 0,
                "enforce_eager": False, "disable_log_stats": False, "gpu_memory_utilization": 0.85}


T0 = time.perf_counter()


ROWS = None  # the file of rows (argv[2]), line-buffered


def emit(row: dict) -> None:
    ROWS.write(json.dumps(row) + "\n")
    ROWS.flush()


def log(*a) -> None:
    """Progress on stderr (the caller's log), so a stalled job shows where it stalled."""
    print(f"[gpu-bench-vllm {time.perf_counter() - T0:7.1f}s]", *a, file=sys.stderr, flush=True)


def sampling(max_tokens: int):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)


def request_result(out, wall_s: float) -> dict:
    m = out.metrics
    n = len(out.outputs[0].token_ids)
    ttft = getattr(m, "first_token_latency", None) if m is not None else None
    tpot = None
    if m is not None and n > 1 and getattr(m, "last_token_ts", 0) and getattr(m, "first_token_ts", 0):
        tpot = (m.last_token_ts - m.first_token_ts) / (n - 1)
    return {"ttft_s": ttft, "tpot_s": tpot, "wall_s": wall_s, "output_tokens": n,
            "output_token_ids": list(out.outputs[0].token_ids) if n <= 8 else None,
            "num_cached_tokens": out.num_cached_tokens}


def job_requests(llm, job: dict) -> list[dict]:
    from vllm.inputs import TokensPrompt

    if job.get("sleep_s"):
        time.sleep(job["sleep_s"])
    results = []
    for ids in job["prompts"]:
        if job.get("reset_prefix_cache"):
            llm.reset_prefix_cache()
            time.sleep(0.3)
        t0 = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], sampling(job["max_tokens"]), use_tqdm=False)[0]
        results.append(request_result(out, time.perf_counter() - t0))
    return results


def job_batch(llm, job: dict) -> list[dict]:
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in job["prompts"]]
    sps = [sampling(k) for k in job["max_tokens"]]
    results = []
    for _ in range(job["passes"]):
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sps, use_tqdm=False)
        wall = time.perf_counter() - t0
        results.append({"wall_s": wall, "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
                        "num_cached_tokens": sum(o.num_cached_tokens or 0 for o in outs)})
        log(f"{job['name']}: pass of {len(prompts)} prompts in {wall:.2f}s, {results[-1]['output_tokens']} tokens")
    return results


JOBS = {"requests": job_requests, "batch": job_batch}


def main() -> None:
    global ROWS
    if len(sys.argv) != 3:
        sys.exit("usage: gpu-bench-vllm.py SPEC.json ROWS.jsonl")
    ROWS = open(sys.argv[2], "a")
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    unknown = [j.get("job") for j in spec["jobs"] if j.get("job") not in JOBS]
    if unknown:
        sys.exit(f"gpu-bench-vllm.py: unknown jobs {unknown}")

    import torch
    import vllm
    from vllm import LLM
    from vllm.platforms import current_platform

    args = dict(LLM_DEFAULTS, model=os.path.abspath(spec["model"]), **spec["llm"])
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        log(f"GPU memory free: {free / 2**30:.1f} of {total / 2**30:.1f} GiB")
    log("LLM(", args, ")")
    t0 = time.perf_counter()
    llm = LLM(**args)
    emit({"startup": {"vllm": vllm.__version__, "torch": torch.__version__,
                      "gpu": current_platform.get_device_name(), "startup_s": round(time.perf_counter() - t0, 2),
                      "llm": {k: v for k, v in args.items() if k != "model"}}})
    for job in spec["jobs"]:
        log(f"job {job['name']}: {len(job['prompts'])} prompts")
        emit({"job": job["name"], "results": JOBS[job["job"]](llm, job)})
        log(f"job {job['name']} done")
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the engine's teardown is slow and measures nothing


if __name__ == "__main__":
    main()
