"""The router's per-request P/D decision against the planner's (issue 20).

One CPU-like profile of the embedded `small` model times both sides: `pdserve plan --model small
--latency-model FILE --gpus 2` (1P1D against 2 colocated replicas) and the router that `pdserve
serve --pd-decision margin --pd-profile FILE` builds (api/server.py `router_for`: the cost model
made affine at the 512-token serving chunk, the layer-wise stream's 12 layers; both sides build
it with router/policy/pd_decision.py `served_pd`). The SLOs follow the goodput study
(scripts/goodput_study.sh): TTFT = 5 x the isolated TTFT of the workload's median prompt, TPOT =
2 x the isolated decode step at that prompt, both from the profile.

The planner models the deployment `pdserve serve` runs (`--pd-decision margin`, its default): its
disaggregated plan is simulated with one event clock (sim/margin_routed.py), and at each arrival
the router's own `decide_pd` (search/margin_routing.py) reads what the router would read there
(D's decoding batch and live routes, D's and P's pending prompt rows, the recent arrival rate)
and hands the request off or prefills it on D. So the agreement checked here is exact: every
decision the planner's simulation made at the matched load (the report's operating point, 0.8 x
the smaller planned goodput) is the decision the served router makes from the same facts, term
for term (`test_the_planner_routes_each_request_as_the_served_router`), the whole route included
where the facts fit a load report (`..._through_route`).

What the planner now finds (pinned in `test_the_margin_routed_plan`):
- long (1024-2048 prompts): disaggregate. The margin-routed 1P1D has 0.0964 req/s of goodput
  (always-disaggregate: 0.0964; 2 colocated replicas: 0.0325), the measured direction on the real
  server (scripts/pd_decision_study.sh: margin ~ always on long prompts). At the matched load its
  router keeps 400 of 512 requests local, every one that finds D idle (B = 0: nothing to stall,
  TTFT met), and hands off those that find B >= 1 (each local chunk would be a gap of seconds
  against a 214 ms per-token target); at its goodput it keeps 8% local.
- short (32-128 prompts): colocate. Margin-routed 1P1D 0.790 req/s (always 0.811, colocated 1.10):
  the router keeps 3% local at that rate: a local prefill's step is one inter-token gap past the
  127 ms target for every running decode (the ledger's `gap_late_s`), which the decodes' mean-TPOT
  slack would have absorbed.
The median long request at the matched load is still kept local while the verdict is
"disaggregate": the verdict chooses the deployment (1P1D with margin routing, which carries more
load within the SLOs), the decision routes one request within it (D is idle at that load, so the
prefill stays there). They no longer disagree: the deployment the verdict picks is the one whose
router made that local decision (`test_long_prompts_stay_local_beside_an_idle_decode_worker`).
The report's dT (end-to-end latency, colocated against disaggregated) keeps the sign of the
router's net margin at the long point; at the short point they differ by design: the report
weighs end-to-end time, the router the running decodes' inter-token gaps.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import pytest

from pdserve.api.server import ServeConfig, router_for
from pdserve.cli import build_parser
from pdserve.commands.plan import plan_inputs
from pdserve.engine.config import EngineConfig
from pdserve.latency.load import latency_from_dict
from pdserve.latency.profiled import ProfiledLatency
from pdserve.ledger.margin import gap_late_s, tpot_slack_s
from pdserve.model.default import resolve_model
from pdserve.router.messages import Role, RouteRequest, WorkerInfo, WorkerLoad
from pdserve.router.policy.pd_decision import PdDecision, PdFacts, decide_pd, local_steps_s
from pdserve.router.router import Router
from pdserve.search.margin_routing import RoutedDecision, served_pricing
from pdserve.search.plan_report import plan_summary, plan_table
from pdserve.search.planner import MARGIN_LOAD, PlanResult, plan

# `pdserve profile --model small` on one core of this machine (bfloat16, one thread), rounded:
# --quick fitted prefill (0.059 s, 2.74 ms/token, 3.75e-6 s/pair) and decode (0.061 s, 1.14 ms/seq);
# a fit over 64-2048-token prompts in 512-token chunks and contexts up to 16k gave the decode
# context slope 2.9e-5 s/token. No per-batch decode bases: the planner and the router then read
# one affine decode formula. K/V: 12 layers x 2 x 4 heads x 64 x 2 bytes; 512 MiB pool.
PROFILE = {"kind": "profiled", "prefill_coef": [0.06, 2.5e-3, 4e-6], "decode_coef": [0.06, 1e-3, 3e-5],
           "kv_bytes_per_token": 12288, "kv_capacity_tokens": (512 << 20) // 12288,
           "meta": {"model": "small", "dtype": "bfloat16", "threads": 1, "block_size": 16}}
ENGINE = EngineConfig(model="small")  # served defaults: bfloat16, 16-token blocks, 512-token steps, 64 seqs
NUM_REQUESTS = 100  # the planner grows every phase's workload to 8 x --max-seqs anyway


@dataclass(frozen=True)
class Case:
    name: str
    prompt_lo: int
    prompt_hi: int
    seed: int  # the goodput study's seeds
    verdict: str  # what the planner decides
    batch: int  # round(B) at the matched load
    out_lo: int = 64
    out_hi: int = 128

    @property
    def median_prompt(self) -> int:
        return (self.prompt_lo + self.prompt_hi) // 2

    @property
    def mean_output(self) -> float:
        return (self.out_lo + self.out_hi) / 2

    @property
    def decode_context(self) -> float:
        """A sequence's mean context over its decode life: the prompt and half its output."""
        return self.median_prompt + self.mean_output / 2


