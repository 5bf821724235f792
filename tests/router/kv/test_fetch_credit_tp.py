"""The prefix policy's fetch-versus-recompute credit at each destination's own TP size (issue 23):
`fetch_plan.fetch_credit` weighs a fetch against the prefill it saves at each slot's own prefill
terms (the snapshot's `Derived.prefill_coef`, its worker's registered TP size), so a TP 1 and a
TP 2 worker in one pool decide differently; the served decision (`plan_fetch` with the
destination's `Router.worker_cost`) agrees with the credit slot by slot, bit for bit; the fused
prefix path (compiled kernel) reads the same per-slot terms. Exact numbers from the one formula."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve.engine.kv.kv_events import BlockEventKind as K
from pdserve.engine.kv.kv_events import KvTier as T
from pdserve.latency.tp_collectives import CollectiveCosts
from pdserve.latency.tp_scaling import PhaseShares, TpScaling
from pdserve.router import kernels
from pdserve.router.config import Mode, RouterConfig
from pdserve.router.kv.fetch_plan import FETCH, LOCAL, RECOMPUTE, fetch_credit, fetch_gain, plan_fetch
from pdserve.router.kv.kv_index import KvDelta
from pdserve.router.messages import Role, RoutePlan, RouteRequest, WorkerInfo, WorkerLoad
from pdserve.router.pricing.cost import CostModel
from pdserve.router.pricing.tp_pricing import TpPricing
from pdserve.router.router import Router
from pdserve.router.state.snapshot import prefill_coefficients
from pdserve.router.synthetic import chain

# measured at TP 1: prefill 10 ms + 1 ms a token; 1 MB of K/V a token (16 MB a block); 2 GB/s on a
# host; 40 ms per fetch beyond the link (router/pricing/kv_rates.py's measured overhead)
BASE = CostModel(prefill_s_per_token=1e-3, prefill_overhead_s=0.01, decode_step_base_s=0.02, decode_step_s_per_seq=1e-3,
                 same_host_bytes_per_s=2e9, cross_host_bytes_per_s=1e8, transfer_overhead_s=0.0,
                 kv_bytes_per_token=1_000_000, block_size_tokens=16, fetch_overhead_s=0.04, fitted=True)
# TP 2: prefill compute x 0.5 (r = 0, 1 thread); 8 all_reduces of 1 ms + 2 ms sync = 10 ms a step, 8 us a row
COSTS2 = CollectiveCosts(tp=2, pinned=True, allreduce_s=1e-3, allreduce_s_per_byte=1e-9, step_sync_s=2e-3)
PRICING = TpPricing(BASE, TpScaling(PhaseShares(0.0), PhaseShares(0.5), 1, num_layers=4, row_bytes=1000,
                                    collectives=(COSTS2,)))
P_FIXED2, P_ROW2 = 0.015, 5.08e-4  # TP 2's prefill: 0.5 x 10 ms + 10 ms, 0.5 x 1 ms + 8 us a token
DOC = tuple(chain(1, 0, 8))  # an 8-block prefix (128 tokens)
LONG = RouteRequest("long", prompt_tokens=8 * 16 + 10, expected_output_tokens=10, block_hashes=DOC)
# w0 (TP 1) holds the prefix behind a 1 s queue; w1 (TP 1) and w2 (TP 2) hold nothing; one host
WORKERS = {"w0": (1, 1000, DOC), "w1": (1, 0, ()), "w2": (2, 0, ())}


def _router(workers=WORKERS, kv_sharing=True, pricing=PRICING) -> Router:
    router = Router(RouterConfig(Mode.COLOCATED, "m", "abi", policy="prefix", cost=PRICING.pair(1, 1), pricing=pricing,
                                 ttft_slo_s=100.0, tpot_slo_s=100.0, kv_sharing=kv_sharing), clock=lambda: 0.0)
    for wid, (tp, pending, held) in workers.items():
        router.register(WorkerInfo(wid, "h0", Role.COLOCATED, 1, 10_000, "m", "abi", tp))
        router.report_load(wid, 1, WorkerLoad(pending, 0, 10_000))
        if held:
            router.report_kv(wid, 1, KvDelta(len(held), tuple((K.STORED, k, T.DEVICE) for k in held), True))
    return router


def test_the_credit_weighs_each_slot_at_its_own_tp_price():
    router = _router()
    snapshot = router.snapshot()
    coef = snapshot.derived(router.config.cost).prefill_coef
    assert snapshot.prefill.members.tp_sizes == (1, 1, 2)
    assert coef.ravel().tolist() == pytest.approx([0.01, 0.01, P_FIXED2, 1e-3, 1e-3, P_ROW2], rel=1e-14)
    own, same_host = np.array([8, 0, 0]), np.array([1, 1, 1])
    # fetch 128 MB: 64 ms at 2 GB/s + 40 ms = 104 ms; it saves 128 ms at TP 1, 128 x 0.508 ms at TP 2
    _, fetch_s, saved_s = fetch_gain(BASE, own, 8, same_host, (coef[0], coef[1]))
    assert fetch_s.tolist() == pytest.approx([0.0, 0.104, 0.104], rel=1e-14)
    assert saved_s.tolist() == pytest.approx([0.0, 0.128, 128 * P_ROW2], rel=1e-12)
    eff, paid = fetch_credit(BASE, own, 8, same_host, coef)
    assert eff.tolist() == [8, 8, 0] and paid.tolist() == pytest.approx([0.0, 0.104, 0.0], rel=1e-14)
    # at the role size (every slot TP 1, what the credit read before) w2 would fetch too
    flat, _ = fetch_credit(BASE, own, 8, same_host, prefill_coefficients([BASE] * 3))
    assert flat.tolist() == [8, 8, 8]


def test_the_served_fetch_decision_is_the_credit_slot_by_slot():
    """plan_fetch at each destination's worker cost (fetch_runner.FetchRunner.terms) decides and
    prices exactly as the policy's credit for that slot."""
    router = _router()
    snapshot = router.snapshot()
    coef = snapshot.derived(router.config.cost).prefill_coef
    ids, held = snapshot.prefill.worker_ids, {w: set(WORKERS[w][2]) for w in WORKERS}
    own = np.array([len(WORKERS[w][2]) for w in ids])
    eff, paid = fetch_credit(router.kv_cost, own, 8, np.ones(3, dtype=np.int64), coef)
    _, _, saved_s = fetch_gain(router.kv_cost, own, 8, np.ones(3, dtype=np.int64), (coef[0], coef[1]))
    decisions = []
    for i, wid in enumerate(ids):
        terms = plan_fetch(wid, DOC, held, 8, router.worker_cost(wid), lambda w: True)
        decisions.append(terms.decision)
        hit = terms.remote_blocks if terms.decision == FETCH else terms.local_blocks
        assert (hit, terms.fetch_s if terms.decision == FETCH else 0.0) == (eff[i], paid[i])
        assert terms.saved_s == saved_s[i]  # bit for bit: the one formula, fetch_gain
    assert decisions == [LOCAL, FETCH, RECOMPUTE]


