"""Splitwise's mixed pool in the router (router/splitwise/mixed_pool.py): where a mixed worker is offered,
with exact choices. The cluster: p0 (prefill) and d0 (decode) busy, m0 (mixed) idle, so the
least-loaded policy (jsq) takes m0 wherever it is offered; the rule alone decides where that is."""

from __future__ import annotations

import pytest

from pdserve.router.config import ClusterShape, Mode, RouterConfig
from pdserve.router.messages import RejectReason, Role, RoutePlan, RouteRejection, RouteRequest, WorkerInfo, WorkerLoad
from pdserve.router.router import Router
from pdserve.router.splitwise.mixed_pool import MixedOffer, PressureLatch, membership
from pdserve.router.splitwise.splitwise import PoolController, PoolSignals, Thresholds
from pdserve.workers.local_prefill import LocalPrefills
from pdserve.workers.roles import RoleSwitch, sides

ROLE = {"p": Role.PREFILL, "d": Role.DECODE, "m": Role.MIXED}
BUSY = {"p0": WorkerLoad(5000, 0, 100), "d0": WorkerLoad(0, 8, 100), "m0": WorkerLoad(0, 0, 100)}


def router(loads: dict[str, WorkerLoad] = BUSY, pd: str = "always") -> Router:
    from pdserve.router.policy.pd_decision import PdPolicy

    r = Router(RouterConfig(Mode.DISAGGREGATED, "m", "abi", policy="jsq", pd=PdPolicy(pd)))
    for wid, load in loads.items():
        r.register(WorkerInfo(wid, "h0", ROLE[wid[0]], 1, 100, "m", "abi"))
        r.report_load(wid, 1, load)
    return r


def route(r: Router, rid: str = "r") -> RoutePlan | RouteRejection:
    return r.route(RouteRequest(rid, prompt_tokens=100, expected_output_tokens=60))


def pair(plan) -> tuple[str, str]:
    assert isinstance(plan, RoutePlan), plan
    return plan.prefill_id, plan.decode_id


def test_calm_pools_prefer_their_own_workers_over_an_idle_mixed_one():
    r = router()
    plan = route(r)
    assert pair(plan) == ("p0", "d0") and plan.prefill_hold.worker_id == "p0"


def test_a_pressed_prompt_pool_gives_the_mixed_worker_prompt_work_handed_off_to_decode():
    r = router()
    r.set_mixed_offer(MixedOffer(prefill=True))
    plan = route(r)
    assert pair(plan) == ("m0", "d0") and plan.prefill_hold.worker_id == "m0" and plan.transfer_tokens == 100


def test_a_pressed_token_pool_gives_the_mixed_worker_token_work_handed_off_from_prefill():
    r = router()
    r.set_mixed_offer(MixedOffer(decode=True))
    plan = route(r)
    assert pair(plan) == ("p0", "m0") and plan.decode_hold.worker_id == "m0" and plan.transfer_tokens == 100


def test_both_phases_on_one_mixed_worker_run_whole_there():
    r = router()
    r.set_mixed_offer(MixedOffer(prefill=True, decode=True))
    plan = route(r)
    assert pair(plan) == ("m0", "m0") and plan.prefill_hold is None  # one hold: prompt + growth at m0
    assert (plan.pd.disaggregate, plan.pd.reason) == (False, "mixed_whole") and plan.transfer_bytes == 0
    assert plan.decode_hold.blocks == 10  # ceil(160 / 16), a local prefill's hold
    assert r.counters().pd_decisions == {"local": 1}
    r.complete("r")
    r.assert_no_leaks()


def test_a_tie_goes_to_the_pools_own_worker():
    idle = {"p0": WorkerLoad(0, 0, 100), "d0": WorkerLoad(0, 0, 100), "m0": WorkerLoad(0, 0, 100)}
    r = router(idle)
    r.set_mixed_offer(MixedOffer(prefill=True, decode=True))
    assert pair(route(r)) == ("p0", "d0")  # "m0" sorts first by name, but own-role slots come first


def test_a_route_refused_without_the_mixed_worker_overflows_to_it():
    full = {"p0": WorkerLoad(0, 0, 100), "d0": WorkerLoad(0, 0, 5), "m0": WorkerLoad(0, 0, 100)}  # d0: no room
    r = router(full)
    plan = route(r)
    assert pair(plan) == ("p0", "m0")  # calm pools, but d0 cannot hold it: m0 takes the decode
    counts = r.counters().route_total
    assert counts == {("jsq", "routed"): 1}  # one decision counted: the overflow is the same route


def test_a_refusal_stands_when_the_mixed_worker_cannot_help_either():
    full = {"p0": WorkerLoad(0, 0, 100), "d0": WorkerLoad(0, 0, 5), "m0": WorkerLoad(0, 0, 5)}
    result = route(router(full))
    assert isinstance(result, RouteRejection) and result.reason is RejectReason.NO_DECODE_CAPACITY


def test_a_pool_without_workers_of_its_own_takes_the_mixed_ones():
    r = router({"d0": WorkerLoad(0, 0, 100), "m0": WorkerLoad(0, 0, 100)})
    assert pair(route(r, "a")) == ("m0", "d0")  # --prefill 0: m0 is the prompt pool
    only_mixed = router({"m0": WorkerLoad(0, 0, 100), "m1": WorkerLoad(0, 0, 100)})
    assert pair(route(only_mixed, "b")) == ("m0", "m0")  # both pools are mixed workers: whole on the least loaded


