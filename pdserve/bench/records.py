"""The per-request record every benchmark metric is computed from.

Contract: a `RequestRecord` is everything the metrics need to know about one request, and nothing
about how it was produced: the HTTP client fills it from a stream, the planner's discrete-event
simulator fills it from a model. All times are seconds. `arrival_s` is the request's scheduled
(offered) arrival relative to the start of the run; the latency fields are measured from the moment
the request was sent (`start_s`, when known, is that moment relative to the run start; the client
may lag its schedule). A request that failed, was rejected or was cut off has `success=False`; its
latencies are kept for inspection but never enter latency percentiles, and it misses every SLO.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)  # slots: the simulator makes one per simulated request
class RequestRecord:
    """One request's outcome.

    `ttft_s` is None when no token arrived. `itls_s` are the gaps between successive streamed
    token chunks (sse.py: text, or a held-back token's empty text; one gap fewer than the
    chunks). `output_tokens` is the server's usage count when it reported one, else the number
    of token chunks. `error` is empty on
    success, else a short reason such as ``"rejected:429"``, ``"http:500"``, ``"cut_off"``.
    """

    request_id: int
    arrival_s: float
    success: bool
    ttft_s: float | None = None
    e2e_s: float = 0.0
    itls_s: tuple[float, ...] = ()
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str = ""
    start_s: float | None = None

    @property
    def tpot_s(self) -> float | None:
        """(E2E - TTFT) / (output tokens - 1); None when failed or fewer than two tokens."""
        if not self.success or self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    @property
    def finish_s(self) -> float:
        """Completion (or failure) time relative to the run start."""
        sent_s = self.arrival_s if self.start_s is None else self.start_s
        return sent_s + self.e2e_s


def failed_record(request_id: int, arrival_s: float, error: str, e2e_s: float = 0.0) -> RequestRecord:
    """A record for a request that produced nothing usable."""
    return RequestRecord(request_id=request_id, arrival_s=arrival_s, success=False, e2e_s=e2e_s, error=error)