LONG = Case("long", 1024, 2048, seed=1, verdict="disaggregate", batch=0)
SHORT = Case("short", 32, 128, seed=2, verdict="colocate", batch=5)
CASES = {c.name: c for c in (LONG, SHORT)}
LATENCY = latency_from_dict(PROFILE)


def study_slo_s(case: Case) -> tuple[float, float]:
    """(TTFT, TPOT) targets: 5 x the median prompt's isolated prefill, 2 x its first decode step."""
    m = case.median_prompt
    return 5 * LATENCY.prefill_batch_s([m], [0]), 2 * LATENCY.decode_step_s(1, m)


def matched_rate_rps(result: PlanResult) -> float:
    """The offered load of the report's net margin (planner `_margin`), both plans positive."""
    return MARGIN_LOAD * min(result.colocated.goodput_rps, result.disaggregated.goodput_rps)


def little_batch(rate_rps: float, case: Case) -> float:
    """B = rate x output tokens x decode_step_s(B), the step from the profile at the workload's
    context, a + B (b + c ctx): B = rate O a / (1 - rate O (b + c ctx))."""
    a, b, c = PROFILE["decode_coef"]
    load = rate_rps * case.mean_output
    per_seq = b + c * case.decode_context
    assert load * per_seq < 1, "the decode worker would saturate at the matched load"
    return load * a / (1 - load * per_seq)


def pending_prefill_tokens(rate_rps: float, case: Case) -> int:
    """Little's law at P: rate x the median prompt's prefill time requests, each of its tokens."""
    m = case.median_prompt
    return round(rate_rps * LATENCY.prefill_batch_s([m], [0]) * m)


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("profile") / "small-cpu.json"
    path.write_text(json.dumps(PROFILE))
    return str(path)


def plan_for(profile_path: str, case: Case, *extra: str) -> PlanResult:
    """`pdserve plan` for one workload, its inputs built by the command's own parser."""
    ttft, tpot = study_slo_s(case)
    args = build_parser().parse_args([
        "plan", "--model", "small", "--latency-model", profile_path, "--gpus", "2",
        "--input-dist", f"uniform:{case.prompt_lo},{case.prompt_hi}",
        "--output-dist", f"uniform:{case.out_lo},{case.out_hi}", "--seed", str(case.seed),
        "--num-requests", str(NUM_REQUESTS), "--chunk-budgets", str(ENGINE.max_num_batched_tokens),
        "--max-seqs", str(ENGINE.max_num_seqs),
        "--slo-ttft-ms", repr(ttft * 1e3), "--slo-tpot-ms", repr(tpot * 1e3), *extra,
    ])
    return plan(plan_inputs(args))


@pytest.fixture(scope="module")
def plans(profile_path) -> dict[str, PlanResult]:
    """`pdserve plan` (its default: margin routing, as `pdserve serve` runs) for each workload."""
    return {case.name: plan_for(profile_path, case) for case in CASES.values()}