def test_a_mixed_worker_in_both_pools_carries_one_load_in_both_slots():
    r = router()
    r.set_mixed_offer(MixedOffer(prefill=True, decode=True))
    r.report_load("m0", 1, WorkerLoad(300, 2, 40))
    snap = r.snapshot()
    p, d = snap.prefill.worker_ids.index("m0"), snap.decode.worker_ids.index("m0")
    assert (snap.prefill.pending_tokens[p], snap.decode.pending_tokens[d]) == (300, 300)
    assert (snap.prefill.headroom_blocks[p], snap.decode.headroom_blocks[d]) == (40, 40)
    assert pair(route(r)) == ("m0", "m0")  # m0's 300 queued tokens < p0's 5000; its batch 2 < d0's 8: whole there
    snap = r.snapshot()  # the in-flight hold at m0 (10 blocks) charged on both of its slots
    assert (snap.prefill.headroom_blocks[p], snap.decode.headroom_blocks[d]) == (30, 30)


def test_membership_rule():
    calm, prompt, token = MixedOffer(), MixedOffer(prefill=True), MixedOffer(decode=True)
    assert membership(calm, 1, 1) == (False, False)
    assert membership(prompt, 1, 1) == (True, False)
    assert membership(token, 1, 1) == (False, True)
    assert membership(calm, 0, 1) == (True, False) and membership(calm, 2, 0) == (False, True)
    assert membership(calm, 1, 1, overflow=True) == (True, True)


def test_pressure_latch_hysteresis():
    latch = PressureLatch(high=2.0, low=0.5, hold=2)
    seen = [latch.observe(v) for v in (3.0, 1.0, 3.0, 3.0, 1.0, 0.1, 1.0, 0.1, 0.1, 3.0)]
    assert seen == [False, False, False, True, True, True, True, True, False, False]


def test_the_pool_controller_latches_the_offer_from_its_own_signals():
    c = PoolController(Thresholds(prompt_high_s=2.0, prompt_low_s=0.5, kv_high=0.8, kv_low=0.5, hold=2))
    prompt = PoolSignals({"p0": 3.0}, {"d0": 0.2}, local_prompt_s={"m0": 1.0})
    token = PoolSignals({"p0": 0.1}, {"d0": 0.9})
    offers = []
    for t, signals in enumerate([prompt, prompt, token, token, token]):
        c.observe(signals, float(t))
        offers.append(c.offer)
    assert offers == [MixedOffer(), MixedOffer(True, False), MixedOffer(True, False), MixedOffer(False, True),
                      MixedOffer(False, True)]
    assert c.moves == []  # one worker per pool: nothing to lend; mixed workers are never moved


def test_a_mixed_worker_has_both_sides_and_takes_local_prefills():
    assert sides("mixed") == (True, True)
    switch = RoleSwitch("prefill", 1)
    switch.request("mixed", 2)
    assert switch.finish() == ("prefill", "mixed") and switch.epoch == 2
    local = LocalPrefills("mixed")
    local.accept("r")
    assert local.request_ids == {"r"}


@pytest.mark.parametrize("counts, message", [
    ((-1, 1, 1), "must be >= 0"),
    ((0, 0, 0), "no workers"),
    ((0, 1, 0), "--prefill >= 1"),
])
def test_cluster_shape_refuses_bad_counts(counts, message):
    with pytest.raises(ValueError, match=message):
        ClusterShape.disaggregated(*counts)


def test_cluster_shape_with_a_mixed_pool_launches_its_roles():
    assert ClusterShape.disaggregated(1, 1, 1).roles() == [Role.PREFILL, Role.DECODE, Role.MIXED]
    assert ClusterShape.disaggregated(0, 0, 2).roles() == [Role.MIXED, Role.MIXED]


@pytest.mark.parametrize("policy", ["prefix", "slo", "round_robin"])
def test_every_policy_routes_over_twin_slots_and_prefix_sets_follow_both(policy):
    from pdserve.router.policy.pd_decision import PdPolicy

    r = Router(RouterConfig(Mode.DISAGGREGATED, "m", "abi", policy=policy, pd=PdPolicy("always"), ttft_slo_s=1e9,
                            tpot_slo_s=1e9))
    for wid in ("p0", "d0", "m0"):
        r.register(WorkerInfo(wid, "h0", ROLE[wid[0]], 1, 100, "m", "abi"))
        r.report_load(wid, 1, WorkerLoad(0, 0, 100))
    blocks = (11, 12, 13, 14, 15, 16)  # the request's 6 full blocks, all held by m0 only
    r.report_load("m0", 1, WorkerLoad(0, 0, 100, prefix_hashes=frozenset(blocks)))
    r.set_mixed_offer(MixedOffer(prefill=True, decode=True))
    snap = r.snapshot()
    p_hits, d_hits = snap.leading_hits(blocks)
    assert list(p_hits) == [0, 6] and list(d_hits) == [0, 6]  # slots: [p0, m0] and [d0, m0]
    plan = r.route(RouteRequest("r", prompt_tokens=100, expected_output_tokens=60, block_hashes=blocks))
    assert isinstance(plan, RoutePlan)
    if policy != "round_robin":  # the whole prefix at m0, in both pools: it runs there, reusing it
        assert pair(plan) == ("m0", "m0") and plan.pd.reason == "mixed_whole" and plan.decode_hit_blocks == 6
    else:  # round robin's turn 0: the lowest slots, own-role workers
        assert pair(plan) == ("p0", "d0")
    r.complete("r")
    r.assert_no_leaks()
