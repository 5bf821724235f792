"""Placement arithmetic is the ledger's: g_system, per-GPU denominators, K/V demand vs link."""

from __future__ import annotations

import pytest

from pdserve.ledger.goodput import replica_count, system_goodput, system_goodput_per_gpu
from pdserve.ledger.placement import link_feasible, model_residency_bytes, payload_demand_bytes_per_s
from pdserve.search.candidates import Parallel
from pdserve.search.phase_search import Score
from pdserve.search.plans import (ColocatedPlan, colocated_plan, common_segments, high_affinity_plan, low_affinity_plan,
                                  split_budget)


def score(phase, tp, pp, rps, chunk=0):
    return Score(phase, Parallel(tp, pp), rps, rps * 2, "simulated", chunk)


def test_spec_fixture_numbers():
    """0x08C: g_p = 8, g_d = 12 on 2 + 1 GPUs, target 10 rps -> 2 P + 1 D, 12 rps, 2 rps/GPU."""
    pre, dec = [score("prefill", 1, 1, 8.0)], [score("decode", 2, 1, 12.0)]
    plan = high_affinity_plan(pre, dec, budget=99, target_rps=10, kv_bytes_per_request=64 * 2**20,
                              nic_bytes_per_s=4 * 2**30, weight_bytes=132 * 2**30)
    assert (plan.n_prefill, plan.n_decode) == (2, 1)
    assert plan.goodput_rps == system_goodput(16, 12) == 12
    assert plan.prefill_gpus + plan.decode_gpus == 4
    assert plan.goodput_per_gpu == system_goodput_per_gpu(12, 2, 2) == 3
    assert plan.kv_demand_bytes_per_s == payload_demand_bytes_per_s(12, 64 * 2**20) == 768 * 2**20
    assert plan.link_ok and plan.residency_bytes == model_residency_bytes(3, 132 * 2**30) == 396 * 2**30


def test_slow_link_is_infeasible():
    pre, dec = [score("prefill", 1, 1, 8.0)], [score("decode", 1, 1, 12.0)]
    plan = high_affinity_plan(pre, dec, 99, 10, 64 * 2**20, 256 * 2**20, 1)
    assert plan.link_capacity_bytes_per_s == 1 * 256 * 2**20
    assert not plan.link_ok
    assert plan.link_ok == link_feasible(plan.kv_demand_bytes_per_s, plan.link_capacity_bytes_per_s)


@pytest.mark.parametrize("g_p,gp,g_d,gd,budget", [(8, 1, 12, 2, 6), (3, 2, 20, 1, 9), (5, 4, 5, 4, 8), (1, 1, 1, 1, 1)])
def test_split_budget_is_the_best_ledger_split(g_p, gp, g_d, gd, budget):
    got = split_budget(g_p, gp, g_d, gd, budget)
    options = [(n_p, n_d) for n_p in range(1, budget + 1) for n_d in range(1, budget + 1) if n_p * gp + n_d * gd <= budget]
    if not options:
        assert got is None
        return
    best = max(system_goodput(n_p * g_p, n_d * g_d) for n_p, n_d in options)
    assert got[0] * gp + got[1] * gd <= budget
    assert system_goodput(got[0] * g_p, got[1] * g_d) == best


def test_budget_plan_counts_every_gpu_of_both_pools():
    pre = [score("prefill", 2, 1, 10.0), score("prefill", 1, 1, 4.0)]
    dec = [score("decode", 1, 1, 9.0), score("decode", 4, 1, 50.0)]
    plan = high_affinity_plan(pre, dec, budget=8, target_rps=None, kv_bytes_per_request=1, nic_bytes_per_s=1e9, weight_bytes=1)
    assert plan.gpus <= 8
    assert plan.goodput_per_gpu == pytest.approx(plan.goodput_rps / (plan.prefill_gpus + plan.decode_gpus))
    assert plan.goodput_rps == min(plan.n_prefill * plan.prefill.goodput_rps, plan.n_decode * plan.decode.goodput_rps)


