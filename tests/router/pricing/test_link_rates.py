"""The handoff link's measured price (router/pricing/link_rates.py): the least-squares fit of the
reported transfers, its fallbacks, the prior before any sample, and how the router applies it."""

from __future__ import annotations

import pytest

from pdserve.router.pricing.cost import CostModel
from pdserve.router.pricing.link_rates import MAX_BYTES_PER_S, LinkRates, fit_link
from pdserve.router.state.snapshot import Snapshot

PRIOR = CostModel()


def test_an_exact_line_is_recovered_per_path_with_one_overhead():
    same = [(n, 0.002 + n / 4e9, True) for n in (1 << 16, 1 << 18, 1 << 20)]
    cross = [(n, 0.002 + n / 1e9, False) for n in (1 << 17, 1 << 19)]
    price = fit_link(same + cross, PRIOR)
    assert price.overhead_s == pytest.approx(0.002, rel=1e-9)
    assert price.same_host_bytes_per_s == pytest.approx(4e9, rel=1e-9)
    assert price.cross_host_bytes_per_s == pytest.approx(1e9, rel=1e-9)
    assert price.num_samples == 5


def test_one_path_measured_leaves_the_other_at_the_prior_below_the_same_host_rate():
    price = fit_link([(n, 0.001 + n / 2e9, True) for n in (1000, 5000)], PRIOR)
    assert price.same_host_bytes_per_s == pytest.approx(2e9, rel=1e-9)
    assert price.cross_host_bytes_per_s == pytest.approx(2e9, rel=1e-9)  # the 5 GB/s prior, capped at the measured same-host rate
    slow_cross = fit_link([(n, 0.001 + n / 1e8, False) for n in (1000, 5000)], PRIOR)
    assert slow_cross.same_host_bytes_per_s == PRIOR.same_host_bytes_per_s
    assert slow_cross.cross_host_bytes_per_s == pytest.approx(1e8, rel=1e-9)


def test_fallbacks_clamp_the_overhead_and_take_each_path_s_rate_beyond_it():
    one = fit_link([(10_000, 0.003, True)], PRIOR)  # one point: the prior's 1 ms overhead, the rest is the link
    assert one.overhead_s == PRIOR.transfer_overhead_s
    assert one.same_host_bytes_per_s == pytest.approx(10_000 / 0.002, rel=1e-12)
    tiny = fit_link([(10_000, 0.0004, True)], PRIOR)  # faster than the prior overhead: clamped to the sample
    assert tiny.overhead_s == 0.0004 and tiny.same_host_bytes_per_s == MAX_BYTES_PER_S
    falling = [(1000, 0.005, True), (2000, 0.004, True), (3000, 0.003, True)]  # slope < 0: not a price
    price = fit_link(falling, PRIOR)
    assert price.overhead_s == 0.003  # the fit's 6 ms clamped to the fastest sample
    assert price.same_host_bytes_per_s == pytest.approx(6000 / 0.003, rel=1e-12)


def test_rates_apply_after_the_first_sample_and_keep_the_step_terms():
    rates = LinkRates(PRIOR)
    base = CostModel(prefill_s_per_token=3e-4, fitted=True)
    assert rates.apply(base) is base  # the prior stands
    rates.observe(1 << 20, 0.002, True)
    assert rates.apply(PRIOR) is PRIOR  # placeholders stay whole: a measured link is weighed only against measured steps
    rates.observe(0, 1.0, True)  # nothing moved: no sample
    priced = rates.apply(base)
    assert priced is rates.apply(base)  # one object until the price changes
    assert (priced.transfer_overhead_s, priced.same_host_bytes_per_s) == (0.001, pytest.approx((1 << 20) / 0.001))
    assert priced.prefill_s_per_token == 3e-4 and priced.steps_of is base
    assert float(priced.transfer_s(1 << 20, 1)) == pytest.approx(0.002, rel=1e-12)
    snapshot = object.__new__(Snapshot)
    snapshot.__dict__["derived_cache"] = [(base, "terms of base")]
    assert snapshot.derived(priced) == "terms of base"  # the load terms of the base serve the priced model
