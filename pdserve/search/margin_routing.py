"""The planner's per-request P/D decisions, made by the router's own function (issue 20).

Contract: `MarginRouter` is a `sim.margin_routed.Decide`. For each simulated arrival it builds the
facts the router builds (`router.pd_decision.facts_for` over the arrival's `ArrivalView`; the
arrival rate from the router's `ArrivalRate`, read before the arrival is counted, as
`Router.route` reads it), calls `decide_pd` with the cost model and policy `pdserve serve
--pd-decision MODE --pd-profile FILE` builds (`router.policy.pd_decision.served_pd`: the same profile, K/V
geometry and step budget), and records each (view, facts, decision). Nothing of the decision is
computed here. What the simulation does not model reads as nothing: no transfer failures, no
measured TPOT beyond the profile, one host unless told otherwise; a prefix hit counts at both
workers (the simulator's cached tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.kv.kv_abi import KvAbi
from pdserve.latency.geometry import ModelSpec
from pdserve.router.messages import RouteRequest
from pdserve.router.policy.pd_decision import PdDecision, PdFacts, PdPolicy, decide_pd, facts_for, served_pd
from pdserve.router.pricing.cost import CostModel
from pdserve.router.pricing.decode_clocks import ArrivalRate
from pdserve.sim.margin_routed import ArrivalView

DTYPES = {4: "float32", 2: "bfloat16"}  # K/V bytes per scalar -> the served dtype of that width
BLOCK_SIZE = 16  # the served engine's default K/V block (engine/config.py)


@dataclass(frozen=True)
class RoutedDecision:
    """One simulated arrival: what the router would read, its facts and its decision."""

    view: ArrivalView
    arrival_rate_rps: float
    facts: PdFacts
    decision: PdDecision


def served_pricing(model: ModelSpec, profile: dict, chunk_tokens: int, mode: str = "margin") -> tuple[CostModel, PdPolicy]:
    """What `pdserve serve --pd-profile` builds for `model` from `profile` (a TP 1 fit)."""
    g = model.geometry
    if g.dtype_bytes not in DTYPES:
        raise ValueError(f"margin routing: no served K/V dtype of {g.dtype_bytes} bytes (served: {sorted(DTYPES)})")
    abi = KvAbi(g.layers, g.kv_heads, g.head_dim, BLOCK_SIZE, DTYPES[g.dtype_bytes])
    return served_pd(abi, profile, chunk_tokens, mode)


class MarginRouter:
    """The router's decision over simulated arrivals (module contract)."""

    def __init__(self, cost: CostModel, policy: PdPolicy, ttft_slo_s: float, tpot_slo_s: float, same_host: bool = True):
        self.cost, self.policy, self.same_host = cost, policy, same_host
        self.ttft_slo_s, self.tpot_slo_s = ttft_slo_s, tpot_slo_s
        self.arrivals = ArrivalRate()  # the router's own estimator, with its default window
        self.decisions: list[RoutedDecision] = []

    def __call__(self, view: ArrivalView) -> bool:
        request = RouteRequest(str(view.request), view.prompt_tokens, view.output_tokens)
        hit_blocks = view.cached_tokens // self.cost.block_size_tokens
        rate = self.arrivals.rate(view.now_s)
        facts = facts_for(request, hit_blocks, hit_blocks, self.same_host, view.decode_batch, view.prefill_pending_tokens,
                          0.0, self.cost, view.decode_pending_tokens, rate, view.decode_routed)
        decision = decide_pd(facts, self.policy, self.cost, self.ttft_slo_s, self.tpot_slo_s)
        self.arrivals.observe(view.now_s)
        self.decisions.append(RoutedDecision(view, rate, facts, decision))
        return decision.disaggregate
