"""The start-up invariance probe is strong enough: whatever product plan it accepts keeps a row's
bits alone and among others for 64 rows, not only the one row it happened to sample (a BLAS's
one-row path differs from its many-row path for roughly one bf16 row in twelve on some CPUs)."""

from __future__ import annotations

import pytest
import torch

from pdserve.model import bf16_gemm
from pdserve.model.numerics import ONE_ROW_AS, choose_plan, linear, prepare

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


def test_the_paired_plan_runs_one_row_as_the_first_of_several():
    gen = torch.Generator().manual_seed(3)
    w = (torch.randn(96, 64, generator=gen) / 8).to(torch.bfloat16)
    x = torch.randn(1, 64, generator=gen).to(torch.bfloat16)
    paired = prepare(w, "paired")
    assert ONE_ROW_AS >= 2
    pair = torch.nn.functional.linear(x.expand(ONE_ROW_AS, 64), w)[:1]
    assert torch.equal(linear(x, paired), pair) and linear(x, paired).shape == (1, 96)
    many = torch.randn(5, 64, generator=gen).to(torch.bfloat16)
    assert torch.equal(linear(many, paired), torch.nn.functional.linear(many, w))
    for rows in range(2, ONE_ROW_AS):  # fewer rows: the first repeated up to ONE_ROW_AS, the same bits as alone
        few = many[:rows]
        padded = torch.cat([few, few[:1].expand(ONE_ROW_AS - rows, 64)])
        got = linear(few, paired)
        assert got.shape == (rows, 96) and torch.equal(got, torch.nn.functional.linear(padded, w)[:rows])
    for plan in ("paired", "native", "fast", "tiled", "kernel"):  # an empty step's product: [0, N], no padding
        if plan == "kernel" and not bf16_gemm.vectorised():
            continue
        none = linear(many[:0], prepare(w, plan))
        assert none.shape == (0, 96) and none.dtype == torch.bfloat16
