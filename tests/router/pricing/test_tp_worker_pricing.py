"""The router prices each worker at its own registered TP size (router/tp_pricing.TpPricing,
RouterConfig.pricing): two workers of different TP in one pool get different terms (exact
numbers from the one formula, latency/tp_scaling.py), the policy picks by them, and the P/D
decision and the plan's clocks price the chosen pair at its workers' sizes."""

from __future__ import annotations

import pytest

from pdserve.latency.tp_collectives import CollectiveCosts
from pdserve.latency.tp_scaling import PhaseShares, TpScaling
from pdserve.router import kernels
from pdserve.router.config import Mode, RouterConfig
from pdserve.router.messages import Role, RoutePlan, RouteRequest, WorkerInfo, WorkerLoad
from pdserve.router.policy.pd_decision import PdPolicy, decide_pd, facts_for, local_wait_s
from pdserve.router.pricing.cost import CostModel
from pdserve.router.pricing.tp_pricing import TpPricing
from pdserve.router.router import Router
from pdserve.router.splitwise.mixed_pool import MixedOffer

# prefill 10 ms + 1 ms/token, decode step 20 ms + 1 ms/seq, 1 MB/s links, 100 B/token (measured at TP 1, 1 thread)
BASE = CostModel(prefill_s_per_token=1e-3, prefill_overhead_s=0.01, decode_step_base_s=0.02, decode_step_s_per_seq=1e-3,
                 same_host_bytes_per_s=1e6, cross_host_bytes_per_s=1e6, transfer_overhead_s=1e-3,
                 kv_bytes_per_token=100, block_size_tokens=16)
# r: prefill 0, decode 0.5; 4 layers (8 all_reduces a step) of 1000-byte rows; TP 2: 1 ms a call, 1 ns/byte, 2 ms sync
COSTS2 = CollectiveCosts(tp=2, pinned=True, allreduce_s=1e-3, allreduce_s_per_byte=1e-9, step_sync_s=2e-3)
PRICING = TpPricing(BASE, TpScaling(PhaseShares(0.0), PhaseShares(0.5), 1, num_layers=4, row_bytes=1000,
                                    collectives=(COSTS2,)))
# TP 2: o = 8 x 1 ms + 2 ms = 10 ms a step, 8 x 1000 x 1 ns = 8 us a row; compute x 0.5 (prefill), x 0.75 (decode)
P_FIXED2, P_ROW2 = 0.5 * 0.01 + 0.010, 0.5 * 1e-3 + 8e-6  # 15 ms, 0.508 ms a token
D_FIXED2, D_ROW2 = 0.75 * 0.02 + 0.010, 0.75 * 1e-3 + 8e-6  # 25 ms, 0.758 ms a sequence
MARGIN = PdPolicy(mode="margin", ttft_slo_s=100.0, tpot_slo_s=100.0)  # the decision reads the targets the router admits by


def _router(workers: dict[str, tuple[Role, int]], loads: dict[str, tuple[int, int]], pricing=PRICING, pd=MARGIN) -> Router:
    cost = PRICING.pair(1, 1)  # the deployment's role sizes: TP 1 for both
    router = Router(RouterConfig(Mode.DISAGGREGATED, "m", "abi", policy="slo", cost=cost, pricing=pricing, pd=pd,
                                 ttft_slo_s=100.0, tpot_slo_s=100.0), clock=lambda: 0.0)
    for wid, (role, tp) in workers.items():
        router.register(WorkerInfo(wid, "h0", role, 1, 10_000, "m", "abi", tp))
        pending, batch = loads.get(wid, (0, 0))
        router.report_load(wid, 1, WorkerLoad(pending, batch, 10_000))
    return router


def test_a_workers_own_terms_are_the_formulas_at_its_size():
    one, two = PRICING.worker(1), PRICING.worker(2)
    assert one == BASE
    assert (two.prefill_overhead_s, two.prefill_s_per_token) == pytest.approx((P_FIXED2, P_ROW2), rel=1e-14)
    assert (two.decode_step_base_s, two.decode_step_s_per_seq) == pytest.approx((D_FIXED2, D_ROW2), rel=1e-14)
    assert (P_FIXED2, P_ROW2, D_FIXED2, D_ROW2) == pytest.approx((0.015, 5.08e-4, 0.025, 7.58e-4), rel=1e-14)
    mixed = PRICING.pair(2, 1)  # prefill at TP 2, decode at TP 1, a local prefill on the decode worker at TP 1
    assert (mixed.prefill_s_per_token, mixed.decode_step_s_per_seq) == (two.prefill_s_per_token, one.decode_step_s_per_seq)
    assert mixed.at_decode_worker().prefill_s(300) == pytest.approx(one.prefill_s(300), rel=1e-14)
    assert PRICING.pair(1, 2).at_decode_worker().prefill_s(300) == pytest.approx(two.prefill_s(300), rel=1e-14)
    assert PRICING.pair(2, 1) is mixed  # cached: a deployment has few pairs


