"""The router process's upkeep of its workers: the watchdog, lease renewals, key revocation,
load reports and `/workers` rows (split out of frontend.py; each function takes the
`ClusterBackend`).

Contract: `watchdog` runs for the backend's life: every 0.1 s it retires workers whose process
is gone or whose heartbeats stopped (time the router itself did not run, a tick more than
STALL_S late, is excused: router.excuse_stall) (their requests move on through frontend_events; a hung one
is handed to the launcher to be ended and so restarted, `on_worker_hung`), and every
`lease_renew_s` it renews the K/V leases of live requests. `revoke_capabilities` rotates the
router's capability key, hands the new public key to every worker and waits for each one's
acknowledgement (a silent worker is retired: router/process/control_acks.py). `report_load` applies one
heartbeat's load, hands a TP worker's collective seconds to the router's live price of them
(router/pricing/live_collectives.py; gauges and the /workers row show it, a phase's gauges only while it
is priced live: a retired or new epoch's go, `forget_live_collectives`) and queues its block events
for the cluster K/V index (router/kv/kv_inbox.py); `apply_kv_slice` is the applier's turn: one
slice of the queue, scheduled behind whatever is ready to run on the event loop (routes
included) and again while reports remain (a gap sends the worker `ResyncKv`); `worker_view` is
one row of GET /workers (`failed_view` the row of a worker the supervisor gave up on);
`frontend_events.forget_worker` drops a retired incarnation's last load and per-worker gauges.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable

from pdserve.engine.tp_tally import PHASES
from pdserve.router.contract import WorkerView
from pdserve.router.kv.kv_inbox import SLICE_REPORTS
from pdserve.router.kv.kv_index import KvDelta
from pdserve.router.messages import WorkerLoad
from pdserve.router.pricing.decode_clocks import decode_budgets
from pdserve.router.process import control_acks
from pdserve.router.process import frontend_events as ev
from pdserve.router.process.inflight import InFlight
from pdserve.workers import messages as m

log = logging.getLogger(__name__)
WATCH_S = 0.1  # the watchdog's period
STALL_S = 0.5  # a tick this much past its period: the router itself was not running


async def watchdog(backend) -> None:
    last = time.monotonic()
    next_renewal = last + backend.lease_renew_s
    while True:
        await asyncio.sleep(WATCH_S)
        now = time.monotonic()
        stalled, last = now - last - WATCH_S, now
        if stalled > STALL_S:  # stopped (SIGSTOP, a suspended VM) or its event loop held: the workers' silence
            backend.router.excuse_stall(stalled)  # over that time is the router's, not theirs
            log.warning("the router did not run for %.1f s (its process stopped or its event loop blocked); "
                        "workers' heartbeats are not counted missing over that time", stalled)
        await backend.reap_lost_workers()
        if time.monotonic() >= next_renewal:
            next_renewal = time.monotonic() + backend.lease_renew_s
            await backend.renew_leases()


async def revoke_capabilities(backend, ack_timeout_s: float | None = None) -> dict:
    """A new capability key: every worker verifies with it from now on (outstanding
    capabilities of the old key fail), and restarted workers get it. Returns the key epoch and
    {worker: when it installed the key} (its wall clock); a worker that did not is retired."""
    public_key_hex, key_epoch = backend.capabilities.rotate()
    backend.on_key_rotated(public_key_hex, key_epoch)  # a worker restarted from here on starts with it
    key = m.CapabilityKey(public_key_hex, key_epoch)
    wait_s = control_acks.ack_timeout_s(backend) if ack_timeout_s is None else ack_timeout_s
    acks = await control_acks.broadcast(backend, lambda wid: key, "capability_key", str(key_epoch), wait_s)
    return {"key_epoch": key_epoch, "installed_at_s": acks}


async def renew_leases(backend) -> None:
    """Extend the K/V leases of every live request on the workers its route uses, and of every
    running prefix fetch on its destination and holder."""
    for wid, request_ids in renewals(backend.live.values(), backend.fetches.lease_ids()).items():
        if wid in backend.registered:
            await backend._send(wid, m.RenewLeases(request_ids))
    if backend.runahead is not None:
        await backend.runahead.renew_leases(backend)  # the inner stages of live chains


async def reap_lost_workers(backend) -> None:
    """One watchdog pass: retire each worker whose process is gone or whose heartbeats
    stopped, then move its requests on (frontend_events.on_worker_lost)."""
    for wid in backend.is_dead():
        reg = backend.registered.pop(wid, None)
        backend.away.add(wid)
        if reg is not None:
            retirement = backend.router.deregister(wid, reg.epoch)
            ev.forget_worker(backend, wid)
            await ev.on_worker_lost(backend, wid, retirement.orphaned_request_ids)
    for retirement in backend.router.expire():
        wid = retirement.worker.worker_id
        backend.registered.pop(wid, None)
        backend.away.add(wid)
        ev.forget_worker(backend, wid)
        backend.metrics.hung_workers.inc()
        silent_s = backend.router.config.heartbeat_timeout_s
        reason = f"sent no heartbeat for {silent_s:g} s of the router's running time (--heartbeat-timeout-s)"
        backend.on_worker_hung(wid, retirement.worker.role_epoch, reason)  # ended, then restarted under its next epoch
        await ev.on_worker_lost(backend, wid, retirement.orphaned_request_ids)
    for wid in backend.failed_workers():
        backend.away.discard(wid)  # not coming back: admission does not wait for it
        backend.metrics.workers_failed.labels(wid).set(1)


def failed_view(backend, worker_id: str) -> WorkerView:
    """The /workers row of a worker past the crash-loop limit: its last registration, state "failed"."""
    reg = backend.last_register.get(worker_id)
    if reg is None:  # it never registered (crashed while loading)
        return WorkerView(worker_id, "unknown", "", 0, 0, "failed")
    return WorkerView(worker_id, reg.role, reg.host_id, reg.pid, reg.epoch, "failed", {}, reg.cpu, reg.tp)


def worker_view(backend, reg: m.Register) -> WorkerView:
    load = backend.loads.get(reg.worker_id)
    load_dict = {} if load is None else {
        "pending_prompt_tokens": load.pending_prompt_tokens, "active_decode": load.active_decode,
        "num_running": load.num_running, "free_blocks": load.free_blocks, "reserved_blocks": load.reserved_blocks,
        "num_blocks": load.num_blocks, "integrity_ok": load.integrity_ok, "leases_expired": load.leases_expired,
        "local_prefills": load.local_prefills, "local_prefill_tokens": load.local_prefill_tokens,
        "num_preemptions": load.num_preemptions, "num_priority_preemptions": load.num_priority_preemptions,
        "tenant_roots": load.tenant_roots,  # at most the engine's --max-tenant-roots (block_manager.py)
        "handoff_records": load.handoff_records,  # live transfers only (handoff/endpoint.py's release)
    }
    if load is not None and reg.role in ("decode", "mixed"):
        load_dict["pd_slo"] = backend.router.config.pd.slo_view()  # the margin's targets (pd_decision.py)
    lent = backend.router.lent_to(reg.worker_id)
    if load is not None and lent is not None:  # Splitwise's loan: it serves that pool too (registry.py's lend)
        load_dict["lent_to"] = lent.value
    if load is not None:  # TetriInfer admission: the reservation mode and p2c's heavy/light routes here
        heavy, light = backend.router.heavy_light(reg.worker_id)
        load_dict.update(reserve_mode=backend.tetri.mode, heavy_decodes=heavy, light_decodes=light)
    if load is not None:  # the K/V tiers (engine/kv/host_tier.py): blocks by state
        load_dict["kv_tiers"] = {"device": {"used": load.num_blocks - load.free_blocks, "cached": load.cached_blocks},
                                 "host": {"used": load.host_blocks, "capacity": load.host_capacity,
                                          "hits": load.host_hits, "evictions": load.host_evictions,
                                          "pinned": load.host_pinned, "inplace_reads": load.host_inplace_reads}}
    live = backend.router.live
    if load is not None and live is not None and reg.tp > 1:  # its collectives as priced from its own steps
        load_dict["collectives"] = live.view(reg.worker_id)
    state = backend.router.worker_state(reg.worker_id)
    return WorkerView(reg.worker_id, reg.role, reg.host_id, reg.pid, reg.epoch, state.value if state else "unknown",
                      load_dict, reg.cpu, reg.tp)


def report_load(backend, hb: m.Heartbeat) -> None:
    backend.loads[hb.worker_id] = hb.load
    backend.hits.on_load(hb.worker_id, hb.epoch, hb.load, backend._block_size)  # the router's own hit counters
    load = WorkerLoad(hb.load.pending_prompt_tokens, hb.load.active_decode, hb.load.free_blocks,
                      hb.load.applied_grant_seq)
    backend.router.report_load(hb.worker_id, hb.epoch, load)
    backend.away.discard(hb.worker_id)  # routable from its first report (registry: LIVE), not its registration
    backend.router.signals.note_measured_tpot(hb.worker_id, measured_tpot_s(backend, hb.worker_id))
    budgets = decode_budgets(backend.live.values(), hb.worker_id, time.monotonic())
    backend.router.signals.note_decode_clocks(hb.worker_id, budgets, backend.itl.p90_s(hb.worker_id))
    if hb.load.collectives is not None:  # a TP worker's collective seconds (router/pricing/live_collectives.py)
        backend.router.report_collectives(hb.worker_id, hb.epoch, hb.load.collectives)
        export_live_collectives(backend, hb.worker_id)
    if hb.kv is not None:
        queue_kv(backend, hb.worker_id, hb.epoch, KvDelta.from_report(hb.kv))
    backend.metrics.queue_depth.labels(hb.worker_id).set(hb.load.pending_prompt_tokens)
    backend.metrics.active_decode.labels(hb.worker_id).set(hb.load.active_decode)
    backend.metrics.free_blocks.labels(hb.worker_id).set(hb.load.free_blocks)
    preempted = backend.metrics.preemptions
    preempted.labels(hb.worker_id, "prompt_priority").set(hb.load.num_priority_preemptions)
    preempted.labels(hb.worker_id, "memory").set(hb.load.num_preemptions - hb.load.num_priority_preemptions)


def export_live_collectives(backend, worker_id: str) -> None:
    """The worker's live collective terms and the ignored windows' counts as gauges; a phase not
    priced live (yet, or any more) has none."""
    live = backend.router.live
    if live is None:
        return
    view = live.view(worker_id)
    for phase in PHASES:
        row = view.get(phase)
        if row is None or not row["live"]:
            ev.drop_phase(backend, worker_id, phase)
            continue
        backend.metrics.tp_collectives.labels(worker_id, phase, "step").set(row["step_ms"] / 1e3)
        backend.metrics.tp_collectives.labels(worker_id, phase, "row").set(row["row_ms"] / 1e3)
    for reason, count in live.num_ignored.items():
        backend.metrics.tp_reports_ignored.labels(reason).set(count)


def queue_kv(backend, worker_id: str, epoch: int, delta: KvDelta) -> None:
    """Queue a heartbeat's block events; an applier turn is pending exactly while the queue is
    not empty, so the first report into an empty queue schedules one."""
    backend.kv_inbox.put(worker_id, epoch, delta)
    if len(backend.kv_inbox) == 1:
        asyncio.get_running_loop().call_soon(apply_kv_slice, backend)


def apply_kv_slice(backend) -> None:
    """One applier turn (router/kv/kv_inbox.py): a slice of the queued reports into the index, then
    another turn behind everything ready to run while reports remain."""
    loop = asyncio.get_running_loop()
    for worker_id in backend.kv_inbox.drain(backend.router, SLICE_REPORTS):
        loop.create_task(backend._send(worker_id, m.ResyncKv()))
    if len(backend.kv_inbox):
        loop.call_soon(apply_kv_slice, backend)


def measured_tpot_s(backend, worker_id: str) -> float:
    """Mean TPOT of the worker's live requests so far (role_control's measure), 0 with none."""
    from pdserve.router.process.role_control import measured_tpot_share  # role control imports the frontend's peers

    share = measured_tpot_share(backend, [worker_id], time.monotonic())[worker_id]
    return share * backend.router.config.tpot_slo_s


# ---- which leases the router renews ------------------------------------------------------------
# `renewals(live)` (pure) maps a worker id to the request ids (the ids that worker knows the current
# attempt by) whose K/V leases it should extend; finished requests and requests not yet placed are
# left out; `fetches` adds (worker, fetch id) pairs (a running fetch's destination and holder,
# router/kv/fetch_runner.py). One `RenewLeases` per worker every `lease_s / 3`, so a request or
# fetch whose router is alive never loses its reservation or source pin (handoff/leases.py).
def renewals(live: Iterable[InFlight], fetches: Iterable[tuple[str, str]] = ()) -> dict[str, tuple[str, ...]]:
    by_worker: dict[str, list[str]] = {}
    for req in live:
        if req.done:
            continue
        for worker_id in {req.prefill_id, req.decode_id} - {""}:
            by_worker.setdefault(worker_id, []).append(req.engine_id)
    for worker_id, fetch_id in fetches:
        by_worker.setdefault(worker_id, []).append(fetch_id)
    return {wid: tuple(sorted(ids)) for wid, ids in sorted(by_worker.items())}
