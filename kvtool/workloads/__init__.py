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
    hf_baseline.py  Hugging Face transformers on the same weights, measured in the same run
    figures.py      percentiles and medians
    plot.py         the TTFT / speed-up figure
"""
