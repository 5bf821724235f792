"""The A100 profile's measured kernel terms (docs/planner.md, "Measured kernels on the A100"):
one GEMM kernel and one all-reduce to exact numbers, the roofline built from them, TP's
all-reduces on NVLink with only PP's node-crossing hops on the NIC, and a prefill pipeline that
no prompt overtakes."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import pytest

from pdserve.latency.base import LatencyModel
from pdserve.latency.geometry import load_model_spec
from pdserve.latency.hardware import load_hardware
from pdserve.latency.kernel_costs import AllReduceTable, ElementwiseCost, GemmCurve, layer_gemms
from pdserve.latency.roofline import RooflineLatency
from pdserve.sim.prefill_pool import PrefillPolicy, run_prefill_pool

CURVE = GemmCurve(peak_flops_per_s=312e12, peak_bytes_per_s=2.039e12, compute_efficiency_max=0.9,
                  compute_half_flops=4e9, compute_ramp_exponent=0.5, memory_efficiency=0.7, kernel_floor_s=5e-6)


def test_layer_gemms_hold_the_layer_weights_split_over_the_ranks():
    g = load_model_spec("llama-13b-class").geometry
    assert sum(n * k for n, k in layer_gemms(g, 1)) == g.params_per_layer
    assert sum(n * k for n, k in layer_gemms(g, 4)) * 4 == g.params_per_layer
    g70 = load_model_spec("llama-70b-class").geometry  # 8 K/V heads: at tp 16 each rank keeps one
    assert layer_gemms(g70, 16)[0] == ((64 // 16 + 2) * 128, 8192)


def test_a_gemm_is_its_memory_time_plus_the_floor_or_its_ramped_compute():
    # one row: memory-bound, bytes = weights + input + output
    assert CURVE.seconds(1, 4096, 4096, 2) == pytest.approx(
        2 * (4096 * 4096 + 4096 + 4096) / (2.039e12 * 0.7) + 5e-6, rel=1e-12)
    # F = F_half: half the peak efficiency
    m, n, k = 2000, 1000, 1000  # F = 4e9
    assert CURVE.seconds(m, n, k, 2) == pytest.approx(4e9 / (312e12 * 0.9 / 2), rel=1e-12)
    # large: the ramp fades, sqrt(4e9 / F) of extra time
    m, n, k = 4096, 8192, 8192
    f = 2 * m * n * k
    assert CURVE.seconds(m, n, k, 2) == pytest.approx(f * (1 + math.sqrt(4e9 / f)) / (312e12 * 0.9), rel=1e-12)
    assert CURVE.seconds(0, n, k, 2) == 0.0


def test_elementwise_kernels_read_and_write_the_activation_at_every_tp():
    cost = ElementwiseCost(kernels=6, floor_s=3e-6, bytes_per_s=1e12)
    assert cost.seconds(100, 5120, 2) == pytest.approx(6 * (3e-6 + 2 * 100 * 5120 * 2 / 1e12), rel=1e-12)
    assert cost.seconds(0, 5120, 2) == 0.0
    spec, hw = load_model_spec("opt-13b"), load_hardware("a100-80g")
    # replicated on every rank: the same at tp 1 and tp 4
    per_layer = hw.elementwise.seconds(607, spec.geometry.d_model, 2)
    assert per_layer == pytest.approx(6 * (3e-6 + 2 * 607 * 5120 * 2 / (2.039e12 * 0.694)), rel=1e-12)


def test_all_reduce_interpolates_the_measured_points():
    table = AllReduceTable(((2, ((1e3, 10e-6), (1e5, 40e-6), (1e6, 100e-6))), (8, ((1e3, 20e-6), (1e6, 200e-6)))))
    assert table.seconds(1e5, 2) == pytest.approx(40e-6)
    assert table.seconds(1e4, 2) == pytest.approx(20e-6)  # half way in log size: geometric mean of 10 and 40
    assert table.seconds(10, 2) == 10e-6  # below the smallest: its latency
    assert table.seconds(2e6, 2) == pytest.approx(100e-6 + 1e6 * 60e-6 / 9e5)  # past the largest: its bandwidth
    assert table.seconds(1e3, 4) == 20e-6  # an unmeasured degree takes the next larger one
    assert table.seconds(1e5, 1) == 0.0
    with pytest.raises(ValueError):
        AllReduceTable(((2, ((1e3, 1e-5), (1e3, 2e-5))),))


def test_the_a100_roofline_is_its_measured_kernels():
    spec, hw = load_model_spec("opt-13b"), load_hardware("a100-80g")
    g = spec.geometry
    model = RooflineLatency(spec, hw, tp=2)
    rows = 607
    gemms = g.layers * sum(hw.gemm.seconds(rows, n, k, 2) for n, k in layer_gemms(g, 2))
    comm = 2 * g.layers * hw.allreduce.seconds(rows * g.d_model * 2, 2)
    # six elementwise kernels per layer, each a full activation read and write plus a 3 us floor
    elementwise = g.layers * 6 * (3e-6 + 2 * rows * g.d_model * 2 / (2.039e12 * 0.694))
    # each layer's causal kernel on the measured context-attention curve, one rank's 20 heads
    pairs = rows * (rows + 1) // 2
    flops, nbytes = 4 * (g.q_heads // 2) * g.head_dim * pairs, 2 * rows * 2 * (g.kv_heads // 2) * g.head_dim * 2
    compute = flops * (1 + (22.62e9 / flops) ** 0.612) / (312e12 * 0.56)
    attn = g.layers * max(compute, nbytes / (2.039e12 * 0.171) + 14.63e-6)
    assert model.prefill_s(rows) == pytest.approx(hw.step_overhead_s + gemms + comm + elementwise + attn, rel=1e-12)
    assert hw.allreduce.seconds(512, 2) == pytest.approx(9.98e-6)  # NCCL's smallest measured message, tp 2


def test_measured_tp_scales_below_the_flat_roofline():
    """Figures docs/planner.md quotes: OPT-13B, a decode step at batch 1 and 1,000 tokens, and a
    607-token prefill, at TP 1/2/4 (ms)."""
    spec, hw = load_model_spec("opt-13b"), load_hardware("a100-80g")
    flat = hw.without_measured_kernels()
    decode = [RooflineLatency(spec, hw, tp).decode_step_s(1, 1000) * 1e3 for tp in (1, 2, 4)]
    prefill = [RooflineLatency(spec, hw, tp).prefill_s(607) * 1e3 for tp in (1, 2, 4)]
    flat_decode = [RooflineLatency(spec, flat, tp).decode_step_s(1, 1000) * 1e3 for tp in (1, 2, 4)]
    assert decode == pytest.approx([22.52, 14.05, 9.56], abs=0.01)
    assert prefill == pytest.approx([70.6, 46.2, 31.6], abs=0.1)
    assert flat_decode == pytest.approx([16.93, 9.77, 5.79], abs=0.01)
    assert decode[0] / decode[1] < flat_decode[0] / flat_decode[1]


@pytest.mark.parametrize("tp,pp,links", [(2, 4, (3, 0)), (4, 3, (1, 1)), (8, 2, (0, 1)), (3, 3, (1, 1)), (1, 16, (14, 1))])
def test_pipeline_hops_cross_the_nic_only_between_nodes(tp, pp, links):
    spec, hw = load_model_spec("opt-175b"), load_hardware("a100-80g")
    assert RooflineLatency(spec, hw, tp, pp).hop_links == links


def test_tensor_parallel_all_reduces_stay_on_nvlink_past_one_node():
    spec = load_model_spec("opt-66b")
    hw = load_hardware("a100-80g").without_measured_kernels()
    g = spec.geometry
    one, two = RooflineLatency(spec, hw, 8, 1), RooflineLatency(spec, hw, 8, 2)
    rows = 100
    hop = rows * g.d_model * g.dtype_bytes / hw.internode_bytes_per_s + hw.collective_latency_s
    # 16 GPUs: the same TP8 all-reduces (NVLink) plus one activation hop over the NIC
    assert two.rows_s(rows) - one.rows_s(rows) == pytest.approx(hop, rel=1e-12)


@dataclass(frozen=True)
class _Linear(LatencyModel):
    """1 ms per prompt token, `stages` pipeline stages."""

    stages: int

    @property
    def pipeline_stages(self) -> int:  # type: ignore[override]
        return self.stages

    def prefill_batch_s(self, new_tokens: Sequence[int], cached_tokens: Sequence[int]) -> float:
        return sum(new_tokens) * 1e-3

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        return 0.0

    def mixed_step_s(self, *args) -> float:
        return 0.0

    def to_dict(self) -> dict:
        return {}


@pytest.mark.parametrize("policy", [PrefillPolicy(), PrefillPolicy(max_batch=1, order="sjf")])
def test_a_short_prompt_cannot_overtake_a_long_one_in_the_pipeline(policy):
    model = _Linear(4)
    # a 400-token prompt, then a 40-token one behind it: the short one enters at 100 ms (stage 1
    # free) and waits at each later stage for the long one to leave it: done at 410 ms, not 140
    out = run_prefill_pool([0.0, 0.001], [0, 1], [400, 40], [0, 0], model, 1, policy)
    assert (out.start_s, out.done_s) == (pytest.approx([0.0, 0.1]), pytest.approx([0.4, 0.41]))
    # equal prompts fill the pipe: the second is done one stage after the first
    out = run_prefill_pool([0.0, 0.001], [0, 1], [400, 400], [0, 0], model, 1, policy)
    assert out.done_s == pytest.approx([0.4, 0.5])
    # one stage: back to back
    out = run_prefill_pool([0.0, 0.001], [0, 1], [400, 40], [0, 0], _Linear(1), 1, policy)
    assert out.done_s == pytest.approx([0.4, 0.44])


def test_pipeline_parallelism_never_shortens_one_prompts_ttft():
    spec, hw = load_model_spec("opt-13b"), load_hardware("a100-80g")
    alone, piped = RooflineLatency(spec, hw, 1, 1), RooflineLatency(spec, hw, 1, 4)
    # every stage in turn, plus three activation hops
    assert piped.prefill_s(512) > alone.prefill_s(512)
    out = run_prefill_pool([0.0], [0], [512], [0], piped, 1, PrefillPolicy())
    assert out.done_s[0] == pytest.approx(piped.prefill_s(512), rel=1e-12)


@pytest.mark.parametrize("name,fit,ar_1mb_tp8_us", [
    ("h100", (0.818, 3.77e9, 0.835, 0.827, 3.57e-6), 25.41),
    ("h200", (0.809, 3.44e9, 0.875, 0.805, 3.94e-6), 26.14),
])
def test_hopper_profiles_carry_their_fits(name, fit, ar_1mb_tp8_us):
    """The H100/H200 GEMM curves and NCCL tables `scripts/aic_kernel_fit.py h100_sxm|h200_sxm` derives
    from aiconfigurator's vLLM 0.24 GEMMs and NCCL all-reduces (docs/planner.md)."""
    hw = load_hardware(name)
    e_max, half, gamma, r, floor = fit
    assert hw.gemm == GemmCurve(989e12, hw.hbm_bytes_per_s, e_max, pytest.approx(half), gamma, r, pytest.approx(floor))
    assert hw.elementwise.floor_s == pytest.approx(3e-6) and hw.elementwise.bytes_per_s == pytest.approx(hw.hbm_bytes_per_s * r)
    assert hw.allreduce.seconds(2**20, 8) * 1e6 == pytest.approx(ar_1mb_tp8_us, abs=0.01)
    # one weight row through an 8192 x 8192 layer: memory-bound, at the fit's efficiency plus its floor
    assert hw.gemm.seconds(1, 8192, 8192, 2) == pytest.approx(2 * (8192 * 8192 + 2 * 8192) / (hw.hbm_bytes_per_s * r) + floor, rel=1e-12)


