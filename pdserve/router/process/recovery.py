"""The decode-start fallback as the router process runs it: facts in, one decision, actions out.

Contract: `decide(backend, live, cause, lost)` is the one place the runtime decides how a
disaggregated request's decode starts, or how a request whose route broke continues, and it
decides with `fallback.decide_decode_start` (the pure function the tests check) over these facts:

    kv_visible          the K/V is PUBLISHED at the request's decode worker, that worker lives,
                        and the first token (which StartDecode carries) is known
    kv_expected_in_s    while the transfer still runs: the cost model's time for its planned
                        bytes; None once it failed or a worker of the route was lost
    ttft_budget_left_s  the router's TTFT target minus the time since the prefill ended (its
                        first token; before it, since the transfer started: InFlight.wait_clock_s):
                        a request that queued in admission or at its prefill worker past its TTFT
                        target still waits for a K/V whose prefill work is already spent, instead
                        of recomputing it or failing `kv_not_visible`
    visible_at          other live decode workers whose prefix cache holds every full prompt
                        block, with headroom for the hold (router.takeover_holds)
    can_recompute       some live decode worker has headroom for the hold

Actions: ENQUEUE sends StartDecode (the decode worker admits only a PUBLISHED handle). WAIT does
the same and arms a timer that decides again when the budget is spent, unless the K/V was
published by then. REROUTE / RECOMPUTE tell the old owners to abort (the decode worker returns
its reservation, the source cancels its transfer), move the router's holds to the new worker
(the old ones released once, the new one taken; `Router.retake`) and resume there with
Generate after the tokens already streamed (same seed, so the continuation is identical).
FAIL ends the request with an explicit `kv_not_visible` error, except while a decode worker may
take it later: one the supervisor is starting again (lost, restarts on: `backend.away`), or a live
one that has no room for it now (its pool taken by the requests admitted meanwhile, or by a lost
worker's other requests moving there). Then the request waits (RESTART_WAIT while a decode worker
is away, CAPACITY_WAIT otherwise: its owners abort, its holds are released, and it is decided again
once a decode worker registers, one has room for it, or none is coming back), at most
`backend.admission_wait_s` after its first such wait, as admission waits for a pool that is away
or full (a 1P1D or 2P1D deployment whose only decode worker was killed or hung would otherwise
fail every request it was serving, and with a small pool the restarted worker is full of new
admissions by the time the waiting requests are decided again). A request already moved
`backend.max_reroutes` times (`--max-reroutes`; reroutes and retries together) is not moved
again: it FAILs with `max_reroutes`, so a request that takes down every worker it lands on (a
poison request) costs at most that many more workers. Every decision but a first-try
ENQUEUE or WAIT (the normal path) is counted in `pdserve_fallback_total` by outcome and written
on the request's trace line (`fallback`, `fallback_cause`); `decode_start` records the whole
path, e.g. "wait>recompute".
"""

from __future__ import annotations

import asyncio
import time

from pdserve.router.contract import ErrorEvent
from pdserve.router.messages import RouteRequest
from pdserve.router.process.fallback import (
    KV_NOT_VISIBLE,
    DecodeStartAction,
    DecodeStartDecision,
    DecodeStartSituation,
    decide_decode_start,
)
from pdserve.router.process.inflight import InFlight
from pdserve.router.state.reservations import HoldRequest
from pdserve.workers import messages as m

MAX_REROUTES = "max_reroutes"
WORKER_LOST = "worker_lost"  # a server fault (503), never the client's (api/errors.py)
RESTART_WAIT = "restart_wait"  # the fallback outcome of a request waiting for a decode worker being restarted
CAPACITY_WAIT = "capacity_wait"  # ... waiting for room at a live decode worker
RESTART_POLL_S = 0.05
DECODE_ROLES = frozenset({"decode", "colocated", "mixed"})


def situation(backend, live: InFlight, lost: str | None) -> tuple[DecodeStartSituation, dict[str, HoldRequest]]:
    """The facts `decide_decode_start` reads, and the hold each candidate worker would take."""
    router = backend.router
    route_broken = live.kv_failed or (lost is not None and lost in (live.prefill_id, live.decode_id))
    decode_lives = live.decode_id in backend.registered and live.decode_id != lost
    visible = live.published and decode_lives and live.first_token_s is not None and live.disaggregated
    expected = None if route_broken or live.published else _planned_transfer_s(backend, live)
    budget = router.config.ttft_slo_s - (time.monotonic() - live.wait_clock_s())
    exclude = frozenset({lost} if lost else set()) | frozenset(w for w in live.owners if w not in backend.registered)
    seen, fresh = router.takeover_holds(_route_request(backend, live), exclude)
    holds = {h.worker_id: h for h in (*fresh, *seen)}
    return DecodeStartSituation(visible, budget, expected, tuple(h.worker_id for h in seen), bool(fresh)), holds


