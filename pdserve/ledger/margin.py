"""Net-margin decision for enabling P/D in one workload/topology cell (spec 0x0FD).

dT = interference saved - exposed (non-overlapped) transfer - routing delta - expected failure
penalty. Enable only when dT exceeds the declared safety margin and both SLO gates pass.
The interference a local prefill would cause is counted against the SLOs (`slo_interference_s`):
the running decodes' stall beyond their TPOT slack (TPOT as goodput counts it: a request's mean),
and the request's own TTFT beyond its target.
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


def tpot_slack_s(tpot_slo_s: float, decode_step_s: float, decode_tokens: int, arrival_rate_rps: float) -> float:
    """Stall one running decode absorbs from one local prefill before its TPOT (the per-request
    mean, as goodput counts it) misses the objective: its headroom per token over its tokens,
    shared by the 1 + lambda x lifetime prefills expected to land during its life."""
    life_s = decode_tokens * decode_step_s
    return max(0.0, tpot_slo_s - decode_step_s) * decode_tokens / (1.0 + arrival_rate_rps * life_s)


def slo_interference_s(decode_batch: int, step_s: Sequence[float], tpot_slo_s: float, ttft_slo_s: float,
                       wait_s: float = 0.0, arrival_rate_rps: float = 0.0, decode_step_s: float = 0.0,
                       decode_tokens: int = 1, own_stall_s: float = 0.0, measured_tpot_s: float = 0.0) -> float:
    """SLO time a local prefill costs on its decode worker, run as the mixed steps `step_s` (each
    holding a prompt chunk beside the B running decodes, whose own step is `decode_step_s`) after
    `wait_s` of prompt work already queued there:
      - each running decode waits the steps' prefill part; what exceeds its TPOT slack
        (`tpot_slack_s` over `decode_tokens` tokens) is late;
      - the request's first token is late by the wait and the steps beyond the TTFT objective;
      - less what disaggregating costs the request itself: handed off, it decodes beside the
        prompt work still queued at D when its K/V lands (`own_stall_s`), late beyond its slack.
    `arrival_rate_rps` shares the slack among the prefills expected during a decode's life;
    `measured_tpot_s` (the TPOT the worker's live decodes have had, 0: unknown) replaces the
    predicted step in the slack when larger: a slower machine than the profile's leaves less.
    Disaggregating saves exactly this (negative: it costs more than it saves)."""
    busy_s = sum(step_s)
    stall_s = busy_s - len(step_s) * decode_step_s if decode_batch else 0.0
    slack_s = tpot_slack_s(tpot_slo_s, max(decode_step_s, measured_tpot_s), decode_tokens, arrival_rate_rps)
    late_decodes = decode_batch * max(0.0, stall_s - slack_s)
    return late_decodes + max(0.0, wait_s + busy_s - ttft_slo_s) - max(0.0, own_stall_s - slack_s)


def should_enable_pd(terms: MarginTerms, safety_margin_s: float, ttft_gate_passes: bool, tpot_gate_passes: bool) -> bool:
    """Strictly above the margin, and both clocks' attainment gates pass."""
    return net_margin_s(terms) > safety_margin_s and ttft_gate_passes and tpot_gate_passes
