"""Prometheus metrics for /metrics, in a registry of the server's own (no process-wide globals).

Two kinds: what the server observes per request (counters by final status, token counters,
latency histograms), updated as requests progress; and the engine's state (running / waiting
requests, KV blocks, prefix-cache hit rate, preemptions), read from `LLMEngine.stats()` when
/metrics is scraped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from tokenmill.engine.engine import EngineStats

# Final status of a request: how it finished, or why it never ran.
STATUSES = ("stop", "length", "abort", "rejected", "invalid", "error")

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0, 600.0)


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], EngineStats | None]):
        self._stats = stats

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        s = self._stats()
        if s is None:   # the model is still loading
            return
        yield GaugeMetricFamily("tokenmill_num_requests_running", "Sequences in the running batch",
                                value=s.num_running)
        yield GaugeMetricFamily("tokenmill_num_requests_waiting", "Sequences waiting to be scheduled",
                                value=s.num_waiting)
        yield GaugeMetricFamily("tokenmill_kv_blocks_total", "KV-cache blocks in the pool", value=s.num_kv_blocks)
        yield GaugeMetricFamily("tokenmill_kv_blocks_used", "KV-cache blocks held by requests",
                                value=s.num_kv_blocks - s.num_free_kv_blocks)
        yield GaugeMetricFamily("tokenmill_prefix_cache_hit_rate",
                                "Prompt tokens found in the prefix cache / prompt tokens admitted",
                                value=s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0)
        yield CounterMetricFamily("tokenmill_prefix_cache_queries", "Prompt tokens admitted (looked up in the cache)",
                                  value=s.prefix_cache_queries)
        yield CounterMetricFamily("tokenmill_prefix_cache_hits", "Prompt tokens found in the prefix cache",
                                  value=s.prefix_cache_hits)
        yield CounterMetricFamily("tokenmill_num_preemptions",
                                  "Sequences preempted (KV blocks freed, recomputed later)", value=s.num_preemptions)
        if s.kv_transfer_role is not None:   # prefill/decode disaggregation
            for name, help, value in [
                ("exports", "Requests whose prompt K/V this engine exported (a kv_producer)", s.kv_transfer_exports),
                ("loaded_tokens", "Prompt tokens whose K/V this engine received instead of computing them "
                 "(a kv_consumer)", s.kv_transfer_loaded_tokens)]:
                family = CounterMetricFamily(f"tokenmill_kv_transfer_{name}", help, labels=["role"])
                family.add_metric([s.kv_transfer_role], value)
                yield family
        if s.spec_proposer is not None:   # vLLM's spec_decode counters, labelled by proposer
            for name, help, value in [
                ("num_drafts", "Request-steps that verified proposed tokens", s.spec_num_drafts),
                ("num_draft_tokens", "Proposed tokens verified", s.spec_num_draft_tokens),
                ("num_accepted_tokens", "Proposed tokens accepted", s.spec_num_accepted_tokens)]:
                family = CounterMetricFamily(f"tokenmill_spec_decode_{name}", help, labels=["proposer"])
                family.add_metric([s.spec_proposer], value)
                yield family
            for name, help, value in [
                ("row_cost", "The adaptive draft length's cost of one more row relative to a batch-1 decode step, "
                 "learned from the engine's steps", s.spec_row_cost),
                ("proposal_cost", "The adaptive draft length's cost of proposing one token relative to a batch-1 "
                 "decode step, learned from the engine's steps", s.spec_proposal_cost)]:
                cost = GaugeMetricFamily(f"tokenmill_spec_decode_{name}", help, labels=["proposer"])
                cost.add_metric([s.spec_proposer], value)
                yield cost


class ServerMetrics:
    def __init__(self, engine_stats: Callable[[], EngineStats | None]):
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("tokenmill_requests", "Requests by final status", ["status"], registry=self.registry)
        for status in STATUSES:
            self.requests.labels(status)   # every status shows, at 0, from the start
        self.prompt_tokens = Counter("tokenmill_prompt_tokens", "Prompt tokens of accepted requests",
                                     registry=self.registry)
        self.generation_tokens = Counter("tokenmill_generation_tokens", "Generated tokens", registry=self.registry)
        self.ttft = Histogram("tokenmill_time_to_first_token_seconds", "Arrival to first generated token",
                              buckets=_TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram("tokenmill_inter_token_latency_seconds",
                             "Time between consecutive outputs of a request (one per engine step that gave it tokens)",
                             buckets=_ITL_BUCKETS, registry=self.registry)
        self.e2e = Histogram("tokenmill_e2e_request_latency_seconds", "Arrival to the last token",
                             buckets=_E2E_BUCKETS, registry=self.registry)
        self.registry.register(_EngineCollector(engine_stats))

    def count(self, status: str) -> None:
        self.requests.labels(status).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
