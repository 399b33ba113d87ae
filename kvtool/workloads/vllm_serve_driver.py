"""vLLM's arm of `kvtool bench serve`, in a process of its own: the trace at an offered load,
sent to vLLM's asynchronous engine (`AsyncLLM`, the engine behind vLLM's OpenAI server).

    python3 vllm_serve_driver.py SPEC.json ROWS.jsonl

vllm_serve.py writes SPEC and runs this file with the vLLM site first on PYTHONPATH; it imports
nothing of kvtool. SPEC is a JSON object:

    {"model": DIR, "engine_args": {AsyncEngineArgs keywords; kv_transfer_config as an object},
     "prompts": [[ids], ...], "max_tokens": [K, ...], "num_warmups": W,
     "runs": [{"name": N, "arrivals": [seconds, ...], "max_concurrency": C or null, "salt": S}, ...]}

The prompts are the token ids kvtool's arms ran, the arrival times theirs. Every request is
greedy with EOS ignored and a fixed output length, tokenizer off. One asyncio task per request
sleeps until its arrival, takes a slot when max_concurrency limits them, and consumes the
request's stream (RequestOutputKind.DELTA), stamping its first token and its end, the way
kvtool's arms are measured. The W first prompts run once before the runs, under a salt of
their own, so that no run pays for the engine's first steps.

Proof of hits, gathered per run by a stat logger: the prompt tokens of the run's requests by
source, as vLLM's output processor counts them once per request (`IterationStats.
prompt_token_stats`: computed, local_cache_hit, external_kv_transfer), and the sums of vLLM's
scheduler statistics, `prefix_cache_stats` (the device prefix cache's queries and hits) and
`connector_prefix_cache_stats` (the connector's external hits); and each request's
`num_cached_tokens` (device prefix cache and connector together).

ROWS gets one JSON line at start-up ({"startup": ...}) and one per run ({"run": N, "requests":
[...], "stats": {...}}), each as soon as it is known; vLLM's logs go to stderr. Rows go to a
file: vLLM's engine-core process inherits stdout.
"""

import asyncio
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

T0 = time.perf_counter()
ROWS = None  # the file of rows (argv[2])
# vLLM's scheduler statistics since start, summed by the stat logger (fields may be missing in
# another vLLM: they then stay 0).
STATS = {"prompt_tokens": 0, "prompt_tokens_computed": 0, "prompt_tokens_local_cache_hit": 0,
         "prompt_tokens_external_kv_transfer": 0, "prefix_cache_queries": 0, "prefix_cache_hits": 0,
         "connector_queries": 0, "connector_hits": 0, "num_scheduler_stats": 0, "max_waiting_reqs": 0}


def emit(row: dict) -> None:
    ROWS.write(json.dumps(row) + "\n")
    ROWS.flush()


def log(*a) -> None:
    print(f"[bench-serve-vllm {time.perf_counter() - T0:7.1f}s]", *a, file=sys.stderr, flush=True)


