"""Live K/V placement rates for the router's cost model (issue 19, parts 2, 4 and 5).

Contract: `KvRates` turns what the runtime observed into the cost model's three placement terms
(router/pricing/cost.py `fetch_bytes_per_s`, `fetch_overhead_s`, `host_copy_bytes_per_s`); nothing else
in the cost model changes.
- `observe_link(bytes, link_s)`: a holder's FetchDone (bytes over the time its sender moved
  them) -> the fetch link bandwidth, an EWMA with weight `weight` (the first sample sets it).
- `observe_fetch(base, bytes, wall_s, same_host)`: a landed fetch's router wall time (plan to
  the destination's FetchDone) -> the per-fetch overhead sample `wall_s - fetch_s(bytes)` at the
  current bandwidth without overhead (clamped at 0: what the link time does not explain, the
  reserve/serve/done round trips and the holder's wait for its engine step). The overhead is the
  median of the last `window` samples no older than `max_age_s`: not an EWMA, because one
  fetch that waited seconds behind a busy holder would price every later fetch above its
  recompute, so none would run and re-measure it (seen live: one 3.8 s sample turned every later
  fetch of a run into a recompute); a median sheds it, and with every sample aged out the
  overhead is unmeasured again, so the next fetch measures afresh.
- `observe_host_copies(bytes, seconds)`: the workers' cumulative host-tier copy bytes and
  seconds (their loads; a calibration copy at start, then every promotion) -> the host -> pool
  copy rate, their ratio.
- `cost(base)` is `base` with the measured terms in place of its own (unmeasured ones keep
  `base`'s); the same object until a rate changes, so callers may compare by identity. Only a
  `fitted` base (prefill and decode measured on this machine) takes them: a fetch or promotion
  is weighed against the prefill it saves, and this machine's fetch times against a placeholder
  prefill (a GPU's 10k tokens/s) would call every fetch too slow (seen live: colocated serving,
  unfitted, recomputed 14-block histories a fetch moved in 40 ms, and its TTFT gain fell from
  3.2x to 1.8x). An unfitted base stays whole, placeholders against placeholders.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace

from pdserve.router.pricing.cost import CostModel

WEIGHT = 0.3  # EWMA weight of a new link-rate sample
WINDOW = 8  # overhead samples kept
MAX_AGE_S = 60.0  # an overhead sample older than this no longer counts


class KvRates:
    def __init__(self, weight: float = WEIGHT, window: int = WINDOW, max_age_s: float = MAX_AGE_S,
                 clock: Callable[[], float] = time.monotonic):
        if not 0 < weight <= 1 or window < 1 or max_age_s <= 0:
            raise ValueError(f"need 0 < weight <= 1, window >= 1, max_age_s > 0; got {weight}, {window}, {max_age_s}")
        self.weight, self.max_age_s, self.clock = weight, max_age_s, clock
        self.link_bytes_per_s: float | None = None
        self._overheads: deque[tuple[float, float]] = deque(maxlen=window)  # (observed at, seconds)
        self.host_copy_bytes_per_s: float | None = None
        # id(base) -> (base, with the rates): the deployment's model and each TP size's (router/pricing/tp_pricing.py)
        self._cached: dict[int, tuple[CostModel, CostModel]] = {}

    def _ewma(self, old: float | None, sample: float) -> float:
        return sample if old is None else old + self.weight * (sample - old)

    def observe_link(self, nbytes: int, link_s: float) -> None:
        if nbytes > 0 and link_s > 0:
            self.link_bytes_per_s = self._ewma(self.link_bytes_per_s, nbytes / link_s)
            self._cached.clear()

    def observe_fetch(self, base: CostModel, nbytes: int, wall_s: float, same_host: bool) -> float | None:
        """Fold one landed fetch into the overhead; returns the sample (None: nothing moved)."""
        if nbytes <= 0:
            return None
        link_only = replace(self.cost(base), fetch_overhead_s=0.0)
        sample = max(0.0, wall_s - float(link_only.fetch_s(nbytes, int(same_host))))
        self._overheads.append((self.clock(), sample))
        self._cached.clear()
        return sample

    @property
    def overhead_s(self) -> float | None:
        """The median of the live overhead samples; None when none is younger than max_age_s."""
        self._age_out()
        return statistics.median(s for _, s in self._overheads) if self._overheads else None

    def _age_out(self) -> None:
        oldest = self.clock() - self.max_age_s
        while self._overheads and self._overheads[0][0] < oldest:
            self._overheads.popleft()
            self._cached.clear()

    def observe_host_copies(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0 and nbytes / seconds != self.host_copy_bytes_per_s:
            self.host_copy_bytes_per_s = nbytes / seconds
            self._cached.clear()

    def cost(self, base: CostModel) -> CostModel:
        self._age_out()
        if not base.fitted:
            return base
        hit = self._cached.get(id(base))
        if hit is not None and hit[0] is base:
            return hit[1]
        measured = {k: v for k, v in (("fetch_bytes_per_s", self.link_bytes_per_s), ("fetch_overhead_s", self.overhead_s),
                                      ("host_copy_bytes_per_s", self.host_copy_bytes_per_s)) if v is not None}
        cost = replace(base, **measured) if measured else base
        if len(self._cached) >= 16:  # a few bases live at once; never let a stream of fresh ones pile up
            self._cached.clear()
        self._cached[id(base)] = (base, cost)
        return cost

    def trace_fields(self) -> dict:
        """The rates a decision used (for the trace line)."""
        return {"fetch_link_bytes_per_s": self.link_bytes_per_s, "fetch_overhead_s": self.overhead_s,
                "host_copy_bytes_per_s": self.host_copy_bytes_per_s}
