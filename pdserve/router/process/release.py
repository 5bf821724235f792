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
    ADVANCE_ROUTE_EPOCH        the route epoch goes up (GET /admin/state) on the router and every
                               worker: a transfer whose capability was issued before is refused
                               by the memory owner when it connects (`capability_stale_route`)
    DRAIN_OR_ABORT_TRANSFERS   unpublished transfers publish within the drain window, or are
                               cancelled at the source, then at the destination, and their
                               requests recomputed (decode-start fallback)
    ENABLE_COLOCATED_FALLBACK  every prefill worker changes role to colocated (workers/roles.py)
    DISABLE_CONNECTOR          the router issues no transfer plan any more
    REVOKE_CAPABILITIES        the capability key is replaced and every worker installs the new
                               public key (and acknowledges it): every outstanding capability fails
    RECLAIM_UNPUBLISHED        no route holds prefill staging or an unpublished reservation;
                               while anything is still held after `drain_timeout_s` the rollback
                               fails (`RollbackIncomplete`, 503): the state stays ROLLING_BACK (any
                               other move is refused, 409) and a retry runs from the top
    ROLLBACK_COMPLETE

Each step that tells workers something waits for every live worker's acknowledgement
(router/process/control_acks.py, `ack_timeout_s`: the heartbeat timeout unless given); a worker that
does not answer is retired (ended and
restarted under a new epoch, as a hung worker is), and the step's detail gives each worker's own
time of the action: ADVANCE_ROUTE_EPOCH sends the new route epoch (capabilities bind it and the
memory owner refuses an older one, handoff/trust/capability.py), REVOKE_CAPABILITIES the new key, and
the drain cancels each unpublished transfer at its source and, only once the source acknowledged,
at its destination, which frees the reserved blocks (the spec's order: never free a destination
under a transfer still running).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from pdserve.ledger.release import RELEASE_TRANSITIONS, ROLLBACK_ORDER, rollback_order_error
from pdserve.router.process import control_acks, recovery, role_control
from pdserve.workers import messages as m

OPERATOR_OVERRIDES = {"ACTIVE": frozenset({"PINNED"}), "PINNED": frozenset({"ACTIVE"}), "ROLLED_BACK": frozenset({"ACTIVE"})}


class ReleaseBusy(RuntimeError):
    """Another admin operation is running."""


class IllegalReleaseTransition(ValueError):
    pass


class RollbackIncomplete(RuntimeError):
    """RECLAIM_UNPUBLISHED found something still held: the rollback did not complete."""


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
    drain_timeout_s: float = 30.0  # role changes and the reclaim wait this long
    drain_window_s: float = 30.0  # unpublished transfers may publish this long before they are aborted
    ack_timeout_s: float | None = None  # a worker that does not acknowledge a control message this long is
    # retired; None: the heartbeat timeout (control_acks.ack_timeout_s)

    def __post_init__(self) -> None:
        self._lock = asyncio.Lock()
        if self.ack_timeout_s is None:
            self.ack_timeout_s = control_acks.ack_timeout_s(self.backend)
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
            # in the target state already, the roles are reconciled again: a worker that a kill -9
            # during the first attempt left in its old role is changed now (the retry is not a no-op)
            if self.state != target and not allowed(self.state, target):
                raise IllegalReleaseTransition(f"release state {self.state} -> {target} is not allowed")
            t0 = time.monotonic()
            if enabled:
                self.backend.router.handoff_enabled = True
            try:
                changes = await role_control.set_disaggregation(self.backend, enabled, self.drain_timeout_s)
            except role_control.RoleChangeFailed:
                if not enabled and self.state != target:  # new requests run whole from the first step on: pinned
                    self._move(target)
                raise
            if self.state != target:
                self._move(target)
            return {"state": self.state, "seconds": time.monotonic() - t0,
                    "role_changes": [c.__dict__ for c in changes]}

    async def rollback(self) -> dict:
        if self._lock.locked():
            raise ReleaseBusy("another admin operation is running")
        async with self._lock:
            if self.state != "ROLLING_BACK":  # a rollback that failed part way is run again from the top
                self._move("ROLLING_BACK")
            steps = await _rollback_steps(self.backend, self)
            error = rollback_order_error([s.name for s in steps])
            if error is not None:  # the order is this module's own code: a bug, never the client's
                raise AssertionError(error)
            self._move("ROLLED_BACK")
            total = steps[-1].elapsed_s
            self.backend.metrics.rollback_seconds.observe(total)
            return {"state": self.state, "seconds": total, "steps": [s.__dict__ for s in steps]}


