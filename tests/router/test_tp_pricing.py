"""The router prices each role's steps at its TP size with one formula (latency/tp_scaling.py,
router/tp_pricing.py): exact numbers for the formula, the cost model it scales, and the wiring in
`router_for` (a `--prefill-tp 2 --decode-tp 1` deployment with a profile measured at TP 1)."""

from __future__ import annotations

import json

import pytest

from pdserve.api.server import ServeConfig, router_for
from pdserve.engine.config import EngineConfig
from pdserve.engine.kv_abi import KvAbi
from pdserve.latency.tp_scaling import PhaseShares, TpScaling, lm_head_share, model_scaling
from pdserve.model.config import load_config
from pdserve.model.default import resolve_model
from pdserve.router.cost import CostModel
from pdserve.router.tp_pricing import measured_tp, role_sizes, scaling_for, tp_cost
from pdserve.workers.tp_rank import TpShape

SCALING = TpScaling(PhaseShares(0.0, 0.07), PhaseShares(0.02, 0.07), threads=2)
ABI = KvAbi(8, 2, 64, 16, "bfloat16")
PROFILE = {"prefill_coef": [0.004, 2.0e-4, 1.0e-8], "decode_coef": [0.01, 1.0e-3, 2.0e-7],
           "meta": {"threads": 1, "tp": 1}}


def test_formula_exact_numbers():
    # u(1) = 1/T; u(N) = ((1 - r)/N + r) / (1 - s2 * 2(N - 1)/N)
    assert SCALING.units("prefill", 1) == 0.5
    assert SCALING.units("prefill", 2) == 0.5 / (1 - 0.07)
    assert SCALING.units("decode", 2) == (0.98 / 2 + 0.02) / (1 - 0.07)
    assert SCALING.units("prefill", 4) == 0.25 / (1 - 0.07 * 2 * 3 / 4)
    assert SCALING.factor("prefill", 2) == pytest.approx(1 / 0.93, rel=1e-15)  # 1.0753: the measured 1.05-1.10
    assert SCALING.factor("decode", 2) == pytest.approx(2 * 0.51 / 0.93, rel=1e-15)
    assert SCALING.factor("prefill", 4) == pytest.approx(2 * 0.25 / 0.895, rel=1e-15)
    assert SCALING.factor("decode", 1, measured_tp=2) == pytest.approx(0.93 / (2 * 0.51), rel=1e-15)
    assert SCALING.factor("prefill", 2, measured_tp=2) == 1.0
    one_thread = TpScaling(PhaseShares(0.0, 0.0), PhaseShares(0.0, 0.0), threads=1)
    assert one_thread.factor("prefill", 4) == 0.25  # no replication, no all-reduce: ideal
    with pytest.raises(ValueError):
        SCALING.factor("mixed", 2)
    with pytest.raises(ValueError):
        PhaseShares(1.5)


def test_lm_head_share_of_tiny():
    mc = load_config(resolve_model("tiny"))  # V 259, d 512, ff 1408, 8 layers, 8/2 heads of 64
    layer = 512 * (512 + 2 * 128) + 512 * 512 + 3 * 512 * 1408
    assert lm_head_share(259, 512, 1408, 8, 512, 128) == 259 * 512 / (259 * 512 + 8 * layer)
    scaling = model_scaling(mc, threads=3)
    assert scaling.decode.replicated == 259 * 512 / (259 * 512 + 8 * layer)
    assert scaling.prefill.replicated == 0.0 and scaling.threads == 3


def test_tp_cost_scales_each_role_and_the_decode_workers_prefill():
    base = CostModel.from_profile(ABI, PROFILE, 256)
    cost = tp_cost(base, SCALING, prefill_tp=2, decode_tp=1)
    f = 1 / 0.93  # prefill at TP 2 over TP 1 with 2 threads
    assert cost.prefill_s_per_token == pytest.approx(base.prefill_s_per_token * f, rel=1e-15)
    assert cost.prefill_overhead_s == pytest.approx(0.004 * f, rel=1e-15)
    assert cost.prefill_s_per_pair == pytest.approx(1.0e-8 * f, rel=1e-15)
    assert cost.queue_s(1000) == pytest.approx(base.queue_s(1000) * f, rel=1e-15)
    assert (cost.decode_step_base_s, cost.decode_step_s_per_seq) == (base.decode_step_base_s, base.decode_step_s_per_seq)
    assert cost.decode_worker_prefill_factor == pytest.approx(0.93, rel=1e-15)
    local = cost.at_decode_worker()  # a prefill on the TP 1 decode worker: the measured terms again
    assert local.prefill_s(300) == pytest.approx(base.prefill_s(300), rel=1e-15)
    assert local.decode_worker_prefill_factor == 1.0 and local.decode_step_s(4) == base.decode_step_s(4)
    assert cost.kernel_coefficients[1] == cost.prefill_s_per_token  # the vectorised policies read the scaled terms
    same = tp_cost(base, SCALING, 1, 1)
    assert same is base and same.at_decode_worker() is base


def test_a_profile_measured_at_tp2_prices_tp2_as_measured():
    profile = {**PROFILE, "meta": {"threads": 1, "tp": 2}}
    base = CostModel.from_profile(ABI, profile, 256)
    scaling = scaling_for(load_config(resolve_model("tiny")), profile, threads_per_worker=2)
    assert measured_tp(profile) == 2 and measured_tp(None) == 1 and measured_tp({"prefill_coef": []}) == 1
    assert scaling.threads == 2  # a TP 2 profile says nothing of a TP 1 worker's threads: the served ones
    cost = tp_cost(base, scaling, prefill_tp=2, decode_tp=1, measured_tp=2)
    assert cost.prefill_s_per_token == base.prefill_s_per_token  # measured at its own size
    assert cost.decode_step_base_s == pytest.approx(0.01 * scaling.units("decode", 1) / scaling.units("decode", 2), rel=1e-15)
    assert scaling_for(load_config(resolve_model("tiny")), PROFILE, threads_per_worker=4).threads == 1  # the profile's own
    assert role_sizes("colocated", 2, 1, 4) == (4, 4) and role_sizes("disaggregated", 2, 1, 4) == (2, 1)


def test_router_for_prices_the_deployments_tp_sizes(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(PROFILE))
    engine = EngineConfig(model="tiny", dtype="bfloat16")
    kwargs = dict(mode="disaggregated", engine=engine, pd_profile=str(path), threads_per_worker=1)
    tp1 = router_for(ServeConfig(**kwargs), resolve_model("tiny")).config.cost
    tp2 = router_for(ServeConfig(**kwargs, tp=TpShape(prefill=2, decode=1)), resolve_model("tiny")).config.cost
    expected = model_scaling(load_config(resolve_model("tiny")), 1).factor("prefill", 2)  # 0.5 / 0.93
    assert expected == pytest.approx(0.5 / 0.93, rel=1e-15)
    assert tp1.decode_worker_prefill_factor == 1.0
    assert tp2.prefill_s_per_token == pytest.approx(tp1.prefill_s_per_token * expected, rel=1e-15)
    assert tp2.decode_step_s_per_seq == tp1.decode_step_s_per_seq
    assert tp2.at_decode_worker().prefill_s(512) == pytest.approx(tp1.prefill_s(512), rel=1e-15)