def serving_router(profile_path: str, case: Case) -> Router:
    """The router `pdserve serve --pd-decision margin --pd-profile FILE` builds for this workload."""
    ttft, tpot = study_slo_s(case)
    config = ServeConfig(engine=ENGINE, mode="disaggregated", pd_decision="margin", pd_profile=profile_path,
                         slo_ttft_s=ttft, slo_tpot_s=tpot)
    return router_for(config, resolve_model("small"))


def route_request(router: Router, request: RouteRequest, decode_batch: int, pending_tokens: int,
                  rate_rps: float = 0.0, decode_pending_tokens: int = 0) -> PdDecision:
    """One 1P1D pair on one host, loads as given, arrivals at `rate_rps` so far; the request
    routed (itself one more arrival), then released."""
    blocks = PROFILE["kv_capacity_tokens"] // ENGINE.block_size
    loads = {"p0": (Role.PREFILL, WorkerLoad(pending_tokens, 0, blocks)),
             "d0": (Role.DECODE, WorkerLoad(decode_pending_tokens, decode_batch, blocks))}
    for worker_id, (role, load) in loads.items():
        router.register(WorkerInfo(worker_id, "h0", role, 1, blocks, router.config.model_identity,
                                   router.config.kv_abi_hash))
        router.report_load(worker_id, 1, load)
    router.signals.arrivals.reset(rate_rps, router._clock())
    routed = router.route(request)
    assert routed.colocated == (not routed.pd.disaggregate)
    router.complete(request.request_id)
    router.assert_no_leaks()
    return routed.pd


def route_median_request(router: Router, case: Case, decode_batch: int, pending_tokens: int,
                         rate_rps: float = 0.0) -> PdDecision:
    """The workload's median request, routed as `route_request` routes."""
    return route_request(router, RouteRequest("median", case.median_prompt, int(case.mean_output)), decode_batch,
                         pending_tokens, rate_rps)


def operating_point(plans: dict[str, PlanResult], case: Case) -> tuple[float, int, int]:
    """(matched rate, round(B), P's pending tokens) of this workload's plan."""
    rate = matched_rate_rps(plans[case.name])
    return rate, round(little_batch(rate, case)), pending_prefill_tokens(rate, case)


def test_one_profile_and_one_geometry_time_both_sides(plans, profile_path):
    assert study_slo_s(LONG) == pytest.approx((5 * (0.06 + 2.5e-3 * 1536 + 4e-6 * 1536 * 1537 / 2),
                                               2 * (0.06 + 1e-3 + 3e-5 * 1536)), abs=1e-12)  # 43.108 s, 214.16 ms
    assert study_slo_s(SHORT) == pytest.approx((5 * (0.06 + 2.5e-3 * 80 + 4e-6 * 80 * 81 / 2),
                                                2 * (0.06 + 1e-3 + 3e-5 * 80)), abs=1e-12)  # 1.3648 s, 126.8 ms
    for case in CASES.values():
        inputs = plans[case.name].inputs
        assert isinstance(inputs.fixed_model, ProfiledLatency)
        assert inputs.fixed_model.decode_coef == tuple(PROFILE["decode_coef"])
        assert not inputs.fixed_model.decode_batch_base
        assert inputs.model.kv_bytes_per_token == PROFILE["kv_bytes_per_token"] and inputs.gpus == 2
        assert (inputs.slo.ttft_s, inputs.slo.tpot_s) == pytest.approx(study_slo_s(case), rel=1e-12)
        router = serving_router(profile_path, case)
        cost, pd = router.config.cost, router.config.pd
        assert cost.kv_bytes_per_token == PROFILE["kv_bytes_per_token"] and cost.block_size_tokens == 16
        assert cost.prefill_s_per_token == pytest.approx(2.5e-3 + 4e-6 * 513 / 2, abs=1e-15)  # 3.526 ms at the chunk
        assert cost.decode_step_s_per_seq == pytest.approx(1e-3 + 3e-5 * 512, abs=1e-15)  # 16.36 ms: 512 context each
        assert (pd.mode, pd.chunk_tokens, pd.stream_layers, pd.layerwise_min_tokens) == ("margin", 512, 12, 256)
        # the planner's decisions are priced by the same construction, to the bit
        # (the served policy also carries the user's SLO targets; the planner passes its own per call)
        assert (pd.ttft_slo_s, pd.tpot_slo_s) == study_slo_s(case)
        planned = dataclasses.replace(pd, ttft_slo_s=None, tpot_slo_s=None)
        assert served_pricing(inputs.model, inputs.fixed_model.to_dict(), ENGINE.max_num_batched_tokens) == (cost, planned)


