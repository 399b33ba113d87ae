"""Workloads that produce evidence about KV reuse: traces, arms, replay and benchmarks.

Everything here returns msgspec Structs and reports progress through a callback; nothing
prints. `commands/replay.py` and `commands/bench.py` parse flags, call these and render.

    trace.py        the trace format (JSON Lines) and its strict reader
    make_trace.py   generators for common trace shapes (multi-turn, long-doc-qa, shared-prefix)
    arms.py         arms: a name, a KV transfer config, and how its reuse is proven
    lmcache_server.py  an LMCache server from the peer environment, when no URL is given
    trace_pass.py   one pass of a trace through an in-process engine, honouring arrivals
    cold_pass.py    the same pass in a cold subprocess (`--restart process`)
    server_pass.py  the same pass against an OpenAI-compatible server
    replay.py       fill pass, restart, reuse pass for each arm; identity and hit checks
    ttft.py         the TTFT grid of `kvtool bench ttft`
    throughput.py   the offline throughput workload of `kvtool bench throughput`
    serve_bench.py  `kvtool bench serve`: a trace at offered loads against every arm, and its report
    serve_arrivals.py  the offered loads: Poisson arrivals at a rate, all at once, or the trace's
    serve_sizing.py the trace's working set, and the device and CPU tier sizes it sets
    serve_pass.py   kvtool's arms of it: an in-process engine behind the engine loop, streamed
    serve_metrics.py  per-request timings to percentiles, tokens/s and queue growth
    serve_plot.py   its figure: TTFT p50/p99 and throughput against the load
    vllm_serve.py   vLLM's arms of it, each in a process of its own (vllm_serve_driver.py)
    hf_baseline.py  Hugging Face transformers on the same weights, measured in the same run
    figures.py      percentiles and medians
    plot.py         the TTFT / speed-up figure of `kvtool bench ttft`
"""
