"""Exact and property tests of the pure two-clock metrics."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdserve.bench.metrics import Slo, attainment, latency_stats, percentile, select_window, summarize
from pdserve.bench.records import RequestRecord, failed_record


def rec(i, ttft, e2e, tokens, arrival=0.0, success=True, itls=()):
    return RequestRecord(i, arrival, success, ttft_s=ttft, e2e_s=e2e, itls_s=itls, output_tokens=tokens)


def test_tpot_definition():
    assert rec(0, 0.1, 0.5, 5).tpot_s == pytest.approx(0.1)
    assert rec(0, 0.1, 0.1, 1).tpot_s is None
    assert rec(0, 0.1, 0.5, 5, success=False).tpot_s is None


def test_percentile_is_numpy_linear():
    values = [1.0, 2.0, 3.0, 4.0]
    assert percentile(values, 50) == 2.5
    assert percentile(values, 90) == pytest.approx(3.7)
    assert percentile(values, 99) == pytest.approx(3.97)
    assert percentile([], 50) is None


def test_attainment_hand_computed():
    slo = Slo(ttft_s=0.2, tpot_s=0.05)
    records = [
        rec(0, 0.1, 0.1 + 4 * 0.04, 5),  # both met
        rec(1, 0.3, 0.3 + 4 * 0.04, 5),  # TTFT missed
        rec(2, 0.1, 0.1 + 4 * 0.06, 5),  # TPOT missed
        rec(3, 0.2, 0.2, 1),  # single token: TTFT met at equality, TPOT counts as met
        failed_record(4, 0.0, "http:500"),
    ]
    att = attainment(records, slo)
    assert (att.ttft, att.tpot, att.joint, att.num_requests) == (3 / 5, 3 / 5, 2 / 5, 5)
    assert att.meets_phase(0.6) and not att.meets_joint(0.6)


def test_failed_requests_lower_attainment_and_skip_percentiles():
    slo = Slo(1.0, 1.0)
    ok = [rec(i, 0.1, 0.2, 3) for i in range(3)]
    summary = summarize(ok + [failed_record(9, 0.0, "rejected:429")], slo)
    assert summary["attainment_joint"] == 0.75
    assert summary["completed"] == 3 and summary["failed"] == 1
    assert summary["failure_reasons"] == {"rejected:429": 1}
    assert summary["mean_ttft_ms"] == pytest.approx(100.0)


def test_summary_keys_and_values():
    records = [rec(i, 0.01 * (i + 1), 0.01 * (i + 1) + 0.02, 3, arrival=i * 0.1, itls=(0.01, 0.01)) for i in range(4)]
    s = summarize(records, Slo(0.025, 0.02))
    expected_ttft = np.array([10.0, 20.0, 30.0, 40.0])
    assert s["p50_ttft_ms"] == pytest.approx(np.percentile(expected_ttft, 50))
    assert s["p90_ttft_ms"] == pytest.approx(np.percentile(expected_ttft, 90))
    assert s["p99_ttft_ms"] == pytest.approx(np.percentile(expected_ttft, 99))
    assert s["mean_tpot_ms"] == pytest.approx(10.0)
    assert s["mean_itl_ms"] == pytest.approx(10.0)
    assert s["attainment_ttft"] == 0.5 and s["attainment_tpot"] == 1.0 and s["attainment_joint"] == 0.5
    # window: first arrival 0 to last completion 0.3 + 0.06
    assert s["duration"] == pytest.approx(0.36)
    assert s["request_throughput"] == pytest.approx(4 / 0.36)
    assert s["output_throughput"] == pytest.approx(12 / 0.36)
    for key in ("mean_e2el_ms", "p99_itl_ms", "median_tpot_ms", "std_ttft_ms", "good_request_throughput"):
        assert key in s


def test_latency_stats_empty():
    assert latency_stats("tpot", [])["p99_tpot_ms"] is None


def test_window_excludes_warmup_and_cooldown():
    records = [rec(i, 0.1, 0.2, 2, arrival=float(i)) for i in range(10)]
    window = select_window(records, warmup_s=2.0, cooldown_s=3.0)
    assert [r.request_id for r in window.measured] == [2, 3, 4, 5, 6]
    assert (window.num_warmup, window.num_cooldown) == (2, 3)


record_strategy = st.builds(
    RequestRecord,
    request_id=st.just(0),
    arrival_s=st.floats(0, 10),
    success=st.booleans(),
    ttft_s=st.one_of(st.none(), st.floats(0, 2)),
    e2e_s=st.floats(0, 5),
    output_tokens=st.integers(0, 50),
)


@given(st.lists(record_strategy, max_size=40), st.floats(0, 2), st.floats(0, 0.5))
def test_joint_never_above_either_marginal(records, ttft_s, tpot_s):
    att = attainment(records, Slo(ttft_s, tpot_s))
    assert att.joint <= min(att.ttft, att.tpot) + 1e-12
    assert 0.0 <= att.joint <= 1.0


@given(st.lists(record_strategy, min_size=1, max_size=40), st.floats(0, 1), st.floats(0, 1), st.floats(0, 1), st.floats(0, 1))
def test_attainment_monotone_in_thresholds(records, t1, t2, o1, o2):
    tight = attainment(records, Slo(min(t1, t2), min(o1, o2)))
    loose = attainment(records, Slo(max(t1, t2), max(o1, o2)))
    assert tight.ttft <= loose.ttft and tight.tpot <= loose.tpot and tight.joint <= loose.joint