@pytest.mark.parametrize("name", ["long", "short"])
def test_the_planner_weighs_1p1d_against_two_colocated_replicas(plans, name):
    case, result = CASES[name], plans[name]
    assert result.decision == case.verdict and result.verdict.decided_by == "goodput_per_gpu"
    assert result.pd_decision == "margin" and result.inputs.pd_decision == "margin"
    # margin routing is priced from a profile: without one the plan hands every request off
    assert dataclasses.replace(result.inputs, fixed_model=None).pd_modelled == "always"
    assert (result.disaggregated.n_prefill, result.disaggregated.n_decode, result.disaggregated.gpus) == (1, 1, 2)
    assert (result.colocated.replicas, result.colocated.score.chunk_tokens, result.colocated.gpus) == (2, 512, 2)
    gain = result.verdict.goodput_gain
    assert gain > result.inputs.margin if case.verdict == "disaggregate" else gain <= result.inputs.margin
    # the matched load is set by the losing plan: the smaller goodput
    smaller = result.colocated if case.verdict == "disaggregate" else result.disaggregated
    assert matched_rate_rps(result) == MARGIN_LOAD * smaller.goodput_rps


@pytest.mark.parametrize("name", ["long", "short"])
def test_the_decode_batch_at_the_matched_load(plans, name):
    case = CASES[name]
    rate = matched_rate_rps(plans[name])
    b = little_batch(rate, case)
    base_s, seq_s, context_s = PROFILE["decode_coef"]
    step_s = base_s + b * (seq_s + context_s * case.decode_context)  # the profile's step, at a fractional B
    assert b == pytest.approx(rate * case.mean_output * step_s, rel=1e-12)  # the fixed point
    assert round(b) == case.batch  # long: ~0.08 (0.0137 req/s); short: ~5.1 (0.62 req/s)


def served_router_like_the_plan(profile_path: str, result: PlanResult, clock_s: float = 100.0) -> Router:
    """The served router (`router_for`) at the plan's own SLO values, on a clock that stands still."""
    slo = result.inputs.slo
    config = ServeConfig(engine=ENGINE, mode="disaggregated", pd_decision="margin", pd_profile=profile_path,
                         slo_ttft_s=slo.ttft_s, slo_tpot_s=slo.tpot_s)
    return Router(router_for(config, resolve_model("small")).config, clock=lambda: clock_s)


@pytest.mark.parametrize("name", ["long", "short"])
def test_the_planner_routes_each_request_as_the_served_router(plans, profile_path, name):
    """Every decision of the planner's margin-routed run at the matched load: the served router's
    config decides the same from the same facts, terms and gates to the bit."""
    result = plans[name]
    cfg = served_router_like_the_plan(profile_path, result).config
    routed: tuple[RoutedDecision, ...] = result.routed
    assert len(routed) == 512 and [r.view.now_s for r in routed] == sorted(r.view.now_s for r in routed)
    for r in routed:
        assert decide_pd(r.facts, cfg.pd, cfg.cost, cfg.ttft_slo_s, cfg.tpot_slo_s) == r.decision
        assert (r.facts.prompt_tokens, r.facts.decode_batch, r.facts.decode_routed, r.facts.prefill_pending_tokens,
                r.facts.decode_pending_tokens) == (r.view.prompt_tokens, r.view.decode_batch, r.view.decode_routed,
                                                   r.view.prefill_pending_tokens, r.view.decode_pending_tokens)
    assert {r.decision.disaggregate for r in routed} == {False, True}  # both routes are exercised


@pytest.mark.parametrize("name", ["long", "short"])
def test_the_planner_routes_each_request_as_the_served_router_through_route(plans, profile_path, name):
    """A sample through `Router.route` itself (load reports, arrival rate, pair choice): where B is
    D's reported batch (its live routes no more), the whole decision is the planner's."""
    routed = [r for r in plans[name].routed if r.facts.decode_routed <= r.facts.decode_batch]
    sample = routed[::25] + [next(r for r in routed if r.decision.disaggregate)]
    for r in sample:
        router = served_router_like_the_plan(profile_path, plans[name])
        request = RouteRequest(f"r{r.view.request}", r.view.prompt_tokens, r.view.output_tokens)
        got = route_request(router, request, r.view.decode_batch, r.view.prefill_pending_tokens, r.arrival_rate_rps,
                            r.view.decode_pending_tokens)
        assert got == r.decision


