"""Net-margin decision for enabling P/D in one workload/topology cell (spec 0x0FD).

dT = interference saved - exposed (non-overlapped) transfer - routing delta - expected failure
penalty. Enable only when dT exceeds the declared safety margin and both SLO gates pass.
"""

from __future__ import annotations

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


def should_enable_pd(terms: MarginTerms, safety_margin_s: float, ttft_gate_passes: bool, tpot_gate_passes: bool) -> bool:
    """Strictly above the margin, and both clocks' attainment gates pass."""
    return net_margin_s(terms) > safety_margin_s and ttft_gate_passes and tpot_gate_passes