def test_hopper_measured_kernels_against_the_flat_roofline():
    """Figures docs/planner.md quotes: llama-70b-class, a decode step at batch 1 and 1,000 tokens and
    a 2,048-token prefill at TP 2/4/8 (ms); measured GEMMs beat 60% of peak on a long prompt, and
    decode pays weight reads at the measured efficiency, kernel floors (attention's 15 us a layer)
    and NCCL's latencies."""
    spec = load_model_spec("llama-70b-class")
    got = {}
    for name in ("h100", "h200"):
        hw = load_hardware(name)
        for kind, profile in (("measured", hw), ("flat", hw.without_measured_kernels())):
            models = [RooflineLatency(spec, profile, tp) for tp in (2, 4, 8)]
            got[name, kind] = ([round(m.decode_step_s(1, 1000) * 1e3, 2) for m in models],
                               [round(m.prefill_s(2048) * 1e3, 1) for m in models])
    assert got["h100", "measured"] == ([30.65, 18.77, 13.39], [223.8, 138.1, 96.4])
    assert got["h100", "flat"] == ([27.69, 14.89, 8.49], [254.9, 140.4, 83.2])
    assert got["h200", "measured"] == ([23.80, 15.38, 12.03], [221.1, 134.9, 92.9])
    assert got["h200", "flat"] == ([19.95, 11.02, 6.56], [254.9, 140.4, 83.2])


