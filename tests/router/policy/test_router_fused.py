"""The fused prefix-aware kernel (lookup + caps + pair search in one call) decides exactly as the
general path does, and it is the path loose-capacity requests with a prefix hit take."""

from __future__ import annotations

import random

import pytest

from pdserve.router import kernels
from pdserve.router.policy import policies
from pdserve.router.policy.policies import Choice, PolicyContext, prefix_aware
from pdserve.router.synthetic import random_router


@pytest.fixture
def compiled():
    saved = kernels.enabled
    kernels.enabled = True
    yield
    kernels.enabled = saved


@pytest.mark.parametrize("colocated", [False, True])
@pytest.mark.parametrize("tpot_slo_s", [0.05, 0.02])  # loose, and one that excludes busy decode slots
def test_fused_equals_general_path(compiled, monkeypatch, colocated, tpot_slo_s):
    router, workload = random_router(3, 8, 8, "prefix", colocated=colocated)
    snapshot, rng = router.snapshot(), random.Random(4)
    ctx = PolicyContext(router.config.cost, ttft_slo_s=5.0, tpot_slo_s=tpot_slo_s)
    requests = [workload.request(rng, f"r{i}") for i in range(300)]
    fused_calls = []
    real = policies._prefix_fused

    def counting(*args):
        out = real(*args)
        fused_calls.append(out is not None)
        return out

    monkeypatch.setattr(policies, "_prefix_fused", counting)
    got = [prefix_aware(snapshot, r, ctx) for r in requests]
    monkeypatch.setattr(policies, "_prefix_fused", lambda *a: None)  # the general path only
    want = [prefix_aware(snapshot, r, ctx) for r in requests]
    for g, w in zip(got, want):
        if isinstance(w, Choice):
            assert g == w and g.ttft_s == w.ttft_s
        else:
            assert type(g) is type(w) and g.reason == w.reason and g.retry_after_s == w.retry_after_s
    assert sum(fused_calls) > 100  # most of these requests hit some worker's prefix
    assert any(isinstance(w, Choice) and w.prefill_hit_blocks > 0 for w in want)
