"""The few-row kernel gives oneDNN's matrix-kernel bits where it is used, and is not used elsewhere."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F

from pdserve.model import matched_gemv, numerics
from pdserve.model.cpu import cpu_report
from pdserve.model.matched_gemv import ROWS_MAX, MatchedWeight, block_for, candidates, pack, unpack
from pdserve.model.numerics import PairedWeight, linear, prepare, probe_invariance
from pdserve.model.onednn_packed import PackedWeight, available as onednn_available

# Where the kernel must match oneDNN: the kind it was measured on (AVX512-BF16 without AMX, oneDNN's
# vdpbf16ps matrix kernel). Elsewhere a shape either matches, under the same bit checks, or stays on
# oneDNN (AMX: its tile kernels may sum otherwise; AVX2: no kernel, no oneDNN bf16).
MUST_MATCH = matched_gemv.available() and cpu_report()["kind"] == "avx512-bf16"
# the 107M checkpoint's fused products and LM head, a tiny model's, and shapes off the 64-column grid
SHAPES = [(1280, 768), (6144, 768), (768, 3072), (2048, 768), (96, 64), (100, 130), (97, 64), (1, 64)]


def _weight(shape, seed):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) / shape[1] ** 0.5).to(torch.bfloat16)  # [N, K]


def test_candidates_and_layout_round_trip():
    assert candidates(768) == (32, 64, 128, 256, 512, 768)
    assert candidates(1024) == (32, 64, 128, 256, 512, 1024)
    assert candidates(32) == (32,)
    w = _weight((100, 130), 1)
    packed = pack(w)
    assert packed.shape == (2, 65, 64, 2)  # 100 columns padded to two groups of 64
    assert torch.equal(packed[0, 3, 5], w[5, 6:8])  # pair 3 of column 5
    assert torch.equal(packed[1, :, 36:].float().abs().sum(), torch.tensor(0.0))  # padding columns are zero
    assert torch.equal(unpack(packed, 100), w)


@pytest.mark.parametrize("shape", SHAPES)
def test_matched_rows_equal_onednn_among_many_rows(shape):
    """A row's bits from the kernel equal its bits in oneDNN's products of 4, 9 and 33 rows;
    where the kernel cannot match here (no AVX512-BF16 or no oneDNN bf16) it is not built."""
    w = _weight(shape, shape[0])
    matched = MatchedWeight.build(w)
    if matched is None:
        assert not MUST_MATCH
        return
    assert matched.kb in candidates(shape[1])
    onednn = PackedWeight(w)
    gen = torch.Generator().manual_seed(7)
    for rows in range(1, ROWS_MAX + 1):
        x = torch.randn(rows, shape[1], generator=gen).to(torch.bfloat16)  # [T, K]
        out = matched.product(x)
        for mates in (4, 9, 33):
            batch = torch.randn(max(mates, rows), shape[1], generator=gen).to(torch.bfloat16)
            batch[-rows:] = x  # the rows last among their mates
            assert torch.equal(out, onednn(batch)[-rows:])
    strided = torch.randn(2, 2 * shape[1], generator=gen).to(torch.bfloat16)[:, ::2]  # elements not contiguous
    assert torch.equal(matched.product(strided), onednn(torch.cat([strided, strided, strided])[:4])[:2])


@pytest.mark.parametrize("shape", SHAPES)
def test_the_matched_weight_reads_onednns_bytes_in_place_where_they_are_its_layout(shape):
    """One copy of a weight where oneDNN's blocked bytes are the kernel's layout (compared at load),
    its own copy elsewhere; the same bits either way, and oneDNN's memory lives as long as it."""
    w = _weight(shape, shape[0])
    if not onednn_available():  # AVX2: oneDNN packs no bf16 weight, so there are no bytes to share and no kernel
        assert MatchedWeight.build(w) is None and not MUST_MATCH
        plain = prepare(w, "native")  # the engine's holder keeps torch's plain weight
        assert isinstance(plain, torch.Tensor) and torch.equal(plain, w)
        return
    onednn = PackedWeight(w)
    shared, own = MatchedWeight.build(w, onednn), MatchedWeight.build(w)
    if shared is None:
        assert own is None and not MUST_MATCH
        return
    assert not own.shares_onednn_bytes
    if MUST_MATCH and shape[0] % 64 == 0:  # oneDNN's AVX512-BF16 blocking: the 107M checkpoint's products
        assert shared.shares_onednn_bytes
    if shared.shares_onednn_bytes:
        assert shared.packed.data_ptr() == onednn.raw().data_ptr() and shared.owner is onednn
        assert torch.equal(shared.packed.view(torch.int16), own.packed.view(torch.int16))
    del onednn
    gc.collect()
    x = torch.randn(ROWS_MAX, shape[1], generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)  # [T, K]
    assert torch.equal(shared.product(x), own.product(x)) and torch.equal(shared.weight, w)
    paired = prepare(w, "native")  # the engine's holder: the matched kernel over oneDNN's bytes where they fit
    assert paired.matched.shares_onednn_bytes == shared.shares_onednn_bytes
    assert not paired.matched.shares_onednn_bytes or paired.matched.owner is paired.inner


