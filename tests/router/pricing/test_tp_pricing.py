"""The router prices each role's steps at its TP size with one formula (latency/tp_scaling.py,
router/pricing/tp_pricing.py): exact numbers for the formula, the cost model it scales, and the wiring in
`router_for` (a `--prefill-tp 2 --decode-tp 1` deployment with a profile measured at TP 1)."""

from __future__ import annotations

import json

import pytest

from pdserve.api.server import ServeConfig, router_for
from pdserve.engine.config import EngineConfig
from pdserve.engine.kv.kv_abi import KvAbi
from pdserve.latency.tp_collectives import CollectiveCosts
from pdserve.latency.tp_scaling import (
    DEFAULT_COLLECTIVES,
    PhaseShares,
    StepPrice,
    TpScaling,
    lm_head_share,
    model_scaling,
    ring_costs,
)
from pdserve.model.config import load_config
from pdserve.model.default import resolve_model
from pdserve.router.pricing.cost import CostModel
from pdserve.router.pricing.tp_pricing import measured_tp, role_sizes, scaling_for, tp_cost
from pdserve.router.state.snapshot import prefill_coefficients
from pdserve.workers.process.tp_rank import TpShape

COSTS2 = CollectiveCosts(tp=2, pinned=True, allreduce_s=1.0e-3, allreduce_s_per_byte=1.0e-9, step_sync_s=2.0e-3)
SCALING = TpScaling(PhaseShares(0.0), PhaseShares(0.02), threads=2, num_layers=8, row_bytes=1024, collectives=(COSTS2,))
ABI = KvAbi(8, 2, 64, 16, "bfloat16")
PROFILE = {"prefill_coef": [0.004, 2.0e-4, 1.0e-8], "decode_coef": [0.01, 1.0e-3, 2.0e-7],
           "meta": {"threads": 1, "tp": 1}}
# o(2, rows) = K (alpha + rows B beta) + sync with K = 2 * 8 all_reduces, B = 1024 bytes a row
FIXED2, PER_ROW2 = 16 * 1.0e-3 + 2.0e-3, 16 * 1024 * 1.0e-9  # 0.018 s, 1.6384e-5 s a row
# TP 4 from the TP 2 measurement as a ring scales: alpha and sync x 3, beta x (3/4) / (1/2) = 1.5
FIXED4, PER_ROW4 = 16 * 3.0e-3 + 6.0e-3, 16 * 1024 * 1.5e-9  # 0.054 s, 2.4576e-5 s a row


def test_compute_units_exact_numbers():
    # c(1) = 1/T; c(N) = (1 - r)/N + r
    assert SCALING.units("prefill", 1) == 0.5
    assert SCALING.units("prefill", 2) == 0.5
    assert SCALING.units("decode", 2) == 0.98 / 2 + 0.02
    assert SCALING.units("prefill", 4) == 0.25
    # the compute factor alone (before: 1/0.93 = 1.0753 with an all-reduce share; that share is
    # now the measured collectives' own term)
    assert SCALING.factor("prefill", 2) == 1.0
    assert SCALING.factor("decode", 2) == pytest.approx(2 * 0.51, rel=1e-15)
    assert SCALING.factor("prefill", 4) == 0.5
    assert SCALING.factor("prefill", 2, measured_tp=2) == 1.0
    with pytest.raises(ValueError):
        SCALING.factor("mixed", 2)
    with pytest.raises(ValueError):
        PhaseShares(1.5)


def test_collective_terms_exact_numbers():
    assert SCALING.overhead(1) == StepPrice(0.0)
    two, four = SCALING.overhead(2), SCALING.overhead(4)
    assert (two.fixed_s, two.per_row_s) == pytest.approx((0.018, 1.6384e-5), rel=1e-12)
    assert (four.fixed_s, four.per_row_s) == pytest.approx((0.054, 2.4576e-5), rel=1e-12)
    assert (FIXED2, PER_ROW2, FIXED4, PER_ROW4) == pytest.approx((0.018, 1.6384e-5, 0.054, 2.4576e-5), rel=1e-12)
    # a 10 ms decode step of 4 rows at TP 1 (2 threads) -> 1.02 * 10 ms + 18 ms + 4 * 16.384 us
    assert SCALING.price("decode", 2).step_s(0.010, 4) == pytest.approx(0.028265536, rel=1e-12)
    four_price = SCALING.price("prefill", 4)
    assert (four_price.factor, four_price.fixed_s, four_price.per_row_s) == pytest.approx((0.5, FIXED4, PER_ROW4), rel=1e-12)
    # measured at TP 2: take TP 2's collectives out, scale the compute, add TP 4's
    back = SCALING.price("decode", 1, measured_tp=2)
    f = 0.5 / 0.51
    assert (back.factor, back.fixed_s, back.per_row_s) == pytest.approx((f, -f * 0.018, -f * 1.6384e-5), rel=1e-12)
    up = SCALING.price("prefill", 4, measured_tp=2)
    assert (up.factor, up.fixed_s, up.per_row_s) == pytest.approx((0.5, 0.045, 1.6384e-5), rel=1e-12)
    # a measured TP 2 decode step of 0.1 s and 64 rows priced at TP 1 and back at TP 2 is itself
    there = SCALING.price("decode", 2).step_s(back.step_s(0.1, 64), 64)
    assert there == pytest.approx(0.1, rel=1e-12)
    # no measurement: the documented TP 2 defaults
    plain = TpScaling(PhaseShares(0.0), PhaseShares(0.0), 1, num_layers=8, row_bytes=1024)
    assert plain.costs_at(2) == DEFAULT_COLLECTIVES
    assert plain.overhead(2).fixed_s == pytest.approx(16 * 1.6e-3 + 1.1e-3, rel=1e-12)
    assert ring_costs(COSTS2, 3).allreduce_s == pytest.approx(2.0e-3, rel=1e-12)
    assert CollectiveCosts.from_dict(json.loads(json.dumps(COSTS2.to_dict()))) == COSTS2


