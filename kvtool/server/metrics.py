"""Prometheus metrics of `kvtool serve`, under vLLM's names, types, labels and buckets.

What vLLM 0.33 also measures is named as vLLM names it (`vllm:*`, labels `model_name` and
`engine`), so vLLM's Grafana dashboards and routers that read `vllm:num_requests_waiting` or
`vllm:kv_cache_usage_perc` work unchanged; figures only kvtool has keep a `kvtool:` name. Two
names that vLLM's published dashboard still queries but vLLM 0.33 dropped,
`vllm:gpu_cache_usage_perc` and `vllm:time_per_output_token_seconds`, are exposed as the same
figures as their successors. `vllm:kv_offload_cpu_cache_usage_perc` is there only when the
connector has a CPU tier (vLLM: the OffloadingConnector's CPU spec) and means what vLLM means:
the share of its slots pinned by transfers in flight; how full it is has a kvtool: name.

Engine totals are read at scrape time from the engine loop's copy of EngineStats, by a custom
collector, so the numbers are exactly the engine's. Per-request histograms are recorded when a
request ends. The inter-token latency is recorded as vLLM records it: one observation per engine
output that gave a request tokens after its first ones, the time since that request's previous
output (`observe_token_gap`, called by the engine loop as the step ends).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvtool.engine.outputs import EngineStats, RequestResult

# vLLM 0.33's buckets (vllm/v1/metrics/buckets.py).
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
TIME_TO_FIRST_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                               10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
INTER_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                               10.0, 20.0, 40.0, 80.0)
LABELS = ["model_name", "engine"]
ENGINE_INDEX = "0"


def request_tokens_buckets(max_model_len: int) -> list[int]:
    """vLLM's 1-2-5 series up to max_model_len (request_prompt_tokens and friends)."""
    out, exponent = [], 0
    while True:
        for m in (1, 2, 5):
            v = m * 10**exponent
            if v > max_model_len:
                return out
            out.append(v)
        exponent += 1


class _EngineStatsCollector(Collector):
    """Turns the latest EngineStats (and queue lengths) into counters and gauges at each scrape."""

    def __init__(self, model_name: str, read_stats: Callable[[], EngineStats],
                 read_queues: Callable[[], tuple[int, int]], has_connector: bool) -> None:
        self.labels = [model_name, ENGINE_INDEX]
        self.has_connector = has_connector
        self.read_stats = read_stats
        self.read_queues = read_queues

    def _family(self, cls, name: str, doc: str, value: float):
        family = cls(name, doc, labels=LABELS)
        family.add_metric(self.labels, value)
        return family

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        return self._family(CounterMetricFamily, name, doc, value)

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        return self._family(GaugeMetricFamily, name, doc, value)

    def collect(self) -> Iterator[Metric]:
        s = self.read_stats()
        running, waiting = self.read_queues()
        yield self._gauge("vllm:num_requests_running", "Number of requests in model execution batches.", running)
        yield self._gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", waiting)
        usage = 1.0 - s.num_free_blocks / s.num_blocks if s.num_blocks else 0.0
        yield self._gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", usage)
        yield self._gauge("vllm:gpu_cache_usage_perc", "KV-cache usage (the name before vllm:kv_cache_usage_perc).", usage)
        yield self._counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                            s.num_prefix_cache_queries)
        yield self._counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                            s.num_prefix_cache_hits)
        yield self._counter("vllm:external_prefix_cache_queries",
                            "External prefix cache queries from KV connector, in terms of number of queried tokens.",
                            max(0, s.num_prefix_cache_queries - s.num_prefix_cache_hits) if self.has_connector else 0)
        yield self._counter("vllm:external_prefix_cache_hits",
                            "External prefix cache hits from KV connector, in terms of number of cached tokens.",
                            s.external_tokens_matched)
        yield self._counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", s.num_preemptions)
        yield self._counter("vllm:prompt_tokens", "Number of prefill tokens processed.", s.num_prompt_tokens)
        yield self._counter("vllm:generation_tokens", "Number of generation tokens processed.", s.num_generation_tokens)
        by_source = CounterMetricFamily("vllm:prompt_tokens_by_source", "Number of prompt tokens by source.",
                                        labels=[*LABELS, "source"])
        local_compute = max(0, s.num_prompt_tokens - s.num_prefix_cache_hits - s.external_tokens_matched)
        for source, value in (("local_compute", local_compute), ("local_cache_hit", s.num_prefix_cache_hits),
                              ("external_kv_transfer", s.external_tokens_matched)):
            by_source.add_metric([*self.labels, source], value)
        yield by_source
        yield self._counter("vllm:kv_offload_load_bytes", "Total bytes loaded from offload storage to GPU.", s.bytes_loaded)
        yield self._counter("vllm:kv_offload_load_time", "Total load time from offload storage to GPU, in seconds.", s.load_s)
        yield self._counter("vllm:kv_offload_store_bytes", "Total bytes stored from GPU to offload storage.", s.bytes_stored)
        yield self._counter("vllm:kv_offload_store_time", "Total store time from GPU to offload storage, in seconds.",
                            s.store_s)
        if s.cpu_tier is not None and s.cpu_tier.num_slots:
            tier = s.cpu_tier
            # vLLM's CPU offload manager counts as used the chunks neither free nor evictable,
            # i.e. those a transfer in flight holds (kv_offload/cpu/manager.py get_stats).
            yield self._gauge("vllm:kv_offload_cpu_cache_usage_perc",
                              "Fraction of CPU KV-cache space currently pinned by active transfers "
                              "(0.0 = idle, 1.0 = saturated).", tier.num_pinned / tier.num_slots)
            yield self._gauge("kvtool:kv_offload_cpu_cache_filled_perc",
                              "Fraction of CPU KV-cache slots holding a block (evictable ones included).",
                              tier.num_filled / tier.num_slots)
            yield self._gauge("kvtool:kv_offload_cpu_cache_slots", "Slots (offload blocks) of the CPU KV-cache tier.",
                              tier.num_slots)
        # kvtool's own figures.
        yield self._counter("kvtool:requests", "Requests added to the engine.", s.num_requests)
        yield self._counter("kvtool:connector_loaded_tokens", "Tokens of KV loaded through the connector.",
                            s.external_tokens_loaded)
        yield self._counter("kvtool:connector_loaded_from_disk_tokens",
                            "Tokens of KV loaded through the connector that were read from its disk tier.",
                            s.external_tokens_loaded_from_disk)
        yield self._counter("kvtool:connector_stored_tokens", "Tokens of KV stored through the connector.",
                            s.external_tokens_stored)
        yield self._counter("kvtool:connector_load_failures", "External KV loads that failed (any policy).", s.load_failures)
        yield self._counter("kvtool:connector_store_skipped_chunks",
                            "Chunks not stored because the store's backlog held every staging buffer.",
                            s.store_skipped_chunks)
        yield self._gauge("kvtool:kv_cache_blocks", "KV blocks in the engine's cache.", s.num_blocks)
        yield self._gauge("kvtool:kv_cache_free_blocks", "KV blocks free (evictable cached blocks included).",
                          s.num_free_blocks)


