"""Latency models: the roofline is the ledger's bound, fits recover coefficients, JSON round trips."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pdserve.ledger.phase import decode_work, lower_bound_s, prefill_work
from pdserve.ledger.splitwise import layer_visibility_s
from pdserve.latency.geometry import load_model_spec
from pdserve.latency.hardware import BUILTIN_HARDWARE, load_hardware
from pdserve.latency.base import ConstantLatency
from pdserve.latency.load import latency_from_dict, load_latency_model
from pdserve.latency.profiled import ProfiledLatency, fit_profile
from pdserve.latency.roofline import RooflineLatency
from pdserve.sim.transfer import LinkSpec, visible_at_s


@pytest.mark.parametrize("name", BUILTIN_HARDWARE)
def test_hardware_profiles_cite_datasheets(name):
    hw = load_hardware(name)
    for key in ("peak_bf16_tflops", "hbm_tb_per_s", "memory_gb", "nvlink_gb_per_s", "internode_gb_per_s"):
        assert "Datasheet" in hw.sources[key] or "reference configuration" in hw.sources[key]
    assert hw.peak_flops_per_s > 1e14 and hw.hbm_bytes_per_s > 1e12


def test_h200_differs_from_h100_in_memory_only():
    h100, h200 = load_hardware("h100"), load_hardware("h200")
    assert h100.peak_flops_per_s == h200.peak_flops_per_s
    assert h200.hbm_bytes_per_s > h100.hbm_bytes_per_s and h200.memory_bytes > h100.memory_bytes


def test_example_configs_have_the_requested_geometry():
    g13 = load_model_spec("llama-13b-class").geometry
    g70 = load_model_spec("llama-70b-class").geometry
    assert (g13.layers, g13.d_model, g13.q_heads, g13.d_ff) == (40, 5120, 40, 13824)
    assert (g70.layers, g70.d_model, g70.q_heads, g70.kv_heads, g70.d_ff) == (80, 8192, 64, 8, 28672)


@pytest.mark.parametrize("new,cached", [(512, 0), (64, 1000), (2048, 0)])
def test_roofline_single_gpu_prefill_is_the_ledger_bound_plus_overhead(new, cached):
    # the plain roofline: the A100 profile without its measured kernel terms (kernel_costs.py)
    spec, hw = load_model_spec("llama-13b-class"), load_hardware("a100-80g").without_measured_kernels()
    model = RooflineLatency(spec, hw)
    bound = lower_bound_s(prefill_work(spec.geometry, new, cached), hw.effective_flops_per_s, hw.effective_bytes_per_s)
    assert model.prefill_s(new, cached) == pytest.approx(bound + hw.step_overhead_s, rel=1e-12)


def test_roofline_decode_step_is_the_ledger_bound_plus_overhead():
    # the plain roofline: the H100 profile without its measured kernel terms (kernel_costs.py)
    spec, hw = load_model_spec("llama-70b-class"), load_hardware("h100").without_measured_kernels()
    model = RooflineLatency(spec, hw, tp=8)
    lengths = [700, 900, 1100, 1300]
    bound = lower_bound_s(decode_work(spec.geometry, lengths), 8 * hw.effective_flops_per_s, 8 * hw.effective_bytes_per_s)
    comm = model.decode_step_s(4, sum(lengths)) - bound - hw.step_overhead_s
    assert comm > 0  # the TP all-reduces are extra
    assert comm == pytest.approx(model.decode_step_s(4, 10 * sum(lengths)) - lower_bound_s(
        decode_work(spec.geometry, [10 * x for x in lengths]), 8 * hw.effective_flops_per_s, 8 * hw.effective_bytes_per_s
    ) - hw.step_overhead_s)


def test_tensor_parallel_speeds_up_and_pipeline_keeps_latency():
    spec, hw = load_model_spec("llama-13b-class"), load_hardware("a100-80g")
    one, tp2, pp2 = (RooflineLatency(spec, hw, tp, pp) for tp, pp in ((1, 1), (2, 1), (1, 2)))
    assert one.prefill_s(1024) / 2 < tp2.prefill_s(1024) < one.prefill_s(1024)
    assert pp2.prefill_s(1024) >= one.prefill_s(1024) and pp2.pipeline_stages == 2
    assert pp2.kv_capacity_tokens > 2 * one.kv_capacity_tokens


@pytest.mark.parametrize("make", [
    lambda: RooflineLatency(load_model_spec("llama-13b-class"), load_hardware("h100"), 2, 2),
    lambda: ConstantLatency(10, 5),
    lambda: ProfiledLatency((0.01, 1e-4, 1e-8), (0.005, 1e-4, 1e-7)),
])
def test_decode_segment_matches_two_steps(make):
    model = make()
    d0, d1 = model.decode_segment_s(12, 12 * 800)
    assert d0 == pytest.approx(model.decode_step_s(12, 12 * 800))
    assert d0 + d1 == pytest.approx(model.decode_step_s(12, 12 * 801))


def test_profile_fit_recovers_known_coefficients():
    true_p, true_d = (0.02, 3e-4, 2e-8), (0.004, 2e-4, 5e-8)
    prefill = [(n, true_p[0] + true_p[1] * n + true_p[2] * n * (n + 1) / 2) for n in (32, 128, 512, 1024)]
    decode = [(b, c, true_d[0] + true_d[1] * b + true_d[2] * c) for b in (1, 8, 32) for c in (100 * b, 900 * b)]
    fit = fit_profile(prefill, decode, kv_bytes_per_token=8)
    assert np.allclose(fit.prefill_coef, true_p, rtol=1e-6) and np.allclose(fit.decode_coef, true_d, rtol=1e-6)
    again = latency_from_dict(json.loads(json.dumps(fit.to_dict())))
    assert again.prefill_s(300) == pytest.approx(fit.prefill_s(300))


def test_profile_keeps_a_decode_base_per_measured_batch():
    """A step whose cost jumps between 1 and 4 rows (GEMV vs small GEMM) is not affine in the
    batch; the per-batch bases recover it exactly and interpolate between measured sizes."""
    bases, per_token = {1: 0.045, 4: 0.150, 16: 0.200}, 2e-6
    decode = [(b, c, bases[b] + per_token * c) for b in bases for c in (100 * b, 900 * b)]
    fit = fit_profile([(16, 0.01), (64, 0.03), (128, 0.06)], decode)
    assert [b for b, _ in fit.decode_batch_base] == [1, 4, 16]
    assert np.allclose([t for _, t in fit.decode_batch_base], [0.045, 0.150, 0.200], rtol=1e-9)
    assert fit.decode_context_s == pytest.approx(per_token, rel=1e-9)
    for b, c, t in decode:
        assert fit.decode_step_s(b, c) == pytest.approx(t, rel=1e-9)
    assert fit.decode_step_s(2, 0) == pytest.approx(0.045 + (0.150 - 0.045) / 3)  # between 1 and 4
    slope = fit.decode_coef[1]  # past the largest measured batch: the affine fit's per-sequence slope
    assert fit.decode_step_s(20, 0) == pytest.approx(0.200 + 4 * slope)
    again = latency_from_dict(json.loads(json.dumps(fit.to_dict())))
    assert again.decode_step_s(3, 500) == fit.decode_step_s(3, 500)


def test_fit_never_returns_negative_coefficients():
    decode = [(1, 100, 0.010), (2, 200, 0.009), (4, 400, 0.0095), (8, 800, 0.0098)]
    fit = fit_profile([(16, 0.01), (64, 0.03), (128, 0.06)], decode)
    assert min(fit.prefill_coef + fit.decode_coef) >= 0


def test_constant_model_file(tmp_path):
    path = tmp_path / "c.json"
    path.write_text('{"kind": "constant", "prefill_ms": 20, "decode_step_ms": 4}')
    model = load_latency_model(path)
    assert model.prefill_s(999) == pytest.approx(0.02) and model.decode_step_s(64, 10**6) == pytest.approx(0.004)
    with pytest.raises(ValueError):
        latency_from_dict({"kind": "nope"})


@pytest.mark.parametrize("free_s", [0.0, 0.05, 0.2])
@pytest.mark.parametrize("per_layer_s,transfer_s", [(0.025, 0.010), (0.005, 0.030)])
def test_layerwise_closed_form_matches_the_ledger_recurrence(free_s, per_layer_s, transfer_s):
    layers, start = 4, 0.0
    ready = [start + (l + 1) * per_layer_s for l in range(layers)]
    ledger = layer_visibility_s([max(r, free_s) for r in ready], [transfer_s] * layers)
    link = LinkSpec(1.0, "layer", layers)
    got = visible_at_s(start, ready[-1], free_s, transfer_s * layers, link)
    assert got == pytest.approx(ledger[-1])
    request = visible_at_s(start, ready[-1], free_s, transfer_s * layers, LinkSpec(1.0, "request", layers))
    assert got <= request


def test_spec_example_per_layer_visibility():
    """Ready [25, 50, 75, 100] ms, 10 ms per layer: 110 ms layer-wise, 140 ms request-level."""
    link = LinkSpec(1.0, "layer", 4)
    assert visible_at_s(0.0, 0.100, 0.0, 0.040, link) == pytest.approx(0.110)
    assert visible_at_s(0.0, 0.100, 0.0, 0.040, LinkSpec(1.0, "request", 4)) == pytest.approx(0.140)
