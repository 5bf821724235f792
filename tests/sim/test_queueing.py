"""The simulator against queueing theory: M/D/1 prefill TTFT (spec 0x08B)."""

from __future__ import annotations

from statistics import fmean

import pytest

from pdserve.bench.metrics import Slo, summarize
from pdserve.ledger.queueing import md1_ttft_s
from pdserve.latency.base import ConstantLatency
from pdserve.sim.prefill_pool import PrefillPolicy
from pdserve.sim.simulator import SimConfig, simulate

SERVICE_S = 0.010


@pytest.mark.parametrize("rho", [0.5, 0.8])
def test_mean_ttft_matches_md1_within_3_percent(make_requests, rho):
    rate = rho / SERVICE_S
    model = ConstantLatency(prefill_ms=SERVICE_S * 1e3, decode_step_ms=1.0)
    config = SimConfig(mode="disaggregated", prefill=PrefillPolicy("fcfs", max_batch=1))
    means = []
    for seed in (1, 2, 3):
        result = simulate(make_requests(40000, seed=seed), rate, config, model)
        means.append(summarize(result.records, Slo(1.0, 1.0))["mean_ttft_ms"] / 1e3)
    expected = md1_ttft_s(rate, SERVICE_S)
    assert fmean(means) == pytest.approx(expected, rel=0.03)


def test_two_instances_halve_the_load(make_requests):
    """Two FCFS instances at twice the rate wait less than one at the single rate (M/D/2 < M/D/1)."""
    model = ConstantLatency(prefill_ms=10, decode_step_ms=1)
    requests = make_requests(20000, seed=4)
    one = simulate(requests, 60, SimConfig(), model)
    two = simulate(requests, 120, SimConfig(prefill_replicas=2), model)
    mean = lambda r: fmean(x.ttft_s for x in r.records)  # noqa: E731
    assert SERVICE_S < mean(two) < mean(one)