def test_lm_head_share_of_tiny():
    mc = load_config(resolve_model("tiny"))  # V 259, d 512, ff 1408, 8 layers, 8/2 heads of 64
    layer = 512 * (512 + 2 * 128) + 512 * 512 + 3 * 512 * 1408
    assert lm_head_share(259, 512, 1408, 8, 512, 128) == 259 * 512 / (259 * 512 + 8 * layer)
    scaling = model_scaling(mc, threads=3)
    # r per phase: the larger of the shapes' share (decode: the LM head's, 0.0058; prefill: 0) and
    # the measured floor (MEASURED_REPLICATED: prefill 0.1, decode 0.8)
    assert (scaling.prefill.replicated, scaling.decode.replicated) == (0.1, 0.8) and scaling.threads == 3
    assert (scaling.num_layers, scaling.row_bytes, scaling.collectives) == (8, 512 * 2, ())


def test_tp_cost_scales_each_role_and_the_decode_workers_prefill():
    base = CostModel.from_profile(ABI, PROFILE, 256)
    cost = tp_cost(base, SCALING, prefill_tp=2, decode_tp=1)
    # prefill at TP 2 over TP 1 with 2 threads: compute x 1 (was 1/0.93), plus the collectives
    assert cost.prefill_s_per_token == pytest.approx(base.prefill_s_per_token + PER_ROW2, rel=1e-15)
    assert cost.prefill_overhead_s == pytest.approx(0.004 + FIXED2, rel=1e-15)
    assert cost.prefill_s_per_pair == 1.0e-8
    assert cost.queue_s(1000) == pytest.approx(1000 * (base.prefill_s_per_token + PER_ROW2), rel=1e-15)
    assert (cost.decode_step_base_s, cost.decode_step_s_per_seq) == (base.decode_step_base_s, base.decode_step_s_per_seq)
    assert cost.decode_worker_prefill_factor == 1.0
    extras = (cost.decode_worker_prefill_fixed_s, cost.decode_worker_prefill_s_per_token)
    assert extras == pytest.approx((-FIXED2, -PER_ROW2), rel=1e-12)
    local = cost.at_decode_worker()  # a prefill on the TP 1 decode worker: the measured terms again
    assert local.prefill_s(300) == pytest.approx(base.prefill_s(300), rel=1e-15)
    assert local.decode_worker_prefill_fixed_s == 0.0 and local.decode_step_s(4) == base.decode_step_s(4)
    coef = prefill_coefficients([cost])  # what the vectorised policies read: the priced terms
    assert (coef[0, 0], coef[1, 0]) == (cost.prefill_overhead_s, cost.prefill_s_per_token)
    same = tp_cost(base, SCALING, 1, 1)
    assert same is base and same.at_decode_worker() is base
    decode2 = tp_cost(base, SCALING, prefill_tp=1, decode_tp=2)  # decode at TP 2: x 1.02 + collectives a step
    assert decode2.decode_step_base_s == pytest.approx(0.01 * 1.02 + FIXED2, rel=1e-15)
    assert decode2.decode_step_s_per_seq == pytest.approx(base.decode_step_s_per_seq * 1.02 + PER_ROW2, rel=1e-15)
    assert decode2.decode_step_s_per_context_token == pytest.approx(2.0e-7 * 1.02, rel=1e-15)
    assert decode2.at_decode_worker().prefill_s(300) == pytest.approx(0.004 + FIXED2 + 300 * (base.prefill_s_per_token + PER_ROW2), rel=1e-14)


