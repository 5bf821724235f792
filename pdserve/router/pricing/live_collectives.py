"""A served TP worker's collectives priced from what its rank 0 spends, live (issue 23).

Contract: every heartbeat of a TP N > 1 worker carries, per phase, the steps rank 0 ran since the
previous one, their rows and its wall seconds inside their all_reduces and step broadcasts
(engine/tp_tally.py `CollectiveReport`). `LiveCollectives.fold(worker, tp, report)` folds each
phase's window into that worker's `PhaseFit` and, once the phase has shown `min_steps` steps,
prices the worker with the collectives its own steps show instead of the profile's (or the
documented defaults): `TpPricing.worker(tp, prefill_live, decode_live)`, which is
`TpScaling.price`'s one formula, o(N, rows) = K (alpha + rows B beta) + sync with the live alpha,
beta and sync in place of the measured ones at N. It returns the worker's new `CostModel` when a
window moved the estimate (None otherwise: nothing to re-price), and `cost(worker)` is the
current one (None: the worker is priced by its TP size alone, as every TP 1 worker always is);
`pair(p, p_tp, d, d_tp)` is a route's pair with each worker's live phases (the P/D decision and
the plan's predicted clocks).

The fit (`PhaseFit`): the least squares line "all_reduce seconds per step = a + b x rows" over
every step reported (a window carries its steps' sums of rows, rows^2, seconds and rows x
seconds), the sums decayed so that a window's steps weigh half after `half_life_steps` newer
steps of their phase (a window without steps decays nothing: an idle worker keeps its estimate).
When the rows per step hardly vary (coefficient of variation under `MIN_SPREAD`: a steady decode
batch) the slope is not identifiable; it keeps the profile's (K B beta at N) and fits a alone. A
negative slope is 0 (a = the mean), a negative intercept 0 (b through the origin). Then
alpha = a / K, beta = b / (K B) and sync = the weighted broadcast seconds per step, so the
formula's o gives back a + b rows + sync. A window that is not finite, negative, or inconsistent
(rows or seconds without steps, fewer rows than steps, a sum of squares or of rows x seconds no
set of steps could have) is ignored and counted by reason; so is a report from a TP 1 worker
that claims steps.
`forget(worker)` drops a worker's fits (a new epoch starts from the profile) and says whether it
had a live price. A report at another TP size than the worker's fits were made at starts it
afresh; when that drops a live price `fold` answers `WITHDRAWN` (unless the new size's window
prices it at once): the caller prices the worker at its TP size again.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from enum import Enum

from pdserve.engine.tp_tally import PHASES, CollectiveReport, PhaseCollectives
from pdserve.latency.tp_collectives import CollectiveCosts
from pdserve.router.pricing.cost import CostModel
from pdserve.router.pricing.tp_pricing import TpPricing

MIN_STEPS = 8  # steps a phase must show before its live collectives replace the profile's
HALF_LIFE_STEPS = 32.0  # a step's weight in the fit halves after this many newer steps of its phase
MIN_SPREAD = 0.25  # rows per step must vary by this coefficient of variation to fit a slope
ROUNDING = 1e-9  # relative slack on the float sums' bounds (window_fault)


class Repricing(Enum):
    WITHDRAWN = "withdrawn"  # fold dropped the worker's live price: price it at its TP size again


WITHDRAWN = Repricing.WITHDRAWN
REASONS = ("not_finite", "negative", "inconsistent", "not_tp")


@dataclass(frozen=True)
class PhaseFit:
    """One phase's decayed sums over its steps (module docstring), r a step's rows and y its
    all_reduce seconds: weight N = sum 1, rows SR = sum r, rows_sq SRR = sum r^2, reduce_s
    SY = sum y, rows_reduce SRY = sum r y, broadcast_s = sum of the broadcast seconds;
    `num_steps` counts every step seen, undecayed."""

    weight: float = 0.0
    rows: float = 0.0
    rows_sq: float = 0.0
    reduce_s: float = 0.0
    rows_reduce: float = 0.0
    broadcast_s: float = 0.0
    num_steps: int = 0

    def folded(self, window: PhaseCollectives, half_life_steps: float) -> PhaseFit:
        """These sums aged by the window's steps, plus the window."""
        w = window
        if w.steps == 0:
            return self
        keep = 0.5 ** (w.steps / half_life_steps)
        return PhaseFit(keep * self.weight + w.steps, keep * self.rows + w.rows, keep * self.rows_sq + w.rows_sq,
                        keep * self.reduce_s + w.reduce_s, keep * self.rows_reduce + w.rows_reduce_s,
                        keep * self.broadcast_s + w.broadcast_s, self.num_steps + w.steps)

    def line(self, profile_slope: float) -> tuple[float, float]:
        """(a, b): all_reduce seconds per step = a + b x rows (module docstring)."""
        n, sr, sy = self.weight, self.rows, self.reduce_s
        mean = sr / n
        spread = self.rows_sq - sr * sr / n  # N x the weighted variance of rows per step
        if spread > n * (MIN_SPREAD * mean) ** 2:
            b = (self.rows_reduce - sr * sy / n) / spread
            a = (sy - b * sr) / n
            if b < 0:
                return sy / n, 0.0
            if a < 0:
                return 0.0, self.rows_reduce / self.rows_sq
            return a, b
        a = (sy - profile_slope * sr) / n
        return (a, profile_slope) if a >= 0 else (0.0, sy / sr)

    def sync_s(self) -> float:
        return self.broadcast_s / self.weight


