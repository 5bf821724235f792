"""Worker role changes driven from the router process, and live disable/enable of disaggregation.

Contract: `change_role(backend, worker_id, role)` is the one mechanism every role change uses
(live disable, the rollback drill, a Splitwise loan adopted as a role change; a loan itself is
not a role change):

    1. the registry marks the worker DRAINING: no policy is offered it any more;
    2. the requests whose route uses it finish (or, after `drain_timeout_s`, are left to the
       worker, which aborts them when the switch begins: the router recovers each through the
       decode-start fallback chain once the new epoch registers and the old one is retired);
    3. `ChangeRole(role, epoch + 1)` goes to the worker, which switches once no handoff thread
       touches its blocks and registers again under the new epoch (workers/roles.py);
    4. the change counts in `pdserve_role_changes_total{from_role,to_role}` and the launcher
       learns the new role and epoch (a later restart brings the worker back in it).

`set_disaggregation(backend, enabled)`: disabled, new requests run whole on the decode workers at
once, and every prefill worker changes role to colocated (so all workers serve); enabled, those
workers change back to prefill and the router routes disaggregated again. A worker the
supervisor is starting again (it comes back in its launch role) is waited for, up to the drain
timeout, and changed too. Every change returns a
`RoleChange` record; a change that cannot finish raises `RoleChangeFailed`.

`run_pool_controller(backend, controller)`: `pdserve serve --mode splitwise` runs Splitwise's pool
controller (splitwise.py) over the LIVE workers' load reports every period and never waits on a
move (`apply_move`): a lend and a return are router calls (`Router.lend`: the worker keeps its
role, epoch and running work; nothing drains), and only an adoption ("change") is a role change,
run by `change_role` as a task while the controller keeps observing. After every observation it
hands the router the controller's latched offer, the pools the mixed workers serve
(router/splitwise/mixed_pool.py). A mixed worker's queued prompts count as prompt pressure, and
its own load says whether it has room left before the other pool is borrowed from.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from pdserve.router.errors import RouterError
from pdserve.router.messages import Role
from pdserve.router.splitwise.splitwise import Move, PoolController, PoolSignals
from pdserve.router.state.registry import WorkerState
from pdserve.workers import messages as m

POLL_S = 0.02
log = logging.getLogger("pdserve.router")


class RoleChangeFailed(RuntimeError):
    """A role change that did not complete (the worker never registered in its new role)."""


@dataclass(frozen=True)
class RoleChange:
    worker_id: str
    from_role: str
    to_role: str
    from_epoch: int
    to_epoch: int
    drain_s: float  # time until the worker's routes ended (or the drain timed out)
    left_to_abort: int  # requests still on the worker when the drain timed out
    total_s: float  # until the worker was LIVE in its new role


def holders(backend, worker_id: str) -> list[str]:
    """Requests whose route still uses the worker."""
    return [rid for rid, live in backend.live.items()
            if not live.done and worker_id in {live.prefill_id, live.decode_id, *live.owners}]


class _Replaced(Exception):
    """The worker's process died during the change and its supervisor started it again."""


async def change_role(backend, worker_id: str, role: str, drain_timeout_s: float = 30.0,
                      register_timeout_s: float = 30.0, attempts: int = 3) -> RoleChange:
    """Drain `worker_id` and switch it to `role` under its next epoch (module contract). A worker
    whose process dies during the change (kill -9, OOM) comes back from its supervisor: in `role`
    when the death followed the ChangeRole (the launcher learns the target before it is sent), in
    its old role when it preceded it; then the change runs again on the new incarnation, up to
    `attempts` times in all."""
    t0, origin = time.monotonic(), None
    for _ in range(attempts):
        reg = await _past_registration(backend, worker_id, register_timeout_s)
        if reg.role == role:
            if origin is None:  # nothing to change
                return RoleChange(worker_id, role, role, reg.epoch, reg.epoch, 0.0, 0, time.monotonic() - t0)
            backend.metrics.role_changes.labels(origin.role, role).inc()  # its restart came back in `role`
            return RoleChange(worker_id, origin.role, role, origin.epoch, reg.epoch, 0.0, 0, time.monotonic() - t0)
        origin = origin or reg
        try:
            return await _change_once(backend, worker_id, reg, role, drain_timeout_s, register_timeout_s, t0)
        except _Replaced as exc:
            log.warning("role change of %s to %s: %s; changing its new incarnation", worker_id, role, exc)
    raise RoleChangeFailed(f"{worker_id} was replaced {attempts} times during its change to {role}")


