"""How fast the served engine ran in a time window, measured by its own steps against a profile.

Contract: `step_speed(profile, records)` compares every engine step of a window (the workers'
step logs, engine/step_log.py) with the time the profiled latency model gives the same step
shape, and returns one factor per phase (measured / modelled; 1.0 = the profile's speed, 1.2 =
20% slower). A step's modelled time splits into a prefill-form part P (the prompt rows, and in a
colocated step the decode rows the profile costs with the prefill form) and a decode-form part
D (a decode step; the context term of a colocated step), so `calibrate.scaled(profile, p, d)`
costs it p * P + d * D. The factors are ratios of sums, alternated a few rounds:
p = sum(seconds - d * D) / sum(P) over the steps with P > 0, d = sum(seconds) / sum(D) over the
decode-only steps (over every step with D > 0 when there is none). A phase without a step in the
window gets None. Sums, not medians: a step's time varies +-15% on a shared machine, and what a
window's requests waited for is the time its steps took in all, a stalled step included; the
ratio of sums is the profile scaled to that total.

`drift(profile, window, reference)` says how much slower one window ran than another, per phase,
comparing like with like: steps are grouped by shape class and only classes both windows ran
are compared (see its docstring).

Why: step times are the engine's own clock. Unlike request latencies they do not contain
queueing, so a factor fitted to them measures the machine, not the simulator being checked
(validate_windows.py uses them to carry a calibration across the minutes to its benchmark).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pdserve.engine.step_log import StepRecord
from pdserve.latency.base import causal_pairs
from pdserve.latency.profiled import ProfiledLatency

ROUNDS = 4


@dataclass(frozen=True)
class StepSpeed:
    """Per-phase speed factors of one window (None: no step of that phase) and the step counts."""

    prefill_factor: float | None
    decode_factor: float | None
    prefill_steps: int
    decode_steps: int

    def to_dict(self) -> dict:
        return {"prefill_factor": self.prefill_factor, "decode_factor": self.decode_factor,
                "prefill_steps": self.prefill_steps, "decode_steps": self.decode_steps}


def modelled_parts(profile: ProfiledLatency, step: StepRecord) -> tuple[float, float]:
    """(P, D): the prefill-form and decode-form seconds the profile gives this step's shape."""
    if step.new and step.batch:  # colocated iteration: the mixed-step form
        pairs = sum(causal_pairs(n, k) for n, k in zip(step.new, step.cached))
        total = profile.mixed_step_s(sum(step.new), pairs, 0, 0.0, step.batch, step.context)
        decode = profile.decode_coef[2] * step.context
        return total - decode, decode
    if step.new:
        return profile.prefill_batch_s(step.new, step.cached), 0.0
    return 0.0, profile.decode_step_s(step.batch, step.context)


def step_speed(profile: ProfiledLatency, records: Sequence[StepRecord]) -> StepSpeed:
    """The window's per-phase factors against `profile` (see the module contract)."""
    parts = [(r.seconds, *modelled_parts(profile, r)) for r in records]
    prefill = [(s, p, d) for s, p, d in parts if p > 0]
    decode_only = [(s, d) for s, p, d in parts if p == 0 and d > 0]
    with_decode = [(s, p, d) for s, p, d in parts if d > 0]
    pf = df = None
    for _ in range(ROUNDS):  # alternate: each phase's factor shifts the other's residual a little
        if decode_only:
            df = sum(s for s, _ in decode_only) / sum(d for _, d in decode_only)
        elif with_decode:
            df = sum(s - (pf or 1.0) * p for s, p, _ in with_decode) / sum(d for _, _, d in with_decode)
        if prefill:
            pf = sum(s - (df or 0.0) * d for s, _, d in prefill) / sum(p for _, p, _ in prefill)
    if df is not None and df <= 0:
        df = None  # the decode term is too small against the prefill form to separate
    return StepSpeed(pf, df, len(prefill), len(with_decode))


def step_class(step: StepRecord) -> tuple:
    """Steps of one class have shapes the profile costs alike: a phase, the decode rows, and for
    prompt rows the number of requests and the chunk's position (which 512-token span it starts in)."""
    if not step.new:
        return ("decode", step.batch)
    return ("prefill", len(step.new), min(step.cached) // CHUNK_SPAN, step.batch)


CHUNK_SPAN = 512


def drift(profile: ProfiledLatency, window: Sequence[StepRecord], reference: Sequence[StepRecord]) -> tuple[float, float]:
    """(prefill, decode): how much slower `window` ran than `reference`, on matched shapes.

    Per step class (`step_class`) the speed is its total time over its modelled total; a class's
    drift is the window's speed over the reference's, and a phase's drift is the mean of its
    classes' drifts weighted by the window's modelled time in each (classes in only one of the two
    windows are left out; a phase with no class in both gets 1.0). Matching shapes keeps the
    profile's own shape errors out of the drift: a window with more 3-row decode steps than its
    reference is not "faster" because the profile happens to overcost 3-row steps; that error
    stays with the prediction being checked."""
    def speeds(records: Sequence[StepRecord]) -> dict[tuple, tuple[float, float]]:
        out: dict[tuple, list[float]] = {}
        for r in records:
            p, d = modelled_parts(profile, r)
            acc = out.setdefault(step_class(r), [0.0, 0.0])
            acc[0] += r.seconds
            acc[1] += p + d
        return {c: (t / m, m) for c, (t, m) in out.items() if m > 0}

    ours, theirs = speeds(window), speeds(reference)
    result = []
    for phase in ("prefill", "decode"):
        common = [(ours[c][0] / theirs[c][0], ours[c][1]) for c in ours if c[0] == phase and c in theirs]
        weight = sum(w for _, w in common)
        result.append(sum(q * w for q, w in common) / weight if weight > 0 else 1.0)
    return result[0], result[1]
