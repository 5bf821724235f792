"""The cost model and P/D policy `pdserve serve` decides with, built from a latency profile (issue 20).

Contract: `served_pd` is the one construction of the margin decision's inputs before TP pricing.
api/server.py `router_for` calls it (then prices each worker's TP size, router/pricing/tp_pricing.py) and
the planner calls it for its margin-routed simulation (search/margin_routing.py; one-GPU shapes,
where that pricing is the identity), so both decide with the same terms: a profile's fit made
affine at the serving chunk (`CostModel.from_profile`), the placeholders without one, the layer-
wise stream over the model's layers, chunks of the engine's step budget.
"""

from __future__ import annotations

from pdserve.engine.kv_abi import KvAbi
from pdserve.router.pricing.cost import CostModel
from pdserve.router.policy.pd_decision import PdPolicy


def served_pd(abi: KvAbi, profile: dict | None, chunk_tokens: int, mode: str, min_prompt_tokens: int = 0,
              layerwise_min_tokens: int = 256, safety_margin_s: float = 0.0, ttft_slo_s: float | None = None,
              tpot_slo_s: float | None = None) -> tuple[CostModel, PdPolicy]:
    """(cost model, policy) for a worker pool of `abi` whose steps `profile` times (None: placeholders);
    SLO targets None: derived from that cost model per request (pd_decision.decision_slos)."""
    cost = CostModel.from_abi(abi) if profile is None else CostModel.from_profile(abi, profile, chunk_tokens)
    policy = PdPolicy(mode, min_prompt_tokens, safety_margin_s, ttft_slo_s, tpot_slo_s, stream_layers=abi.num_layers,
                      layerwise_min_tokens=layerwise_min_tokens, chunk_tokens=chunk_tokens)
    return cost, policy
