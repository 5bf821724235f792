"""Open-loop arrival processes, generated at unit rate and scaled to any offered rate.

Contract: `unit_arrivals_s(spec, rng, n)` returns n non-decreasing times whose mean gap is one
second and whose first arrival is at 0; dividing by a rate R gives the same process at R req/s.
Generating once and scaling keeps a rate sweep on one seeded schedule: only the time axis changes.

- poisson: exponential gaps (coefficient of variation 1);
- gamma: gamma gaps with coefficient of variation `burstiness_cv` (CV > 1 is burstier than
  Poisson, CV < 1 smoother, CV = 1 is Poisson). Note vLLM's `--burstiness` is the gamma *shape*
  k = 1 / CV**2, not the CV;
- constant: evenly spaced;
- trace: times taken from a trace (see `trace.py`), normalised here to unit rate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

ARRIVAL_KINDS = ("poisson", "gamma", "constant", "trace")


@dataclass(frozen=True)
class ArrivalSpec:
    """Which arrival process, and its burstiness (used by gamma only)."""

    kind: str = "poisson"
    burstiness_cv: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in ARRIVAL_KINDS:
            raise ValueError(f"arrival must be one of {ARRIVAL_KINDS}, got {self.kind!r}")
        if self.burstiness_cv <= 0:
            raise ValueError("burstiness CV must be > 0")


def unit_arrivals_s(spec: ArrivalSpec, rng: np.random.Generator, n: int) -> np.ndarray:
    """n arrival times at a mean rate of 1 request/s, the first at 0."""
    if n <= 0:
        return np.zeros(0)
    if spec.kind == "trace":
        raise ValueError("trace arrivals come from the trace file")
    gaps = _unit_gaps(spec, rng, n - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


def scale_to_rate(unit_times_s: np.ndarray, rate: float) -> np.ndarray:
    """Times of a unit-rate schedule at `rate` req/s; an infinite rate sends everything at 0."""
    if rate <= 0:
        raise ValueError("rate must be > 0")
    if math.isinf(rate):
        return np.zeros_like(unit_times_s)
    return np.asarray(unit_times_s, dtype=float) / rate


def normalise_trace_times(times_s: np.ndarray) -> tuple[np.ndarray, float]:
    """(unit-rate times, the trace's own rate) for recorded arrival times.

    The trace's rate is (n - 1) / span, so `scale_to_rate(unit, native_rate)` replays it as
    recorded (shifted to start at 0).
    """
    times = np.sort(np.asarray(times_s, dtype=float))
    shifted = times - times[0]
    span_s = float(shifted[-1]) if len(shifted) else 0.0
    if len(times) < 2 or span_s <= 0:
        return np.zeros_like(shifted), math.inf
    native_rate = (len(times) - 1) / span_s
    return shifted * native_rate, native_rate


def _unit_gaps(spec: ArrivalSpec, rng: np.random.Generator, n: int) -> np.ndarray:
    if spec.kind == "constant":
        return np.ones(n)
    if spec.kind == "poisson":
        return rng.exponential(1.0, size=n)
    shape = 1.0 / spec.burstiness_cv**2
    return rng.gamma(shape, 1.0 / shape, size=n)
