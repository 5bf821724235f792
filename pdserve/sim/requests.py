"""The simulator's view of a benchmark workload: columns of numbers, plus record building.

Contract: `SimRequests.from_workload` reads a `pdserve.bench.workload.Workload` (the same seeded
specs and traces the HTTP benchmark replays) into columns on the workload's unit-rate time axis;
`arrivals_at(rate)` rescales with the benchmark's own `scale_to_rate`, so a simulated rate sweep
replays exactly the requests a measured sweep sends. `cached_tokens` are prefix-cache hits: the
shared system prefix, plus (for multi-turn workloads) the previous turn's prompt and reply.
`records` turns simulated times into the benchmark's `RequestRecord`s.

Context window: `build_requests(..., max_context=C)` gives a synthetic single-turn workload
conditioned on prompt + output <= C (what a model with C positions can serve; DistServe built its
ShareGPT workload for OPT the same way): the unit arrivals are the workload's own, and the
lengths are the first len(workload) pairs that fit, drawn from the same seeded distributions.
Lengths and arrivals are drawn independently, so this is exact conditioning for any arrival
process. A trace or a multi-turn workload with a request past C is refused (its requests are
what they are).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

from pdserve.bench.arrivals import scale_to_rate
from pdserve.bench.records import RequestRecord, failed_record
from pdserve.bench.workload import Workload, WorkloadConfig, build_workload

REJECTED_KV = "rejected:kv_capacity"


@dataclass(frozen=True)
class SimRequests:
    """Per-request columns, in request-id order."""

    unit_arrivals_s: tuple[float, ...]
    prompt_tokens: tuple[int, ...]
    output_tokens: tuple[int, ...]
    cached_tokens: tuple[int, ...]
    native_rate: float | None = None

    def __len__(self) -> int:
        return len(self.prompt_tokens)

    def arrivals_at(self, rate: float | None) -> list[float]:
        """Arrival times (s) at `rate` req/s; None replays a trace at its recorded rate."""
        rate = self.native_rate if rate is None else rate
        if rate is None:
            raise ValueError("a rate is needed: this workload has no recorded arrival times")
        return scale_to_rate(self.unit_arrivals_s, rate).tolist()

    @classmethod
    def from_workload(cls, workload: Workload, prefix_cache: bool = False, shared_prefix_len: int = 0) -> SimRequests:
        reqs = workload.requests
        prompts = tuple(r.prompt_tokens for r in reqs)
        outputs = tuple(r.output_tokens for r in reqs)
        cached = _prefix_hits(reqs, shared_prefix_len) if prefix_cache else (0,) * len(reqs)
        return cls(tuple(r.arrival_s for r in reqs), prompts, outputs, cached, workload.native_rate)


def build_requests(config: WorkloadConfig, prefix_cache: bool = False, max_context: int | None = None) -> SimRequests:
    """Build the benchmark workload for `config` and view it as simulator columns; with
    `max_context`, conditioned on prompt + output <= max_context (module contract)."""
    requests = SimRequests.from_workload(build_workload(config, content=False), prefix_cache, config.shared_prefix_len)
    if max_context is None or _fit(requests, max_context) == len(requests):
        return requests
    if config.trace_path is not None or config.num_conversations > 0:
        kind = "trace" if config.trace_path is not None else "multi-turn workload"
        raise ValueError(f"{len(requests) - _fit(requests, max_context)} of the {kind}'s requests exceed the model's "
                         f"context window of {max_context} tokens (prompt + output)")
    return _within_context(config, requests, max_context, prefix_cache)


def _fit(requests: SimRequests, max_context: int) -> int:
    return sum(p + o <= max_context for p, o in zip(requests.prompt_tokens, requests.output_tokens))


def _within_context(config: WorkloadConfig, requests: SimRequests, max_context: int, prefix_cache: bool) -> SimRequests:
    """`requests`' arrivals with the first len(requests) length pairs that fit, from larger draws."""
    n = len(requests)
    for factor in (2, 4, 16, 64):
        more = SimRequests.from_workload(build_workload(dataclasses.replace(config, num_requests=factor * n), content=False),
                                         prefix_cache, config.shared_prefix_len)
        keep = [i for i in range(len(more)) if more.prompt_tokens[i] + more.output_tokens[i] <= max_context][:n]
        if len(keep) == n:
            pick = lambda col: tuple(col[i] for i in keep)  # noqa: E731
            return dataclasses.replace(requests, prompt_tokens=pick(more.prompt_tokens), output_tokens=pick(more.output_tokens),
                                       cached_tokens=pick(more.cached_tokens))
    raise ValueError(f"almost no request of this workload fits the model's context window of {max_context} tokens "
                     "(prompt + output)")


def _prefix_hits(reqs, shared_prefix_len: int) -> tuple[int, ...]:
    """Cached rows per request: shared prefix, or the whole previous turn of its conversation."""
    previous_total: dict[int, int] = {}
    hits = []
    for r in reqs:
        hit = previous_total.get(r.conversation_id, shared_prefix_len) if r.turn > 0 else shared_prefix_len
        hits.append(min(hit, r.prompt_tokens - 1))
        previous_total[r.conversation_id] = r.prompt_tokens + r.output_tokens
    return tuple(hits)


def records(
    requests: SimRequests,
    arrivals_s: Sequence[float],
    first_token_s: Sequence[float],
    finish_s: Sequence[float],
    rejected: Sequence[bool],
) -> list[RequestRecord]:
    """One `RequestRecord` per request (absolute simulated times in, latencies out).

    Simulated streams carry no per-token gaps, so `itls_s` stays empty: TPOT is exact, ITL
    statistics are not produced.
    """
    out = []
    prompts, outputs = requests.prompt_tokens, requests.output_tokens
    for i, arrival in enumerate(arrivals_s):
        if rejected[i]:
            out.append(failed_record(i, arrival, REJECTED_KV))
            continue
        # positional: (request_id, arrival_s, success, ttft_s, e2e_s, itls_s, output_tokens, prompt_tokens)
        out.append(RequestRecord(i, arrival, True, first_token_s[i] - arrival, finish_s[i] - arrival, (), outputs[i], prompts[i]))
    return out
