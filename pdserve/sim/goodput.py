"""Simulated goodput: the benchmark's own search, driven by the simulator instead of HTTP.

Contract: `goodput_rps(run, slo, ladder, definition)` measures attainment with
`pdserve.bench.metrics.attainment` on the records `run(rate)` returns and chooses rates with
`pdserve.bench.goodput.next_rate` / `result`, exactly as `pdserve bench --sweep` does, so a
simulated and a measured goodput differ only in where the records came from. Phase-only runs
(`prefill_records`, `decode_records`) isolate one clock: a prefill-only record has one output
token (no TPOT to miss); a decode-only record has TTFT 0 (its first token is the handoff).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from pdserve.bench.goodput import SearchPlan, geometric_ladder, next_rate, result
from pdserve.bench.metrics import Attainment, Slo, attainment
from pdserve.bench.records import RequestRecord
from pdserve.sim.decode_pool import DecodeLimits, run_decode_instance
from pdserve.latency.base import LatencyModel
from pdserve.sim.prefill_pool import PrefillPolicy, run_prefill_pool
from pdserve.sim.requests import SimRequests

RecordsAt = Callable[[float], Sequence[RequestRecord]]


@dataclass(frozen=True)
class GoodputSearch:
    """The answer and every (rate -> attainment) point measured on the way."""

    rate: float
    saturated: bool
    points: dict[float, Attainment]


def ladder_around(estimate_rps: float, factor: float = 2.0) -> tuple[float, ...]:
    """A sweep ladder from estimate/4 to past 2 x estimate; a saturated search extends it."""
    base = max(estimate_rps, 1e-6)
    return geometric_ladder(base / 4, base * 2, factor)


def goodput_rps(run: RecordsAt, slo: Slo, ladder: Sequence[float], definition: str = "joint", rel_tol: float = 0.05,
                max_extensions: int = 4) -> GoodputSearch:
    """Largest simulated rate meeting `slo` under `definition` ("joint" or "phase").

    When every ladder rate passes, the ladder is extended upward (x4 per extension, reusing
    every point) so an estimate that was too low does not cap the answer.
    """
    points: dict[float, Attainment] = {}
    ladder = tuple(ladder)
    for _ in range(max_extensions + 1):
        plan = SearchPlan(ladder=ladder, target=slo.attainment, rel_tol=rel_tol)
        while (rate := next_rate(points, plan, definition)) is not None:
            points[rate] = attainment(run(rate), slo)
        found = result(points, plan, definition)
        if not found.saturated:
            break
        ladder = ladder + tuple(ladder[-1] * 2 ** k for k in (1, 2))
    return GoodputSearch(found.rate, found.saturated, points)


def prefill_records(requests: SimRequests, model: LatencyModel, policy: PrefillPolicy) -> RecordsAt:
    """Records of one prefill instance alone: TTFT only."""
    new = [p - c for p, c in zip(requests.prompt_tokens, requests.cached_tokens)]

    def run(rate: float) -> list[RequestRecord]:
        arrivals = requests.arrivals_at(rate)
        order = sorted(range(len(arrivals)), key=arrivals.__getitem__)
        out = run_prefill_pool(arrivals, order, new, requests.cached_tokens, model, 1, policy)
        return [
            RequestRecord(request_id=i, arrival_s=a, success=True, ttft_s=d - a, e2e_s=d - a, output_tokens=1)
            for i, (a, d) in enumerate(zip(arrivals, out.done_s))
        ]

    return run


def decode_records(requests: SimRequests, model: LatencyModel, max_seqs: int) -> RecordsAt:
    """Records of one decode instance alone, fed at the arrival rate: TPOT only."""
    limits = DecodeLimits(max_seqs, model.kv_capacity_tokens)
    outputs = requests.output_tokens

    def run(rate: float) -> list[RequestRecord]:
        arrivals = requests.arrivals_at(rate)
        order = sorted((i for i in range(len(arrivals)) if outputs[i] > 1), key=arrivals.__getitem__)
        ready = [arrivals[i] for i in order]
        finish = run_decode_instance(ready, order, requests.prompt_tokens, outputs, model, limits).finish_s
        return [
            RequestRecord(request_id=i, arrival_s=a, success=True, ttft_s=0.0,
                          e2e_s=finish.get(i, a) - a, output_tokens=outputs[i])
            for i, a in enumerate(arrivals)
        ]

    return run
