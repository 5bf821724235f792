"""bf16 weights packed once for oneDNN give F.linear's exact bits, and the product plans use them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.model import onednn_packed
from pdserve.model.numerics import ONE_ROW_AS, PairedWeight, dense, linear, prepare
from pdserve.model.matched_gemv import MatchedWeight
from pdserve.model.onednn_packed import PackedWeight

pytestmark = pytest.mark.skipif(not onednn_packed.available(), reason="no oneDNN bf16 packing in this torch build")


@pytest.mark.parametrize("shape", [(1280, 768), (768, 3072), (96, 64)])
@pytest.mark.parametrize("rows", [1, 2, 7, 32, 130])
def test_packed_products_equal_f_linear_bit_for_bit(shape, rows):
    gen = torch.Generator().manual_seed(rows)
    w = (torch.randn(*shape, generator=gen) / shape[1] ** 0.5).to(torch.bfloat16)  # [N, K]
    bias = torch.randn(shape[0], generator=gen).to(torch.bfloat16)
    x = torch.randn(rows, shape[1], generator=gen).to(torch.bfloat16)  # [T, K]
    packed = PackedWeight(w)
    assert torch.equal(packed(x), F.linear(x, w))
    assert torch.equal(packed(x, bias), F.linear(x, w, bias))
    assert torch.equal(linear(x[:, :], packed, bias), F.linear(x, w, bias))
    assert torch.equal(packed(x.t().contiguous().t()), F.linear(x, w))  # a strided input is made contiguous


def test_plans_pack_bf16_weights_only_and_keep_the_plain_values():
    w = torch.randn(64, 32).to(torch.bfloat16)
    matched = MatchedWeight.build(w) is not None  # the few-row kernel reproduces oneDNN here (AVX512-BF16)
    native, paired, fast = (prepare(w, plan) for plan in ("native", "paired", "fast"))
    for unpadded in (native, fast):
        if matched:  # few rows go to the matched kernel, never padded
            assert isinstance(unpadded, PairedWeight) and unpadded.matched is not None
            assert isinstance(unpadded.inner, PackedWeight)
        else:
            assert isinstance(unpadded, PackedWeight)
    assert isinstance(paired, PairedWeight) and isinstance(paired.inner, PackedWeight)
    assert (paired.matched is not None) == matched
    assert all(torch.equal(dense(p), w) for p in (native, paired, fast))
    assert isinstance(prepare(w.float(), "fast"), torch.Tensor)  # fp32 stays on MKL
    x = torch.randn(1, 32).to(torch.bfloat16)
    repeated = x.expand(ONE_ROW_AS, 32)
    for p in (paired, native, fast) if matched else (paired,):  # one row gets the bits it gets among four
        assert torch.equal(linear(x, p), F.linear(repeated, w)[:1])


def test_packed_weight_holds_no_plain_copy_and_rebuilds_it():
    w = torch.randn(96, 64).to(torch.bfloat16)
    packed = PackedWeight(w)
    assert "weight" not in vars(packed) and packed.shape == (96, 64)
    assert torch.equal(packed.weight, w)
