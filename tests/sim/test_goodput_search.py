"""Simulated goodput uses the benchmark's search; it is monotone in the SLO."""

from __future__ import annotations

import pytest

from pdserve.bench.metrics import Slo
from pdserve.sim.goodput import goodput_rps, ladder_around, prefill_records, decode_records
from pdserve.latency.base import ConstantLatency
from pdserve.sim.prefill_pool import PrefillPolicy
from pdserve.sim.simulator import SimConfig, simulate


@pytest.fixture(scope="module")
def requests():
    from pdserve.bench.lengths import fixed
    from pdserve.bench.prompts import PromptStyle
    from pdserve.bench.workload import WorkloadConfig
    from pdserve.sim.requests import build_requests

    return build_requests(WorkloadConfig(num_requests=1500, input_len=fixed(64), output_len=fixed(16), seed=7,
                                         prompt_style=PromptStyle(format="ids")))


MODEL = ConstantLatency(prefill_ms=20, decode_step_ms=8)


def _goodput(requests, slo):
    run = lambda rate: simulate(requests, rate, SimConfig(), MODEL).records  # noqa: E731
    return goodput_rps(run, slo, ladder_around(25.0)).rate


def test_goodput_is_monotone_in_the_slo(requests):
    ttfts = [0.03, 0.05, 0.1, 0.3]
    tpots = [0.0085, 0.01, 0.02]
    grid = {(f, o): _goodput(requests, Slo(f, o)) for f in ttfts for o in tpots}
    for (f, o), g in grid.items():
        for (f2, o2), g2 in grid.items():
            if f2 >= f and o2 >= o:
                assert g2 >= g - 1e-9, ((f, o), (f2, o2))
    assert grid[(0.3, 0.02)] < 1 / 0.020  # never above the prefill capacity


def test_prefill_goodput_tracks_md1(requests):
    """A 50 ms p90-TTFT gate on a 20 ms prefill: goodput lies below capacity (50 rps) and above 0."""
    found = goodput_rps(prefill_records(requests, MODEL, PrefillPolicy()), Slo(0.05, 1.0), ladder_around(25.0))
    assert 10 < found.rate < 50 and not found.saturated


def test_decode_goodput_saturates_with_a_constant_step(requests):
    """A constant decode step never misses a looser TPOT gate: the search extends and saturates."""
    found = goodput_rps(decode_records(requests, MODEL, 256), Slo(1.0, 0.05), ladder_around(1.0), max_extensions=1)
    assert found.saturated
