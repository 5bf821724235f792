"""The decode workers' token clocks as the P/D decision reads them (issue 36, part 2).

Contract: `ItlWindows` keeps, per decode worker, the last `WINDOW` inter-token gaps its requests
had (the frontend observes each token item's gap from the request's previous item, sequence 0
only, from its second decode token on: the first gap holds the handoff or the local prefill);
`p90_s(worker)` is the batch's p90 inter-token latency (0 with no gap yet). `decode_budgets`
gives each live request decoding at a worker its own `DecodeBudget` (tokens so far, the time
since its first token, max_tokens left). Both reach the router once per heartbeat
(`PdSignals.note_decode_clocks`, router/policy/pd_signals.py); nothing here decides. Beside them, what the decision reads of the
recent traffic: `ArrivalRate` (requests per second) and `PromptLengths` (the median prompt).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable

import numpy as np

from pdserve.ledger.margin import DecodeBudget

WINDOW = 256  # gaps kept per decode worker


class ItlWindows:
    def __init__(self, window: int = WINDOW):
        self._gaps: dict[str, deque[float]] = {}
        self._window = window

    def observe(self, worker_id: str, gap_s: float) -> None:
        gaps = self._gaps.get(worker_id)
        if gaps is None:
            gaps = self._gaps[worker_id] = deque(maxlen=self._window)
        gaps.append(gap_s)

    def p90_s(self, worker_id: str) -> float:
        gaps = self._gaps.get(worker_id)
        return float(np.percentile(np.fromiter(gaps, float), 90)) if gaps else 0.0

    def forget(self, worker_id: str) -> None:
        self._gaps.pop(worker_id, None)


def decode_budgets(live_requests: Iterable, worker_id: str, now_s: float) -> tuple[DecodeBudget, ...]:
    """The budgets of the live requests decoding at `worker_id` (router/process/inflight.py's `InFlight`)."""
    out = []
    for live in live_requests:
        if live.decode_id != worker_id or live.done or live.first_token_s is None:
            continue
        done = len(live.output_ids)
        out.append(DecodeBudget(done, now_s - live.first_token_s, max(0, live.req.params.max_tokens - done)))
    return tuple(out)


# ---- the router's recent request arrival rate (the P/D decision reads it) ---------------------
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


# ---- the workload's recent prompt lengths (the P/D decision's default TTFT target reads them) ----
class PromptLengths:
    """The last `window` prompts' lengths in tokens; `median()` is the workload's typical prompt,
    which the default TTFT target is derived at (pd_decision.decision_slos): a short prompt is held
    to the workload's target, as a goodput benchmark holds every request to one, not to a fraction
    of a second its own idle prefill would suggest. 0 before any prompt."""

    def __init__(self, window: int = 256):
        self._lengths: deque[int] = deque(maxlen=window)
        self._median: int | None = 0

    def observe(self, prompt_tokens: int) -> None:
        self._lengths.append(prompt_tokens)
        self._median = None  # recomputed on the next read

    def median(self) -> int:
        if self._median is None:
            self._median = int(np.median(np.fromiter(self._lengths, float)))
        return self._median
