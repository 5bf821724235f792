"""The `Router` facade's typed answers besides route plans: a retirement and the plain counters.

Contract: frozen values, built by router.Router (`_on_retired`, `counters`) and read by the
process edge (router/frontend*.py) and the metrics layer; nothing here computes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from pdserve.router.state.registry import RetiredWorker


@dataclass(frozen=True)
class Retirement:
    """A retired worker epoch and the routes that lost a hold on it (the runtime must fail or
    reroute them; their other holds are already released)."""

    worker: RetiredWorker
    orphaned_request_ids: tuple[str, ...]


@dataclass(frozen=True)
class RouterCounters:
    """Plain counters for the metrics layer; `route_total` is keyed by (policy, result)."""

    route_total: Mapping[tuple[str, str], int]
    workers_retired: Mapping[str, int]  # by reason
    num_stale_rejected: int
    num_holds_granted: int
    num_holds_released: int
    num_kv_published: int
    num_completed: int
    num_aborted: int
    num_orphaned: int
    pd_decisions: Mapping[str, int]  # routed disaggregated-mode requests by P/D decision
