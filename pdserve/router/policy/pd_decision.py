"""Per-request P/D decision: disaggregate, or prefill on the chosen decode worker (issue 20).

Contract: pure functions over the router's snapshot and the policy's chosen pair; nothing here
holds blocks or does I/O. `decide_pd(facts, policy, cost, ttft_slo_s, tpot_slo_s)` is the one decision (facts may be None
where the policy reads none: "never", and "always" without a prompt floor):

    mode "never"                   prefill locally on the decode worker
    uncached < min_prompt_tokens   prefill locally: a prompt with fewer uncached tokens at D (its
                                   prefix cache subtracted, as llm-d's decider counts) never
                                   disaggregates (applies first, in "always" and "margin" mode alike)
    mode "always"                  disaggregate (the demo and the handoff tests pin it)
    mode "margin"                  the spec's net margin, decided by the ledger's `should_enable_pd`
                                   (one formula, shared with the planner and the release check)

The four terms, in seconds per request, from the router's cost model (`CostModel`, fitted on this
machine at start or by `pdserve profile`: router/pricing/calibration.py) and the live load reports:

    interference saved  a local prefill of u_D tokens (its uncached prompt at D) runs in chunks of
                        the step budget left beside the B decodes at D; each mixed step
                        takes decode_step_s(B) + prefill_chunk_s(chunk, context so far): a later
                        chunk of a long prompt attends to more keys. Counted against the SLOs (the
                        ledger's `slo_interference_s`): B x the stall (the steps' prefill part)
                        beyond each decode's TPOT slack (TPOT target - decode_step_s(B)) x its
                        tokens, shared by the 1 + lambda x lifetime prefills landing during its
                        life), plus the local TTFT (D's queued prompt work + the steps) beyond the TTFT
                        target. Each decode's slack is its own (`PdFacts.budgets`: its tokens so
                        far, the time they took and its max_tokens left; a decode not yet started
                        takes this request's expected output), and its harm is at least the
                        inter-token gaps the steps open beyond the TPOT target, each gap the
                        batch's p90 ITL (`itl_p90_s`) plus the step's prefill part (the ledger's
                        `gap_late_s`). D's step for its running decodes takes each to look like this
                        request (`decode_step_at`: its prompt and half its output as context);
                        lambda is the router's recent arrival rate. B counts every sequence
                        that will share D's batch with the local prefill: the larger of D's
                        reported decoding batch (plus grants not yet applied) and the router's
                        live routes to D, which also holds the requests still prefilling at P or
                        queued at D (D reports only the sequences already decoding, so a decision
                        from the report alone sees an idle D while P prepares its next decodes).
                        Less what the handoff does not save: a handed-off request whose K/V lands
                        at D (after P's queue, its prefill and the exposed transfer) before D's
                        queued prompt work drains decodes beside that work; its own stall beyond
                        its slack counts against disaggregating (a local prefill waits behind it).
                        The slack reads D's measured TPOT (its live requests' mean so far, from
                        their token times) where that exceeds the profile's step: a profile fitted
                        at start on a quieter machine otherwise promises slack D no longer has
    exposed transfer    the K/V bytes the handoff moves, transfer_s(bytes, same host), less what
                        the layer-wise stream hides behind P's prefill (handoff/streaming.py's
                        visible-time recurrence over `stream_layers` equal layers)
    route delta         the request's own first token past its TTFT target on the handed-off
                        route before the transfer: P's queue, queue_s(P's pending prompt tokens),
                        and its prefill of u_P (the ledger's `ttft_late_s`). A wait the target
                        absorbs costs nothing, as it costs goodput nothing; the local route's own
                        lateness (D's queued prompt work and the steps) is in the interference term,
                        so both routes are priced in the same unit: seconds past a target
    failure penalty     the observed transfer-failure rate x the recompute cost (the whole prompt's
                        chunked prefill)

Targets (`decision_slos`): the request's own, else `--slo-ttft-ms` / `--slo-tpot-ms`, else
derived from the profile: `SLO_SCALE` x the idle prefill of the prompt or of the workload's recent
median prompt (the longer) and x an idle decode step (the ledger's `profile_slo_s`).

Gates: TTFT passes when the disaggregated route's predicted TTFT (P's queue + its chunked prefill of u_P +
exposed transfer) is within the TTFT target or no later than the local route's (D's queue + its
mixed steps); TPOT passes when D's next decode step decode_step_s(B + 1) is within the TPOT
target or no longer than the local route's longest mixed step. A gate vetoes disaggregation only
where it would miss a target the local prefill meets: both routes decode at D, and a local prefill
that puts any running decode past its TPOT target (the decodes' part of the interference,
`local_decodes_late_s`) meets no veto from the TTFT gate: one late first token is not worth more
than the decodes it would make late, and the margin weighs the two.
"""


