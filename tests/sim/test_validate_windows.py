"""The window check: each bench point held to the prediction for its own window (validate_windows.py)."""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path

import pytest

from pdserve.validate import windows as vw
from pdserve.search.plan_report import bracket_ranking, measured_interval, validation_lines
from pdserve.latency.profiled import ProfiledLatency
from pdserve.validate.step_clock import StepSpeed
from pdserve.validate.runtime import LocalConfig

T = 0.15
G0 = 2.0  # goodput at the profile's machine speed (speed factor 1)
PROFILE = ProfiledLatency((0.1, 0.0, 0.0), (0.05, 0.0, 0.0))
SHAPED = ProfiledLatency((0.1, 0.0, 0.0), (0.05, 0.0, 0.0), decode_batch_base=((1, 0.05), (2, 0.06)))


def test_bounds_and_their_verdicts():
    b = vw.ErrorBounds()
    assert b.verdict(T) == "unknown" and b.next_side(T) == "pass"
    b.add(True, 1.10)
    assert (b.lower, b.upper) == (0.0, 1.10) and b.next_side(T) == "fail"
    b.add(False, 0.90)
    assert b.verdict(T) == "within" and b.next_side(T) is None
    assert vw.ErrorBounds(lower=1.2).verdict(T) == "below"
    assert vw.ErrorBounds(lower=1.15).verdict(T) == "below"  # e > 1.15
    assert vw.ErrorBounds(upper=0.8).verdict(T) == "above"
    assert vw.ErrorBounds(lower=1.0, upper=0.9).verdict(T) == "inconsistent"
    assert vw.ErrorBounds(lower=0.5, upper=1.1).verdict(T) == "unknown"
    spent = vw.ErrorBounds()
    for _ in vw.AIMS:
        spent.add(False, 1.0, sought="pass")  # a sought pass that failed: a miss
    spent.add(True, 1.5, sought="pass")  # a sought pass that passed is no miss
    assert spent.missed == {"pass": len(vw.AIMS), "fail": 0}
    assert spent.next_side(T) is None  # the pass side is open and missed at every aim: nothing can make it within


def test_rates_seek_a_pass_below_and_a_fail_above_the_prediction():
    assert [vw.next_rate(1.0, "pass", k, T) for k in range(3)] == [0.9302, 0.8929, 0.7692]
    assert [vw.next_rate(1.0, "fail", k, T) for k in range(3)] == [1.081, 1.136, 1.429]
    assert vw.next_rate(1.0, "fail", 2, 0.5) == 4.0  # the fail side's aim stops at 0.75
    with pytest.raises(ValueError):
        vw.next_rate(1.0, "pass", 0, 1.0)


class _Machine:
    """A fake server whose speed factor changes between windows, and a simulator that is off by
    `error` (predicted / measured goodput at any one speed)."""

    def __init__(self, cal_speeds, bench_speeds, error):
        self.cal_speeds, self.bench_speeds, self.error = list(cal_speeds), list(bench_speeds), error
        self.windows = []  # StepSpeeds handed out, in order
        self.benched = []
        self.loads = []  # the rate each calibration load was placed around (None: the anchor's default)

    @contextlib.contextmanager
    def serving(self, config, model, startup_timeout_s, keep_dir, trace=False):
        assert trace  # the step logs are on
        yield "http://fake", Path("/nonexistent-pdserve-test"), None

    def measure(self, config, url, k, load):
        if load is None:  # the half-load calibration before point 0 (its own prompt salt)
            assert k == vw.ANCHOR_SALT and not self.loads
            self.loads.append(None)
            return "anchor", None
        # near the latest calibrated prediction: the window serves the bench's batch sizes
        fraction, most, around = load
        assert (fraction, most) == vw.WINDOW_LOAD
        self.loads.append(around)
        speed = self.cal_speeds[k]
        self.windows.append(StepSpeed(speed, 1.0, 5, 50))  # the prefill phase drifts, decode does not
        return k, speed

    def fit(self, config, measured, model):
        k, speed = measured
        if k == "anchor":
            assert model is None  # the plan's own profile: no window read yet
            return {}, 0.9 * G0
        assert model is SHAPED  # fitted against the profile reshaped from the calibration's own steps
        return {"prefill_factor": speed, "decode_factor": 1.0, "round": k}, G0 / speed

    def bench_ladder(self, url, ladder, bench_args, out_dir, log, timeout_s, tag=""):
        k = len(self.benched)
        speed = self.bench_speeds[k]
        self.windows.append(StepSpeed(speed, 1.0, 5, 50))
        self.benched.append((ladder[0], bench_args[-1]))
        measured = G0 / speed / self.error
        return {"slo_attainment": 0.9, "sweep": [{"rate": ladder[0], "attainment_joint": 1.0 if ladder[0] <= measured else 0.5}]}


