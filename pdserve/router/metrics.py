"""Prometheus metrics of the serving runtime, in one private registry per router process.

Names are prefixed `pdserve_`. Counters mirror the request life cycle: route decisions by
policy and result, early rejections, K/V transfer attempts / failures / retries and bytes,
fallbacks, stale or duplicate publication rejects; histograms hold TTFT, TPOT and exposed
transfer seconds; gauges hold per-worker queue depth and free blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily

LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class RouteDecisions:
    """Exports the control plane's own (policy, result) counters at scrape time: one source of truth."""

    def __init__(self, read: Callable[[], Mapping[tuple[str, str], int]]):
        self.read = read

    def collect(self):
        family = CounterMetricFamily("pdserve_route_decisions", "Route decisions", labels=["policy", "result"])
        for (policy, result), count in sorted(self.read().items()):
            family.add_metric([policy, result], count)
        yield family


class RuntimeMetrics:
    def __init__(self, route_counts: Callable[[], Mapping[tuple[str, str], int]] = dict) -> None:
        r = self.registry = CollectorRegistry()
        r.register(RouteDecisions(route_counts))
        self.early_rejections = Counter("pdserve_early_rejections", "Requests rejected before prefill", ["reason"], registry=r)
        self.requests = Counter("pdserve_requests", "Finished requests", ["result"], registry=r)
        self.kv_transfer_bytes = Counter("pdserve_kv_transfer_bytes", "Logical K/V bytes published at decode", registry=r)
        self.kv_transfer_physical_bytes = Counter("pdserve_kv_transfer_physical_bytes", "Bytes on the wire incl. headers and resends", registry=r)
        self.kv_transfer_attempts = Counter("pdserve_kv_transfer_attempts", "K/V transfers started", registry=r)
        self.kv_transfer_failures = Counter("pdserve_kv_transfer_failures", "K/V transfers aborted", ["reason"], registry=r)
        self.kv_transfer_retries = Counter("pdserve_kv_transfer_retries", "K/V transfers retried under a new generation", registry=r)
        self.kv_exposed_seconds = Histogram("pdserve_kv_exposed_transfer_seconds", "Transfer time not hidden behind prefill",
                                            buckets=LATENCY_BUCKETS_S, registry=r)
        self.kv_transfer_seconds = Histogram("pdserve_kv_transfer_seconds", "Transfer wall time (source side)",
                                             buckets=LATENCY_BUCKETS_S, registry=r)
        self.fallbacks = Counter("pdserve_fallbacks", "Decode-start fallbacks and reroutes", ["kind"], registry=r)
        self.publication_rejects = Counter("pdserve_publication_rejects", "Stale or duplicate publications refused", ["reason"], registry=r)
        self.ttft = Histogram("pdserve_ttft_seconds", "Time to first token", buckets=LATENCY_BUCKETS_S, registry=r)
        self.tpot = Histogram("pdserve_tpot_seconds", "Time per output token after the first", buckets=TPOT_BUCKETS_S, registry=r)
        self.queue_depth = Gauge("pdserve_queue_pending_prompt_tokens", "Pending prompt tokens", ["worker"], registry=r)
        self.active_decode = Gauge("pdserve_active_decode_batch", "Sequences decoding", ["worker"], registry=r)
        self.free_blocks = Gauge("pdserve_free_blocks", "Free K/V blocks", ["worker"], registry=r)
        self.workers_live = Gauge("pdserve_workers_live", "Live workers", ["role"], registry=r)

    def text(self) -> bytes:
        return generate_latest(self.registry)