def make_stat_logger():
    """A vLLM stat logger class that sums the scheduler's prefix-cache statistics into STATS."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class ServeStatLogger(StatLoggerBase):
        def __init__(self, vllm_config, engine_index: int = 0):
            self.engine_index = engine_index

        def record(self, scheduler_stats=None, iteration_stats=None, *args, **kwargs):
            prompt = getattr(iteration_stats, "prompt_token_stats", None)
            if prompt is not None:
                STATS["prompt_tokens"] += getattr(prompt, "total", 0)
                STATS["prompt_tokens_computed"] += getattr(prompt, "computed", 0)
                STATS["prompt_tokens_local_cache_hit"] += getattr(prompt, "local_cache_hit", 0)
                STATS["prompt_tokens_external_kv_transfer"] += getattr(prompt, "external_kv_transfer", 0)
            if scheduler_stats is None:
                return
            STATS["num_scheduler_stats"] += 1
            STATS["max_waiting_reqs"] = max(STATS["max_waiting_reqs"], getattr(scheduler_stats, "num_waiting_reqs", 0))
            local = getattr(scheduler_stats, "prefix_cache_stats", None)
            if local is not None:
                STATS["prefix_cache_queries"] += getattr(local, "queries", 0)
                STATS["prefix_cache_hits"] += getattr(local, "hits", 0)
            external = getattr(scheduler_stats, "connector_prefix_cache_stats", None)
            if external is not None:
                STATS["connector_queries"] += getattr(external, "queries", 0)
                STATS["connector_hits"] += getattr(external, "hits", 0)

        def log_engine_initialized(self):
            pass

        def log(self):
            pass

        def record_sleep_state(self, *args, **kwargs):
            pass

    return ServeStatLogger


def token_prompt(prompt: list[int], salt: str):
    """The prompt as vLLM 0.26's renderer hands it to AsyncLLM (`tokens_input`); a raw
    TokensPrompt dict where that does not exist (vLLM still takes one, with a warning)."""
    try:
        from vllm.inputs.engine import tokens_input
    except ImportError:
        return {"prompt_token_ids": prompt, "cache_salt": salt}
    return tokens_input(prompt, cache_salt=salt)


async def send(engine, i: int, prompt: list[int], max_tokens: int, salt: str, request_id: str, t0: float,
               arrival: float) -> dict:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False,
                            output_kind=RequestOutputKind.DELTA)
    rec = {"index": i, "arrival_s": arrival, "send_s": time.perf_counter() - t0, "first_token_s": None,
           "finish_s": None, "num_prompt_tokens": len(prompt), "num_output_tokens": 0, "num_cached_tokens": 0,
           "error": None, "output_token_ids": []}
    ids = rec["output_token_ids"]
    try:
        async for out in engine.generate(token_prompt(prompt, salt), params, request_id):
            new = list(out.outputs[0].token_ids) if out.outputs else []
            if new and rec["first_token_s"] is None:
                rec["first_token_s"] = time.perf_counter() - t0
            ids += new
            if out.num_cached_tokens is not None:
                rec["num_cached_tokens"] = out.num_cached_tokens
    except Exception as e:  # noqa: BLE001 - one request's failure is part of the run's result
        rec["error"] = f"{type(e).__name__}: {e}"
    rec["finish_s"] = time.perf_counter() - t0
    rec["num_output_tokens"] = len(ids)
    return rec


async def run_one(engine, spec: dict, run: dict) -> list[dict]:
    prompts, max_tokens, arrivals = spec["prompts"], spec["max_tokens"], run["arrivals"]
    slots = asyncio.Semaphore(run["max_concurrency"]) if run.get("max_concurrency") else None
    t0 = time.perf_counter()

    async def one(i: int) -> dict:
        await asyncio.sleep(max(0.0, arrivals[i] - (time.perf_counter() - t0)))
        if slots is not None:
            await slots.acquire()
        try:
            return await send(engine, i, prompts[i], max_tokens[i], run["salt"], f"{run['name']}-{i}", t0,
                              arrivals[i])
        finally:
            if slots is not None:
                slots.release()

    return list(await asyncio.gather(*(one(i) for i in range(len(arrivals)))))


async def main_async(spec: dict) -> None:
    import torch
    import vllm
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.platforms import current_platform
    from vllm.v1.engine.async_llm import AsyncLLM

    args = dict(spec["engine_args"])
    if args.get("kv_transfer_config") is not None:
        from vllm.config import KVTransferConfig

        args["kv_transfer_config"] = KVTransferConfig(**args["kv_transfer_config"])
    log("AsyncEngineArgs(", spec["engine_args"], ")")
    t0 = time.perf_counter()
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=os.path.abspath(spec["model"]), **args),
                                       stat_loggers=[make_stat_logger()])
    cache = engine.vllm_config.cache_config
    emit({"startup": {"vllm": vllm.__version__, "torch": torch.__version__,
                      "gpu": current_platform.get_device_name(), "startup_s": round(time.perf_counter() - t0, 2),
                      "num_gpu_blocks": cache.num_gpu_blocks, "block_size": cache.block_size,
                      "engine_args": spec["engine_args"]}})
    warm = spec.get("num_warmups", 0)
    if warm:
        log(f"warm-up: {warm} requests")
        await run_one(engine, spec, {"name": "warm-up", "arrivals": [0.0] * warm, "max_concurrency": None,
                                     "salt": "kvtool-bench-serve-warm-up"})
    for run in spec["runs"]:
        log(f"run {run['name']}: {len(run['arrivals'])} requests")
        STATS["max_waiting_reqs"] = 0
        before = dict(STATS)
        records = await run_one(engine, spec, run)
        await asyncio.sleep(0.5)  # the last steps' statistics reach the logger after their outputs
        emit({"run": run["name"], "requests": records,
              "stats": {k: STATS[k] - before[k] if k != "max_waiting_reqs" else STATS[k] for k in STATS}})
        log(f"run {run['name']} done")


def main() -> None:
    global ROWS
    if len(sys.argv) != 3:
        sys.exit("usage: vllm_serve_driver.py SPEC.json ROWS.jsonl")
    ROWS = open(sys.argv[2], "a")
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    asyncio.run(main_async(spec))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the engine's teardown is slow and measures nothing; the caller ends its session


if __name__ == "__main__":
    main()