async def _change_once(backend, worker_id: str, reg, role: str, drain_timeout_s: float, register_timeout_s: float,
                       t0: float) -> RoleChange:
    started = time.monotonic()
    backend.router.drain(worker_id, reg.epoch)
    while holders(backend, worker_id) and time.monotonic() - started < drain_timeout_s:
        if _incarnation(backend, worker_id) != reg.epoch:
            raise _Replaced(f"epoch {reg.epoch} died while it drained")
        await asyncio.sleep(POLL_S)
    drain_s, left = time.monotonic() - started, len(holders(backend, worker_id))
    if _incarnation(backend, worker_id) != reg.epoch:
        raise _Replaced(f"epoch {reg.epoch} died while it drained")
    epoch = reg.epoch + 1
    backend.control_auth.advance(worker_id, epoch)  # its key may register under the new epoch
    # before the message: a restart after the switch comes back in `role` above `epoch`, never a
    # second incarnation under `epoch` (the handoff's fences and capabilities bind epochs)
    backend.on_role_changed(worker_id, role, epoch)
    await backend._send(worker_id, m.ChangeRole(role, epoch))
    now = await _until_live(backend, worker_id, role, epoch, register_timeout_s)  # above `epoch` if it was restarted
    backend.metrics.role_changes.labels(reg.role, role).inc()
    return RoleChange(worker_id, reg.role, role, reg.epoch, now, drain_s, left, time.monotonic() - t0)


def _incarnation(backend, worker_id: str) -> int | None:
    """The epoch the worker is registered under now (None while it is away)."""
    reg = backend.registered.get(worker_id)
    return None if reg is None else reg.epoch


async def _past_registration(backend, worker_id: str, timeout_s: float):
    """The worker's registration once its first heartbeat made it LIVE: a worker that has just
    registered (e.g. restarted by its supervisor) cannot be drained until then, and one its
    supervisor is starting again is waited for."""
    deadline = time.monotonic() + timeout_s
    while True:
        reg = backend.registered.get(worker_id)
        _refuse_failed(backend, worker_id)
        if reg is None and not (backend.restarts and worker_id in backend.away):
            raise RoleChangeFailed(f"{worker_id} is not registered")
        if reg is not None and backend.router.worker_state(worker_id) is not WorkerState.REGISTERED:
            return reg
        if time.monotonic() > deadline:
            raise RoleChangeFailed(f"{worker_id} registered but sent no heartbeat within {timeout_s:.0f}s"
                                   if reg is not None else f"{worker_id} is restarting and did not register within "
                                   f"{timeout_s:.0f}s")
        await asyncio.sleep(POLL_S)


async def _until_live(backend, worker_id: str, role: str, epoch: int, timeout_s: float) -> int:
    """The epoch the worker is LIVE under in `role` (`epoch`, or above it: it died after the switch
    and its supervisor started it again in `role`)."""
    deadline = time.monotonic() + timeout_s
    while True:
        _refuse_failed(backend, worker_id)
        reg = backend.registered.get(worker_id)
        if reg is not None and reg.epoch >= epoch and backend.router.worker_state(worker_id) is WorkerState.LIVE:
            if reg.role != role:  # it died before the switch and its supervisor started it again in its old role
                raise _Replaced(f"it came back as {reg.role} under epoch {reg.epoch}")
            return reg.epoch
        if time.monotonic() > deadline:
            raise RoleChangeFailed(f"{worker_id} did not register under epoch {epoch} within {timeout_s:.0f}s")
        await asyncio.sleep(POLL_S)


async def _back(backend, worker_id: str, timeout_s: float) -> bool:
    """Whether the worker is registered, waiting for one the supervisor is starting again (lost,
    restarts on): it comes back in its launch role, so skipping it would leave it there."""
    deadline = time.monotonic() + timeout_s
    while worker_id not in backend.registered and backend.restarts and worker_id in backend.away:
        _refuse_failed(backend, worker_id)
        if time.monotonic() > deadline:
            raise RoleChangeFailed(f"{worker_id} is restarting and did not register within {timeout_s:.0f}s")
        await asyncio.sleep(POLL_S)
    return worker_id in backend.registered


