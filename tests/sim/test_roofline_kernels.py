"""The roofline charges each kernel class on its own roofline (GEMMs, prefill attention, decode
attention), and TP all-reduces at NVLink's one-direction bandwidth (docs/planner.md, "Kernels,
not one fused step"). These hold the plain roofline: the A100 profile without its measured kernel
terms (`test_measured_kernels.py` holds those)."""

from __future__ import annotations


import pytest

from pdserve.ledger.phase import (
    attention_flops,
    decode_work,
    linear_flops,
    lower_bound_s,
    mixed_work,
    prefill_causal_pairs,
    prefill_work,
)
from pdserve.latency.geometry import load_model_spec
from pdserve.latency.hardware import load_hardware
from pdserve.latency.roofline import RooflineLatency


@pytest.fixture(scope="module")
def a100_13b():
    spec, hw = load_model_spec("llama-13b-class"), _flat_a100()
    return spec.geometry, hw, RooflineLatency(spec, hw)


def _flat_a100():
    return load_hardware("a100-80g").without_measured_kernels()


def test_a_mixed_step_pays_the_chunk_compute_and_the_decode_kv_read(a100_13b):
    g, hw, model = a100_13b
    c, r = hw.effective_flops_per_s, hw.effective_bytes_per_s
    chunk, batch, per_seq = 1024, 128, 1000
    pairs = prefill_causal_pairs(chunk, 0)
    step = model.mixed_step_s(chunk, pairs, 2 * chunk, 0.5, batch, batch * per_seq)
    # GEMMs over chunk + decode rows are compute-bound; the chunk's attention too; the decodes' is a K/V read
    expected = (hw.step_overhead_s + linear_flops(g, chunk + batch) / c + attention_flops(g, pairs) / c
                + g.kv_bytes_per_token * (batch * per_seq + batch) / r)
    assert step == pytest.approx(expected, rel=1e-12)
    # the fused bound hid the decode batch's K/V read under the chunk's compute
    fused = lower_bound_s(mixed_work([prefill_work(g, chunk, 0), decode_work(g, [per_seq] * batch)]), c, r)
    assert step - hw.step_overhead_s > fused * 1.25


def test_a_large_decode_batch_adds_its_row_compute_to_its_kv_read(a100_13b):
    g, hw, model = a100_13b
    c, r = hw.effective_flops_per_s, hw.effective_bytes_per_s
    batch, context = 256, 256 * 1000
    assert linear_flops(g, batch) / c > g.weight_bytes / r  # past the GEMM ridge
    expected = hw.step_overhead_s + linear_flops(g, batch) / c + g.kv_bytes_per_token * (context + batch) / r
    assert model.decode_step_s(batch, context) == pytest.approx(expected, rel=1e-12)
    d0, d1 = model.decode_segment_s(batch, context)
    assert (d0, d0 + d1) == pytest.approx((expected, model.decode_step_s(batch, context + batch)), rel=1e-12)


@pytest.mark.parametrize("new,cached", [(1, 0), (64, 1000), (300, 0), (512, 0), (2048, 0), (200, 3000)])
def test_never_below_the_ledger_bound(a100_13b, new, cached):
    g, hw, model = a100_13b
    bound = lower_bound_s(prefill_work(g, new, cached), hw.effective_flops_per_s, hw.effective_bytes_per_s)
    assert model.prefill_s(new, cached) >= bound + hw.step_overhead_s - 1e-15
    lengths = [cached + new] * 8
    dbound = lower_bound_s(decode_work(g, lengths), hw.effective_flops_per_s, hw.effective_bytes_per_s)
    assert model.decode_step_s(8, sum(lengths)) >= dbound + hw.step_overhead_s - 1e-15


def test_all_reduces_run_at_nvlink_one_direction():
    spec, hw = load_model_spec("llama-13b-class"), _flat_a100()
    assert hw.nvlink_send_bytes_per_s == 300e9  # the datasheet's 600 GB/s counts both directions
    g = spec.geometry
    tp2 = RooflineLatency(spec, hw, tp=2)
    per_row = 2 * g.layers * 2 * (1 / 2) * g.d_model * g.dtype_bytes  # two ring all-reduces per layer
    single = RooflineLatency(spec, hw)
    # 4096 rows: compute-bound GEMMs and attention, so the TP2 step is half the work plus the all-reduces
    rows = 4096
    work = single.prefill_s(rows) - hw.step_overhead_s
    comm = tp2.prefill_s(rows) - hw.step_overhead_s - 2 * g.layers * hw.collective_latency_s - work / 2
    assert comm == pytest.approx(rows * per_row / 300e9, rel=1e-9)