def _run(monkeypatch, machine: _Machine, max_points: int = 4) -> dict:
    monkeypatch.setattr(vw, "serving", machine.serving)
    monkeypatch.setattr(vw, "bench_ladder", machine.bench_ladder)
    # the step records of a window stand in as its StepSpeed; drift divides two windows' speeds
    monkeypatch.setattr(vw, "read_steps", lambda logs, start, stop: [machine.windows[-1]])
    monkeypatch.setattr(vw, "step_speed", lambda profile, records: records[0])
    monkeypatch.setattr(vw, "served_profile", lambda profile, records: SHAPED)
    monkeypatch.setattr(vw, "drift", lambda profile, window, reference: (
        window[0].prefill_factor / reference[0].prefill_factor, window[0].decode_factor / reference[0].decode_factor))
    # predictions on the reshaped profile are G0 / speed; the unshaped profile's are 10% lower
    live = vw.LiveModel(PROFILE, lambda config, p, d, model=None: G0 / (p * d) * (1.0 if model is SHAPED else 0.9))
    config = LocalConfig("disaggregated", "disaggregated", predicted_goodput_rps=G0)
    calibrator = vw.SplitCalibrator(machine.measure, machine.fit)
    return vw.check_windows(config, "tiny", ["--seed", "0"], calibrator, live, T, max_points)


def test_a_machine_that_slowed_after_its_calibration_is_judged_on_its_own_window(monkeypatch):
    """Point 0's calibration saw speed 1.0 but its bench ran at 1.1: the bench fails at the rate
    meant to pass, yet its window prediction (G0/1.1) says the simulator is only 5% high. Point 1
    seeks its pass at the wider aim (0.8 T) below its own calibration and passes: the error lies
    in (0.977, 1.075], within 15%."""
    machine = _Machine(cal_speeds=[1.0, 1.2], bench_speeds=[1.1, 1.25], error=1.05)
    row = _run(monkeypatch, machine)
    assert [rate for rate, _ in machine.benched] == [1.86, 1.488]  # 2.0 / 1.075, then 2.0 / 1.2 / 1.12
    assert [salt for _, salt in machine.benched] == ["0", "1"]
    # point 0's load sits around the anchor calibration's prediction, point 1's around point 0's
    assert machine.loads == [None, 0.9 * G0, G0]
    assert [p["passed"] for p in row["points"]] == [False, True]
    assert row["points"][0]["drift"] == [pytest.approx(1.1), 1.0]
    assert row["points"][0]["window_goodput_rps"] == pytest.approx(G0 / 1.1)
    # the unshaped profile at the bench window's speed alone (for comparison)
    assert row["points"][0]["steps_only_goodput_rps"] == pytest.approx(0.9 * G0 / 1.1)
    lower, upper = row["error_bounds"]
    assert lower == pytest.approx((G0 / 1.1) / 1.86) and upper == pytest.approx((G0 / 1.25) / 1.488)
    assert row["measured_vs_prediction"] == "within" and row["within_tolerance"] is True
    # at the profile's speed the measured goodput is G0 / 1.05 = 1.905 rps, inside the interval
    ref_lo, ref_hi = row["reference_interval_rps"]
    assert row["reference_goodput_rps"] == pytest.approx(G0) and ref_lo <= G0 / 1.05 <= ref_hi
    json.dumps(row)


def test_a_simulator_far_too_optimistic_is_found_out(monkeypatch):
    machine = _Machine(cal_speeds=[1.0] * 4, bench_speeds=[1.0] * 4, error=1.6)
    row = _run(monkeypatch, machine)
    # every sought pass fails; the third, at 2 / 1.3, bounds e from below by 1.3 > 1.15: conclusive
    assert [p["passed"] for p in row["points"]] == [False, False, False]
    assert row["measured_vs_prediction"] == "below" and row["error_bounds"][0] >= 1.15
    assert row["error_bounds"][1] is None and row["reference_interval_rps"][0] == 0.0
    assert row["measured_goodput_rps"] is None


def test_a_simulator_far_too_pessimistic_is_found_out(monkeypatch):
    machine = _Machine(cal_speeds=[1.0] * 4, bench_speeds=[1.0] * 4, error=0.6)
    row = _run(monkeypatch, machine)
    # a pass, then every sought fail passes too; the last, at 2 / 0.7, bounds e by 0.7 < 0.85
    assert [p["passed"] for p in row["points"]] == [True, True, True, True]
    assert [p["sought"] for p in row["points"]] == ["pass", "fail", "fail", "fail"]
    assert row["measured_vs_prediction"] == "above" and row["error_bounds"][1] < 0.85


def test_the_points_stop_at_max_points(monkeypatch):
    machine = _Machine(cal_speeds=[1.0] * 4, bench_speeds=[1.0] * 4, error=1.6)
    row = _run(monkeypatch, machine, max_points=1)
    assert len(row["points"]) == 1 and row["measured_vs_prediction"] == "unknown"


def test_ranking_and_table_read_the_window_rows(monkeypatch):
    disagg = {"name": "disaggregated", "layout": "1P1D", "predicted_goodput_rps": G0,
              **_run(monkeypatch, _Machine([1.0, 1.2], [1.1, 1.25], 1.05))}
    colo = {"name": "colocated", "layout": "1 x colocated", "predicted_goodput_rps": G0,
            **vw.window_row([], vw.ErrorBounds(lower=1.0, upper=1.1), T, reference=1.0)}
    assert measured_interval(colo) == (pytest.approx(1.0 / 1.1), 1.0)
    assert measured_interval({**colo, "reference_interval_rps": None}) is None
    assert bracket_ranking([disagg, colo]) == "disaggregated"
    text = "\n".join(validation_lines([disagg, colo]))
    assert "engine speed since the calibration x1.100 prefill, x1.000 decode -> window prediction 1.82 rps" in text
    assert "predicted/measured in each bench's own window: (0.978, 1.08]: within -> prediction within 15%" in text
    assert "measured better: disaggregated" in text
    assert math.isinf(measured_interval({**colo, "reference_interval_rps": [0.5, None]})[1])
