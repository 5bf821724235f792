"""The router's live collective pricing: what a TP worker's own steps say it costs, where it is read.

Contract: `LivePricing(pricing, cost, builders)` holds the router's `LiveCollectives` (`live`,
None without `pricing`: every worker is priced at `cost`) and the snapshot builders whose slots
carry a worker's price (router/state/snapshot.py `note_cost`; router/splitwise/mixed_pool.py for the mixed
pools). `report(worker, tp, report)` folds a current epoch's heartbeat window
(live_collectives.py) and re-prices the worker's slots when its estimate moved; `retire(worker)`
withdraws a retired epoch's price (the next epoch is priced from the profile until its own steps
show). `worker_cost(info)` is one worker's own steps at its TP size, live where it has them
(tp_pricing.worker_cost); `pair_cost(snapshot, p, d)` a route's pair, each phase with its own
worker's live collectives (the profile's cached pair while no worker is live). Pure, no I/O; the
caller checks that a report's epoch is current.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from pdserve.engine.tp_tally import CollectiveReport
from pdserve.router.messages import Role, WorkerInfo
from pdserve.router.pricing.cost import CostModel
from pdserve.router.pricing.live_collectives import WITHDRAWN, LiveCollectives
from pdserve.router.pricing.tp_pricing import TpPricing, worker_cost
from pdserve.router.state.snapshot import Snapshot


class CostNotes(Protocol):
    def note_cost(self, worker_id: str, cost: CostModel | None) -> None: ...


class LivePricing:
    """The live collectives and the builders their prices patch (module docstring)."""

    def __init__(self, pricing: TpPricing | None, cost: CostModel, builders: Sequence[CostNotes]):
        self.pricing, self.cost = pricing, cost
        self.live = None if pricing is None else LiveCollectives(pricing)
        self._builders = tuple(builders)

    def report(self, worker_id: str, tp: int, report: CollectiveReport) -> None:
        """A current TP `tp` worker's collective seconds since its last report (a live price
        withdrawn by a change of TP size: its slots at its TP size again)."""
        if self.live is None:
            return
        change = self.live.fold(worker_id, tp, report)
        if change is not None:
            self._note_cost(worker_id, None if change is WITHDRAWN else change)

    def retire(self, worker_id: str) -> None:
        """The worker's epoch ended: its slots at its TP size again, its fits dropped."""
        if self.live is not None and self.live.forget(worker_id):
            self._note_cost(worker_id, None)

    def worker_cost(self, info: WorkerInfo) -> CostModel:
        """One worker's own steps at its registered TP size (tp_pricing.worker_cost)."""
        live = None if self.live is None else self.live.cost(info.worker_id)
        return worker_cost(self.pricing, self.cost, info.tp, info.role is Role.DECODE, live)

    def pair_cost(self, snapshot: Snapshot, prefill_slot: int, decode_slot: int) -> CostModel:
        """A chosen pair's cost model at its workers' TP sizes, each with its live collectives where
        it has them (`cost` without pricing)."""
        if self.pricing is None:
            return self.cost
        tps = snapshot.prefill.members.tp_sizes[prefill_slot], snapshot.decode.members.tp_sizes[decode_slot]
        if not self.live.num_live:  # no worker priced from its own collectives
            return self.pricing.pair(*tps)
        return self.live.pair(snapshot.prefill.worker_ids[prefill_slot], tps[0], snapshot.decode.worker_ids[decode_slot], tps[1])

    def _note_cost(self, worker_id: str, cost: CostModel | None) -> None:
        for builder in self._builders:
            builder.note_cost(worker_id, cost)
