"""Block-event reports queued at the router process's edge and applied off the routing path.

A heartbeat's block events (engine/kv/kv_events.py) are not applied by the message handler that
receives them: `put` queues the report (O(1)) and the applier (frontend_upkeep.apply_kv_events, an
event-loop task) applies the queue in slices between the router's other work. So a route never
waits behind a burst of heartbeats' index writes: at most behind one slice.

Contract:
- Reports are applied in arrival order, each through `Router.report_kv` exactly as the message
  handler applied it before: the index after a drain equals the index after applying every report
  on arrival (same calls, same order), gaps, resyncs and the bound included. Membership changes
  are not queued: a report still queued when its worker epoch retires is ignored, as its entries
  would have been retired with the epoch anyway.
- `drain(router, max_reports)` applies at most `max_reports` of the oldest queued reports and
  returns the workers whose report found a gap (`KvOutcome.RESYNC_NEEDED`): the caller sends them
  `ResyncKv`.
- Staleness: a report is in the index once the applier has reached it. The applier takes one
  slice of `SLICE_REPORTS` per turn of the event loop, so with W workers heartbeating every
  period the queue holds about W reports at worst and a report waits for at most W / SLICE_REPORTS
  turns (`max_lag_s` records the longest wait seen). Until then a route may still price a block a
  queued REMOVED will drop, or miss one a queued STORED adds: the index is a hint (as the
  heartbeat period already makes it), the worker's own prefix cache decides what is reused, and a
  fetch is validated at the holder (a stale entry costs a fallback, never wrong bytes).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from pdserve.router.kv.kv_index import KvDelta, KvOutcome

SLICE_REPORTS = 8  # reports applied per applier turn (about 8 x 60 us at 64 events each)


class KvInbox:
    __slots__ = ("_queue", "_clock", "max_lag_s", "num_applied")

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._queue: deque[tuple[str, int, KvDelta, float]] = deque()  # (worker, epoch, report, arrival)
        self._clock = clock
        self.max_lag_s = 0.0  # the longest a report waited in the queue
        self.num_applied = 0

    def put(self, worker_id: str, epoch: int, delta: KvDelta) -> None:
        self._queue.append((worker_id, epoch, delta, self._clock()))

    def __len__(self) -> int:
        return len(self._queue)

    def drain(self, router, max_reports: int | None = None) -> tuple[str, ...]:
        """Apply up to `max_reports` queued reports (all when None), oldest first; the workers
        to ask for a resync."""
        queue, resync = self._queue, []
        count = len(queue) if max_reports is None else min(max_reports, len(queue))
        now = self._clock() if count else 0.0
        for _ in range(count):
            worker_id, epoch, delta, arrival_s = queue.popleft()
            self.max_lag_s = max(self.max_lag_s, now - arrival_s)
            if router.report_kv(worker_id, epoch, delta) is KvOutcome.RESYNC_NEEDED:
                resync.append(worker_id)
        self.num_applied += count
        return tuple(resync)