from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.kv.kv_abi import KvAbi
from pdserve.handoff.streaming import exposed_transfer_s, layerwise_visible_times
from pdserve.ledger.margin import (
    SLO_SCALE,
    DecodeBudget,
    MarginTerms,
    decodes_late_s,
    net_margin_s,
    profile_slo_s,
    should_enable_pd,
    slo_interference_s,
    ttft_late_s,
)
from pdserve.router.messages import RouteRequest
from pdserve.router.policy import demand
from pdserve.router.pricing.cost import CostModel

MODES = ("always", "never", "margin")
DISAGGREGATE = "disaggregate"
LOCAL = "local"


@dataclass(frozen=True)
class PdPolicy:
    """`--pd-decision`, `--pd-min-prompt-tokens` (uncached tokens at D), `--pd-safety-margin-ms`
    and the SLO targets the margin reads (`--slo-ttft-ms`, `--slo-tpot-ms`; None: derived from
    the profile per request, `decision_slos`); `stream_layers` and `layerwise_min_tokens`
    describe the handoff's layer-wise stream (one layer: a serialized transfer)."""

    mode: str = "always"
    min_prompt_tokens: int = 0
    safety_margin_s: float = 0.0
    ttft_slo_s: float | None = None
    tpot_slo_s: float | None = None
    stream_layers: int = 1
    layerwise_min_tokens: int = 256
    chunk_tokens: int = 512  # the decode worker's per-step token budget (its max_num_batched_tokens)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"--pd-decision must be one of {MODES}, got {self.mode!r}")
        if self.min_prompt_tokens < 0 or self.stream_layers < 1:
            raise ValueError("--pd-min-prompt-tokens must be >= 0 and stream_layers >= 1")
        if not self.safety_margin_s >= 0:
            raise ValueError(f"--pd-safety-margin-ms must be >= 0, got {self.safety_margin_s * 1e3}")

    @property
    def slo_source(self) -> str:
        """Where the margin's targets come from: "flags" (the user's) or "profile" (derived)."""
        return "flags" if self.ttft_slo_s is not None and self.tpot_slo_s is not None else "profile"

    def slo_view(self) -> dict:
        """The margin's targets as `/workers` shows them on decode workers (None: derived per request)."""
        return {"source": self.slo_source, "ttft_s": self.ttft_slo_s, "tpot_s": self.tpot_slo_s,
                "profile_scale": SLO_SCALE, "safety_margin_s": self.safety_margin_s}


@dataclass(frozen=True)
class PdFacts:
    """What one request's decision reads, for the policy's chosen (P, D) pair."""

    prompt_tokens: int
    local_compute_tokens: int  # u_D: prompt tokens D would compute (its prefix cache subtracted)
    remote_compute_tokens: int  # u_P: prompt tokens P would compute
    transfer_bytes: int  # K/V bytes the handoff would move to D
    same_host: bool
    decode_batch: int  # decodes running at D that a local prefill would delay
    prefill_pending_tokens: int  # prompt tokens already queued at P
    failure_rate: float  # observed transfer failures / transfers ended
    decode_pending_tokens: int = 0  # prompt tokens already queued at D (its local prefills)
    arrival_rate_rps: float = 0.0  # the router's recent request arrival rate
    decode_tokens: int = 1  # tokens a running decode makes (this request's expected output: the estimate)
    decode_routed: int = 0  # live routes to D (router ledger): decoding, prefilling at P, or queued at D
    measured_tpot_s: float = 0.0  # mean TPOT of D's live requests so far (0: none measured)
    budgets: tuple[DecodeBudget, ...] = ()  # D's running decodes' own budgets (the frontend's token clocks)
    itl_p90_s: float = 0.0  # p90 inter-token gap of D's recent tokens (0: none measured)

    @property
    def delayed_batch(self) -> int:
        """B: the decodes a local prefill here would delay (module contract)."""
        return max(self.decode_batch, self.decode_routed)


