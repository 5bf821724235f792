"""The profile's decode cost per batch size, re-measured from the served engine's own steps.

Why: a `pdserve profile` decode point is a few timed steps of one (batch, context) shape, taken
minutes or days before a validation on a machine whose speed moves +-15% from second to second.
One bad point bends the per-batch curve (a 3-row step costed 1.5x a 1-row step where the engine
served it at 1.27x), and the simulator then spreads the requests' TPOT wider than the engine
does, which near a TPOT objective moves goodput by far more than the error in the mean. A served
calibration window holds hundreds to thousands of decode steps at exactly the batch sizes and
contexts the workload produces; their mean per batch size is the better estimate of the shape.

Contract: `served_profile(profile, steps)` returns the profile with its decode bases replaced:
for every batch size with at least `min_steps` decode-only steps in `steps`, base(b) = mean
step seconds - context coefficient x mean summed context (the profile's context coefficient is
kept: one window's contexts span too little to refit it). Batch sizes the window did not run
enough keep the profile's base, rescaled by the window's overall speed on the sizes it did run
(ratio of sums), so the level is the window's and the shape is the profile's where nothing was
served. The bases are then made non-decreasing in the batch (pool-adjacent-violators, weighted
by step counts; profile-only sizes weigh as `min_steps`): a larger decode batch never costs
less on one machine, and noise that says otherwise would make the simulator prefer it.
Prefill and mixed-step terms are untouched (their level is the calibration's prefill factor).
The returned profile is at the window's machine speed; `served_bases` is the same fit as data.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from pdserve.engine.step_log import StepRecord
from pdserve.latency.profiled import ProfiledLatency
from pdserve.validate.step_clock import step_speed

MIN_STEPS = 20  # a class mean of 20 steps at +-15% per step is good to about +-3.5%


def _context_s(profile: ProfiledLatency) -> float:
    return profile.decode_context_s if profile.decode_batch_base else profile.decode_coef[2]


def served_bases(profile: ProfiledLatency, steps: Sequence[StepRecord],
                 min_steps: int = MIN_STEPS) -> tuple[tuple[int, float, int], ...]:
    """((batch, base s, weight), ...) in increasing batch: served means where the window ran
    `min_steps` decode-only steps of that size, rescaled profile bases elsewhere, then pooled to
    non-decreasing (see the module contract). Empty when the window served no size enough."""
    if min_steps < 1:
        raise ValueError("min_steps must be >= 1")
    c = _context_s(profile)
    sums: dict[int, list[float]] = {}
    for s in steps:
        if s.batch and not s.new:
            acc = sums.setdefault(s.batch, [0, 0.0, 0])
            acc[0] += 1
            acc[1] += s.seconds
            acc[2] += s.context
    served = {b: (t - c * ctx) / n for b, (n, t, ctx) in sums.items() if n >= min_steps}
    if not served:
        return ()
    # the window's decode speed over the profile on the sizes it served (step_clock's ratio of sums)
    speed = step_speed(profile, [s for s in steps if not s.new and s.batch in served]).decode_factor or 1.0
    known = [b for b, _ in profile.decode_batch_base] or [1]
    points = {b: (profile.decode_step_s(b, 0) * speed, min_steps) for b in known if b not in served}
    points.update({b: (max(base, 0.0), sums[b][0]) for b, base in served.items()})
    return tuple((b, base, w) for b, (base, w) in zip(sorted(points), _pooled([points[b] for b in sorted(points)])))


def _pooled(values: list[tuple[float, int]]) -> list[tuple[float, int]]:
    """Weighted pool-adjacent-violators: the non-decreasing sequence nearest in weighted squares."""
    blocks: list[list[float]] = []  # [mean, weight, count]
    for value, weight in values:
        blocks.append([value, float(weight), 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m1, w1, n1), (m2, w2, n2) = blocks[-2], blocks.pop()
            blocks[-1] = [(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, n1 + n2]
    out = []
    for mean, _, count in blocks:
        out.extend([mean] * count)
    return [(mean, int(w)) for mean, (_, w) in zip(out, values)]


def served_profile(profile: ProfiledLatency, steps: Sequence[StepRecord],
                   min_steps: int = MIN_STEPS) -> ProfiledLatency:
    """The profile with its decode bases from the served steps (unchanged when none qualify)."""
    bases = served_bases(profile, steps, min_steps)
    if not bases:
        return profile
    meta = {**profile.meta, "served_decode_bases": [[b, t, w] for b, t, w in bases]}
    return dataclasses.replace(profile, decode_batch_base=tuple((b, t) for b, t, _ in bases),
                               decode_context_s=_context_s(profile), meta=meta)