def test_low_affinity_pairs_segments_within_a_node():
    pre = [score("prefill", 1, 2, 6.0), score("prefill", 2, 1, 9.0)]
    dec = [score("decode", 2, 2, 20.0), score("decode", 1, 1, 3.0)]
    plan = low_affinity_plan(pre, dec, budget=16, target_rps=None, gpus_per_node=8, kv_bytes_per_request=1,
                             nvlink_bytes_per_s=1e11, weight_bytes=1)
    s = plan.segments
    assert plan.prefill.par.pp % s == 0 and plan.decode.par.pp % s == 0
    groups = plan.gpus // (8 * s) or 1
    per_node = (plan.n_prefill * plan.prefill.par.gpus + plan.n_decode * plan.decode.par.gpus) // (s * groups)
    assert per_node <= 8 and plan.gpus <= 16


def test_common_segments_divide_both_pipelines():
    assert common_segments(1, 2) == [1]
    assert common_segments(4, 2) == [1, 2]
    assert common_segments(3, 3) == [1, 3]
    assert common_segments(6, 4) == [1, 2]


def test_distserve_opt66b_unequal_pipelines_share_one_node():
    """DistServe's OPT-66B placement, prefill TP4 PP1 beside decode TP2 PP2: one segment, 4 + 4 GPUs
    of one node, K/V over NVLink; two nodes hold two such segments."""
    pre, dec = [score("prefill", 4, 1, 2.0)], [score("decode", 2, 2, 2.0)]
    plan = low_affinity_plan(pre, dec, budget=16, target_rps=None, gpus_per_node=8, kv_bytes_per_request=1,
                             nvlink_bytes_per_s=1e11, weight_bytes=1)
    assert (plan.segments, plan.n_prefill, plan.n_decode, plan.gpus) == (1, 2, 2, 16)
    assert plan.goodput_rps == 4.0 and plan.goodput_per_gpu == 0.25


def test_distserve_opt175b_segments_span_three_nodes():
    """OPT-175B (3,3,4,3): both phases cut in 3 segments, 3 + 4 GPUs per node, 21 GPUs."""
    pre, dec = [score("prefill", 3, 3, 1.0)], [score("decode", 4, 3, 1.0)]
    plan = low_affinity_plan(pre, dec, budget=24, target_rps=None, gpus_per_node=8, kv_bytes_per_request=1,
                             nvlink_bytes_per_s=1e11, weight_bytes=1)
    assert (plan.segments, plan.n_prefill, plan.n_decode, plan.gpus) == (3, 1, 1, 21)


def test_low_affinity_cuts_more_segments_when_one_node_cannot_hold_both():
    # 8 + 8 GPUs cannot share one 8-GPU node; cut in two segments each node holds 4 + 4
    pre, dec = [score("prefill", 4, 2, 1.0)], [score("decode", 4, 2, 1.0)]
    plan = low_affinity_plan(pre, dec, budget=16, target_rps=None, gpus_per_node=8, kv_bytes_per_request=1,
                             nvlink_bytes_per_s=1e11, weight_bytes=1)
    assert (plan.segments, plan.n_prefill, plan.n_decode) == (2, 1, 1)
    assert low_affinity_plan(pre, dec, budget=8, target_rps=None, gpus_per_node=8, kv_bytes_per_request=1,
                             nvlink_bytes_per_s=1e11, weight_bytes=1) is None


def test_colocated_plan_replicas():
    scores = [score("colocated", 2, 1, 10.0, 512), score("colocated", 1, 1, 4.0, 512)]
    budget = colocated_plan(scores, 8, None, 100)
    assert isinstance(budget, ColocatedPlan) and budget.score.par == Parallel(2, 1)
    assert (budget.replicas, budget.goodput_rps, budget.goodput_per_gpu) == (4, 40.0, 5.0)
    target = colocated_plan(scores, 8, 25.0, 100)
    assert target.replicas == replica_count(25.0, 10.0) == 3