@dataclass(frozen=True)
class PdDecision:
    disaggregate: bool
    reason: str  # the mode that decided, "min_prompt_tokens", "margin" or "gate"
    terms: MarginTerms | None = None  # only when the margin was computed
    net_margin_s: float | None = None
    ttft_gate: bool | None = None
    tpot_gate: bool | None = None
    delayed_batch: int | None = None  # the B the margin read (PdFacts.delayed_batch)
    measured_tpot_s: float | None = None  # D's measured TPOT the slack read (PdFacts.measured_tpot_s)
    ttft_slo_s: float | None = None  # the targets the margin read (decision_slos)
    tpot_slo_s: float | None = None

    @property
    def label(self) -> str:
        return DISAGGREGATE if self.disaggregate else LOCAL

    def trace_fields(self) -> dict:
        """The request trace line's fields for this decision (router/process/inflight.py)."""
        fields = {"pd_decision": self.label, "pd_reason": self.reason}
        if self.terms is not None:
            fields.update(pd_interference_saved_s=self.terms.interference_saved_s,
                          pd_transfer_exposed_s=self.terms.transfer_exposed_s, pd_route_delta_s=self.terms.route_delta_s,
                          pd_failure_penalty_s=self.terms.failure_penalty_s, pd_net_margin_s=self.net_margin_s,
                          pd_ttft_gate=self.ttft_gate, pd_tpot_gate=self.tpot_gate, pd_delayed_batch=self.delayed_batch,
                          pd_measured_tpot_s=self.measured_tpot_s, pd_ttft_slo_s=self.ttft_slo_s,
                          pd_tpot_slo_s=self.tpot_slo_s)
        return fields


PINNED = {"always": PdDecision(True, "always"), "never": PdDecision(False, "never")}  # shared: the hot path


def facts_for(request: RouteRequest, prefill_hit_blocks: int, decode_hit_blocks: int, same_host: bool,
              decode_batch: int, prefill_pending_tokens: int, failure_rate: float, cost: CostModel,
              decode_pending_tokens: int = 0, arrival_rate_rps: float = 0.0, decode_routed: int = 0,
              measured_tpot_s: float = 0.0, budgets: tuple[DecodeBudget, ...] = (), itl_p90_s: float = 0.0) -> PdFacts:
    """The facts for one chosen pair, with demand.py's token arithmetic (the plan's own)."""
    bs = cost.block_size_tokens
    local_hit = demand.usable_prefill_hit(request, decode_hit_blocks, bs)
    return PdFacts(
        prompt_tokens=request.prompt_tokens,
        local_compute_tokens=int(demand.compute_tokens(request, local_hit, bs)),
        remote_compute_tokens=int(demand.compute_tokens(request, prefill_hit_blocks, bs)),
        transfer_bytes=int(demand.transfer_tokens(request, decode_hit_blocks, bs)) * cost.kv_bytes_per_token,
        same_host=same_host, decode_batch=decode_batch, prefill_pending_tokens=prefill_pending_tokens,
        failure_rate=failure_rate, decode_pending_tokens=decode_pending_tokens, arrival_rate_rps=arrival_rate_rps,
        decode_tokens=max(1, request.expected_output_tokens), decode_routed=decode_routed,
        measured_tpot_s=measured_tpot_s, budgets=budgets, itl_p90_s=itl_p90_s,
    )


def running_step_s(facts: PdFacts, cost: CostModel) -> float:
    """D's decode step for its B sequences (`delayed_batch`), each taken to look like this request
    (its prompt and half its output as context): the profile's own form, not the reference context."""
    batch = facts.delayed_batch
    if not batch:
        return 0.0
    return cost.decode_step_at(batch, facts.prompt_tokens + facts.decode_tokens / 2)


def local_steps_s(facts: PdFacts, policy: PdPolicy, cost: CostModel) -> list[float]:
    """The mixed steps a local prefill of u_D tokens takes at D, each step also carrying the B
    decode rows: the engine's scheduler cuts a prompt on the chunk grid and runs a step's first
    chunk whole even past the budget the decode rows leave (engine/scheduler.py), so a lone local
    prefill takes as many steps beside B decodes as beside none (the simulator's mixed instance,
    sim/colocated.py, steps it the same way)."""
    todo = facts.local_compute_tokens
    decode_s = running_step_s(facts, cost)
    chunks = cost.at_decode_worker().chunked_prefill_s(todo, facts.prompt_tokens - todo, policy.chunk_tokens)
    return [decode_s + chunk_s for chunk_s in chunks]


def remote_prefill_s(facts: PdFacts, policy: PdPolicy, cost: CostModel) -> float:
    """P's prefill of its u_P uncached tokens, in chunks of the step budget after its cached prefix."""
    todo = facts.remote_compute_tokens
    return sum(cost.chunked_prefill_s(todo, facts.prompt_tokens - todo, policy.chunk_tokens)) or float(cost.prefill_s(0))


