"""What a worker tells the router every `heartbeat_s` (split out of worker.py; each function takes
the `Worker`).

Contract: `heartbeat_loop` sends from its own thread and socket, so a long engine step does not
make a worker look dead, and ends the process's serving when the router process is gone
(`exit_with_parent`). A beat vouches for the engine too: while the worker's main loop has not
come round for `step_timeout_s` (one step stuck: a tensor-parallel rank stopped or hung, so rank 0
waits in a collective forever; a deadlock), no beat is sent, and the router retires the worker as
hung after its heartbeat timeout, ends it (its ranks die with it) and starts it again. A beat
never waits long for the worker's lock: past `LOCK_WAIT_S` it repeats the last load, without block
events (an engine thread taking the lock back to back on a loaded CPU must not starve it into a
false "hung"). `heartbeat` reads, under the worker's lock, its load (queue, batch, free
and reserved blocks, the last applied grant, lease reclaims, local prefills, preemptions, the
host tier's counters; a TP worker's collective seconds per phase since the last beat,
engine/tp_tally.py) and its prefix cache's block events since the last beat
(engine/kv/kv_events.py; the whole key set when the router asked for a resync or an epoch begins).
`integrity_ok` runs the pool check only while the engine is idle and reports the last verdict
while it is busy.
"""

from __future__ import annotations

import logging
import os
import time

import msgspec
import zmq

from pdserve.workers import lifeline
from pdserve.workers import messages as m
from pdserve.workers.control_keys import secure

log = logging.getLogger("pdserve.worker")
LOCK_WAIT_S = 1.0  # a beat waits this long for the worker's lock, then repeats the last load


def heartbeat_loop(worker) -> None:
    """Heartbeats from their own thread and socket: a long step never makes a worker look dead."""
    sock = worker.ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, f"{worker.id}#hb".encode())
    sock.setsockopt(zmq.LINGER, 0)
    secure(sock, worker.control_keys)  # the same CURVE key as the worker's main socket
    sock.connect(worker.config.router_address)
    parent = os.getppid()
    stuck_said = False
    while worker.running:
        stuck_s = time.monotonic() - worker.loop_at
        if stuck_s <= worker.config.step_timeout_s:
            sock.send(_bounded(heartbeat(worker)))
            stuck_said = False
        elif not stuck_said:  # withheld: the router's timeout replaces this worker
            log.error("worker %s: the engine loop has not come round for %.0f s (--step-timeout-s %g: a step is "
                      "stuck, e.g. in a collective with a stopped or hung tensor-parallel rank); heartbeats stop so "
                      "that the router replaces this worker", worker.id, stuck_s, worker.config.step_timeout_s)
            stuck_said = True
        time.sleep(worker.config.heartbeat_s)
        if worker.config.exit_with_parent and lifeline.launcher_gone(parent):
            log.warning("worker %s: router process is gone, exiting", worker.id)
            worker.running = False
    sock.close()


def _bounded(beat: m.Heartbeat) -> bytes:
    """The beat encoded; over the router's message bound, without its block events (the router's
    K/V index then misses them: routing loses prefix credit, nothing else)."""
    body = m.encode(beat)
    if len(body) <= m.MAX_TO_ROUTER_BYTES:
        return body
    log.warning("worker %s: %d B of block events are over the control plane's bound; not sent", beat.worker_id, len(body))
    return m.encode(m.Heartbeat(beat.worker_id, beat.epoch, beat.load))


def heartbeat(worker) -> m.Heartbeat:
    """One heartbeat: the load, and the prefix cache's block events since the last one (the
    whole key set when a resync is wanted), under the epoch they belong to; the last load alone
    when the lock is not had within LOCK_WAIT_S (the events wait for the next beat)."""
    last = getattr(worker, "last_load", None)
    if not worker.lock.acquire(timeout=LOCK_WAIT_S if last is not None else -1):
        return m.Heartbeat(worker.id, worker.epoch, msgspec.structs.replace(last, collectives=None))  # those were reported
    try:
        beat = _locked_heartbeat(worker)
    finally:
        worker.lock.release()
    worker.last_load = beat.load
    return beat


def _locked_heartbeat(worker) -> m.Heartbeat:
    eng = worker.engine
    running = eng.scheduler.running
    local_prefills, local_tokens = worker.local_prefills.load(eng)
    load = m.Load(
        pending_prompt_tokens=eng.scheduler.num_pending_prompt_tokens,
        active_decode=sum(1 for s in running if s.is_decoding),
        num_running=len(running) + len(eng.scheduler.waiting),
        free_blocks=eng.blocks.num_free - eng.blocks.num_reserved,  # reserved growth is not free to route to
        reserved_blocks=eng.blocks.num_reserved + sum(len(r.block_ids) for r in eng.imports.values()),
        applied_grant_seq=worker.applied_grant_seq,
        num_blocks=eng.pool.num_blocks,
        integrity_ok=integrity_ok(worker),
        leases_expired=worker.leases_reclaimed,
        local_prefills=local_prefills,
        local_prefill_tokens=local_tokens,
        role_state=worker.roles.state.value,
        num_preemptions=eng.scheduler.num_preemptions,
        num_priority_preemptions=eng.scheduler.num_priority_preemptions,
        cached_blocks=len(eng.blocks.evictable),
        tenant_roots=eng.blocks.num_tenant_roots,
        handoff_records=handoff_records(worker),
        collectives=collective_report(eng),
        **host_tier_load(eng.blocks.host),
    )
    kv = eng.blocks.kv_report(resync=worker.kv_resync_wanted)  # block events since the last beat
    worker.kv_resync_wanted, epoch = False, worker.epoch  # the epoch these events belong to
    return m.Heartbeat(worker.id, epoch, load, kv)


def handoff_records(worker) -> int:
    """Transfer records in the worker's destination endpoints (decode, fetch, KV-Runahead): bounded
    by what is in flight or decoding, since a finished transfer's record is released."""
    sides = (getattr(worker, "decode", None), getattr(worker, "fetch", None), getattr(worker, "runahead", None))
    return sum(len(side.endpoint.transfers) for side in sides if side is not None)


def integrity_ok(worker) -> bool:
    """The pool check walks every block, so it runs only while the engine is idle (when the
    pool must be at rest anyway); a busy worker reports its last verdict."""
    if worker.engine.has_unfinished():
        return worker._last_integrity
    try:
        worker.engine.check_integrity()
        worker._last_integrity = True
    except AssertionError as exc:
        log.error("worker %s: pool integrity check failed: %s", worker.id, exc)
        worker._last_integrity = False
    return worker._last_integrity


def host_tier_load(host) -> dict:
    """The host tier's Load fields (none without a tier)."""
    if host is None:
        return {}
    return {"host_blocks": host.num_used, "host_capacity": host.num_blocks, "host_hits": host.num_hits,
            "host_evictions": host.num_evictions, "host_copy_bytes": host.copy_bytes, "host_copy_s": host.copy_s,
            "host_pinned": host.num_pinned, "host_inplace_reads": host.num_inplace_reads}


def collective_report(engine):
    """Rank 0's collective seconds per phase since the last beat (engine/tp_tally.py); None at TP 1."""
    tally = getattr(engine.model, "tally", None)  # only a TP group's leader has one
    return None if tally is None else tally.take()
