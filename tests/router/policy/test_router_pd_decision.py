"""The per-request P/D decision (router/policy/pd_decision.py) and the routes the Router takes with it."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.engine.kv.kv_abi import KvAbi
from pdserve.latency.profiled import ProfiledLatency
from pdserve.ledger.margin import (
    DecodeBudget,
    MarginTerms,
    budget_slack_s,
    gap_late_s,
    net_margin_s,
    should_enable_pd,
    tpot_slack_s,
)
from pdserve.router.config import Mode, RouterConfig
from pdserve.router.messages import Role, RoutePlan, RouteRequest, WorkerInfo, WorkerLoad
from pdserve.router.policy.pd_decision import (
    PdFacts,
    PdPolicy,
    decide_pd,
    exposed_s,
    facts_for,
    local_steps_s,
    margin_terms,
)
from pdserve.router.pricing.cost import CostModel
from pdserve.router.router import Router

# round numbers: prefill 10 ms + 1 ms/token, decode step 20 ms + 1 ms/seq, 1 MB/s links, 100 B/token
COST = CostModel(prefill_s_per_token=1e-3, prefill_overhead_s=0.01, decode_step_base_s=0.02, decode_step_s_per_seq=1e-3,
                 same_host_bytes_per_s=1e6, cross_host_bytes_per_s=1e6, transfer_overhead_s=1e-3,
                 kv_bytes_per_token=100, block_size_tokens=16)
MARGIN = PdPolicy(mode="margin")
FACTS = PdFacts(prompt_tokens=512, local_compute_tokens=512, remote_compute_tokens=512, transfer_bytes=51_200,
                same_host=True, decode_batch=8, prefill_pending_tokens=256, failure_rate=0.25)


def test_the_four_terms_have_their_spec_values():
    terms = margin_terms(FACTS, MARGIN, COST, 2.0, 0.1)
    # the local prefill runs as one whole 512-token chunk beside 8 decodes (28 + 522 ms; a step's first
    # chunk overruns the budget the decode rows leave, as the engine's scheduler runs it): each decode
    # waits 522 ms, and a one-token decode has 100 - 28 = 72 ms of TPOT slack
    assert local_steps_s(FACTS, MARGIN, COST) == pytest.approx([0.55], abs=1e-12)
    assert terms.interference_saved_s == pytest.approx(8 * (0.522 - 0.072), abs=1e-12)
    assert terms.transfer_exposed_s == pytest.approx(0.0522, abs=1e-12)  # serialized: all of 1 ms + 51.2 kB / 1 MB/s
    # P's 256 queued tokens and its 522 ms prefill put the first token at 0.778 s, within the 2 s target
    assert terms.route_delta_s == 0.0
    assert terms.failure_penalty_s == pytest.approx(0.25 * 0.522, abs=1e-12)  # rate x recompute
    assert net_margin_s(terms) == pytest.approx(3.6 - 0.0522 - 0.1305, abs=1e-12)
    # a 0.5 s TTFT target: the handed-off first token is 0.278 s late, the local one (0.55 s) 0.05 s
    tight = margin_terms(FACTS, MARGIN, COST, 0.5, 0.1)
    assert tight.route_delta_s == pytest.approx(0.778 - 0.5, abs=1e-12)
    assert tight.interference_saved_s == pytest.approx(8 * (0.522 - 0.072) + 0.05, abs=1e-12)


def test_a_layerwise_stream_exposes_only_its_last_layer():
    streamed = PdPolicy(mode="margin", stream_layers=4, layerwise_min_tokens=256)
    assert exposed_s(FACTS, streamed, COST) == pytest.approx(0.0522 / 4, abs=1e-12)
    short = PdFacts(**{**vars(FACTS), "remote_compute_tokens": 100})  # under the threshold: serialized
    assert exposed_s(short, streamed, COST) == pytest.approx(0.0522, abs=1e-12)


def test_margin_disaggregates_a_long_prompt_beside_a_busy_decode_batch():
    decision = decide_pd(FACTS, MARGIN, COST, ttft_slo_s=2.0, tpot_slo_s=0.1)
    assert decision.disaggregate and decision.reason == "margin"
    assert decision.net_margin_s == pytest.approx(3.4173, abs=1e-12)
    assert decision.ttft_gate and decision.tpot_gate  # 0.8302 s <= 2 s, 29 ms <= 100 ms


def test_margin_prefills_locally_beside_an_idle_decode_worker():
    decision = decide_pd(PdFacts(**{**vars(FACTS), "decode_batch": 0}), MARGIN, COST, 2.0, 0.1)
    assert not decision.disaggregate and decision.reason == "margin"
    assert decision.terms.interference_saved_s == 0.0  # nothing running at D to stall


def test_a_short_prompt_whose_steps_stay_within_tpot_prefills_locally_beside_a_busy_batch():
    short = PdFacts(**{**vars(FACTS), "prompt_tokens": 48, "local_compute_tokens": 48, "remote_compute_tokens": 48,
                       "transfer_bytes": 4800})
    decision = decide_pd(short, MARGIN, COST, 2.0, 0.1)  # one step of 28 + 58 ms <= 100 ms: no decode is late
    assert decision.terms.interference_saved_s == 0.0 and not decision.disaggregate
    # an 80 ms target: 6 ms x 8 late > the 5.8 ms transfer + 14.5 ms of expected failures; P's queue
    # (256 tokens, 0.314 s to the first token) is within the 2 s TTFT target and costs nothing
    tight = decide_pd(short, MARGIN, COST, 2.0, 0.08)
    assert tight.disaggregate and tight.terms.route_delta_s == 0.0
    # a 0.2 s TTFT target: handed off, the first token is 0.114 s late, more than the 48 ms the
    # decodes lose; the TTFT gate does not veto (the local route makes decodes late too): the margin keeps it
    late_p = decide_pd(short, MARGIN, COST, 0.2, 0.08)
    assert late_p.terms.route_delta_s == pytest.approx(0.314 - 0.2, abs=1e-12)
    assert not late_p.disaggregate and late_p.reason == "margin" and late_p.ttft_gate


def test_the_local_ttft_beyond_its_target_counts_as_interference():
    idle_long = PdFacts(**{**vars(FACTS), "decode_batch": 0, "prompt_tokens": 2048, "local_compute_tokens": 2048,
                           "remote_compute_tokens": 2048})
    terms = margin_terms(idle_long, MARGIN, COST, 1.0, 0.1)  # 4 chunks of 522 ms: 2.088 s, 1.088 s over the target
    assert terms.interference_saved_s == pytest.approx(1.088, abs=1e-12)


def test_a_gate_vetoes_only_a_target_the_local_route_would_meet():
    # 5,000 tokens queued at P put the remote first token at 5.57 s, past the 2 s target, while a
    # local prefill starts at once and ends in 0.55 s: beside an idle D, the local route meets every
    # target and the TTFT gate fails (the margin, 3.522 s of lateness against nothing saved, agrees)
    idle_busy_p = PdFacts(**{**vars(FACTS), "decode_batch": 0, "prefill_pending_tokens": 5000})
    decision = decide_pd(idle_busy_p, MARGIN, COST, ttft_slo_s=2.0, tpot_slo_s=0.1)
    assert not decision.disaggregate and decision.ttft_gate is False and decision.tpot_gate
    assert decision.terms.route_delta_s == pytest.approx(5.522 - 2.0, abs=1e-12)
    # beside 32 decodes the local route makes each 0.474 s late (one 574 ms gap against a 100 ms
    # target): it meets no target the handoff misses, so no gate vetoes and the margin hands it off,
    # 15.168 s of the decodes' lateness against the request's own 3.522 s (a study's failure: the
    # old gate kept such prompts local, every running decode then missed its TPOT)
    busy_p = PdFacts(**{**vars(idle_busy_p), "decode_batch": 32})
    decision = decide_pd(busy_p, MARGIN, COST, ttft_slo_s=2.0, tpot_slo_s=0.1)
    assert decision.disaggregate and decision.reason == "margin" and decision.ttft_gate and decision.tpot_gate
    assert decision.terms.interference_saved_s == pytest.approx(32 * 0.474, abs=1e-9)
    assert decision.net_margin_s == pytest.approx(32 * 0.474 - 3.522 - 0.0522 - 0.1305, abs=1e-9)
    # the same TTFT overrun when D is as late (a local prefill waits behind 6,000 queued tokens): no veto
    both_late = PdFacts(**{**vars(busy_p), "decode_pending_tokens": 6000})
    assert decide_pd(both_late, MARGIN, COST, 2.0, 0.1).ttft_gate
    # a 25 ms TPOT target D's next step (61 ms) misses either way: no veto from TPOT
    assert decide_pd(FACTS, MARGIN, COST, 2.0, 0.025).tpot_gate


def test_a_long_decode_s_mean_slack_does_not_hide_the_gaps_a_local_prefill_opens():
    # 100-token decodes have (100 - 28) ms x 100 = 7.2 s of mean-TPOT slack, which a 4,096-token local
    # prefill's 4.176 s stall (eight 512-token chunks beside the decode rows, 4.4 s) fits; but each of the
    # eight mixed steps is one 550 ms inter-token gap, 450 ms past the 100 ms target: 3.6 s late per decode
    long = PdFacts(**{**vars(FACTS), "prompt_tokens": 4096, "local_compute_tokens": 4096, "remote_compute_tokens": 4096,
                      "decode_tokens": 100})
    assert sum(local_steps_s(long, MARGIN, COST)) == pytest.approx(4.4, abs=1e-12)
    assert gap_late_s([0.522] * 8, 0.028, 0.1) == pytest.approx(3.6, abs=1e-12)
    assert margin_terms(long, MARGIN, COST, 10.0, 0.1).interference_saved_s == pytest.approx(8 * 3.6, abs=1e-9)
    assert decide_pd(long, MARGIN, COST, 10.0, 0.1).disaggregate
    # at 1 request/s, 1 + 1 x 2.8 s = 3.8 prefills share a decode's life: 1.895 s of slack each, 2.281 s
    # late by the mean, still less than the gaps' 3.6 s
    busy = PdFacts(**{**vars(long), "arrival_rate_rps": 1.0})
    assert tpot_slack_s(0.1, 0.028, 100, 1.0) == pytest.approx(7.2 / 3.8, abs=1e-12)
    assert margin_terms(busy, MARGIN, COST, 10.0, 0.1).interference_saved_s == pytest.approx(8 * 3.6, abs=1e-9)
    # a 1 s per-token target: no gap is late and the mean slack (97.2 s) absorbs the stall
    assert margin_terms(long, MARGIN, COST, 10.0, 1.0).interference_saved_s == 0.0


def test_each_running_decode_s_slack_is_its_own_remaining_budget():
    # one of the 8 decodes has made 50 tokens in 48 s and has 2 left: 1 s x 51 gaps - 48 s - 2 x 28 ms
    # = 2.944 s of slack against the 4.176 s stall; the 7 not yet reporting take the newcomer's 100
    # tokens (97.2 s): only the one is late, by 1.232 s (gaps 550 ms within the 1 s target)
    long = PdFacts(**{**vars(FACTS), "prompt_tokens": 4096, "local_compute_tokens": 4096, "remote_compute_tokens": 4096,
                      "decode_tokens": 100, "budgets": (DecodeBudget(50, 48.0, 2),)})
    assert budget_slack_s(DecodeBudget(50, 48.0, 2), 1.0, 0.028, 0.0) == pytest.approx(2.944, abs=1e-12)
    assert margin_terms(long, MARGIN, COST, 10.0, 1.0).interference_saved_s == pytest.approx(4.176 - 2.944, abs=1e-9)
    # a decode about to start is exactly the old newcomer estimate
    assert budget_slack_s(DecodeBudget(1, 0.0, 100), 0.1, 0.028, 1.0) == tpot_slack_s(0.1, 0.028, 100, 1.0)
    # the newcomer's own max_tokens no longer sets the running decodes' slack: 4,096 tokens asked
    greedy = PdFacts(**{**vars(long), "decode_tokens": 4096, "budgets": (DecodeBudget(50, 48.0, 2),) * 8})
    assert margin_terms(greedy, MARGIN, COST, 10.0, 1.0).interference_saved_s == pytest.approx(8 * 1.232, abs=1e-9)


def test_the_gap_is_the_batch_s_p90_itl_plus_the_prefill_part():
    # D's measured p90 gap of 60 ms (over its 28 ms predicted step): a 522 ms chunk opens a 582 ms gap,
    # 482 ms past 100 ms; a batch already past the target is charged only the prefill part
    assert gap_late_s([0.522], 0.06, 0.1) == pytest.approx(0.482, abs=1e-12)
    assert gap_late_s([0.522], 0.3, 0.1) == pytest.approx(0.522, abs=1e-12)
    slow = PdFacts(**{**vars(FACTS), "itl_p90_s": 0.06})
    assert margin_terms(slow, MARGIN, COST, 2.0, 0.1).interference_saved_s == pytest.approx(8 * 0.482, abs=1e-12)


def test_pinned_modes_and_the_prompt_floor():
    assert decide_pd(None, PdPolicy("always"), COST, 2.0, 0.1).disaggregate
    assert not decide_pd(None, PdPolicy("never"), COST, 2.0, 0.1).disaggregate
    floor = decide_pd(FACTS, PdPolicy("margin", min_prompt_tokens=513), COST, 2.0, 0.1)
    assert not floor.disaggregate and floor.reason == "min_prompt_tokens" and floor.terms is None
    assert decide_pd(FACTS, PdPolicy("margin", min_prompt_tokens=512), COST, 2.0, 0.1).disaggregate
    assert decide_pd(FACTS, PdPolicy("always", min_prompt_tokens=513), COST, 2.0, 0.1).reason == "min_prompt_tokens"
    assert decide_pd(FACTS, PdPolicy("always", min_prompt_tokens=512), COST, 2.0, 0.1).reason == "always"
    with pytest.raises(ValueError):
        PdPolicy("sometimes")


def test_facts_subtract_each_side_s_prefix_hits():
    request = RouteRequest("r", prompt_tokens=100, expected_output_tokens=10)
    facts = facts_for(request, prefill_hit_blocks=2, decode_hit_blocks=6, same_host=False, decode_batch=3,
                      prefill_pending_tokens=7, failure_rate=0.0, cost=COST)
    assert facts.remote_compute_tokens == 100 - 32
    assert facts.local_compute_tokens == 100 - 96  # the last prompt token is always computed
    assert facts.transfer_bytes == (100 - 96) * 100


@settings(max_examples=200, deadline=None)
@given(batch=st.integers(0, 64), pending=st.integers(0, 4096), u=st.integers(1, 4096), rate=st.floats(0, 1),
       safety=st.floats(0, 1), tpot=st.floats(0.01, 0.2))
def test_the_decision_is_the_ledger_s_should_enable_pd(batch, pending, u, rate, safety, tpot):
    facts = PdFacts(u, u, u, u * 100, False, batch, pending, rate)
    policy = PdPolicy("margin", safety_margin_s=safety)
    decision = decide_pd(facts, policy, COST, 5.0, tpot)
    terms = margin_terms(facts, policy, COST, 5.0, tpot)
    assert isinstance(decision.terms, MarginTerms) and decision.terms == terms
    assert decision.disaggregate == should_enable_pd(terms, safety, decision.ttft_gate, decision.tpot_gate)


def make_router(mode: str, free: int = 100) -> Router:
    router = Router(RouterConfig(Mode.DISAGGREGATED, "m", "abi", policy="jsq", cost=COST, pd=PdPolicy(mode)))
    for worker_id, role in (("p0", Role.PREFILL), ("d0", Role.DECODE)):
        router.register(WorkerInfo(worker_id, "h0", role, 1, free, "m", "abi"))
        router.report_load(worker_id, 1, WorkerLoad(0, 0, free))
    return router


def test_a_local_route_holds_only_the_decode_worker():
    router = make_router("never")
    plan = router.route(RouteRequest("r1", prompt_tokens=100, expected_output_tokens=60))
    assert isinstance(plan, RoutePlan) and plan.colocated and (plan.prefill_id, plan.decode_id) == ("d0", "d0")
    assert plan.prefill_hold is None and plan.decode_hold.blocks == 10  # ceil(160 / 16), prompt and growth
    assert plan.transfer_bytes == 0 and plan.compute_tokens == 100 and plan.pd.reason == "never"
    assert router.snapshot().decode.pending_tokens[0] == 100  # the local prefill's tokens count as D's queue
    assert router.counters().pd_decisions == {"local": 1}
    router.complete("r1")
    router.assert_no_leaks()


def test_a_disaggregated_route_carries_its_decision():
    router = make_router("always")
    plan = router.route(RouteRequest("r1", prompt_tokens=100, expected_output_tokens=60))
    assert not plan.colocated and plan.prefill_hold is not None and plan.pd.disaggregate
    assert router.counters().pd_decisions == {"disaggregate": 1}
    router.complete("r1")
    router.assert_no_leaks()


def test_margin_routes_read_the_observed_failure_rate():
    router = make_router("margin")
    router.signals.transfer_ended(failed=True)
    router.signals.transfer_ended(failed=False)
    assert router.signals.failure_rate() == 0.5
    plan = router.route(RouteRequest("r1", prompt_tokens=100, expected_output_tokens=60))
    assert plan.pd.terms.failure_penalty_s == pytest.approx(0.5 * 0.11, abs=1e-12)  # rate x prefill_s(100)
    assert plan.colocated  # idle decode worker: nothing to save, the local prefill wins
    router.complete("r1")
    router.assert_no_leaks()


def test_a_fitted_profile_becomes_the_router_s_cost_model():
    from pdserve.engine.kv.kv_abi import KvAbi

    abi = KvAbi(2, 2, 8, 16, "float32")
    profile = {"kind": "profiled", "prefill_coef": [0.01, 1e-3, 2e-6], "decode_coef": [0.02, 1e-3, 1e-6]}
    cost = CostModel.from_profile(abi, profile, reference_tokens=63)
    assert cost.prefill_overhead_s == 0.01 and cost.decode_step_base_s == 0.02
    assert cost.prefill_s_per_token == pytest.approx(1e-3 + 2e-6 * 32, abs=1e-15)  # pairs of a 63-token chunk per token
    assert cost.decode_step_s_per_seq == pytest.approx(1e-3 + 1e-6 * 63, abs=1e-15)
    assert cost.kv_bytes_per_token == abi.bytes_per_token and cost.block_size_tokens == 16


def test_the_prompt_floor_applies_before_always():
    router = make_router("always")
    router.config = RouterConfig(Mode.DISAGGREGATED, "m", "abi", policy="jsq", cost=COST,
                                 pd=PdPolicy("always", min_prompt_tokens=64))
    short = router.route(RouteRequest("short", prompt_tokens=63, expected_output_tokens=8))
    long = router.route(RouteRequest("long", prompt_tokens=64, expected_output_tokens=8))
    assert short.colocated and short.pd.reason == "min_prompt_tokens"
    assert not long.colocated and long.pd.reason == "always"
    assert router.counters().pd_decisions == {"local": 1, "disaggregate": 1}
    for request_id in ("short", "long"):
        router.complete(request_id)
    router.assert_no_leaks()


def test_routes_headed_to_d_count_in_the_batch_a_local_prefill_delays():
    # D reports nothing decoding, but 8 routes are headed there (prefilling at P, or in transfer):
    # they decode beside the local prefill exactly as 8 running decodes would
    routed = PdFacts(**{**vars(FACTS), "decode_batch": 0, "decode_routed": 8})
    assert routed.delayed_batch == 8
    assert margin_terms(routed, MARGIN, COST, 2.0, 0.1) == margin_terms(FACTS, MARGIN, COST, 2.0, 0.1)
    decision = decide_pd(routed, MARGIN, COST, 2.0, 0.1)
    assert decision.disaggregate and decision.delayed_batch == 8
    assert decision.net_margin_s == pytest.approx(3.4173, abs=1e-12)
    assert decision.trace_fields()["pd_delayed_batch"] == 8
    # the report's batch counts when it is the larger (grants not yet applied, routes not yet seen)
    assert PdFacts(**{**vars(FACTS), "decode_routed": 3}).delayed_batch == 8


def test_a_long_prompt_is_not_kept_local_while_p_prepares_d_s_next_decodes():
    """A failure the P/D decision study showed (scripts/pd_decision_study.sh): three long prompts were handed off while
    D was busy; D's old decodes finished and it reported an idle batch, the three still prefilling
    at P or in transfer. A fourth long prompt kept local then stalled all three decodes."""
    router = Router(RouterConfig(Mode.DISAGGREGATED, "m", "abi", policy="jsq", cost=COST,
                                 pd=PdPolicy("margin", ttft_slo_s=10.0, tpot_slo_s=0.03)), clock=lambda: 0.0)
    free = 1000
    for worker_id, role in (("p0", Role.PREFILL), ("d0", Role.DECODE)):
        router.register(WorkerInfo(worker_id, "h0", role, 1, free, "m", "abi"))
    router.report_load("p0", 1, WorkerLoad(0, 0, free))
    router.report_load("d0", 1, WorkerLoad(0, 8, free))
    held = 0
    for i in range(3):
        plan = router.route(RouteRequest(f"r{i}", prompt_tokens=1024, expected_output_tokens=100))
        assert not plan.colocated and plan.pd.reason == "margin"
        held += plan.decode_hold.blocks
        router.kv_published(f"r{i}")
    # both workers applied every grant; P's queue is done, D decodes nothing yet
    router.report_load("p0", 1, WorkerLoad(0, 0, free, applied_grant_seq=3))
    router.report_load("d0", 1, WorkerLoad(0, 0, free - held, applied_grant_seq=3))
    assert router.snapshot().decode.active_batch[0] == 0 and sum(router.heavy_light("d0")) == 3
    router.signals.arrivals.reset(0.0, 0.0)
    plan = router.route(RouteRequest("r3", prompt_tokens=1024, expected_output_tokens=100))
    # a local prefill: two whole 512-token chunks beside 3 decodes (23 + 522 ms each): each decode
    # waits 1.044 s against 100 x (30 - 23) ms = 0.7 s of TPOT slack, and sees two 545 ms gaps,
    # 515 ms each past the 30 ms target (the larger harm)
    assert not plan.colocated and plan.pd.disaggregate and plan.pd.delayed_batch == 3
    assert plan.pd.terms.interference_saved_s == pytest.approx(3 * 2 * 0.515, abs=1e-12)
    assert plan.pd.net_margin_s == pytest.approx(3 * 2 * 0.515 - 0.1034, abs=1e-12)
    # the load report alone (the old input) saw nobody to stall and kept the prompt local
    blind = PdFacts(1024, 1024, 1024, 102_400, True, 0, 0, 0.0, decode_tokens=100)
    old = decide_pd(blind, MARGIN, COST, 10.0, 0.03)
    assert not old.disaggregate and old.terms.interference_saved_s == 0.0
    assert decide_pd(PdFacts(**{**vars(blind), "decode_routed": 3}), MARGIN, COST, 10.0, 0.03) == plan.pd
    for request_id in ("r0", "r1", "r2", "r3"):
        router.complete(request_id)
    router.assert_no_leaks()


def test_a_handoff_does_not_escape_the_prompt_work_queued_at_d():
    """The study's other miss: a short prompt handed off while D's queue held a long local prefill
    (2 s). Its K/V lands at D after 81.4 ms (64-token prefill 74 ms + 7.4 ms transfer), so it
    escapes only that much of D's wait and decodes beside the rest: a 1.919 s stall against
    72 x (40 - 21) ms = 1.368 s of slack. Prefilled locally it waits behind that work instead."""
    short = PdFacts(prompt_tokens=64, local_compute_tokens=64, remote_compute_tokens=64, transfer_bytes=6400,
                    same_host=True, decode_batch=0, prefill_pending_tokens=0, failure_rate=0.0,
                    decode_pending_tokens=2000, decode_tokens=72, decode_routed=1)
    landed = 0.074 + 0.0074
    decision = decide_pd(short, MARGIN, COST, ttft_slo_s=10.0, tpot_slo_s=0.04)
    own_late = (2.0 - landed) - 72 * (0.04 - 0.021)
    gap = 0.021 + 0.074 - 0.04  # the one routed decode's gap beside the local prefill, past the 40 ms target
    assert decision.terms.route_delta_s == 0.0  # handed off, its first token (81.4 ms) is within the 10 s target
    assert decision.terms.interference_saved_s == pytest.approx(gap - own_late, abs=1e-12)
    assert decision.net_margin_s == pytest.approx(gap - own_late - 0.0074, abs=1e-12)
    assert not decision.disaggregate and decision.reason == "margin" and decision.ttft_gate
    # D's queue drained before the K/V lands (a long prompt's own prefill at P): nothing is met
    long = PdFacts(**{**vars(short), "prompt_tokens": 2500, "local_compute_tokens": 2500,
                      "remote_compute_tokens": 2500, "transfer_bytes": 250_000})
    terms = margin_terms(long, MARGIN, COST, 10.0, 0.04)
    assert terms.route_delta_s == 0.0
    assert decide_pd(long, MARGIN, COST, 10.0, 0.04).disaggregate
    # the TTFT gate reads the handed-off request's own clock, not P's queue less D's
    # (with no decode at D for a local prefill to make late)
    busy_p = PdFacts(**{**vars(short), "prefill_pending_tokens": 11_000, "decode_routed": 0})
    assert decide_pd(busy_p, MARGIN, COST, 10.0, 0.04).ttft_gate is False  # 11.08 s > max(10 s, 2.095 s); less D's 2 s: 9.08


def test_the_slack_reads_d_s_measured_tpot_when_the_machine_runs_slower_than_its_profile():
    # a 600 ms per-token target: the 550 ms gaps are within it, and the 4,096-token prefill's 4.176 s
    # stall fits 100 x (600 - 28) ms of slack by the profile; D's live requests measured at 590 ms per
    # token leave 100 x 10 ms = 1 s: each of the 8 is 3.176 s late
    long = PdFacts(**{**vars(FACTS), "prompt_tokens": 4096, "local_compute_tokens": 4096, "remote_compute_tokens": 4096,
                      "decode_tokens": 100})
    slow = PdFacts(**{**vars(long), "measured_tpot_s": 0.59})
    assert margin_terms(slow, MARGIN, COST, 10.0, 0.6).interference_saved_s == pytest.approx(8 * (4.176 - 1.0), abs=1e-9)
    assert decide_pd(slow, MARGIN, COST, 10.0, 0.6).disaggregate and not decide_pd(long, MARGIN, COST, 10.0, 0.6).disaggregate
    # a measurement below the profile's step changes nothing
    fast = PdFacts(**{**vars(long), "measured_tpot_s": 0.01})
    assert margin_terms(fast, MARGIN, COST, 10.0, 0.6) == margin_terms(long, MARGIN, COST, 10.0, 0.6)


def test_the_router_passes_the_measured_tpot_of_the_chosen_decode_worker():
    router = make_router("margin")
    router.config = RouterConfig(Mode.DISAGGREGATED, "m", "abi", policy="jsq", cost=COST,
                                 pd=PdPolicy("margin", ttft_slo_s=10.0, tpot_slo_s=0.5))
    router.report_load("d0", 1, WorkerLoad(0, 8, 100))
    quiet = router.route(RouteRequest("quiet", prompt_tokens=400, expected_output_tokens=20))
    router.signals.note_measured_tpot("d0", 0.49)
    slow = router.route(RouteRequest("slow", prompt_tokens=400, expected_output_tokens=20))
    # 400 tokens beside 8 (then 9) decodes stall each ~0.41 s in one gap within the 500 ms target:
    # within 20 x (500 - 28) ms of slack by the profile, beyond 20 x (500 - 490) ms measured
    assert quiet.colocated and quiet.pd.terms.interference_saved_s == 0.0
    assert not slow.colocated and slow.pd.terms.interference_saved_s > 9 * (0.4 - 0.2)
    for request_id in ("quiet", "slow"):
        router.complete(request_id)
    router.assert_no_leaks()


def test_a_long_local_prefill_prices_each_chunk_at_its_own_context():
    """From a profile, a later chunk attends to more keys: the chunks sum to the profile's own
    prefill of the whole prompt, not to the reference chunk's price per token."""
    profile = {"prefill_coef": [0.06, 2.5e-3, 4e-6], "decode_coef": [0.06, 1e-3, 3e-5]}
    abi = KvAbi(num_layers=12, num_kv_heads=4, head_dim=64, block_size=16, dtype="bfloat16")
    cost = CostModel.from_profile(abi, profile, 512)
    fitted = ProfiledLatency(tuple(profile["prefill_coef"]), tuple(profile["decode_coef"]))
    chunks = cost.chunked_prefill_s(1536, 0, 512)
    # 0.06 + 1.28 + 4e-6 x 512 x (c + 256.5) for c = 0, 512, 1024: 1.865312, 2.913888, 3.962464 s
    assert chunks == pytest.approx([1.865312, 2.913888, 3.962464], abs=1e-9)
    assert chunks[0] == pytest.approx(float(cost.prefill_s(512)), abs=1e-12)  # the reference chunk
    for cached in (0, 512, 1024):
        assert cost.prefill_chunk_s(512, cached) == pytest.approx(fitted.prefill_batch_s([512], [cached]), abs=1e-12)
    assert sum(cost.chunked_prefill_s(1536, 0, 1536)) == pytest.approx(fitted.prefill_batch_s([1536], [0]), abs=1e-12)
    # a local prefill after a 1024-token cached prefix: its 512 new rows at context 1024
    facts = PdFacts(prompt_tokens=1536, local_compute_tokens=512, remote_compute_tokens=1536, transfer_bytes=0,
                    same_host=True, decode_batch=0, prefill_pending_tokens=0, failure_rate=0.0)
    assert local_steps_s(facts, MARGIN, cost) == pytest.approx([3.962464], abs=1e-9)
