"""Prometheus metrics of `kvtool serve` (names prefixed `kvtool:`, as vLLM prefixes `vllm:`).

Engine totals are read at scrape time from the engine loop's copy of EngineStats, by a custom
collector, so the numbers are exactly the engine's. Per-request distributions (TTFT, end-to-end
latency) and the count of finished requests by reason are recorded when a request ends. Every
metric lives in this server's own CollectorRegistry and carries a `model_name` label.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvtool.engine.outputs import EngineStats, RequestResult

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)


class _EngineStatsCollector(Collector):
    """Turns the latest EngineStats into counters and gauges at each scrape."""

    def __init__(self, model_name: str, read_stats: Callable[[], EngineStats], read_in_flight: Callable[[], int]) -> None:
        self.model_name = model_name
        self.read_stats = read_stats
        self.read_in_flight = read_in_flight

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(name, doc, labels=["model_name"])
        family.add_metric([self.model_name], value)
        return family

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc, labels=["model_name"])
        family.add_metric([self.model_name], value)
        return family

    def _per_direction(self, name: str, doc: str, load: float, store: float) -> CounterMetricFamily:
        family = CounterMetricFamily(name, doc, labels=["model_name", "direction"])
        family.add_metric([self.model_name, "load"], load)
        family.add_metric([self.model_name, "store"], store)
        return family

    def collect(self) -> Iterator[Metric]:
        s = self.read_stats()
        yield self._counter("kvtool:requests", "Requests added to the engine.", s.num_requests)
        yield self._counter("kvtool:requests_finished", "Requests the engine finished (any reason).", s.num_finished)
        yield self._counter("kvtool:prompt_tokens", "Prompt tokens admitted by the engine.", s.num_prompt_tokens)
        yield self._counter("kvtool:generation_tokens", "Tokens generated.", s.num_generation_tokens)
        yield self._counter(
            "kvtool:prefix_cache_queries", "Prompt tokens looked up in the local prefix cache.", s.num_prefix_cache_queries
        )
        yield self._counter(
            "kvtool:prefix_cache_hits", "Prompt tokens served from the local prefix cache.", s.num_prefix_cache_hits
        )
        yield self._counter("kvtool:num_preemptions", "Requests preempted (to be recomputed).", s.num_preemptions)
        yield self._counter(
            "kvtool:connector_matched_tokens", "Prompt tokens the KV connector reported as available.", s.external_tokens_matched
        )
        yield self._counter(
            "kvtool:connector_loaded_tokens", "Tokens of KV loaded through the connector.", s.external_tokens_loaded
        )
        yield self._counter(
            "kvtool:connector_stored_tokens", "Tokens of KV stored through the connector.", s.external_tokens_stored
        )
        yield self._per_direction(
            "kvtool:connector_transfer_bytes", "Bytes of KV moved through the connector.", s.bytes_loaded, s.bytes_stored
        )
        yield self._per_direction(
            "kvtool:connector_transfer_seconds", "Seconds spent moving KV through the connector.", s.load_s, s.store_s
        )
        yield self._counter(
            "kvtool:connector_load_failures", "External KV loads that failed (any policy).", s.load_failures
        )
        yield self._gauge("kvtool:kv_cache_blocks", "KV blocks in the engine's cache.", s.num_blocks)
        yield self._gauge("kvtool:kv_cache_free_blocks", "KV blocks free (evictable cached blocks included).", s.num_free_blocks)
        usage = 1.0 - s.num_free_blocks / s.num_blocks if s.num_blocks else 0.0
        yield self._gauge("kvtool:kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).", usage)
        yield self._gauge("kvtool:num_requests_in_flight", "Requests the server is running or queuing.", self.read_in_flight())


class ServerMetrics:
    """The metrics of one server; `observe_finished` is called on the engine loop thread."""

    def __init__(self, model_name: str, read_stats: Callable[[], EngineStats], read_in_flight: Callable[[], int]) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(_EngineStatsCollector(model_name, read_stats, read_in_flight))
        self.ttft = Histogram(
            "kvtool:time_to_first_token_seconds", "Time from the engine's arrival to the first token.",
            ["model_name"], buckets=_TTFT_BUCKETS, registry=self.registry,
        ).labels(model_name)
        self.e2e_latency = Histogram(
            "kvtool:e2e_request_latency_seconds", "Time from the engine's arrival to the request's end.",
            ["model_name"], buckets=_E2E_BUCKETS, registry=self.registry,
        ).labels(model_name)
        self._finished = Counter(
            "kvtool:request_finished", "Requests ended, by finish reason (stop, length, abort, error).",
            ["model_name", "finished_reason"], registry=self.registry,
        )

    def observe_finished(self, result: RequestResult) -> None:
        self._finished.labels(self.model_name, result.finish_reason).inc()
        st = result.stats
        if st.ttft_s is not None:
            self.ttft.observe(st.ttft_s)
            self.e2e_latency.observe(st.ttft_s + (st.decode_s or 0.0))

    def render(self) -> tuple[bytes, str]:
        """The exposition text and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
