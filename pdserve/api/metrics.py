"""Prometheus metrics every backend shares: requests by result, time to first token, time per output token.

Contract: `ServingMetrics` owns its metrics in a private `CollectorRegistry` (so two backends in one
process never collide in the global registry); a backend that needs more metrics registers them
on `metrics.registry` and they appear in `render()`. Per request, a backend keeps one
`RequestClock`: `first_tokens()` on every token event, `finish(result, num_output_tokens)` once at
the end. All calls are thread-safe (prometheus_client locks internally), so an engine thread may
record while the event loop renders.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class ServingMetrics:
    """The shared serving metrics, registered under `prefix` in a private registry."""

    def __init__(self, prefix: str = "pdserve", registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        self.requests = Counter(
            f"{prefix}_requests", "Finished requests by result (stop, length, abort, error, rejected)",
            ["result"], registry=self.registry,
        )
        self.in_flight = Gauge(
            f"{prefix}_requests_in_flight", "Requests admitted and not yet finished", registry=self.registry,
        )
        self.ttft_s = Histogram(
            f"{prefix}_time_to_first_token_seconds", "Submission to first output token", buckets=TTFT_BUCKETS_S,
            registry=self.registry,
        )
        self.tpot_s = Histogram(
            f"{prefix}_time_per_output_token_seconds", "Mean gap between output tokens after the first, per request",
            buckets=TPOT_BUCKETS_S, registry=self.registry,
        )

    def clock(self) -> RequestClock:
        """Start timing one admitted request (counts it in flight until `finish`)."""
        self.in_flight.inc()
        return RequestClock(self)

    def count_rejected(self) -> None:
        self.requests.labels(result="rejected").inc()

    def render(self) -> bytes:
        """Prometheus text exposition of everything in the registry."""
        return generate_latest(self.registry)


@dataclass
class RequestClock:
    """One request's timestamps; observes TTFT at the first token and TPOT at the finish."""

    metrics: ServingMetrics
    start_s: float = field(default_factory=time.monotonic)
    first_token_s: float | None = None
    finished: bool = False

    def first_tokens(self) -> None:
        """Call on every token event; only the first one is observed."""
        if self.first_token_s is None:
            self.first_token_s = time.monotonic()
            self.metrics.ttft_s.observe(self.first_token_s - self.start_s)

    def finish(self, result: str, num_output_tokens: int) -> None:
        """Record the outcome once; later calls are ignored."""
        if self.finished:
            return
        self.finished = True
        self.metrics.in_flight.dec()
        self.metrics.requests.labels(result=result).inc()
        if self.first_token_s is not None and num_output_tokens > 1:
            gap_s = (time.monotonic() - self.first_token_s) / (num_output_tokens - 1)
            self.metrics.tpot_s.observe(gap_s)
