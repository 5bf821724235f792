"""Hand-built workers and snapshots for router tests."""

from __future__ import annotations

from pdserve.router.messages import Role, RoutePlan, RouteRequest, WorkerInfo, WorkerLoad
from pdserve.router.state.registry import WorkerEntry, WorkerState
from pdserve.router.state.snapshot import Snapshot, make_snapshot

MODEL, ABI = "test-model", "test-abi"


def entry(
    worker_id: str,
    role: Role,
    host: str = "h0",
    pending: int = 0,
    batch: int = 0,
    free: int = 1000,
    held: frozenset[int] = frozenset(),
    epoch: int = 1,
) -> WorkerEntry:
    info = WorkerInfo(worker_id, host, role, epoch, 10_000, MODEL, ABI)
    return WorkerEntry(info, WorkerState.LIVE, 0.0, WorkerLoad(pending, batch, free), held)


def pd(prefill: list[dict], decode: list[dict]) -> Snapshot:
    """A disaggregated snapshot; worker ids p0.. and d0.. in list order."""
    p = [entry(f"p{i}", Role.PREFILL, **kw) for i, kw in enumerate(prefill)]
    d = [entry(f"d{j}", Role.DECODE, **kw) for j, kw in enumerate(decode)]
    return make_snapshot(p, d)


def colocated(workers: list[dict]) -> Snapshot:
    return make_snapshot([entry(f"w{i}", Role.COLOCATED, **kw) for i, kw in enumerate(workers)], [], colocated=True)


def route(router, rid: str) -> RoutePlan:
    """Route a 64-token prompt with 16 output tokens and no cached blocks; it must be placed."""
    plan = router.route(RouteRequest(rid, 64, 16, ()))
    assert isinstance(plan, RoutePlan), plan
    return plan