def test_attention_kernels_on_their_measured_curves():
    """Context and generation attention each on its own fit; no rows of a class, no kernel."""
    spec, hw = load_model_spec("llama-70b-class"), load_hardware("h100")
    g, gen = spec.geometry, hw.attention.generation
    assert (gen.memory_efficiency, gen.kernel_floor_s, gen.memory_half_bytes, gen.memory_ramp_exponent) == (
        1.0, pytest.approx(8.16e-6), pytest.approx(72.51e6), 0.749)
    model = RooflineLatency(spec, hw, tp=4)
    # a decode batch reading 32,000 K/V tokens: per layer and rank 2 of the 8 K/V heads, memory-bound,
    # at a bandwidth that ramps with the bytes read
    nbytes = 32_000 * 2 * 2 * g.head_dim * 2
    memory = nbytes / 3.35e12 * (1 + (72.51e6 / nbytes) ** 0.749)
    assert model.attention_s(31_968, 32_000) == pytest.approx(g.layers * (memory + 8.16e-6), rel=1e-12)
    assert model.attention_s(0, 0) == 0.0 and model.attention_s(0, 0, "context") == 0.0
    assert model.decode_step_s(32, 31_968) == pytest.approx(model.rows_s(32) + model.attention_s(31_968, 32_000), rel=1e-12)
    # the flat profile: the old max(compute, memory) at 60% / 80% of peak
    flat = RooflineLatency(spec, hw.without_measured_kernels(), tp=4)
    assert flat.attention_s(31_968, 32_000) == pytest.approx(
        g.kv_bytes_per_token * 32_000 / (4 * 3.35e12 * 0.8), rel=1e-12)


