"""The goodput search: exact answers on synthetic attainment curves, and properties."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.bench.goodput import SearchPlan, geometric_ladder, next_rate, search_goodput
from pdserve.bench.metrics import Attainment, Slo, attainment
from pdserve.bench.records import RequestRecord


def step_curve(joint_knee, phase_knee):
    """Joint attainment 1 up to joint_knee; marginals 1 up to phase_knee; 0.5 beyond."""

    def evaluate(rate):
        marginal = 1.0 if rate <= phase_knee else 0.5
        joint = 1.0 if rate <= joint_knee else 0.5
        return Attainment(marginal, 1.0, min(joint, marginal), 10)

    return evaluate


def test_geometric_ladder():
    assert geometric_ladder(1, 10) == (1, 2, 4, 8, 16)


def test_joint_and_phase_goodput_exact():
    plan = SearchPlan((4.0, 8.0, 16.0, 32.0), target=0.9, rel_tol=0.0, max_bisections=3)
    results, points = search_goodput(step_curve(10.0, 20.0), plan)
    # joint: bracket [8, 16] -> probes 12 (fail), 10 (pass), 11 (fail): goodput 10
    assert results["joint"].rate == 10.0 and results["joint"].lowest_failing_rate == 11.0
    # phase: bracket [16, 32] -> 24 (fail), 20 (pass), 22 (fail)
    assert results["phase"].rate == 20.0 and results["phase"].lowest_failing_rate == 22.0
    assert not results["joint"].saturated
    assert sorted(points) == [4, 8, 10, 11, 12, 16, 20, 22, 24, 32]


def test_saturated_and_zero():
    plan = SearchPlan((1.0, 2.0), max_bisections=2)
    results, _ = search_goodput(step_curve(100, 100), plan)
    assert results["joint"].rate == 2.0 and results["joint"].saturated
    results, points = search_goodput(lambda r: Attainment(0, 0, 0, 1), plan)
    assert results["joint"].rate == 0.0 and len(points) == 1 + 2


def test_next_rate_follows_the_sweep_first():
    plan = SearchPlan((1.0, 2.0, 4.0))
    assert next_rate({}, plan, "joint") == 1.0
    assert next_rate({1.0: Attainment(1, 1, 1, 1)}, plan, "joint") == 2.0


def test_rel_tol_stops_bisection():
    plan = SearchPlan((10.0, 20.0), rel_tol=0.3, max_bisections=10)
    results, points = search_goodput(step_curve(13.0, 13.0), plan)
    # [10, 20]: 10 > 6 -> 15 fails; [10, 15]: 5 > 4.5 -> 12.5 passes; [12.5, 15]: 2.5 <= 4.5, stop
    assert results["joint"].rate == 12.5 and sorted(points) == [10.0, 12.5, 15.0, 20.0]


def records_at(rate):
    """A deterministic 'system': TTFT and TPOT grow with load, differently per request."""
    return [
        RequestRecord(i, 0.0, True, ttft_s=0.01 * rate * (1 + i / 10), e2e_s=0.01 * rate * (1 + i / 10) + 0.002 * rate * (1 + (9 - i) / 10) * 4, output_tokens=5)
        for i in range(10)
    ]


@settings(max_examples=40, deadline=None)
@given(st.floats(0.05, 2.0), st.floats(0.05, 2.0), st.floats(0.005, 0.2), st.floats(0.005, 0.2), st.sampled_from([0.5, 0.8, 0.9]))
def test_goodput_monotone_in_slo(t1, t2, o1, o2, p):
    plan = SearchPlan(geometric_ladder(1.0, 64.0), target=p, rel_tol=0.01, max_bisections=8)
    tight = Slo(min(t1, t2), min(o1, o2), p)
    loose = Slo(max(t1, t2), max(o1, o2), p)
    res_tight, _ = search_goodput(lambda r: attainment(records_at(r), tight), plan)
    res_loose, _ = search_goodput(lambda r: attainment(records_at(r), loose), plan)
    for definition in ("joint", "phase"):
        assert res_tight[definition].rate <= res_loose[definition].rate
    assert res_tight["joint"].rate <= res_tight["phase"].rate
    assert res_loose["joint"].rate <= res_loose["phase"].rate


def test_plan_validation():
    with pytest.raises(ValueError):
        SearchPlan((2.0, 1.0))