def test_a_profile_measured_at_tp2_prices_tp2_as_measured():
    profile = {**PROFILE, "meta": {"threads": 1, "tp": 2},
               "collectives": [{"tp": 2, "pinned": True, "allreduce_s": 0.5e-3, "allreduce_s_per_byte": 2.0e-9,
                                "step_sync_s": 1.0e-3}]}
    base = CostModel.from_profile(ABI, profile, 256)
    scaling = scaling_for(load_config(resolve_model("tiny")), profile, threads_per_worker=2)
    assert measured_tp(profile) == 2 and measured_tp(None) == 1 and measured_tp({"prefill_coef": []}) == 1
    assert scaling.threads == 2  # a TP 2 profile says nothing of a TP 1 worker's threads: the served ones
    cost = tp_cost(base, scaling, prefill_tp=2, decode_tp=1, measured_tp=2)
    assert cost.prefill_s_per_token == base.prefill_s_per_token  # measured at its own size
    f = scaling.units("decode", 1) / scaling.units("decode", 2)  # compute at TP 1 over TP 2
    costs = CollectiveCosts(tp=2, pinned=True, allreduce_s=0.5e-3, allreduce_s_per_byte=2.0e-9, step_sync_s=1.0e-3)
    assert scaling.collectives == (costs,)  # the profile's own measurement
    # tiny: 8 layers (16 all_reduces a step), rows of 512 bf16 = 1024 bytes
    assert cost.decode_step_base_s == pytest.approx(f * (0.01 - 16 * 0.5e-3 - 1.0e-3), rel=1e-14)
    assert cost.decode_step_s_per_seq == pytest.approx(f * (base.decode_step_s_per_seq - 16 * 1024 * 2.0e-9), rel=1e-14)
    assert scaling_for(load_config(resolve_model("tiny")), PROFILE, threads_per_worker=4).threads == 1  # the profile's own
    assert role_sizes("colocated", 2, 1, 4) == (4, 4) and role_sizes("disaggregated", 2, 1, 4) == (2, 1)


def test_router_for_prices_the_deployments_tp_sizes(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(PROFILE))
    engine = EngineConfig(model="tiny", dtype="bfloat16")
    kwargs = dict(mode="disaggregated", engine=engine, pd_profile=str(path), threads_per_worker=1)
    tp1 = router_for(ServeConfig(**kwargs), resolve_model("tiny")).config.cost
    tp2 = router_for(ServeConfig(**kwargs, tp=TpShape(prefill=2, decode=1)), resolve_model("tiny")).config.cost
    price = model_scaling(load_config(resolve_model("tiny")), 1).price("prefill", 2)
    # one thread at TP 1: compute x (0.9 / 2 + 0.1) = 0.55 (was 0.5 / 0.93); no collectives in the
    # profile: the defaults, 16 all_reduces of 1.6 ms + 1.1 ms a step, 16 x 1024 bytes x 1.1 ns a row
    assert (price.factor, price.fixed_s, price.per_row_s) == pytest.approx((0.55, 16 * 1.6e-3 + 1.1e-3, 16 * 1024 * 1.1e-9), rel=1e-12)
    assert tp1.decode_worker_prefill_factor == 1.0
    assert tp2.prefill_s_per_token == pytest.approx(tp1.prefill_s_per_token * price.factor + price.per_row_s, rel=1e-15)
    assert tp2.prefill_overhead_s == pytest.approx(tp1.prefill_overhead_s * price.factor + price.fixed_s, rel=1e-15)
    assert tp2.decode_step_s_per_seq == tp1.decode_step_s_per_seq
    assert tp2.at_decode_worker().prefill_s(512) == pytest.approx(tp1.prefill_s(512), rel=1e-15)


def test_a_term_never_goes_below_zero():
    # measured at TP 2 with a decode step cheaper than the collectives priced for TP 2 (a quieter
    # machine than the collectives'): priced at TP 1, its fixed term is 0, not 0.5 * (0.01 - 0.018)
    profile = {**PROFILE, "meta": {"threads": 1, "tp": 2}}
    base = CostModel.from_profile(ABI, profile, 256)
    cost = tp_cost(base, SCALING, prefill_tp=2, decode_tp=1, measured_tp=2)
    assert cost.decode_step_base_s == 0.0
    f = 0.5 / 0.51  # decode compute at TP 1 (2 threads) over TP 2
    assert cost.decode_step_s_per_seq == pytest.approx(f * (base.decode_step_s_per_seq - PER_ROW2), rel=1e-14)
    assert cost.prefill_s_per_token == base.prefill_s_per_token  # the prefill role runs at its measured size
    local = cost.at_decode_worker()  # prefill at TP 1: 1.0 * (0.004 - 0.018) < 0 -> 0
    assert local.prefill_overhead_s == 0.0
    assert local.prefill_s_per_token == pytest.approx(base.prefill_s_per_token - PER_ROW2, rel=1e-14)