def test_the_driver_overhead_does_not_pipeline():
    """A PP prefill's first stage is the driver's process: each prompt's step overhead runs there,
    before its layers, so the stage interval is overhead + (latency - overhead) / pp, not latency
    / pp; a lone prompt's TTFT is still the full latency."""
    spec, hw = load_model_spec("opt-13b"), load_hardware("a100-80g")
    piped = RooflineLatency(spec, hw, 1, 8)
    latency = piped.prefill_s(607)
    assert round(latency * 1e3, 2) == 70.81 and hw.step_overhead_s == 1e-3
    assert piped.prefill_stage_s(latency) == pytest.approx(1e-3 + (latency - 1e-3) / 8, rel=1e-12)
    assert round(piped.prefill_stage_s(latency) * 1e3, 3) == 9.726  # was latency / 8 = 8.851 ms
    assert RooflineLatency(spec, hw, 1, 1).prefill_stage_s(0.05) == 0.05
    # two equal prompts back to back: the second enters when stage 0 frees, done one interval later
    out = run_prefill_pool([0.0, 0.0], [0, 1], [607, 607], [0, 0], piped, 1, PrefillPolicy())
    stage = piped.prefill_stage_s(latency)
    assert out.start_s == pytest.approx([0.0, stage], rel=1e-12)
    assert out.done_s == pytest.approx([latency, latency + stage], rel=1e-12)
