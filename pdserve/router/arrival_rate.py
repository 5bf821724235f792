"""The router's recent request arrival rate, which the per-request P/D decision reads (pd_decision.py)."""

from __future__ import annotations

import math


class ArrivalRate:
    """Requests per second, exponentially weighted over `window_s`: each arrival adds 1/window
    and the sum decays with time constant `window_s` (a steady Poisson stream of rate r settles
    at r)."""

    def __init__(self, window_s: float = 20.0):
        self.window_s, self._value, self._at = window_s, 0.0, None

    def _decay_to(self, now_s: float) -> None:
        if self._at is not None:
            self._value *= math.exp(-max(0.0, now_s - self._at) / self.window_s)
        self._at = now_s

    def observe(self, now_s: float) -> None:
        self._decay_to(now_s)
        self._value += 1.0 / self.window_s

    def reset(self, rate_rps: float, now_s: float) -> None:
        """Start from a known steady rate (tests, a planner's operating point)."""
        self._value, self._at = rate_rps, now_s

    def rate(self, now_s: float) -> float:
        self._decay_to(now_s)
        return self._value
