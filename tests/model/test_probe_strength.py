"""The start-up invariance probe is strong enough: whatever product plan it accepts keeps a row's
bits alone and among others for 64 rows, not only the one row it happened to sample (a BLAS's
one-row path differs from its many-row path for roughly one bf16 row in twelve on some CPUs)."""

from __future__ import annotations

import pytest
import torch

from pdserve.model.numerics import choose_plan, linear, prepare

SHAPES = ((768, 512), (2816, 512), (512, 1408), (259, 512))  # the default tiny model's products


@pytest.mark.parametrize("compute", [torch.bfloat16, torch.float32])
def test_the_accepted_plan_is_invariant_for_many_rows(compute):
    plan = choose_plan(compute, True, SHAPES)
    gen = torch.Generator().manual_seed(77)
    for n, k in SHAPES:
        weight = prepare((torch.randn(n, k, generator=gen) / k**0.5).to(compute), plan.plan)
        rows = torch.randn(64, k, generator=gen).to(compute)  # [64, K]
        alone = torch.stack([linear(rows[i:i + 1], weight)[0] for i in range(64)])
        pairs = torch.cat([linear(rows[i:i + 2], weight)[:1] for i in range(63)])  # row i first of two
        assert torch.equal(pairs, alone[:63]), (plan, n, k)
        assert torch.equal(linear(rows, weight), alone), (plan, n, k)
