"""Control messages the router waits on: send to workers, collect their acknowledgements, retire
the ones that stay silent.

Contract: `ControlAcks` (one per backend) maps an expected acknowledgement (worker, kind,
subject) to a future; `dispatch` hands it every `ControlAck` (`on_ack`), and an ack nobody waits
for, or of a retired epoch, is dropped. `broadcast(backend, make, kind, subject, timeout_s)` sends
`make(worker)` to every registered worker and returns {worker: the worker's wall-clock time of the
action} for those that acknowledged `subject` within `timeout_s`; every worker that did not is
retired (`retire`: deregistered, its requests moved on, and handed to the launcher to be ended and
restarted, as a hung worker is). `ask(backend, worker, msg, kind, subject, timeout_s)` is the same
for one worker and returns its time, or None when it was silent (and is now retired).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from pdserve.router.process import frontend_events as ev
from pdserve.workers import messages as m

log = logging.getLogger(__name__)
_Key = tuple[str, str, str]  # (worker id, kind, subject)


class ControlAcks:
    def __init__(self) -> None:
        self._waiting: dict[_Key, asyncio.Future] = {}

    def expect(self, worker_id: str, kind: str, subject: str) -> asyncio.Future:
        key = (worker_id, kind, subject)
        if key not in self._waiting or self._waiting[key].done():
            self._waiting[key] = asyncio.get_running_loop().create_future()
        return self._waiting[key]

    def on_ack(self, ack: m.ControlAck) -> None:
        future = self._waiting.pop((ack.worker_id, ack.kind, ack.subject), None)
        if future is not None and not future.done():
            future.set_result(ack.at_s)

    def forget(self, key: _Key) -> None:
        self._waiting.pop(key, None)


def ack_timeout_s(backend) -> float:
    """How long a worker has to acknowledge a control message: its heartbeat timeout
    (`--heartbeat-timeout-s`). A worker handles control messages between engine steps, so an ack
    waits for the step under way; a worker whose heartbeats still arrive is not hung, and a long
    step must not get it retired (ended and restarted) where the heartbeat rule would keep it."""
    return backend.router.config.heartbeat_timeout_s


async def ask(backend, worker_id: str, msg, kind: str, subject: str, timeout_s: float) -> float | None:
    """Send `msg` to one worker and wait for its acknowledgement; a silent worker is retired, and
    one no longer registered (retired, dead) is not asked."""
    if worker_id not in backend.registered:
        return None
    future = backend.acks.expect(worker_id, kind, subject)
    sent = await backend._send(worker_id, msg)
    try:
        return await asyncio.wait_for(asyncio.shield(future), timeout_s) if sent else None
    except asyncio.TimeoutError:
        await retire(backend, worker_id, f"sent no {kind} acknowledgement in {timeout_s:g} s")
        return None
    finally:
        backend.acks.forget((worker_id, kind, subject))


async def broadcast(backend, make: Callable[[str], object], kind: str, subject: str, timeout_s: float) -> dict[str, float]:
    """Every registered worker gets `make(worker)`; {worker: action time} of those that acknowledged."""
    workers = sorted(backend.registered)
    times = await asyncio.gather(*(ask(backend, wid, make(wid), kind, subject, timeout_s) for wid in workers))
    return {wid: at for wid, at in zip(workers, times) if at is not None}


async def retire(backend, worker_id: str, reason: str) -> None:
    """Take a worker that stopped answering out of service: as if its heartbeats had stopped."""
    reg = backend.registered.pop(worker_id, None)
    if reg is None:
        return
    log.warning("retiring %s (epoch %d): %s", worker_id, reg.epoch, reason)
    backend.away.add(worker_id)
    retirement = backend.router.deregister(worker_id, reg.epoch)
    ev.forget_worker(backend, worker_id)
    backend.metrics.hung_workers.inc()
    backend.on_worker_hung(worker_id, reg.epoch, reason)  # ended, then restarted under its next epoch
    await ev.on_worker_lost(backend, worker_id, retirement.orphaned_request_ids)
