"""The bracket check with a fresh calibration before each of its two bench runs.

Why: on a shared CPU the machine's speed moves by 10-30% within minutes, and a configuration's
goodput moves 2-2.5x as much near saturation. One calibration before a two-point bracket holds the
second point (ten or more minutes later on long prompts) to a prediction made for a machine that
may no longer be there; a point that misses by one request of six then says more about the drift
than about the simulator.

Contract: `check_points(config, model, bench_args, calibrator, tolerance)` starts one server for
`config` and, for point k = 0 then 1, calls `calibrator(config, url, k)` for a prediction made
against that server now, benches the single rate `bracket(prediction, tolerance)[k]` (the lower
rate pred/(1+T) first, then the upper pred/(1-T)), and records whether its joint attainment met
the target. Point k's calibration and bench get content salt k, so neither is answered from an
earlier one's prefix cache. A failing lower point ends the check (the measured goodput is below
the prediction whatever the upper point does). `points_verdict` then reads the points as
`bracket_verdict` reads a two-rate sweep: within when the lower point passes and the upper fails.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

from pdserve.validate.runtime import LocalConfig, bench_ladder, bracket, serving

PointCalibrator = Callable[[LocalConfig, str, int], "tuple[dict, float]"]  # (config, url, point) -> (details, rps)


def check_points(config: LocalConfig, model: str, bench_args: list[str], calibrator: PointCalibrator,
                 tolerance: float, progress: Callable[[str], None] = lambda _m: None,
                 keep_dir: Path | None = None, startup_timeout_s: float = 300.0,
                 bench_timeout_s: float = 1800.0) -> list[dict]:
    """Per point: its calibration, its prediction, its rate and what the bench measured there."""
    points = []
    with serving(config, model, startup_timeout_s, keep_dir) as (url, out_dir, log):
        for k in (0, 1):
            details, predicted = calibrator(config, url, k)
            rate = bracket(predicted, tolerance)[k]
            progress(f"validate {config.name}: point {k}: calibrated prediction {predicted:.3g} rps, bench at {rate:g}")
            report = bench_ladder(url, [rate], [*bench_args, "--content-salt", str(k)], out_dir, log,
                                  bench_timeout_s, tag=f"-{k}")
            point = bench_point(report, rate)
            points.append({"point": k, "calibration": details, "calibrated_goodput_rps": predicted, **point})
            if k == 0 and not point["passed"]:
                break
    return points


def recalibrated_row(config: LocalConfig, model: str, bench_args: list[str], calibrator: PointCalibrator,
                     tolerance: float, progress: Callable[[str], None], keep_dir: Path | None) -> dict:
    """A validation row's measured fields: the points, their verdict and the machine's stability."""
    points = check_points(config, model, bench_args, calibrator, tolerance, progress, keep_dir)
    return {**points_verdict(points), "tolerance": tolerance, **stability(points, tolerance),
            "calibrated_goodput_rps": points[0]["calibrated_goodput_rps"], "calibration": points[0]["calibration"]}


def bench_point(report: dict, rate: float) -> dict:
    target = report.get("slo_attainment", 0.9)
    row = next((p for p in report.get("sweep", []) if p.get("rate") == rate), {})
    joint = row.get("attainment_joint")
    keys = ("attainment_joint", "attainment_ttft", "attainment_tpot", "p99_ttft_ms", "p99_tpot_ms", "failed")
    return {"rate": rate, "passed": joint is not None and joint >= target, **{k: row.get(k) for k in keys}}


def points_verdict(points: list[dict]) -> dict:
    """Where the measured goodput lies relative to the per-point predictions.

    The measured goodput is at least the lower rate when that point passed; the upper point
    failing puts it below the upper rate. Each rate is within T of the prediction made just
    before it, so "within" means both predictions agree with the measurement to T."""
    rates = [p["rate"] for p in points] + [None] * (2 - len(points))  # [lower, upper or None if not run]
    passed = [p["passed"] for p in points]
    if passed and not passed[0]:
        where = "below"
    elif len(passed) == 2 and passed[1]:
        where = "above"
    elif passed == [True, False]:
        where = "within"
    else:
        where = "unknown"
    measured = max((p["rate"] for p in points if p["passed"]), default=None)
    return {"bracket_rps": rates, "within_tolerance": where == "within", "measured_vs_prediction": where,
            "measured_goodput_rps": measured, "points": points}


def stability(points: list[dict], tolerance: float) -> dict:
    """Whether the machine held still enough for a +-`tolerance` check to mean anything.

    `stability_needed`: the speed change that moves the goodput by `tolerance` (tolerance over the
    first calibration's `goodput_elasticity`). `machine_drift`: how far the calibration factors
    moved between the two points (the larger of the prefill and decode changes). The verdict is
    `conclusive` only when the drift stayed within what the check needs; otherwise a miss (or a
    hit) says more about the machine than about the simulator."""
    out: dict = {}
    elasticity = points[0]["calibration"].get("goodput_elasticity") if points else None
    if elasticity and elasticity > 0:
        out["stability_needed"] = tolerance / elasticity
    if len(points) == 2:
        first, second = points[0]["calibration"], points[1]["calibration"]
        moves = [abs(math.log(second[k] / first[k])) for k in ("prefill_factor", "decode_factor")
                 if first.get(k) and second.get(k)]
        if moves:
            out["machine_drift"] = math.exp(max(moves)) - 1
    if "stability_needed" in out and "machine_drift" in out:
        out["conclusive"] = out["machine_drift"] <= out["stability_needed"]
    return out

