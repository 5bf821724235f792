"""Net-margin decision for enabling P/D in one workload/topology cell (spec 0x0FD).

dT = interference saved - exposed (non-overlapped) transfer - routing delta - expected failure
penalty. Enable only when dT exceeds the declared safety margin and both SLO gates pass.
The interference a local prefill would cause is counted against the SLOs (`slo_interference_s`):
the running decodes' steps beyond the TPOT objective and the request's own TTFT beyond its target.
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


def slo_interference_s(decode_batch: int, step_s: Sequence[float], tpot_slo_s: float, ttft_slo_s: float) -> float:
    """SLO time a local prefill costs on its decode worker, run as the mixed steps `step_s` (each
    holding a prompt chunk beside the B running decodes): every decode is late by each step's time
    beyond the TPOT objective, and the request's first token by the steps' total beyond the TTFT
    objective. Disaggregating saves exactly this."""
    late_decodes = decode_batch * sum(max(0.0, s - tpot_slo_s) for s in step_s)
    return late_decodes + max(0.0, sum(step_s) - ttft_slo_s)


def should_enable_pd(terms: MarginTerms, safety_margin_s: float, ttft_gate_passes: bool, tpot_gate_passes: bool) -> bool:
    """Strictly above the margin, and both clocks' attainment gates pass."""
    return net_margin_s(terms) > safety_margin_s and ttft_gate_passes and tpot_gate_passes