async def decide(backend, live: InFlight, cause: str, lost: str | None = None) -> DecodeStartDecision | None:
    """Decide and act; see the module contract. None: the rollback's drain is cancelling this
    attempt (source first, then destination: router/process/release.py) and moves the request itself."""
    if live.draining:
        return None
    facts, holds = situation(backend, live, lost)
    decision = _capped(backend, live, decide_decode_start(facts))
    if decision.action is DecodeStartAction.FAIL and decision.reason == KV_NOT_VISIBLE and _may_wait(backend, live, lost):
        _record_outcome(backend, live, RESTART_WAIT if _decode_restarting(backend) else CAPACITY_WAIT, cause)
        await _wait_restart(backend, live, lost)
        return decision
    _record(backend, live, decision, cause)
    action = decision.action
    if action in (DecodeStartAction.ENQUEUE, DecodeStartAction.WAIT):
        if lost is not None:
            live.owners.discard(lost)
        if not live.started_decode and live.first_token_s is not None:
            live.started_decode = True
            await backend._send(live.decode_id, m.StartDecode(live.engine_id, live.output_ids[0], live.seed, live.forks))
        if action is DecodeStartAction.WAIT:
            _arm_wait(backend, live, decision.wait_s)
        return decision
    if action is DecodeStartAction.FAIL and decision.reason == MAX_REROUTES:
        backend.metrics.reroute_limits.inc()
        await fail(backend, live, f"the request's route broke after {moves(live)} reroutes (--max-reroutes "
                                  f"{backend.max_reroutes}); last cause: {cause}", MAX_REROUTES)
        return decision
    if action is DecodeStartAction.FAIL and decision.reason == WORKER_LOST:
        await fail(backend, live, f"the worker serving this request's {live.req.params.n} choices was lost after they "
                                  f"began ({cause}); n > 1 choices cannot resume on another worker", WORKER_LOST)
        return decision
    if action is DecodeStartAction.FAIL:
        await fail(backend, live, "no live decode worker can continue this request", decision.reason)
        return decision
    target = decision.reroute_to or _first_recompute(facts, holds)
    await _move(backend, live, holds[target], lost)
    return decision


def moves(live: InFlight) -> int:
    """How many times the request was moved to another worker (reroutes and retries)."""
    return int(live.trace.get("reroutes", 0)) + int(live.trace.get("retries", 0))


def _capped(backend, live: InFlight, decision: DecodeStartDecision) -> DecodeStartDecision:
    """An n > 1 request whose choices have output continues only where it is (ENQUEUE, WAIT): the
    engine resumes from one sequence's output only (engine.add_request), so a move, or a wait for a
    restarted worker that could only end in one, ends it as the worker's loss, not as a refusal the
    client would read as its own fault. Any other move past the reroute budget becomes a FAIL naming it."""
    if decision.action in (DecodeStartAction.ENQUEUE, DecodeStartAction.WAIT):
        return decision
    if live.req.params.n > 1 and live.output_ids:
        return DecodeStartDecision(DecodeStartAction.FAIL, reason=WORKER_LOST)
    if decision.action is not DecodeStartAction.FAIL and moves(live) >= backend.max_reroutes:
        return DecodeStartDecision(DecodeStartAction.FAIL, reason=MAX_REROUTES)
    return decision


def _first_recompute(facts: DecodeStartSituation, holds: dict[str, HoldRequest]) -> str:
    return next(wid for wid in holds if wid not in facts.visible_at)


async def _move(backend, live: InFlight, hold: HoldRequest, lost: str | None) -> None:
    """Abort the old attempt everywhere, move the holds, resume on `hold.worker_id`."""
    rid = live.req.request_id
    for wid in live.owners - {lost}:
        await backend._send(wid, m.Abort(live.engine_id, "rerouted"))
    grant = backend.router.retake(rid, hold)
    if grant is None:  # cannot happen in one event-loop turn: the candidate's headroom was just read
        await fail(backend, live, "the fallback worker could not hold the request", "kv_not_visible")
        return
    live.bump("reroutes" if lost else "retries")
    live.generation += 1
    live.owners = {hold.worker_id}
    live.prefill_id = live.decode_id = hold.worker_id
    live.published = live.kv_failed = live.started_decode = False
    # a fresh engine id: tokens still in flight from the abandoned attempt can never be mistaken
    live.engine_id = backend.alias(live, f"{rid}#g{live.generation}")
    await backend._send(hold.worker_id, m.Generate(live.engine_id, live.req.prompt_ids, live.req.params, live.seed,
                                                   resume_output_ids=tuple(live.output_ids), grant_seq=grant.grant_seq))


def _decode_restarting(backend) -> bool:
    """A decode-capable worker is lost and the supervisor is starting it again."""
    roles = {wid: reg.role for wid, reg in backend.last_register.items()}
    return backend.restarts and any(roles.get(wid) in DECODE_ROLES for wid in backend.away)


