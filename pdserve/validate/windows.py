"""The validation check that holds each benchmark to a prediction for the machine it ran on.

Why: on a shared CPU the machine's speed moves 5-20% within minutes and goodput moves 2-5x as
much, so a prediction made before a benchmark is a prediction for a machine that may be gone by
the time the benchmark runs. The engine's step log (engine/step_log.py) says how fast it ran
while the benchmark ran; `step_clock.step_speed` turns that into per-phase factors without any
queueing in them, so scaling the calibrated model by the change of those factors between the
calibration and the benchmark predicts for the benchmark's own window without fitting anything
to the latencies being checked.

Contract: `check_windows` starts one server for `config` with its step logs on, then per point
k (at most `max_points`): runs a calibration load (`calibrator.measure`, salt k, at WINDOW_LOAD
of the latest calibrated prediction: near the bench's own load, so its window serves the decode
batch sizes the bench will; before point 0, a calibration at the default half load of the plan's
prediction gives the first one, since 0.9 of an uncalibrated prediction can overload), reads
the engine's steps of that window, reshapes the profile's decode cost per batch size from them
(`served_shape.served_profile`: the served per-batch costs differed from a lone-engine profile's
by up to 20%), fits the factors against the reshaped profile (`calibrator.fit`), benches one
rate and reads the bench window's steps. The window prediction is `live.predict(config,
p_cal * drift_p, d_cal * drift_d, shaped)`, drift being how much slower the bench window ran
than the calibration window on matched step shapes (`step_clock.drift`). A point bounds the
error ratio e = predicted / measured goodput *in its own window*: a pass at rate r means
measured >= r, so e <= pred_w / r; a fail means measured < r, so e > pred_w / r. `ErrorBounds`
intersects the points' bounds; the prediction is within T when 1 - T <= lower and
upper <= 1 + T.

Rates close the open side (the pass side first) around the calibrated prediction: a pass is
sought at pred / (1 + T/2), a fail at pred / (1 - T/2); after each miss on a side (a sought pass
that failed) its aim widens to 0.8 T (short of the edge, so a few % of drift can still close it),
then 2 T (which can only prove the prediction outside T). A right outcome with a loose bound (its
window ran faster or slower than its calibration) is retried at the same aim. The check stops
when conclusive (within, or outside T either way), at `max_points`, or when the open side missed
at every aim.

Ranking: the bounds turn into an interval of the measured goodput at the profile's own machine
speed, `[ref / upper, ref / lower]`, with ref the prediction (reshaped profile) with the
calibration's factors over the calibration window's step speed against the profile (the
deployment's own overheads kept, the machine's drift divided out), so two configurations
measured minutes apart are compared on one machine.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.engine.step_log import StepRecord, read_steps
from pdserve.latency.profiled import ProfiledLatency
from pdserve.validate.served_shape import served_profile
from pdserve.validate.step_clock import StepSpeed, drift, step_speed
from pdserve.validate.runtime import LocalConfig, bench_ladder, serving
from pdserve.validate.points import bench_point

AIMS = (0.5, 0.8, 2.0)  # fractions of T: the aim at a side before its first, second and third miss
# a window check's calibration load: this fraction of the latest calibrated prediction, at most this
# many requests (the bench seeks rates at 0.93-1.08 of it; half of it ran too few 3- and 4-row steps,
# 0.9 of an optimistic one made the router turn requests away for want of decode K/V)
WINDOW_LOAD = (0.8, 24)
ANCHOR_SALT = 1000  # prompt salt of the first point's half-load calibration (k + this: no cache hits)


@dataclass(frozen=True)
class LiveModel:
    """The profile the step logs are read against, and the goodput it predicts with given
    factors (on `model`, default that profile)."""

    profile: ProfiledLatency
    predict: Callable[..., float]  # (config, prefill x, decode x, model=None) -> rps


@dataclass(frozen=True)
class SplitCalibrator:
    """A calibration in two halves: `measure(config, url, salt, load)` runs it through the server
    (`load`: (fraction, most requests, around this rps), None for the default: a fraction of the
    configuration's prediction) and `fit(config,
    measured, model)` fits its factors against `model` (None: the plan's profile), returning
    (details, predicted goodput). Called whole it is the one-step calibrator of validate.py."""

    measure: Callable[..., object]
    fit: Callable[..., tuple[dict, float]]

    def __call__(self, config: LocalConfig, url: str, round_: int) -> tuple[dict, float]:
        return self.fit(config, self.measure(config, url, round_, None), None)


@dataclass
class ErrorBounds:
    """lower < e <= upper for e = predicted / measured goodput, from the points seen so far, and
    per side how often seeking it got the other outcome (a sought pass that failed)."""

    lower: float = 0.0
    upper: float = math.inf
    missed: dict = field(default_factory=lambda: {"pass": 0, "fail": 0})

    def add(self, passed: bool, ratio: float, sought: str | None = None) -> None:
        if passed:
            self.upper = min(self.upper, ratio)
        else:
            self.lower = max(self.lower, ratio)
        if sought is not None and (sought == "pass") != passed:
            self.missed[sought] += 1

    def verdict(self, tolerance: float) -> str:
        if self.lower > self.upper:
            return "inconsistent"  # the points disagree more than the windows explain
        if self.lower >= 1 + tolerance:
            return "below"  # e > lower: the measured goodput is below the prediction by more than T
        if self.upper < 1 - tolerance:
            return "above"
        if self.lower >= 1 - tolerance and self.upper <= 1 + tolerance:
            return "within"
        return "unknown"

    def next_side(self, tolerance: float) -> str | None:
        """"pass" or "fail": the open side to seek next (the pass side first); None when both are
        closed or the open one missed at every aim (no further point can make it within)."""
        for side, open_ in (("pass", self.upper > 1 + tolerance), ("fail", self.lower < 1 - tolerance)):
            if open_:
                return side if self.missed[side] < len(AIMS) else None
        return None


def next_rate(predicted: float, side: str, misses: int, tolerance: float) -> float:
    """The rate that seeks a pass (below the prediction) or a fail (above it)."""
    if not 0 < tolerance < 1:
        raise ValueError(f"tolerance must be in (0, 1), got {tolerance}")
    aim = AIMS[misses] * tolerance if side == "pass" else min(AIMS[misses] * tolerance, 0.75)
    return float(f"{predicted / (1 + aim) if side == 'pass' else predicted / (1 - aim):.4g}")


def check_windows(config: LocalConfig, model: str, bench_args: list[str], calibrator: SplitCalibrator,
                  live: LiveModel, tolerance: float, max_points: int = 4,
                  progress: Callable[[str], None] = lambda _m: None, keep_dir: Path | None = None,
                  startup_timeout_s: float = 300.0, bench_timeout_s: float = 1800.0) -> dict:
    """The points, their bounds and the verdict (see the module contract)."""
    bounds, points, reference, anchor = ErrorBounds(), [], None, None
    with serving(config, model, startup_timeout_s, keep_dir, trace=True) as (url, out_dir, log):
        logs = lambda: sorted((out_dir / "trace").glob("*.steps.jsonl"))  # noqa: E731
        for k in range(max_points):
            side = bounds.next_side(tolerance)
            if side is None or bounds.verdict(tolerance) != "unknown":
                break
            if anchor is None:  # where the deployment is, before loading it near there
                anchor = calibrator.fit(config, calibrator.measure(config, url, ANCHOR_SALT + k, None), None)[1]
            t0 = time.time()
            measured = calibrator.measure(config, url, k, (*WINDOW_LOAD, anchor))
            cal_steps = read_steps(logs(), t0, time.time())
            shaped = served_profile(live.profile, cal_steps)
            details, predicted = calibrator.fit(config, measured, shaped)
            anchor = predicted
            cal_speed = step_speed(live.profile, cal_steps)
            rate = next_rate(predicted, side, bounds.missed[side], tolerance)
            progress(f"validate {config.name}: point {k}: calibrated {predicted:.3g} rps, seeking a {side} at {rate:g}")
            t1 = time.time()
            report = bench_ladder(url, [rate], [*bench_args, "--content-salt", str(k)], out_dir, log,
                                  bench_timeout_s, tag=f"-{k}")
            bench_steps = read_steps(logs(), t1, time.time())
            point = _window_point(config, live, shaped, details, predicted, (cal_steps, cal_speed), bench_steps,
                                  bench_point(report, rate))
            bounds.add(point["passed"], point["error_bound"], side)
            reference = reference or _reference(config, live, shaped, details, cal_speed)
            points.append({"point": k, "sought": side, **point})
            progress(f"validate {config.name}: point {k}: {'pass' if point['passed'] else 'fail'}, window prediction "
                     f"{point['window_goodput_rps']:.3g} rps, error bounds ({bounds.lower:.3g}, {bounds.upper:.3g}]")
    return window_row(points, bounds, tolerance, reference)


def _window_point(config, live: LiveModel, shaped: ProfiledLatency, details: dict, predicted: float,
                  calibration: tuple[list[StepRecord], StepSpeed], bench_steps: list[StepRecord], point: dict) -> dict:
    cal_steps, cal = calibration
    dp, dd = drift(live.profile, bench_steps, cal_steps)
    bench = step_speed(live.profile, bench_steps)
    window = live.predict(config, details["prefill_factor"] * dp, details["decode_factor"] * dd, shaped)
    # for comparison only: the unshaped profile at the bench window's step speed, no request-level calibration
    steps_only = live.predict(config, bench.prefill_factor or 1.0, bench.decode_factor or 1.0)
    served = shaped.meta.get("served_decode_bases") if shaped is not live.profile else None
    return {**point, "calibration": details, "calibrated_goodput_rps": predicted, "served_decode_bases": served,
            "calibration_steps": cal.to_dict(),
            "bench_steps": bench.to_dict(), "drift": [dp, dd], "window_goodput_rps": window,
            "error_bound": window / point["rate"], "steps_only_goodput_rps": steps_only}


def _reference(config, live: LiveModel, shaped: ProfiledLatency, details: dict, cal: StepSpeed) -> float | None:
    """The prediction at the profile's machine speed (the calibration's step speed divided out)."""
    if not cal.prefill_factor and not cal.decode_factor:
        return None
    return live.predict(config, details["prefill_factor"] / (cal.prefill_factor or 1.0),
                        details["decode_factor"] / (cal.decode_factor or 1.0), shaped)


def window_row(points: list[dict], bounds: ErrorBounds, tolerance: float, reference: float | None) -> dict:
    """A validation row's measured fields from the window points."""
    where = bounds.verdict(tolerance)
    passed = [p["rate"] for p in points if p["passed"]]
    failed = [p["rate"] for p in points if not p["passed"]]
    finite = lambda x: x if math.isfinite(x) else None  # noqa: E731 (JSON has no infinity)
    row = {"method": "windows", "points": points, "tolerance": tolerance,
           "error_bounds": [bounds.lower, finite(bounds.upper)],
           "measured_vs_prediction": where, "within_tolerance": where == "within",
           "measured_goodput_rps": max(passed, default=None),
           "bracket_rps": [max(passed, default=None), min(failed, default=None)]}
    if points:
        row.update(calibration=points[0]["calibration"], calibrated_goodput_rps=points[0]["calibrated_goodput_rps"])
    if reference:
        row["reference_goodput_rps"] = reference
        row["reference_interval_rps"] = [reference / bounds.upper if bounds.upper < math.inf else 0.0,
                                         reference / bounds.lower if bounds.lower > 0 else None]
    return row
