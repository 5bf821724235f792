"""The runtime's release controller: live disable/enable of disaggregation and the rollback drill.

Contract: one controller per router process; admin operations run one at a time (a second while
one runs raises `ReleaseBusy`). States are the ledger's (ledger/release.py), with the one
operator override the runtime adds:

    ACTIVE  --disable--> PINNED --enable--> ACTIVE     live switch (POST /admin/disaggregation)
    ACTIVE | PINNED --rollback--> ROLLING_BACK --> ROLLED_BACK --enable--> ACTIVE

A disable whose role change fails (503) leaves the release PINNED: new requests already run whole.
A rollback that fails part way stays ROLLING_BACK and may be posted again; it runs from the top.
A disaggregated cluster starts ACTIVE (disaggregated serving on); a colocated one starts PINNED
and has nothing to enable. The runtime does not run the staged SHADOW/CANARY promotion: those
gates are the operator's. `rollback()` runs the spec's order (ledger's ROLLBACK_ORDER) and returns
each step with its wall-clock timestamp and what it did:

    STOP_NEW_ROUTES            the router routes whole requests only (no route selects the handoff)
    ADVANCE_ROUTE_EPOCH        the route epoch goes up (GET /admin/state); transfers already planned
                               keep their fences (worker epochs) until the role changes and the
                               key rotation below retire them
    DRAIN_OR_ABORT_TRANSFERS   unpublished transfers publish within the drain window, or are
                               aborted and their requests recomputed (decode-start fallback)
    ENABLE_COLOCATED_FALLBACK  every prefill worker changes role to colocated (workers/roles.py)
    DISABLE_CONNECTOR          the router issues no transfer plan any more
    REVOKE_CAPABILITIES        the capability key is replaced and every worker installs the new
                               public key: every outstanding capability fails
    RECLAIM_UNPUBLISHED        no route holds prefill staging or an unpublished reservation
    ROLLBACK_COMPLETE
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from pdserve.ledger.release import RELEASE_TRANSITIONS, ROLLBACK_ORDER, rollback_order_error
from pdserve.router import recovery, role_control
from pdserve.workers import messages as m

OPERATOR_OVERRIDES = {"ACTIVE": frozenset({"PINNED"}), "PINNED": frozenset({"ACTIVE"}), "ROLLED_BACK": frozenset({"ACTIVE"})}


class ReleaseBusy(RuntimeError):
    """Another admin operation is running."""


class IllegalReleaseTransition(ValueError):
    pass


def allowed(before: str, after: str) -> bool:
    return after in RELEASE_TRANSITIONS.get(before, frozenset()) | OPERATOR_OVERRIDES.get(before, frozenset())


@dataclass(frozen=True)
class Step:
    name: str
    at_s: float  # wall clock (time.time) when the step completed
    elapsed_s: float  # since the operation began
    detail: dict


@dataclass
class ReleaseController:
    backend: object
    state: str = "ACTIVE"
    history: list[tuple[str, float]] = field(default_factory=list)
    drain_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        self._lock = asyncio.Lock()
        if not self.backend.router.disaggregation:
            self.state = "PINNED"
        self.history.append((self.state, time.time()))

    def view(self) -> dict:
        router = self.backend.router
        return {"state": self.state, "disaggregation": router.disaggregation, "handoff": router.handoff_enabled,
                "route_epoch": router.route_epoch, "history": [{"state": s, "at": t} for s, t in self.history]}

    def _move(self, target: str) -> None:
        if not allowed(self.state, target):
            raise IllegalReleaseTransition(f"release state {self.state} -> {target} is not allowed")
        self.state = target
        self.history.append((target, time.time()))

    async def set_disaggregation(self, enabled: bool) -> dict:
        if self._lock.locked():
            raise ReleaseBusy("another admin operation is running")
        async with self._lock:
            target = "ACTIVE" if enabled else "PINNED"
            if self.state == target:
                return {"state": self.state, "role_changes": []}
            if not allowed(self.state, target):
                raise IllegalReleaseTransition(f"release state {self.state} -> {target} is not allowed")
            t0 = time.monotonic()
            if enabled:
                self.backend.router.handoff_enabled = True
            try:
                changes = await role_control.set_disaggregation(self.backend, enabled, self.drain_timeout_s)
            except role_control.RoleChangeFailed:
                if not enabled:  # new requests run whole from the first step on: the release is pinned
                    self._move(target)
                raise
            self._move(target)
            return {"state": self.state, "seconds": time.monotonic() - t0,
                    "role_changes": [c.__dict__ for c in changes]}

    async def rollback(self) -> dict:
        if self._lock.locked():
            raise ReleaseBusy("another admin operation is running")
        async with self._lock:
            if self.state != "ROLLING_BACK":  # a rollback that failed part way is run again from the top
                self._move("ROLLING_BACK")
            steps = await _rollback_steps(self.backend, self.drain_timeout_s)
            error = rollback_order_error([s.name for s in steps])
            if error is not None:  # the order is this module's own code: a bug, never the client's
                raise AssertionError(error)
            self._move("ROLLED_BACK")
            total = steps[-1].elapsed_s
            self.backend.metrics.rollback_seconds.observe(total)
            return {"state": self.state, "seconds": total, "steps": [s.__dict__ for s in steps]}


async def _rollback_steps(backend, drain_timeout_s: float) -> list[Step]:
    router, t0, steps = backend.router, time.monotonic(), []

    def done(name: str, **detail) -> None:
        steps.append(Step(name, time.time(), time.monotonic() - t0, detail))

    router.set_disaggregation(False)
    done(ROLLBACK_ORDER[0], routes="whole requests on decode and colocated workers")
    router.route_epoch += 1
    done(ROLLBACK_ORDER[1], route_epoch=router.route_epoch)
    done(ROLLBACK_ORDER[2], **await _drain_or_abort(backend, drain_timeout_s))
    changes = await role_control.set_disaggregation(backend, False, drain_timeout_s)
    done(ROLLBACK_ORDER[3], role_changes=[f"{c.worker_id}:{c.from_role}->{c.to_role}@{c.to_epoch}" for c in changes])
    router.handoff_enabled = False
    done(ROLLBACK_ORDER[4], handoff=False)
    done(ROLLBACK_ORDER[5], key_epoch=await backend.revoke_capabilities())
    done(ROLLBACK_ORDER[6], **await _reclaimed(backend, drain_timeout_s))
    done(ROLLBACK_ORDER[7])
    return steps


def unpublished(backend) -> list:
    """Live disaggregated requests whose K/V is not yet published at their decode worker."""
    return [live for live in backend.live.values()
            if not live.done and live.disaggregated and not live.published and live.transfer_id]


async def _drain_or_abort(backend, timeout_s: float) -> dict:
    """Let unpublished transfers publish within `timeout_s`; then cancel the rest at their
    source and recompute each request (the decode-start fallback, as if its source were lost)."""
    drained_from = len(unpublished(backend))
    deadline = time.monotonic() + timeout_s
    while unpublished(backend) and time.monotonic() < deadline:
        await asyncio.sleep(role_control.POLL_S)
    aborted = unpublished(backend)
    for live in aborted:
        source, engine_id = live.prefill_id, live.engine_id
        await recovery.decide(backend, live, "rollback", lost=source)
        await backend._send(source, m.Abort(engine_id, "rollback"))  # the source cancels its transfer
    return {"in_flight": drained_from, "aborted": len(aborted)}


async def _reclaimed(backend, timeout_s: float) -> dict:
    """Wait until no route holds prefill staging or waits on an unpublished transfer."""
    deadline = time.monotonic() + timeout_s
    while (unpublished(backend) or backend.router.staging_holds()) and time.monotonic() < deadline:
        await asyncio.sleep(role_control.POLL_S)
    return {"unpublished": len(unpublished(backend)), "staging_holds": backend.router.staging_holds()}