def _may_come_back(backend, lost: str | None = None) -> bool:
    """A decode worker may take the request later: one is being started again, or one lives
    (its room frees as its decodes end)."""
    return _decode_restarting(backend) or bool({wid for wid, _ in _decode_workers(backend)} - {lost})


def _may_wait(backend, live: InFlight, lost: str | None) -> bool:
    if not _may_come_back(backend, lost):
        return False
    if live.restart_wait_until_s is None:
        live.restart_wait_until_s = time.monotonic() + backend.admission_wait_s
    return time.monotonic() < live.restart_wait_until_s


def _has_room(backend, live: InFlight) -> bool:
    """Some live decode worker could take the request now (holding its prompt, or with headroom)."""
    facts, _ = situation(backend, live, None)
    return facts.can_recompute or bool(facts.visible_at)


async def _wait_restart(backend, live: InFlight, lost: str | None) -> None:
    """Park the request until a decode worker registers (or none is coming back, or its wait is
    over), then decide again. Its current attempt ends now: owners abort, holds are released, and
    a fresh engine id makes the attempt's late messages and timers stale (no transfer is current)."""
    for wid in live.owners - {lost}:
        await backend._send(wid, m.Abort(live.engine_id, "restart_wait"))
    live.owners = set()
    live.transfer_id, live.kv_failed, live.published, live.started_decode = "", True, False, False
    backend.release(live.req.request_id, completed=False)
    live.generation += 1
    live.engine_id = backend.alias(live, f"{live.req.request_id}#g{live.generation}")
    attempt, decode_workers = live.engine_id, _decode_workers(backend)
    asyncio.get_running_loop().create_task(_decide_when_back(backend, live, attempt, decode_workers))


def _decode_workers(backend) -> frozenset[tuple[str, int]]:
    return frozenset((wid, reg.epoch) for wid, reg in backend.registered.items()
                     if reg.role in DECODE_ROLES and wid in backend.loads)


async def _decide_when_back(backend, live: InFlight, attempt: str, before: frozenset) -> None:
    while not live.done and live.engine_id == attempt and time.monotonic() < live.restart_wait_until_s:
        await asyncio.sleep(RESTART_POLL_S)  # first: a decision that failed just now is not taken again at once
        if _decode_workers(backend) - before or _has_room(backend, live) or not _may_come_back(backend):
            break
    if not live.done and live.engine_id == attempt:
        await decide(backend, live, "restart_waited")


def _record(backend, live: InFlight, decision: DecodeStartDecision, cause: str) -> None:
    _record_outcome(backend, live, decision.action.value, cause, decision)


def _record_outcome(backend, live: InFlight, outcome: str, cause: str, decision: DecodeStartDecision | None = None) -> None:
    path = live.trace.get("decode_start")
    live.note(decode_start=outcome if path is None else f"{path}>{outcome}")
    if path is None and decision is not None and decision.action in (DecodeStartAction.ENQUEUE, DecodeStartAction.WAIT):
        return  # the normal path (decode starts as soon as the K/V is published): not a fallback
    backend.metrics.fallbacks.labels(outcome).inc()
    live.note(fallback=outcome, fallback_cause=cause)
    if decision is not None and decision.reason:
        live.note(fallback_reason=decision.reason)


def _arm_wait(backend, live: InFlight, wait_s: float) -> None:
    """Decide again once the budget is spent, if this attempt is still unpublished by then."""
    loop = asyncio.get_running_loop()
    attempt = live.engine_id

    def expire() -> None:
        if not live.done and live.engine_id == attempt and not live.published:
            loop.create_task(decide(backend, live, "wait_expired"))

    loop.call_later(max(0.0, wait_s), expire)


def _planned_transfer_s(backend, live: InFlight) -> float:
    """The cost model's time for the planned bytes: the router sees no transfer progress."""
    src, dest = backend.registered.get(live.prefill_id), backend.registered.get(live.decode_id)
    same_host = int(src is not None and dest is not None and src.host_id == dest.host_id)
    planned = int(live.trace.get("transfer_bytes_planned", 0))
    return float(backend.router.link_cost(backend.router.config.cost).transfer_s(planned, same_host))


def _route_request(backend, live: InFlight) -> RouteRequest:
    req = live.req
    return RouteRequest(req.request_id, len(req.prompt_ids), backend.output_demand(req), backend._block_hashes(req.prompt_ids, req.params.tenant))


async def fail(backend, live: InFlight, message: str, code: str) -> None:
    """End the request with an explicit error event; every owner is told to abort, the router's
    holds are released once."""
    live.done = True
    backend.live.pop(live.req.request_id, None)
    backend.engine_ids.pop(live.engine_id, None)
    for wid in live.owners:
        await backend._send(wid, m.Abort(live.engine_id, code))
    backend.release(live.req.request_id, completed=False)
    backend.metrics.requests.labels("failed").inc()
    rec = live.record("error")
    rec["error"] = code
    backend.trace.write(rec)
    live.outputs.put(ErrorEvent(message, code))
