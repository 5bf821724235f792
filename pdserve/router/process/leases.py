"""Which leases the router renews: every live request's, on each worker its route uses.

Contract (pure): `renewals(live)` maps a worker id to the request ids (the ids that worker knows
the current attempt by) whose K/V leases it should extend; finished requests and requests not
yet placed are left out. The backend sends one `RenewLeases` per worker every `lease_s / 3`,
so a request whose router is alive never loses its reservation or source pin (handoff/leases.py).
"""

from __future__ import annotations

from collections.abc import Iterable

from pdserve.router.process.inflight import InFlight


def renewals(live: Iterable[InFlight]) -> dict[str, tuple[str, ...]]:
    by_worker: dict[str, list[str]] = {}
    for req in live:
        if req.done:
            continue
        for worker_id in {req.prefill_id, req.decode_id} - {""}:
            by_worker.setdefault(worker_id, []).append(req.engine_id)
    return {wid: tuple(sorted(ids)) for wid, ids in sorted(by_worker.items())}