class ServerMetrics:
    """The metrics of one server; `observe_finished` is called on the engine loop thread."""

    def __init__(self, model_name: str, read_stats: Callable[[], EngineStats],
                 read_queues: Callable[[], tuple[int, int]], max_model_len: int = 8192,
                 has_connector: bool = False) -> None:
        self.model_name = model_name
        self.labels = (model_name, ENGINE_INDEX)
        self.registry = CollectorRegistry()
        self.registry.register(_EngineStatsCollector(model_name, read_stats, read_queues, has_connector))
        reg = self.registry

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, LABELS, buckets=buckets, registry=reg).labels(*self.labels)

        tokens = request_tokens_buckets(max_model_len)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TIME_TO_FIRST_TOKEN_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             INTER_TOKEN_LATENCY_BUCKETS)
        self.tpot = histogram("vllm:request_time_per_output_token_seconds",
                              "Histogram of time_per_output_token_seconds per request.", INTER_TOKEN_LATENCY_BUCKETS)
        self.tpot_old = histogram("vllm:time_per_output_token_seconds",
                                  "Time per output token (the name before vllm:inter_token_latency_seconds).",
                                  INTER_TOKEN_LATENCY_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             REQUEST_LATENCY_BUCKETS)
        self.queue = histogram("vllm:request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.inference = histogram("vllm:request_inference_time_seconds",
                                   "Histogram of time spent in RUNNING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.prefill = histogram("vllm:request_prefill_time_seconds",
                                 "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS)
        self.decode = histogram("vllm:request_decode_time_seconds",
                                "Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS)
        self.prompt_tokens = histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.", tokens)
        self.generation_tokens = histogram("vllm:request_generation_tokens", "Number of generation tokens processed.",
                                           tokens)
        self.max_generation_tokens = histogram("vllm:request_max_num_generation_tokens",
                                               "Histogram of maximum number of requested generation tokens.", tokens)
        self._success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                [*LABELS, "finished_reason"], registry=reg)

    def observe_finished(self, result: RequestResult) -> None:
        st = result.stats
        n_out = len(result.output_token_ids)
        if result.finish_reason in ("stop", "length", "abort", "error"):
            self._success.labels(*self.labels, result.finish_reason).inc()
        self.prompt_tokens.observe(st.num_prompt_tokens)
        self.generation_tokens.observe(n_out)
        self.max_generation_tokens.observe(n_out)
        if st.ttft_s is None:
            return
        self.ttft.observe(st.ttft_s)
        decode = st.decode_s or 0.0
        self.e2e.observe(st.ttft_s + decode)
        queue = st.queue_s if st.queue_s is not None else 0.0
        self.queue.observe(queue)
        self.prefill.observe(max(0.0, st.ttft_s - queue))
        self.decode.observe(decode)
        self.inference.observe(max(0.0, st.ttft_s - queue) + decode)
        if n_out > 1:
            self.tpot.observe(decode / (n_out - 1))

    def observe_token_gap(self, seconds: float) -> None:
        """One inter-token gap of one request (vLLM's inter_token_latencies_iter entry)."""
        self.itl.observe(seconds)
        self.tpot_old.observe(seconds)

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
