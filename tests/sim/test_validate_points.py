"""The bracket check that calibrates again before each point (validate_points.py)."""

from __future__ import annotations

import contextlib
import json

from pdserve.validate import points as vp
from pdserve.search.plan_report import bracket_ranking, measured_interval
from pdserve.validate.run import validate
from pdserve.validate.runtime import LocalConfig


def _point(k: int, rate: float, passed: bool) -> dict:
    return {"point": k, "rate": rate, "passed": passed, "calibrated_goodput_rps": rate}


def test_points_verdict_reads_the_two_points():
    within = vp.points_verdict([_point(0, 0.87, True), _point(1, 1.3, False)])
    assert within["measured_vs_prediction"] == "within" and within["within_tolerance"] is True
    assert within["bracket_rps"] == [0.87, 1.3] and within["measured_goodput_rps"] == 0.87
    above = vp.points_verdict([_point(0, 0.87, True), _point(1, 1.3, True)])
    assert above["measured_vs_prediction"] == "above" and above["measured_goodput_rps"] == 1.3
    below = vp.points_verdict([_point(0, 0.87, False)])
    assert below["measured_vs_prediction"] == "below" and below["bracket_rps"] == [0.87, None]
    assert below["measured_goodput_rps"] is None
    assert measured_interval({**below, "name": "x"}) == (0.0, 0.87)
    assert vp.points_verdict([])["measured_vs_prediction"] == "unknown"


def test_ranking_reads_point_rows_like_sweep_rows():
    rows = [{"name": "colocated", **vp.points_verdict([_point(0, 0.1, False)])},
            {"name": "disaggregated", **vp.points_verdict([_point(0, 0.2, True), _point(1, 0.3, False)])}]
    assert bracket_ranking(rows) == "disaggregated"


class _FakeServer:
    """Stands in for `serving` and `bench_ladder`: attainment falls linearly with the rate."""

    def __init__(self, capacity_rps: float):
        self.capacity_rps = capacity_rps
        self.benched: list[tuple[list[float], list[str]]] = []

    @contextlib.contextmanager
    def serving(self, config, model, startup_timeout_s, keep_dir):
        yield "http://fake", None, None

    def bench_ladder(self, url, ladder, bench_args, out_dir, log, timeout_s, tag=""):
        self.benched.append((ladder, bench_args))
        rate = ladder[0]
        attainment = 1.0 if rate <= self.capacity_rps else 0.5
        return {"slo_attainment": 0.9, "sweep": [{"rate": rate, "attainment_joint": attainment}]}


def _with_fake(monkeypatch, capacity_rps: float) -> _FakeServer:
    fake = _FakeServer(capacity_rps)
    monkeypatch.setattr(vp, "serving", fake.serving)
    monkeypatch.setattr(vp, "bench_ladder", fake.bench_ladder)
    return fake


def test_each_point_is_held_to_the_prediction_made_just_before_it(monkeypatch):
    fake = _with_fake(monkeypatch, capacity_rps=1.5)
    rounds = []

    def calibrator(config, url, round_):
        rounds.append(round_)
        return {"round": round_}, [1.0, 1.4][round_]  # the machine got faster between the points

    config = LocalConfig("colocated", "colocated", replicas=1, predicted_goodput_rps=9.0)
    points = vp.check_points(config, "tiny", ["--seed", "0"], calibrator, 0.15)
    assert rounds == [0, 1]
    assert [p["rate"] for p in points] == [0.8696, 1.647]  # 1.0 / 1.15, then 1.4 / 0.85
    assert [p["calibration"] for p in points] == [{"round": 0}, {"round": 1}]
    assert [args[-2:] for _, args in fake.benched] == [["--content-salt", "0"], ["--content-salt", "1"]]
    assert vp.points_verdict(points)["measured_vs_prediction"] == "within"


def test_a_failing_lower_point_ends_the_check(monkeypatch):
    fake = _with_fake(monkeypatch, capacity_rps=0.5)
    rounds = []

    def calibrator(config, url, round_):
        rounds.append(round_)
        return {}, 1.0

    config = LocalConfig("colocated", "colocated", replicas=1, predicted_goodput_rps=1.0)
    rows = validate([config], "tiny", ["--seed", "0"], tolerance=0.15, calibrator=calibrator, recalibrate=True)
    assert rounds == [0] and len(fake.benched) == 1
    row = rows[0]
    assert "error" not in row, row.get("error")
    assert row["measured_vs_prediction"] == "below" and row["within_tolerance"] is False
    assert row["calibrated_goodput_rps"] == 1.0 and len(row["points"]) == 1
    json.dumps(row)  # the plan's JSON line carries it


