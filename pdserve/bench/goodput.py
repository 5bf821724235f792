"""Goodput: the largest offered rate whose attainment is at least p, by sweep plus bisection.

The search is pure. `next_rate(points, plan, definition)` looks at every (rate -> Attainment)
measured so far and names the next rate to measure, or None when the answer is settled; any
driver (the HTTP benchmark, the planner's simulator, an interleaved A/B comparison) measures that
rate and adds the point. Points are shared between the two definitions:

- "joint": attainment of both clocks per request >= p;
- "phase": the separate-phase (DistServe) contract, TTFT attainment >= p AND TPOT attainment >= p,
  each marginal. Joint passing implies phase passing, so phase goodput >= joint goodput.

Procedure: measure the ladder rates in increasing order until one fails (the sweep); then bisect
between the largest passing measured rate below that failure (or 0) and the smallest failing
measured rate, until the bracket is within `rel_tol` of its top or `max_bisections` midpoints lie
between the bracket's ladder floor and the first failing ladder rate (so the search always ends). The goodput is the largest passing measured rate below the first
failure, so it is always a rate that was actually measured to pass; attainment is assumed to fall
with load, and a pass above a failure is ignored. If every ladder rate passes, the result is
marked `saturated` (a lower bound: raise the ladder).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from pdserve.bench.metrics import Attainment

DEFINITIONS = ("joint", "phase")


@dataclass(frozen=True)
class SearchPlan:
    """Sweep ladder (increasing req/s), the required attainment p, and bisection limits."""

    ladder: tuple[float, ...]
    target: float = 0.9
    rel_tol: float = 0.05
    max_bisections: int = 6

    def __post_init__(self) -> None:
        if not self.ladder or any(b <= a for a, b in zip(self.ladder, self.ladder[1:])):
            raise ValueError("sweep ladder must be non-empty and strictly increasing")
        if self.ladder[0] <= 0:
            raise ValueError("sweep rates must be > 0")


@dataclass(frozen=True)
class GoodputResult:
    """One definition's goodput (req/s; 0.0 if no measured rate passed)."""

    definition: str
    rate: float
    saturated: bool
    lowest_failing_rate: float | None


def geometric_ladder(start: float, stop: float, factor: float = 2.0) -> tuple[float, ...]:
    """start, start*factor, ... up to and including the first value >= stop."""
    if start <= 0 or factor <= 1 or stop < start:
        raise ValueError("need 0 < start <= stop and factor > 1")
    rates = [start]
    while rates[-1] < stop:
        rates.append(rates[-1] * factor)
    return tuple(rates)


def passes(attainment: Attainment, definition: str, target: float) -> bool:
    """Whether one measurement meets `definition` at attainment `target`."""
    if definition == "joint":
        return attainment.meets_joint(target)
    if definition == "phase":
        return attainment.meets_phase(target)
    raise ValueError(f"definition must be one of {DEFINITIONS}")


def next_rate(points: Mapping[float, Attainment], plan: SearchPlan, definition: str) -> float | None:
    """The next rate to measure for `definition`, or None when its goodput is settled."""
    first_fail = _first_failing_ladder_rate(points, plan, definition)
    if first_fail is None:
        return next((r for r in plan.ladder if r not in points), None)
    lo, hi = _bracket(points, plan, definition)
    step_lo = max((r for r in plan.ladder if r < hi), default=0.0)
    inside = sum(1 for r in points if step_lo < r < first_fail and r not in plan.ladder)
    if inside >= plan.max_bisections or hi - lo <= plan.rel_tol * hi:
        return None
    return (lo + hi) / 2


def next_rate_any(points: Mapping[float, Attainment], plan: SearchPlan) -> float | None:
    """The next rate either definition still needs (joint first)."""
    for definition in DEFINITIONS:
        rate = next_rate(points, plan, definition)
        if rate is not None:
            return rate
    return None


def result(points: Mapping[float, Attainment], plan: SearchPlan, definition: str) -> GoodputResult:
    """The goodput `points` establish for `definition` (call once `next_rate` is None)."""
    if _first_failing_ladder_rate(points, plan, definition) is None:
        passing = [r for r, a in points.items() if passes(a, definition, plan.target)]
        return GoodputResult(definition, max(passing, default=0.0), True, None)
    lo, hi = _bracket(points, plan, definition)
    return GoodputResult(definition, lo, False, hi)


def search_goodput(
    evaluate: Callable[[float], Attainment], plan: SearchPlan
) -> tuple[dict[str, GoodputResult], dict[float, Attainment]]:
    """Drive the search with `evaluate(rate)`; returns (results by definition, all points)."""
    points: dict[float, Attainment] = {}
    while (rate := next_rate_any(points, plan)) is not None:
        points[rate] = evaluate(rate)
    return {d: result(points, plan, d) for d in DEFINITIONS}, points


def _first_failing_ladder_rate(points, plan: SearchPlan, definition: str) -> float | None:
    """The first ladder rate measured to fail, if the sweep has reached one."""
    for rate in plan.ladder:
        if rate not in points:
            return None
        if not passes(points[rate], definition, plan.target):
            return rate
    return None


def _bracket(points, plan: SearchPlan, definition: str) -> tuple[float, float]:
    """(largest passing rate below the smallest failing rate, that failing rate)."""
    failing = [r for r, a in points.items() if not passes(a, definition, plan.target)]
    hi = min(failing)
    lo = max((r for r, a in points.items() if r < hi and passes(a, definition, plan.target)), default=0.0)
    return lo, hi