@pytest.fixture(scope="module")
def always_plans(profile_path) -> dict[str, PlanResult]:
    return {case.name: plan_for(profile_path, case, "--pd-decision", "always") for case in CASES.values()}


@pytest.mark.parametrize("name", ["long", "short"])
def test_the_margin_routed_plan(plans, always_plans, name):
    """Goodput (req/s) of 2 colocated replicas, 1P1D handing every request off and 1P1D margin-
    routed; the share kept local at that goodput and at the matched load (module docstring)."""
    margin, always = plans[name], always_plans[name]
    # Each is an end-to-end goodput search (5% resolution) whose ladder is centred on the plan's own
    # figure; the planned figures moved with the steady decode context and the sustained-rate cap
    # (search/candidates.py, phase_search.py), so each search bisects other rates of the same simulation;
    # the local shares moved when the route delta became the handed-off first token's lateness (pd_decision.py).
    expected = {  # colocated, always, margin, local share at margin's goodput, local of 512 at the matched load
        "long": (0.03245162195007773, 0.09643056071499657, 0.09643056071499657, 0.076171875, 400),
        "short": (1.1018219513827425, 0.8111783664314627, 0.7898315673148453, 0.03125, 10),
    }[name]
    got = (margin.end_to_end["colocated"].rate, always.end_to_end["disaggregated"].rate,
           margin.end_to_end["disaggregated"].rate, margin.local_share,
           sum(not r.decision.disaggregate for r in margin.routed))
    assert got == pytest.approx(expected, rel=1e-9)
    assert always.pd_decision == "always" and always.local_share is None and always.routed == ()
    assert (margin.decision, always.decision) == (CASES[name].verdict,) * 2
    # margin mode weighs end-to-end goodput per GPU (both plans on 2 GPUs); always, the planned one
    assert margin.verdict.goodput_gain == pytest.approx(expected[2] / expected[0] - 1, rel=1e-12)
    assert always.verdict.goodput_gain == pytest.approx(
        always.disaggregated.goodput_per_gpu / always.colocated.goodput_per_gpu - 1, rel=1e-12)
    summary = plan_summary(margin)
    assert (summary["pd_decision"], summary["pd_local_share"]) == ("margin", margin.local_share)
    assert f"{margin.local_share:.0%} of requests prefilled on their decode worker" in plan_table(summary)
    assert plan_summary(always)["pd_decision"] == "always" and "every request handed off" in plan_table(plan_summary(always))
    if name == "long":  # every request that found D idle stayed there; B = 0 never disaggregates
        idle = [r for r in margin.routed if r.facts.delayed_batch == 0]
        assert len(idle) == 400 and not any(r.decision.disaggregate for r in idle)