def local_wait_s(facts: PdFacts, cost: CostModel) -> float:
    """Prompt work already queued at D that a local prefill waits behind (at D's TP size)."""
    return float(cost.at_decode_worker().queue_s(facts.decode_pending_tokens))


def remote_ttft_s(facts: PdFacts, policy: PdPolicy, cost: CostModel) -> float:
    """When a handed-off request's K/V is at D: P's queue, its prefill there, the exposed transfer."""
    return float(cost.queue_s(facts.prefill_pending_tokens)) + remote_prefill_s(facts, policy, cost) + exposed_s(facts, policy, cost)


def local_decodes_late_s(facts: PdFacts, cost: CostModel, tpot_slo_s: float, steps: list[float]) -> float:
    """Seconds past their TPOT targets the local route's mixed `steps` put on D's running decodes
    (the ledger's `decodes_late_s`; 0: the local prefill meets every one of their targets)."""
    return decodes_late_s(facts.delayed_batch, steps, tpot_slo_s, facts.arrival_rate_rps, running_step_s(facts, cost),
                          facts.decode_tokens, facts.measured_tpot_s, facts.budgets, facts.itl_p90_s)


def margin_terms(facts: PdFacts, policy: PdPolicy, cost: CostModel, ttft_slo_s: float, tpot_slo_s: float,
                 steps: list[float] | None = None, decodes_late: float | None = None) -> MarginTerms:
    """The four terms; `steps`, `decodes_late`: the local route's mixed steps and what they put on
    D's decodes (`local_decodes_late_s`) when the caller has them already."""
    steps = local_steps_s(facts, policy, cost) if steps is None else steps
    if decodes_late is None:
        decodes_late = local_decodes_late_s(facts, cost, tpot_slo_s, steps)
    wait_s, exposed = local_wait_s(facts, cost), exposed_s(facts, policy, cost)
    before_transfer_s = float(cost.queue_s(facts.prefill_pending_tokens)) + remote_prefill_s(facts, policy, cost)
    return MarginTerms(
        interference_saved_s=slo_interference_s(facts.delayed_batch, steps, tpot_slo_s, ttft_slo_s, wait_s,
                                                facts.arrival_rate_rps, running_step_s(facts, cost), facts.decode_tokens,
                                                own_stall_s=max(0.0, wait_s - before_transfer_s - exposed),
                                                measured_tpot_s=facts.measured_tpot_s, decodes_late=decodes_late),
        transfer_exposed_s=exposed,
        route_delta_s=ttft_late_s(before_transfer_s, ttft_slo_s),
        failure_penalty_s=facts.failure_rate * sum(cost.chunked_prefill_s(facts.prompt_tokens, 0, policy.chunk_tokens)),
    )


def exposed_s(facts: PdFacts, policy: PdPolicy, cost: CostModel) -> float:
    """Transfer time not hidden behind P's prefill. A layer-wise stream sends layer l once its
    prefill is done (ready at (l+1)/L of the prefill) and moves 1/L of the bytes per layer."""
    transfer = float(cost.transfer_s(facts.transfer_bytes, int(facts.same_host)))
    prefill = remote_prefill_s(facts, policy, cost)
    layers = policy.stream_layers if facts.remote_compute_tokens >= policy.layerwise_min_tokens else 1
    ready = [prefill * (i + 1) / layers for i in range(layers)]
    visible = layerwise_visible_times(ready, [transfer / layers] * layers)
    return exposed_transfer_s(visible[-1], prefill)


def decide_pd(facts: PdFacts | None, policy: PdPolicy, cost: CostModel, ttft_slo_s: float, tpot_slo_s: float) -> PdDecision:
    """Disaggregate this request, or prefill it locally on the decode worker (module contract)."""
    if policy.mode == "never":
        return PINNED["never"]
    if facts is not None and facts.local_compute_tokens < policy.min_prompt_tokens:
        return PdDecision(False, "min_prompt_tokens")
    if policy.mode == "always":
        return PINNED["always"]
    steps = local_steps_s(facts, policy, cost)  # once: the terms and the gates read the same steps
    decodes_late = local_decodes_late_s(facts, cost, tpot_slo_s, steps)
    terms = margin_terms(facts, policy, cost, ttft_slo_s, tpot_slo_s, steps, decodes_late)
    remote_tpot_s = float(cost.decode_step_s(facts.delayed_batch + 1))
    # each gate: the disaggregated route meets the target, or does no worse than the local route,
    # or the local route misses a target too: a running decode's (then the margin alone decides)
    ttft_gate = (remote_ttft_s(facts, policy, cost) <= max(ttft_slo_s, local_wait_s(facts, cost) + sum(steps))
                 or decodes_late > 0.0)
    tpot_gate = remote_tpot_s <= max(tpot_slo_s, max(steps, default=0.0))
    enable = should_enable_pd(terms, policy.safety_margin_s, ttft_gate, tpot_gate)
    margin_ok = net_margin_s(terms) > policy.safety_margin_s
    reason = "margin" if enable or not margin_ok else "gate"
    return PdDecision(enable, reason, terms, net_margin_s(terms), ttft_gate, tpot_gate, facts.delayed_batch,
                      facts.measured_tpot_s, ttft_slo_s, tpot_slo_s)