async def _undo(backend, worker_id: str, drain_timeout_s: float) -> bool:
    """Change a worker an interrupted enable made prefill back to colocated; whether it is."""
    try:
        await change_role(backend, worker_id, "colocated", drain_timeout_s)
        return True
    except RoleChangeFailed as exc:
        log.error("undoing the enable on %s failed: %s", worker_id, exc)
        return False


def _refuse_failed(backend, worker_id: str) -> None:
    """A worker past its crash-loop limit is never started again: no change can finish on it."""
    if worker_id in backend.failed_workers():
        raise RoleChangeFailed(f"{worker_id} is FAILED (--max-crashes deaths within --crash-window-s): it is not "
                               f"started again, so it cannot change role")


def origin_prefill_workers(backend) -> list[str]:
    """Workers launched as prefill workers (the ones live disable turns colocated)."""
    return sorted(wid for wid, role in backend.origin_roles.items() if role == "prefill")


async def set_disaggregation(backend, enabled: bool, drain_timeout_s: float = 30.0,
                             failed_ok: bool = False) -> list[RoleChange]:
    """Live disable / enable (module contract); returns the role changes it made, in order. A
    FAILED prefill worker fails the call (RoleChangeFailed) unless `failed_ok` (the rollback: a
    worker that serves nothing needs no fallback role)."""
    router = backend.router
    changes = []
    failed = [wid for wid in origin_prefill_workers(backend) if wid in backend.failed_workers()]
    if enabled and failed:  # nothing changes: the prefill pool would lack workers that never come back
        raise RoleChangeFailed(f"cannot enable disaggregation: {', '.join(failed)} FAILED (past --max-crashes) and "
                               f"will not serve as prefill; the release stays as it is")
    if not enabled:
        router.set_disaggregation(False)  # new requests run whole on decode workers from now on
    try:
        for wid in origin_prefill_workers(backend):
            if wid in failed:
                continue
            if await _back(backend, wid, drain_timeout_s):
                change = await change_role(backend, wid, "prefill" if enabled else "colocated", drain_timeout_s)
                if change.from_role != change.to_role:  # one already in its role is not a change
                    changes.append(change)
    except RoleChangeFailed as exc:
        if not enabled or not changes:
            raise
        # disaggregation stays off: the workers this enable already made prefill would serve nothing
        undone = [c.worker_id for c in changes if await _undo(backend, c.worker_id, drain_timeout_s)]
        raise RoleChangeFailed(f"{exc}; the enable was undone: {', '.join(undone) or 'none'} of "
                               f"{', '.join(c.worker_id for c in changes)} back to colocated") from None
    if failed and not failed_ok:  # disabled: the others changed and requests run whole; the FAILED ones serve nothing
        raise RoleChangeFailed(f"disaggregation is off, but {', '.join(failed)} FAILED (past --max-crashes) and "
                               f"serves no role")
    if enabled:
        router.set_disaggregation(True)
    return changes


MIN_TPOT_TOKENS = 4  # a request's TPOT counts once it has this many tokens


def pool_signals(backend) -> PoolSignals:
    """The controller's observation from the latest load reports of the LIVE workers (one that
    drains, restarts or has not reported yet is left out, the rest still observed). A decode
    worker's queued prompts (local prefills, or prompt work while lent to the prompt pool) are
    prompt work (`local_prompt_s`); its TPOT share is measured, the mean TPOT its live requests
    see so far over the TPOT objective. A mixed worker's, and a prefill worker's, K/V in use and
    TPOT share are reported too: the controller counts a prefill worker's in the token pool while
    it is lent there, and either's as its room for token work."""
    prompt, local, kv, mixed_kv, prefill_kv = {}, {}, {}, {}, {}
    for wid, reg in backend.registered.items():
        load = backend.loads.get(wid)
        if load is None or backend.router.worker_state(wid) is not WorkerState.LIVE:
            continue
        queued_s = float(backend.router.worker_cost(wid).queue_s(load.pending_prompt_tokens))  # at its TP size
        if reg.role == "prefill":
            prompt[wid] = queued_s
            prefill_kv[wid] = 1.0 - load.free_blocks / max(1, load.num_blocks)
        elif reg.role == "decode":
            kv[wid] = 1.0 - load.free_blocks / max(1, load.num_blocks)
            local[wid] = queued_s
        elif reg.role == "mixed":  # its queued prompts are prompt work too; it is never moved
            mixed_kv[wid] = 1.0 - load.free_blocks / max(1, load.num_blocks)
            local[wid] = queued_s
    tpot = measured_tpot_share(backend, [*kv, *mixed_kv, *prefill_kv], time.monotonic())
    return PoolSignals(prompt, kv, tpot, local, mixed_kv, prefill_kv)