def test_long_prompts_stay_local_beside_an_idle_decode_worker(plans, profile_path):
    """Why the median long request stays local at the matched load, term by term: nothing runs at
    D, so nothing is saved (the planner's own run decides every B = 0 arrival so: see
    `test_the_margin_routed_plan`)."""
    _, batch, pending = operating_point(plans, LONG)
    router = serving_router(profile_path, LONG)
    cost, (ttft_slo, tpot_slo) = router.config.cost, study_slo_s(LONG)
    idle = route_median_request(router, LONG, batch, pending)
    assert batch == 0 and not idle.disaggregate and idle.reason == "margin"
    # three 512-token local chunks, each attending to the chunks before it (the profile's pair term):
    # 1.865 + 2.914 + 3.962 = 8.742 s, the profile's own 1536-token prefill plus two more steps'
    # overhead, within the 43.1 s TTFT target; no decode to delay
    local_ttft = sum(cost.chunked_prefill_s(LONG.median_prompt, 0, ENGINE.max_num_batched_tokens))
    assert local_ttft == pytest.approx(8.741664, abs=1e-9) and local_ttft < ttft_slo
    assert local_ttft == pytest.approx(LATENCY.prefill_batch_s([LONG.median_prompt], [0]) + 2 * 0.06, abs=1e-9)
    assert idle.terms.interference_saved_s == 0.0
    # handed off, P's queue and prefill are within the TTFT target too: the route delta is 0 and the
    # exposed transfer alone decides
    assert pending > 0 and float(cost.queue_s(pending)) > 0 and idle.terms.route_delta_s == 0.0
    assert idle.net_margin_s == pytest.approx(-(idle.terms.transfer_exposed_s + idle.terms.failure_penalty_s), abs=1e-12)
    # the report's dT points the same way: at this load a request finishes sooner colocated
    assert plans["long"].net_margin_s < 0 and plans["long"].verdict.agrees is False
    # one running decode of ~1.6k-token context steps in 108.5 ms: 96 tokens x (214.2 - 108.5) ms = 10.1 s
    # of mean-TPOT slack would absorb the 8.7 s stall, but each of the three local chunks (1.865, 2.914,
    # 3.962 s) is one inter-token gap past the 214.2 ms target: 8.742 - 3 x (214.2 - 108.5) ms late
    one = route_median_request(serving_router(profile_path, LONG), LONG, 1, pending)
    assert one.disaggregate and one.reason == "margin"
    assert one.terms.interference_saved_s == pytest.approx(8.741664 - 3 * (0.21416 - 0.10852), abs=1e-9)
    # two such decodes step in 157 ms: each gap 57.1 ms shorter past the target, for both
    two = route_median_request(serving_router(profile_path, LONG), LONG, 2, pending)
    running = cost.decode_step_at(2, LONG.median_prompt + int(LONG.mean_output) / 2)
    assert running == pytest.approx(0.06 + 2 * (1e-3 + 3e-5 * 1584), abs=1e-12)
    assert two.disaggregate and two.reason == "margin" and two.ttft_gate and two.tpot_gate
    assert two.terms.interference_saved_s == pytest.approx(2 * (8.741664 - 3 * (0.21416 - running)), abs=1e-9)


def test_short_prompts_beside_five_decodes_are_handed_off_for_the_gaps(plans, profile_path):
    """The short point, term by term: the stall fits the running decodes' mean-TPOT slack, but the
    local prefill's step is one inter-token gap past the per-token target for each of them."""
    rate, batch, pending = operating_point(plans, SHORT)
    router = serving_router(profile_path, SHORT)
    cost, (ttft_slo, tpot_slo) = router.config.cost, study_slo_s(SHORT)
    decision = route_median_request(router, SHORT, batch, pending, rate)
    assert batch == 5 and decision.disaggregate and decision.reason == "margin"
    assert decision.ttft_gate and decision.tpot_gate
    # D's step for 5 decodes of ~128-token context (the profile's form, not the 512 reference): 84.2 ms
    running = cost.decode_step_at(5, SHORT.median_prompt + int(SHORT.mean_output) / 2)
    assert running == pytest.approx(0.06 + 5 * (1e-3 + 3e-5 * 128), abs=1e-12)
    # slack: (126.8 - 84.2) ms x 96 tokens, shared by 1 + rate x 96 x 84.2 ms prefills: ~0.68 s > the
    # 80-token prompt's 342 ms stall: the mean-TPOT view alone would keep it local
    slack = tpot_slack_s(tpot_slo, running, int(SHORT.mean_output), rate)
    stall = float(cost.prefill_s(SHORT.median_prompt))
    assert stall == pytest.approx(0.342080, abs=1e-9) and slack > stall
    # the gap: D's step with the prompt beside the 5 decodes, past 126.8 ms, for each of the 5
    facts = PdFacts(SHORT.median_prompt, SHORT.median_prompt, SHORT.median_prompt, 0, True, batch, pending, 0.0,
                    decode_tokens=int(SHORT.mean_output))
    parts = [step - running for step in local_steps_s(facts, router.config.pd, cost)]
    assert decision.terms.interference_saved_s == pytest.approx(5 * gap_late_s(parts, running, tpot_slo), abs=1e-12)
    assert decision.terms.interference_saved_s > decision.terms.transfer_exposed_s + decision.terms.route_delta_s


def test_the_router_agrees_with_the_report_s_net_margin_at_the_long_point(plans, profile_path):
    """At the long operating point (D idle), the router's net margin and the report's dT have one
    sign; at the short point the report's end-to-end dT and the router's gap charge differ by design
    (`test_short_prompts_beside_five_decodes_are_handed_off_for_the_gaps`)."""
    rate, batch, pending = operating_point(plans, LONG)
    decision = route_median_request(serving_router(profile_path, LONG), LONG, batch, pending, rate)
    assert plans["long"].net_margin_s < 0 and decision.net_margin_s < 0 and not decision.disaggregate
