"""Net-margin decision for enabling P/D in one workload/topology cell (spec 0x0FD).

dT = interference saved - exposed (non-overlapped) transfer - routing delta - expected failure
penalty. Enable only when dT exceeds the declared safety margin and both SLO gates pass.
The interference a local prefill would cause is counted against the SLOs (`slo_interference_s`):
each running decode's harm is the larger of its stall beyond its own TPOT budget (TPOT as
goodput counts it: a request's mean; `budget_slack_s`) and the inter-token gaps the prefill's
steps open beyond the per-token target (`gap_late_s`); plus the request's own TTFT beyond its
target. The other side is counted in the same unit: the route delta is the request's own first
token past its target on the handed-off route (P's queue and prefill; `ttft_late_s`), so a wait at
P that the TTFT target absorbs costs nothing, as it costs goodput nothing. Without targets from the
user, both are `SLO_SCALE` times the profile's idle times (`profile_slo_s`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class MarginTerms:
    interference_saved_s: float
    transfer_exposed_s: float
    route_delta_s: float
    failure_penalty_s: float


def net_margin_s(terms: MarginTerms) -> float:
    """Seconds saved per request by disaggregating; negative means colocation wins."""
    return terms.interference_saved_s - terms.transfer_exposed_s - terms.route_delta_s - terms.failure_penalty_s


SLO_SCALE = 5.0  # profile-derived targets: this multiple of the idle time (DistServe's "SLO scale")


def profile_slo_s(idle_s: float) -> float:
    """A target derived from the measured profile when the user gives none: `SLO_SCALE` x the
    idle time (TTFT: the whole prefill on an idle worker of the prompt or of the workload's median
    prompt, the longer; TPOT: a decode step at batch 1)."""
    return SLO_SCALE * idle_s


@dataclass(frozen=True)
class DecodeBudget:
    """One running decode as its TPOT target sees it."""

    tokens_done: int  # output tokens so far (the first one included)
    decode_elapsed_s: float  # since its first token
    tokens_left: int  # its max_tokens less tokens_done


def budget_slack_s(budget: DecodeBudget, tpot_slo_s: float, decode_step_s: float, arrival_rate_rps: float) -> float:
    """Stall one running decode absorbs before its mean TPOT over all its tokens misses the
    objective: the target's time for all its gaps, less the time its gaps took so far and its
    remaining steps, shared by the 1 + lambda x remaining life prefills expected to land before it ends."""
    left_s = budget.tokens_left * decode_step_s
    gaps = budget.tokens_done + budget.tokens_left - 1
    return max(0.0, tpot_slo_s * gaps - budget.decode_elapsed_s - left_s) / (1.0 + arrival_rate_rps * left_s)


def tpot_slack_s(tpot_slo_s: float, decode_step_s: float, decode_tokens: int, arrival_rate_rps: float) -> float:
    """`budget_slack_s` of a decode about to start (`decode_tokens` to make, no time spent yet)."""
    return budget_slack_s(DecodeBudget(1, 0.0, decode_tokens), tpot_slo_s, decode_step_s, arrival_rate_rps)


def gap_late_s(prefill_parts_s: Sequence[float], base_gap_s: float, tpot_slo_s: float) -> float:
    """Per running decode: seconds by which the inter-token gaps a local prefill opens exceed the
    per-token target. Each mixed step is one gap: the batch's usual gap `base_gap_s` (its p90
    inter-token latency, at least its predicted step) plus the step's prefill part; only what the
    prefill part adds beyond the target is charged (a batch already past it is not charged twice)."""
    return sum(min(part, max(0.0, base_gap_s + part - tpot_slo_s)) for part in prefill_parts_s)


def decodes_late_s(decode_batch: int, step_s: Sequence[float], tpot_slo_s: float, arrival_rate_rps: float = 0.0,
                   decode_step_s: float = 0.0, decode_tokens: int = 1, measured_tpot_s: float = 0.0,
                   budgets: Sequence[DecodeBudget] = (), itl_p90_s: float = 0.0) -> float:
    """Seconds past their TPOT targets that a local prefill, run as the mixed steps `step_s` (each
    holding a prompt chunk beside the B running decodes, whose own step is `decode_step_s`), puts
    on those decodes: each waits the steps' prefill part; its harm is the larger of what exceeds
    its slack (`budget_slack_s` from its own budget in `budgets`; a decode without one, not yet
    started, `tpot_slack_s` over `decode_tokens`) and the gaps' excess (`gap_late_s`, from the
    batch's p90 inter-token latency `itl_p90_s`). `arrival_rate_rps` shares the slack among the
    prefills expected during a decode's life; `measured_tpot_s` (the TPOT the worker's live
    decodes have had, 0: unknown) replaces the predicted step in the slack when larger: a slower
    machine than the profile's leaves less. 0: the local prefill meets every running decode's target."""
    if not decode_batch:
        return 0.0
    parts = [s - decode_step_s for s in step_s]
    stall_s = sum(parts)
    step = max(decode_step_s, measured_tpot_s)
    slack_s = tpot_slack_s(tpot_slo_s, step, decode_tokens, arrival_rate_rps)
    gap_s = gap_late_s(parts, max(decode_step_s, itl_p90_s), tpot_slo_s)
    own = [budget_slack_s(b, tpot_slo_s, step, arrival_rate_rps) for b in budgets[:decode_batch]]
    slacks = own + [slack_s] * (decode_batch - len(own))
    return sum(max(stall_s - slack, gap_s, 0.0) for slack in slacks)


def slo_interference_s(decode_batch: int, step_s: Sequence[float], tpot_slo_s: float, ttft_slo_s: float,
                       wait_s: float = 0.0, arrival_rate_rps: float = 0.0, decode_step_s: float = 0.0,
                       decode_tokens: int = 1, own_stall_s: float = 0.0, measured_tpot_s: float = 0.0,
                       budgets: Sequence[DecodeBudget] = (), itl_p90_s: float = 0.0,
                       decodes_late: float | None = None) -> float:
    """SLO time a local prefill costs on its decode worker, run as the mixed steps `step_s` after
    `wait_s` of prompt work already queued there:
      - the running decodes' time past their targets (`decodes_late_s`; `decodes_late`: that
        figure when the caller has it already);
      - the request's first token is late by the wait and the steps beyond the TTFT objective;
      - less what disaggregating costs the request itself: handed off, it decodes beside the
        prompt work still queued at D when its K/V lands (`own_stall_s`), late beyond its slack.
    Disaggregating saves exactly this (negative: it costs more than it saves)."""
    if decodes_late is None:
        decodes_late = decodes_late_s(decode_batch, step_s, tpot_slo_s, arrival_rate_rps, decode_step_s, decode_tokens,
                                      measured_tpot_s, budgets, itl_p90_s)
    slack_s = tpot_slack_s(tpot_slo_s, max(decode_step_s, measured_tpot_s), decode_tokens, arrival_rate_rps)
    return decodes_late + ttft_late_s(wait_s + sum(step_s), ttft_slo_s) - max(0.0, own_stall_s - slack_s)


def ttft_late_s(ttft_s: float, ttft_slo_s: float) -> float:
    """Seconds a first token at `ttft_s` is past its target (the route delta's unit: only lateness
    counts against a route, as only lateness counts against goodput)."""
    return max(0.0, ttft_s - ttft_slo_s)


def should_enable_pd(terms: MarginTerms, safety_margin_s: float, ttft_gate_passes: bool, tpot_gate_passes: bool) -> bool:
    """Strictly above the margin, and both clocks' attainment gates pass."""
    return net_margin_s(terms) > safety_margin_s and ttft_gate_passes and tpot_gate_passes