@pytest.mark.parametrize("compiled", [True, False])  # the numba kernel and the numpy path
def test_two_tp_sizes_in_one_pool_get_their_own_terms_and_the_policy_reads_them(compiled, monkeypatch):
    monkeypatch.setattr(kernels, "enabled", compiled and kernels.AVAILABLE)
    workers = {"p1": (Role.PREFILL, 1), "p2": (Role.PREFILL, 2), "d1": (Role.DECODE, 1), "d2": (Role.DECODE, 2)}
    loads = {"p1": (1000, 0), "p2": (1000, 0), "d1": (0, 4), "d2": (0, 4)}
    router = _router(workers, loads, pd=PdPolicy(mode="always"))
    snapshot = router.snapshot()
    assert snapshot.prefill.members.tp_sizes == (1, 2) and snapshot.decode.members.tp_sizes == (1, 2)
    terms = snapshot.derived(router.config.cost)
    # queue: 1000 queued tokens at 1 ms and at 0.508 ms; TPOT of a 5th sequence: 20 + 5 ms and 25 + 5 x 0.758 ms
    assert terms.queue_p.tolist() == pytest.approx([1.0, 0.508], rel=1e-14)
    assert terms.tpot_d.tolist() == pytest.approx([0.025, 0.02879], rel=1e-14)
    assert terms.admission_d.tolist() == pytest.approx([0.024, 0.028032], rel=1e-14)
    assert terms.prefill_coef.ravel().tolist() == pytest.approx([0.01, 0.015, 1e-3, 5.08e-4], rel=1e-14)
    assert terms.queue_p[1] == PRICING.worker(2).queue_s(1000)  # the one formula, bit for bit
    assert terms.tpot_d[1] == PRICING.worker(2).decode_step_s(5)
    # a 160-token prompt: TTFT(p1) = 1.0 + 0.01 + 0.16, TTFT(p2) = 0.508 + 0.015 + 0.08128, each
    # + transfer (1 ms + 16 kB at 1 MB/s) + d1's admission (24 ms)
    plan = router.route(RouteRequest("r", 160, 8))
    assert isinstance(plan, RoutePlan) and (plan.prefill_id, plan.decode_id) == ("p2", "d1")
    assert plan.predicted_ttft_s == pytest.approx(0.60428 + 0.017 + 0.024, rel=1e-12)
    assert plan.predicted_tpot_s == pytest.approx(0.025, rel=1e-14)  # d1 at TP 1
    # priced per role (every worker at TP 1) the two prefill workers tie and the lower slot wins
    flat = _router(workers, loads, pricing=None, pd=PdPolicy(mode="always"))
    assert flat.route(RouteRequest("r", 160, 8)).prefill_id == "p1"


def test_the_pd_decision_prices_the_chosen_pair_at_its_workers_sizes():
    workers = {"p2": (Role.PREFILL, 2), "d2": (Role.DECODE, 2)}  # a decode worker at TP 2 (e.g. a role change)
    tight = PdPolicy(mode="margin", ttft_slo_s=0.5, tpot_slo_s=100.0)  # a 0.5 s first token
    router = _router(workers, {"p2": (200, 0), "d2": (300, 6)}, pd=tight)
    request = RouteRequest("r", 512, 16)
    plan = router.route(request)
    cost = PRICING.pair(2, 2)
    facts = facts_for(request, 0, 0, True, 6, 200, 0.0, cost, 300, 0.0)
    assert plan.pd == decide_pd(facts, tight, cost, 0.5, 100.0)
    # at TP 2 (0.508 ms a token) both first tokens are within 0.5 s: handed off, P's 200 queued tokens
    # and the 512-token prefill (0.377 s); local, D's 300 and the same prefill beside its 6 decodes;
    # transfer 1 ms + 51.2 kB at 1 MB/s exposed: net -0.0522 s, so the prefill stays on d2
    assert local_wait_s(facts, cost) == pytest.approx(300 * 5.08e-4, rel=1e-14)  # D's queued prompts at its TP 2
    assert plan.pd.terms.route_delta_s == 0.0 and plan.pd.terms.interference_saved_s == 0.0
    assert plan.pd.net_margin_s == pytest.approx(-0.0522, rel=1e-9) and not plan.pd.disaggregate
    assert (plan.prefill_id, plan.decode_id) == ("d2", "d2")
    assert plan.predicted_ttft_s == pytest.approx(0.015 + 812 * 5.08e-4, rel=1e-12)  # 300 queued + 512 at d2's TP 2
    assert plan.predicted_tpot_s == pytest.approx(0.025 + 7 * 7.58e-4, rel=1e-12)
    # priced at the role sizes (TP 1: 1 ms a token) both are late, the local one (0.848 s) more than
    # the handed-off one (0.722 s): the margin would disaggregate
    flat = decide_pd(facts, tight, PRICING.pair(1, 1), 0.5, 100.0)
    assert flat.terms.route_delta_s == pytest.approx(0.222, rel=1e-9)
    assert flat.disaggregate and flat.net_margin_s == pytest.approx(0.0738, rel=1e-9)
    assert router.pair_cost(router.snapshot(), 0, 0) is cost
    assert router.worker_cost("d2") is PRICING.worker(2)


def test_a_mixed_worker_is_priced_at_its_own_size_in_either_pool():
    workers = {"p1": (Role.PREFILL, 1), "d1": (Role.DECODE, 1), "x2": (Role.MIXED, 2)}
    router = _router(workers, {"p1": (100, 0), "d1": (0, 2), "x2": (100, 2)})
    router.set_mixed_offer(MixedOffer(prefill=True, decode=True))
    snapshot = router.snapshot()
    assert snapshot.prefill.worker_ids == ("p1", "x2") and snapshot.decode.worker_ids == ("d1", "x2")
    terms = snapshot.derived(router.config.cost)
    assert terms.queue_p.tolist() == pytest.approx([0.1, 0.0508], rel=1e-14)
    assert terms.tpot_d.tolist() == pytest.approx([0.023, 0.025 + 3 * 7.58e-4], rel=1e-14)
    assert router.worker_cost("x2") is PRICING.worker(2) and router.worker_cost("p1") is PRICING.worker(1)