def test_recalibrate_needs_a_tolerance_and_a_calibrator():
    import pytest

    config = LocalConfig("colocated", "colocated", replicas=1, predicted_goodput_rps=1.0)
    with pytest.raises(ValueError):
        validate([config], "tiny", [], tolerance=0.15, recalibrate=True)
    with pytest.raises(ValueError):
        validate([config], "tiny", [], calibrator=lambda c, u, r: ({}, 1.0), recalibrate=True)


def test_the_plan_table_shows_each_point():
    from pdserve.search.plan_report import validation_lines

    cal = {"prefill_factor": 1.1, "decode_factor": 0.9}
    points = [{**_point(0, 0.87, True), "calibration": cal}]
    row = {"name": "colocated", "layout": "2 x colocated", "predicted_goodput_rps": 1.0, "tolerance": 0.15,
           **vp.points_verdict(points)}
    text = "\n".join(validation_lines([row]))
    assert "point 0: calibrated (prefill x1.100, decode x0.900) 0.87 rps -> bench at 0.87: pass" in text
    assert "bracket 0.87..- rps" in text


def test_a_machine_that_slowed_between_the_points_gives_the_hull():
    """Point 0 passed at 0.085 (its prediction 0.098); the machine slowed, point 1's prediction
    0.064 put its rate at 0.075, which failed: each point agrees with its own prediction."""
    row = {"name": "disaggregated", **vp.points_verdict([_point(0, 0.0853, True), _point(1, 0.075, False)])}
    assert row["measured_vs_prediction"] == "within"
    assert measured_interval(row) == (0.075, 0.0853)
    other = {"name": "colocated", **vp.points_verdict([_point(0, 0.0139, True), _point(1, 0.0188, False)])}
    assert bracket_ranking([row, other]) == "disaggregated"


def test_goodput_elasticity_of_a_power_law():
    from pdserve.validate.calibrate import goodput_elasticity

    assert abs(goodput_elasticity(lambda scale: 0.2 * scale ** -3.0) - 3.0) < 1e-9
    assert goodput_elasticity(lambda scale: 0.0 if scale > 1 else 0.2) is None


def test_stability_says_whether_the_machine_held_still():
    def cal(prefill, decode):
        return {"prefill_factor": prefill, "decode_factor": decode, "goodput_elasticity": 3.0}

    steady = [{**_point(0, 0.1, True), "calibration": cal(1.0, 1.0)},
              {**_point(1, 0.12, False), "calibration": cal(1.02, 0.99)}]
    out = vp.stability(steady, 0.15)
    assert abs(out["stability_needed"] - 0.05) < 1e-12
    assert abs(out["machine_drift"] - 0.02) < 1e-12 and out["conclusive"] is True
    drifted = [steady[0], {**steady[1], "calibration": cal(1.10, 1.0)}]
    assert vp.stability(drifted, 0.15)["conclusive"] is False
    one = vp.stability(steady[:1], 0.15)
    assert "machine_drift" not in one and "conclusive" not in one and "stability_needed" in one
    assert vp.stability([], 0.15) == {}


def test_the_plan_table_says_when_a_check_is_not_conclusive():
    from pdserve.search.plan_report import validation_lines

    c0 = {"prefill_factor": 1.0, "decode_factor": 1.0, "goodput_elasticity": 3.0}
    c1 = {"prefill_factor": 1.2, "decode_factor": 1.0, "goodput_elasticity": 3.0}
    points = [{**_point(0, 0.1, True), "calibration": c0}, {**_point(1, 0.12, False), "calibration": c1}]
    row = {"name": "disaggregated", "layout": "1P1D", "predicted_goodput_rps": 0.1, "tolerance": 0.15,
           **vp.points_verdict(points), **vp.stability(points, 0.15)}
    text = "\n".join(validation_lines([row]))
    assert "needs the machine's speed steady to 5.0%; the calibrations drifted 20.0% between the points: NOT conclusive" in text