def test_the_policy_routes_to_the_tp2_worker_that_recomputes():
    # w1 (TP 1): fetch 104 ms + prefill 10 + 10 x 1 ms = 124 ms; w2 (TP 2) recomputes all 138
    # tokens: 15 + 138 x 0.508 ms = 85.104 ms; credited at the role size, w2 would fetch (104 +
    # 15 + 10 x 0.508 = 124.08 ms) and lose to w1
    plan = _router().route(LONG)
    assert isinstance(plan, RoutePlan) and plan.prefill_id == "w2"
    assert plan.predicted_ttft_s == pytest.approx(P_FIXED2 + 138 * P_ROW2, rel=1e-12)
    terms = plan.prefix_terms
    assert (terms.hit_blocks, terms.fetch_blocks, terms.fetch_s) == (0, 0, 0.0)
    assert terms.prefill_s == pytest.approx(0.085104, rel=1e-12)
    # the same request over a pool whose slots are all TP 1 (every slot at the role size): w1 fetches
    flat = _router({**WORKERS, "w2": (1, 0, ())}).route(LONG)
    assert isinstance(flat, RoutePlan) and flat.prefill_id == "w1"
    assert flat.predicted_ttft_s == pytest.approx(0.104 + 0.01 + 10 * 1e-3, rel=1e-12)
    assert (flat.prefix_terms.fetch_blocks, flat.prefix_terms.fetch_s) == (8, pytest.approx(0.104, rel=1e-14))


@pytest.mark.parametrize("compiled", [True, False])  # the fused kernel (kernels.prefix_pair) and the numpy path
def test_the_prefix_path_without_sharing_prices_each_slot_at_its_tp(compiled, monkeypatch):
    monkeypatch.setattr(kernels, "enabled", compiled and kernels.AVAILABLE)
    # w0 (TP 1) holds all 8 blocks behind 40 ms: 40 + 10 + 10 x 1 ms = 60 ms; w1 (TP 2) holds 4:
    # 15 + 74 x 0.508 ms = 52.592 ms (at TP 1 it would be 10 + 74 ms: w0 would win)
    workers = {"w0": (1, 40, DOC), "w1": (2, 0, DOC[:4])}
    plan = _router(workers, kv_sharing=False).route(LONG)
    assert (plan.prefill_id, plan.predicted_ttft_s) == ("w1", pytest.approx(P_FIXED2 + 74 * P_ROW2, rel=1e-12))
    assert _router({"w0": (1, 40, DOC), "w1": (1, 0, DOC[:4])}, kv_sharing=False).route(LONG).prefill_id == "w0"


def test_a_credit_without_one_column_per_slot_is_refused():
    with pytest.raises(ValueError, match=r"prefill_coef must be \[2, 3\]"):
        fetch_credit(BASE, np.array([8, 0, 0]), 8, np.ones(3), prefill_coefficients([BASE] * 2))