async def _rollback_steps(backend, control: "ReleaseController") -> list[Step]:
    router, t0, steps, ack_s = backend.router, time.monotonic(), [], control.ack_timeout_s

    def done(name: str, **detail) -> None:
        steps.append(Step(name, time.time(), time.monotonic() - t0, detail))

    router.set_disaggregation(False)
    done(ROLLBACK_ORDER[0], routes="whole requests on decode and colocated workers")
    router.route_epoch += 1
    advance = m.RouteEpoch(router.route_epoch)
    acks = await control_acks.broadcast(backend, lambda wid: advance, "route_epoch", str(router.route_epoch), ack_s)
    done(ROLLBACK_ORDER[1], route_epoch=router.route_epoch, installed_at_s=acks)
    done(ROLLBACK_ORDER[2], **await _drain_or_abort(backend, control.drain_window_s, ack_s))
    changes = await role_control.set_disaggregation(backend, False, control.drain_timeout_s, failed_ok=True)
    done(ROLLBACK_ORDER[3], role_changes=[f"{c.worker_id}:{c.from_role}->{c.to_role}@{c.to_epoch}" for c in changes],
         failed=[w for w in role_control.origin_prefill_workers(backend) if w in backend.failed_workers()])
    router.handoff_enabled = False
    done(ROLLBACK_ORDER[4], handoff=False)
    done(ROLLBACK_ORDER[5], **await backend.revoke_capabilities(ack_s))
    reclaimed = await _reclaimed(backend, control.drain_timeout_s)
    if reclaimed["unpublished"] or reclaimed["staging_holds"]:
        raise RollbackIncomplete(f"{ROLLBACK_ORDER[6]}: {reclaimed['unpublished']} unpublished transfers and "
                                 f"{reclaimed['staging_holds']} staging holds still held; the release stays ROLLING_BACK")
    done(ROLLBACK_ORDER[6], **reclaimed)
    done(ROLLBACK_ORDER[7])
    return steps


def unpublished(backend) -> list:
    """Live disaggregated requests whose K/V is not yet published at their decode worker."""
    return [live for live in backend.live.values()
            if not live.done and live.disaggregated and not live.published and live.transfer_id]


async def _drain_or_abort(backend, window_s: float, ack_s: float) -> dict:
    """Let unpublished transfers publish within `window_s`; then, for each of the rest, cancel at
    the source and wait for its acknowledgement, only then abort at the destination (which frees
    its blocks) and wait for that, and recompute the request (the decode-start fallback, as if its
    source were lost). A worker that does not acknowledge is retired (its process ended). A
    request still in admission (no owner yet) is sent back through it: it routes whole now."""
    drained_from = len(unpublished(backend))
    deadline = time.monotonic() + window_s
    while unpublished(backend) and time.monotonic() < deadline:
        await asyncio.sleep(role_control.POLL_S)
    aborted = []
    for live in unpublished(backend):
        if live not in unpublished(backend):
            continue  # ended or moved (e.g. its transfer was refused) while an earlier one was drained
        if not live.owners:
            if live.reserved is not None and not live.reserved.done():
                live.reserved.set_result(None)  # frontend_start: the route is lost, admission routes again
            continue
        rid, source, dest, engine_id = live.req.request_id, live.prefill_id, live.decode_id, live.engine_id
        cancel = m.Abort(engine_id, "rollback", ack=True)
        live.draining = True  # a failure either side reports now is the drain's to act on (recovery.decide)
        record = {"request_id": rid, "source": source, "source_cancelled_at_s": None, "destination": dest,
                  "destination_freed_at_s": None}
        aborted.append(record)
        record["source_cancelled_at_s"] = await control_acks.ask(backend, source, cancel, "abort", engine_id, ack_s)
        record["destination_freed_at_s"] = await control_acks.ask(backend, dest, cancel, "abort", engine_id, ack_s)
        live.draining = False
        if _moved_on(backend, live, engine_id):
            continue  # it ended meanwhile (a client disconnect, or every worker lost)
        live.owners -= {source, dest}  # both told already: the fallback does not abort them again
        # the destination freed its blocks (even if the transfer published while the source's ack
        # was awaited): its K/V is gone, so the fallback must move the request, never enqueue it there
        live.published, live.kv_failed, live.started_decode = False, True, False
        await recovery.decide(backend, live, "rollback", lost=source)
    return {"in_flight": drained_from, "aborted": len(aborted), "aborts": aborted}


def _moved_on(backend, live, engine_id: str) -> bool:
    """The attempt being drained ended or was replaced meanwhile."""
    return live.done or live.engine_id != engine_id or backend.live.get(live.req.request_id) is not live


async def _reclaimed(backend, timeout_s: float) -> dict:
    """Wait until no route holds prefill staging or waits on an unpublished transfer."""
    deadline = time.monotonic() + timeout_s
    while (unpublished(backend) or backend.router.staging_holds()) and time.monotonic() < deadline:
        await asyncio.sleep(role_control.POLL_S)
    return {"unpublished": len(unpublished(backend)), "staging_holds": backend.router.staging_holds()}