def test_paired_plan_runs_few_rows_matched_and_stays_invariant():
    shapes = ((1280, 768), (768, 3072))
    bad = probe_invariance("paired", torch.bfloat16, shapes, torch.get_num_threads())
    # invariant on the kind the kernel was built for; elsewhere (AMX: oneDNN's tile kernels may sum
    # a lone row otherwise) the start-up probe must catch it and serve another plan
    assert bad is None or not MUST_MATCH, bad
    if bad is not None:
        assert numerics.choose_plan(torch.bfloat16, True, shapes).plan != "paired"
    w = _weight((1280, 768), 3)
    paired = prepare(w, "paired")
    assert isinstance(paired, PairedWeight)
    assert paired.matched is not None or not MUST_MATCH
    x = torch.randn(3, 768).to(torch.bfloat16)
    assert torch.equal(linear(x, paired), F.linear(torch.cat([x, x]), w)[:3])  # oneDNN's (or torch's) 6-row bits


def test_another_thread_count_falls_back_to_onednn(monkeypatch):
    """The blocking was checked at one thread count: at another, rows go to oneDNN (padded)."""
    w = _weight((1280, 768), 4)
    paired = prepare(w, "paired")
    x = torch.randn(1, 768).to(torch.bfloat16)
    calls, product = [], numerics._product
    monkeypatch.setattr(numerics, "_product", lambda a, b, bias=None: calls.append(a.shape[0]) or product(a, b, bias))
    if paired.matched is not None:  # (without the kernel, AVX2: always oneDNN, padded)
        monkeypatch.setattr(torch, "get_num_threads", lambda: paired.matched.threads + 1)
        assert paired.matched.product(x) is None
    out = linear(x, paired)
    assert calls == [numerics.ONE_ROW_AS] and torch.equal(out, F.linear(x.expand(4, 768), w)[:1])


def test_bad_inputs_are_refused():
    assert block_for(64, 33, torch.get_num_threads()) is None  # an odd inner dimension has no pairs
    assert block_for(64, 32, torch.get_num_threads() + 1) is None  # not the running thread count
    assert MatchedWeight.build(torch.randn(64, 32)) is None  # fp32: oneDNN's bf16 kernel is not involved
    matched = MatchedWeight.build(_weight((96, 64), 5))
    if matched is None:
        assert not MUST_MATCH
        return
    assert matched.product(torch.randn(ROWS_MAX + 1, 64).to(torch.bfloat16)) is None  # more rows: oneDNN's
    with pytest.raises(ValueError, match="bf16 rows"):
        matched_gemv.product(torch.randn(2, 64), matched.packed, 96, matched.kb)  # fp32 rows
    with pytest.raises(ValueError, match="bf16 rows"):
        matched_gemv.product(torch.randn(2, 66).to(torch.bfloat16), matched.packed, 96, matched.kb)
    with pytest.raises(ValueError, match="refused"):
        matched_gemv.product(torch.randn(2, 64).to(torch.bfloat16), matched.packed, 96, 3)  # odd block


@pytest.mark.skipif(not onednn_available(), reason="no oneDNN bf16 packing in this torch build")
def test_engine_weights_are_held_twice_at_most():
    """The oneDNN copy holds no plain tensor, so with the matched copy a weight is held twice."""
    w = _weight((1280, 768), 6)
    paired = prepare(w, "paired")
    assert "weight" not in vars(paired.inner) and "weight" not in vars(paired)
    assert torch.equal(paired.weight, w)


def test_plan_description_counts_matched_weights():
    weights = [prepare(_weight((96, 64), 8), "paired"), prepare(_weight((64, 32), 9).float(), "fast")]
    plan = numerics.ProductPlan("paired", True).with_weights(weights)
    if weights[0].matched is not None:
        assert plan.matched == (1, 2) and plan.describe().endswith("through the matched kernel (oneDNN's bits) in 1 of 2 weights")
    else:
        assert not MUST_MATCH and plan.matched == (0, 2) and "matched" not in plan.describe()


def test_a_bias_is_added_by_onednn_with_the_product():
    """Rows with a bias skip the kernel: oneDNN adds it before its one rounding, as F.linear does."""
    w = _weight((96, 64), 10)
    bias = torch.randn(96).to(torch.bfloat16)
    paired = prepare(w, "paired")
    for rows in (1, 2, 6):
        x = torch.randn(rows, 64).to(torch.bfloat16)
        assert torch.equal(linear(x, paired, bias), F.linear(torch.cat([x] * 4), w, bias)[:rows])