def window_fault(window: PhaseCollectives) -> str | None:
    """Why a window cannot be folded (one of REASONS), None when it can (an empty one included)."""
    w = window
    if not all(math.isfinite(x) for x in (w.reduce_s, w.broadcast_s, w.rows_reduce_s)):
        return "not_finite"
    if min(w.steps, w.rows, w.rows_sq, w.reduce_s, w.broadcast_s, w.rows_reduce_s) < 0:
        return "negative"
    if w.steps == 0:
        return "inconsistent" if (w.rows, w.rows_sq, w.reduce_s, w.broadcast_s, w.rows_reduce_s) != (0, 0, 0, 0, 0) else None
    # every step has a row; the rows' squares are at least their mean's (and at most the whole's);
    # rows x seconds is at least the seconds (a row a step) and at most rows x the seconds (float
    # sums: a relative ROUNDING slack)
    if w.rows < w.steps or not w.rows * w.rows <= w.rows_sq * w.steps <= w.rows * w.rows * w.steps:
        return "inconsistent"
    slack = 1.0 + ROUNDING
    if not w.reduce_s <= w.rows_reduce_s * slack or not w.rows_reduce_s <= w.rows * w.reduce_s * slack:
        return "inconsistent"
    return None


@dataclass
class _Worker:
    tp: int
    fits: dict[str, PhaseFit] = field(default_factory=lambda: {p: PhaseFit() for p in PHASES})
    ignored: Counter = field(default_factory=Counter)
    cost: CostModel | None = None
    live: tuple[CollectiveCosts | None, CollectiveCosts | None] = (None, None)  # (prefill, decode) priced in `cost`


