"""The optimised cost-aware policies pick exactly what a plain double loop picks."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.router.router_fixtures import entry
from tests.router.router_reference import reference_cost_aware

from pdserve.router.messages import Role, RouteRequest
from pdserve.router.policy.plan import predicted_clocks
from pdserve.router.policy.policies import Choice, PolicyContext, prefix_aware, slo_aware
from pdserve.router.pricing.cost import CostModel
from pdserve.router.state.snapshot import make_snapshot
from pdserve.router.synthetic import chain

pytestmark = pytest.mark.usefixtures("kernel_path")  # each test: compiled kernels, then numpy

CHAINS = [chain(c, 7, 8) for c in range(3)]  # three 8-block prefix chains
ALL_HASHES = sorted({h for c in CHAINS for h in c})
COST = CostModel(kv_bytes_per_token=1024, same_host_bytes_per_s=4e6, cross_host_bytes_per_s=1e6)


def held_sets():
    """Either a leading run of one chain (what an LRU prefix cache holds) or an arbitrary subset."""
    runs = st.builds(lambda c, k: frozenset(CHAINS[c][:k]), st.integers(0, 2), st.integers(0, 8))
    return st.one_of(runs, st.frozensets(st.sampled_from(ALL_HASHES), max_size=10))


def workers(role: Role, prefix: str):
    load = st.fixed_dictionaries(
        {
            "host": st.sampled_from(["h0", "h1", "h2"]),
            "pending": st.sampled_from([0, 16, 32, 400, 4000]),
            "batch": st.integers(0, 4),
            "free": st.integers(0, 30),
            "held": held_sets(),
        }
    )
    return st.lists(load, min_size=1, max_size=7).map(
        lambda loads: [entry(f"{prefix}{i}", role, **kw) for i, kw in enumerate(loads)]
    )


requests = st.builds(
    lambda c, shared, tail, out, ttft, tpot: RouteRequest(
        "r", len(CHAINS[c][:shared]) * 16 + tail, out, tuple(CHAINS[c][:shared]), ttft, tpot
    ),
    st.integers(0, 2),
    st.integers(0, 8),
    st.integers(1, 40),
    st.integers(0, 200),
    st.sampled_from([None, 0.05, 0.3, 10.0]),
    st.sampled_from([None, 0.0105, 0.0112, 1.0]),
)


def same(got, want, snapshot, request) -> bool:
    if isinstance(want, Choice):
        # the TTFT a cost-aware choice hands to the plan is the plan's own formula, bit for bit
        return got == want and got.ttft_s == predicted_clocks(snapshot, request, got, COST)[0]
    return not isinstance(got, Choice) and got.reason == want.reason and abs(got.retry_after_s - want.retry_after_s) < 1e-12


@settings(max_examples=400, deadline=None)
@given(workers(Role.PREFILL, "p"), workers(Role.DECODE, "d"), requests, st.booleans())
def test_disaggregated_policies_match_reference(prefill, decode, request, use_prefix):
    snapshot = make_snapshot(prefill, decode)
    ctx = PolicyContext(COST, ttft_slo_s=1.0, tpot_slo_s=0.011)
    policy = prefix_aware if use_prefix else slo_aware
    want = reference_cost_aware(snapshot, request, ctx)
    assert same(policy(snapshot, request, ctx), want, snapshot, request)


@settings(max_examples=200, deadline=None)
@given(workers(Role.COLOCATED, "w"), requests, st.booleans())
def test_colocated_policies_match_reference(pool, request, use_prefix):
    snapshot = make_snapshot(pool, [], colocated=True)
    ctx = PolicyContext(COST, ttft_slo_s=1.0, tpot_slo_s=0.011)
    policy = prefix_aware if use_prefix else slo_aware
    want = reference_cost_aware(snapshot, request, ctx)
    assert same(policy(snapshot, request, ctx), want, snapshot, request)