def measured_tpot_share(backend, decode_workers, now_s: float) -> dict[str, float]:
    """Per worker that decodes: the mean TPOT of its live requests (at least MIN_TPOT_TOKENS tokens,
    counting the wait since the last one) over the TPOT objective; 0 with none."""
    seen: dict[str, list[float]] = {wid: [] for wid in decode_workers}
    for live in backend.live.values():
        n = len(live.output_ids)
        if live.decode_id in seen and live.first_token_s is not None and n >= MIN_TPOT_TOKENS:
            seen[live.decode_id].append((max(now_s, live.last_token_s) - live.first_token_s) / (n - 1))
    objective = backend.router.config.tpot_slo_s
    return {wid: (sum(t) / len(t)) / objective if t else 0.0 for wid, t in seen.items()}


async def run_pool_controller(backend, controller: PoolController, period_s: float = 0.5,
                              drain_timeout_s: float = 30.0) -> None:
    """Observe the pools every `period_s` and carry out the controller's moves without waiting
    on them (module contract)."""
    changes: set[asyncio.Task] = set()  # adoptions under way: role changes run beside the loop
    try:
        while True:
            await asyncio.sleep(period_s)
            for wid in [w for w in controller.loans if _loan_lapsed(backend, w)]:
                controller.forget(wid)
            move = controller.observe(pool_signals(backend), time.monotonic())
            backend.router.set_mixed_offer(controller.offer)  # the pools mixed workers serve (mixed_pool.py)
            if move is not None:
                task = apply_move(backend, move, drain_timeout_s)
                if task is not None:
                    changes.add(task)
                    task.add_done_callback(changes.discard)
    finally:
        for task in changes:
            task.cancel()


def apply_move(backend, move: Move, drain_timeout_s: float = 30.0) -> asyncio.Task | None:
    """Carry out one controller move: a lend or a return at once (the router's offer changes;
    nothing drains, the epoch stays), an adoption as a role-change task (returned)."""
    backend.metrics.pool_moves.labels(move.kind).inc()
    if move.kind == "change":
        return asyncio.create_task(_adopt(backend, move, drain_timeout_s))
    reg = backend.registered.get(move.worker_id)
    if reg is None:
        log.error("splitwise: %s of %s skipped: not registered", move.kind, move.worker_id)
        return None
    try:
        backend.router.lend(move.worker_id, reg.epoch, Role(move.to_role) if move.kind == "lend" else None)
    except RouterError as exc:  # it left between the observation and the move (never while both run in one step)
        log.error("splitwise: %s of %s failed: %s", move.kind, move.worker_id, exc)
        return None
    log.warning("splitwise: %s %s (%s, epoch %d) %s the %s pool (%s)", move.kind, move.worker_id, reg.role, reg.epoch,
                "serves" if move.kind == "lend" else "leaves", move.to_role if move.kind == "lend" else _other(reg.role),
                move.reason)
    return None


async def _adopt(backend, move: Move, drain_timeout_s: float) -> None:
    try:
        change = await change_role(backend, move.worker_id, move.to_role, drain_timeout_s)
        log.warning("splitwise: %s adopted: %s -> %s under epoch %d (%s; drained in %.2fs)", change.worker_id,
                    change.from_role, change.to_role, change.to_epoch, move.reason, change.drain_s)
    except (RoleChangeFailed, RouterError) as exc:  # gone, or already draining for another change
        log.error("splitwise: adoption of %s failed: %s", move.worker_id, exc)


def _loan_lapsed(backend, worker_id: str) -> bool:
    """The controller's loan that the router no longer holds: the worker registered again (a
    restart brings it back unlent, in its launch role) and is LIVE."""
    return (backend.router.worker_state(worker_id) is WorkerState.LIVE
            and backend.router.lent_to(worker_id) is None)


def _other(role: str) -> str:
    return "decode" if role == "prefill" else "prefill"