class LiveCollectives:
    """Per worker: both phases' fits and its live price; ignored windows counted by reason."""

    def __init__(self, pricing: TpPricing, min_steps: int = MIN_STEPS, half_life_steps: float = HALF_LIFE_STEPS):
        if min_steps < 1 or half_life_steps <= 0:
            raise ValueError(f"need min_steps >= 1 and half_life_steps > 0, got {min_steps}, {half_life_steps}")
        self.pricing, self.min_steps, self.half_life_steps = pricing, min_steps, half_life_steps
        self._workers: dict[str, _Worker] = {}
        self._pairs: dict[tuple[str, str], tuple[tuple, tuple, CostModel]] = {}  # pair(): (P's live, D's live, cost)
        self.num_ignored: Counter[str] = Counter()
        self.num_live = 0  # workers priced from their own collectives

    def fold(self, worker_id: str, tp: int, report: CollectiveReport) -> CostModel | Repricing | None:
        """Fold one report of a TP `tp` worker; -> its new live price, WITHDRAWN when a change of
        TP size dropped its live price, None when nothing moved."""
        withdrawn = None
        worker = self._workers.get(worker_id)
        if worker is not None and worker.tp != tp:
            withdrawn = WITHDRAWN if self.forget(worker_id) else None
            worker = None
        if tp < 2:
            if any(report.phase(p).steps for p in PHASES):
                self._ignore(None, "not_tp")
            return withdrawn
        if worker is None:
            worker = self._workers[worker_id] = _Worker(tp)
        moved = False
        for phase in PHASES:
            window = report.phase(phase)
            fault = window_fault(window)
            if fault is not None:
                self._ignore(worker, fault)
            elif window.steps:
                worker.fits[phase] = worker.fits[phase].folded(window, self.half_life_steps)
                moved = True
        live = tuple(self.live_costs(worker_id, p) for p in PHASES)
        if not moved or live == (None, None):
            return withdrawn
        self.num_live += worker.cost is None
        worker.cost, worker.live = self.pricing.worker(tp, *live), live
        return worker.cost

    def pair(self, prefill_id: str, prefill_tp: int, decode_id: str, decode_tp: int) -> CostModel:
        """A route's pair at its workers' sizes (TpPricing.pair), each phase priced with its own
        worker's live collectives where it has them (a local prefill on the decode worker with the
        decode worker's); cached until either worker's estimate moves."""
        p_live, d_live = self._live_of(prefill_id), self._live_of(decode_id)
        if p_live == d_live == (None, None):
            return self.pricing.pair(prefill_tp, decode_tp)
        hit = self._pairs.get((prefill_id, decode_id))
        if hit is not None and hit[0] is p_live and hit[1] is d_live:
            return hit[2]
        cost = self.pricing.pair(prefill_tp, decode_tp, (p_live[0], d_live[1], d_live[0]))
        self._pairs[(prefill_id, decode_id)] = (p_live, d_live, cost)
        return cost

    def _live_of(self, worker_id: str) -> tuple[CollectiveCosts | None, CollectiveCosts | None]:
        worker = self._workers.get(worker_id)
        return (None, None) if worker is None else worker.live

    def live_costs(self, worker_id: str, phase: str) -> CollectiveCosts | None:
        """The collectives the worker's `phase` steps show, once it has shown `min_steps` of them."""
        worker = self._workers.get(worker_id)
        if worker is None or worker.fits[phase].num_steps < self.min_steps:
            return None
        fit, scaling = worker.fits[phase], self.pricing.scaling
        k, row_bytes = 2 * scaling.num_layers, scaling.row_bytes
        if k == 0 or row_bytes == 0:
            return None  # a model without layers or rows has no collectives to price
        profile = scaling.costs_at(worker.tp)
        a, b = fit.line(k * row_bytes * profile.allreduce_s_per_byte)
        return CollectiveCosts(tp=worker.tp, pinned=profile.pinned, allreduce_s=a / k,
                               allreduce_s_per_byte=b / (k * row_bytes), step_sync_s=fit.sync_s())

    def cost(self, worker_id: str) -> CostModel | None:
        worker = self._workers.get(worker_id)
        return None if worker is None else worker.cost

    def forget(self, worker_id: str) -> bool:
        """Drop the worker's fits; -> whether it had a live price."""
        worker = self._workers.pop(worker_id, None)
        had_cost = worker is not None and worker.cost is not None
        self.num_live -= had_cost
        self._pairs = {key: hit for key, hit in self._pairs.items() if worker_id not in key}
        return had_cost

    def view(self, worker_id: str) -> dict:
        """GET /workers: per phase the steps seen and, once live, the priced o's terms (ms)."""
        worker = self._workers.get(worker_id)
        if worker is None:
            return {}
        out: dict = {"ignored": dict(worker.ignored)}
        for phase in PHASES:
            row: dict = {"steps": worker.fits[phase].num_steps, "live": False}
            costs = self.live_costs(worker_id, phase)
            if costs is not None:
                o = self.pricing.scaling.overhead(worker.tp, costs)
                row.update(live=True, step_ms=o.fixed_s * 1e3, row_ms=o.per_row_s * 1e3, sync_ms=costs.step_sync_s * 1e3)
            out[phase] = row
        return out

    def _ignore(self, worker: _Worker | None, reason: str) -> None:
        self.num_ignored[reason] += 1
        if worker is not None:
            worker.ignored[reason] += 1