def slo_line(policy: PdPolicy, cost: CostModel) -> str:
    """The startup line that says which targets the margin decides with."""
    ttft = f"{SLO_SCALE:g}x the idle prefill of the prompt or of the recent median prompt, the longer (profile)"
    if policy.ttft_slo_s is not None:
        ttft = f"{policy.ttft_slo_s * 1e3:g} ms"
    tpot = f"{policy.tpot_slo_s * 1e3:g} ms" if policy.tpot_slo_s is not None else (
        f"{SLO_SCALE:g}x an idle decode step (profile; {profile_slo_s(float(cost.decode_step_at(1, 1024))) * 1e3:.1f} ms "
        "at 1,024 tokens)")
    return (f"P/D decision {policy.mode}: TTFT target {ttft}, TPOT target {tpot}, safety margin "
            f"{policy.safety_margin_s * 1e3:g} ms (--slo-ttft-ms / --slo-tpot-ms / --pd-safety-margin-ms)")


def decision_slos(request: RouteRequest, facts: PdFacts, policy: PdPolicy, cost: CostModel,
                  reference_tokens: int = 0) -> tuple[float, float]:
    """(TTFT, TPOT) targets the margin reads: the request's own, else the user's flags, else
    derived from the profile (the ledger's `profile_slo_s`): of the prefill on an idle worker of
    the prompt or of `reference_tokens` (the workload's recent median prompt, the router's
    `PromptLengths`), the longer, so a short prompt is held to the workload's target, as goodput
    is scored; and of one decode step at batch 1 at this request's context."""
    ttft_s = request.ttft_slo_s if request.ttft_slo_s is not None else policy.ttft_slo_s
    tpot_s = request.tpot_slo_s if request.tpot_slo_s is not None else policy.tpot_slo_s
    if ttft_s is None:
        tokens = max(facts.prompt_tokens, reference_tokens)
        ttft_s = profile_slo_s(sum(cost.at_decode_worker().chunked_prefill_s(tokens, 0, policy.chunk_tokens)))
    if tpot_s is None:
        tpot_s = profile_slo_s(float(cost.decode_step_at(1, facts.prompt_tokens + facts.decode_tokens / 2)))
    return ttft_s, tpot_s


# ---- the decision as `pdserve serve` builds it ------------------------------------------------
# `served_pd` is the one construction of the margin decision's inputs before TP pricing:
# api/server.py `router_for` calls it (then prices each worker's TP size, router/pricing/tp_pricing.py)
# and the planner calls it for its margin-routed simulation (search/margin_routing.py; one-GPU shapes,
# where that pricing is the identity), so both decide with the same terms: a profile's fit made
# affine at the serving chunk (`CostModel.from_profile`), the placeholders without one, the
# layer-wise stream over the model's layers, chunks of the engine's step budget.
def served_pd(abi: KvAbi, profile: dict | None, chunk_tokens: int, mode: str, min_prompt_tokens: int = 0,
              layerwise_min_tokens: int = 256, safety_margin_s: float = 0.0, ttft_slo_s: float | None = None,
              tpot_slo_s: float | None = None) -> tuple[CostModel, PdPolicy]:
    """(cost model, policy) for a worker pool of `abi` whose steps `profile` times (None: placeholders);
    SLO targets None: derived from that cost model per request (pd_decision.decision_slos)."""
    cost = CostModel.from_abi(abi) if profile is None else CostModel.from_profile(abi, profile, chunk_tokens)
    policy = PdPolicy(mode, min_prompt_tokens, safety_margin_s, ttft_slo_s, tpot_slo_s, stream_layers=abi.num_layers,
                      layerwise_min_tokens=layerwise_min_tokens, chunk_tokens=chunk_tokens)
    return cost, policy
