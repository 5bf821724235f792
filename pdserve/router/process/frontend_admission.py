"""How the router process admits a request: route it, wait in admission while capacity is only
momentarily short, and start it on its workers (split out of frontend.py; each function takes the
`ClusterBackend`).

Contract: `admit(backend, live)` returns once the request has started on the workers of one route
(frontend_start.py's `start`), or raises `Rejection` (503, or 400 for a request that could never
fit: `refuse_never_fitting`) before any prefill work. A route is retried from the admission queue
every `ADMISSION_POLL_S` while the refusal is one that waiting can cure (`admission_waits`: a full
decode pool, a dead worker being started again, a pool away in a role change), until the
admission deadline; a route whose decode worker turns the reservation down for capacity, or that
lost a worker before the request started (`AdmissionRetry`), goes back to the queue with its holds
released. The queue is first come, first served, as vLLM's scheduler takes its waiting queue in
order (`AdmissionLine`): while a request that arrived earlier waits, a later one does not route,
but waits behind it (until its own deadline, when it tries once more). Before, each waiter retried
on its own and a request arriving as capacity freed took it at once, so under a full pool requests
that had waited longest ran out their deadline (503) while later ones were served. Every rejection
is counted (`early_rejections`) and traced.
"""

from __future__ import annotations

import asyncio
import heapq
import time

from pdserve.router.contract import GenerationRequest, Rejection
from pdserve.router.messages import RejectReason, RoutePlan, RouteRejection, RouteRequest
from pdserve.router.process.frontend_start import (
    ADMISSION_POLL_S, AdmissionRetry, admission_waits, refuse_never_fitting, start, worst_case_blocks,
)
from pdserve.router.process.inflight import InFlight


class AdmissionLine:
    """The requests waiting in admission, by arrival: `first(rid, arrival_s)` says whether none
    that arrived earlier is waiting (the line's head routes; a request not in the line routes only
    when the line is empty or it arrived first)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, str]] = []
        self._waiting: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self._waiting)

    def join(self, request_id: str, arrival_s: float) -> None:
        if request_id not in self._waiting:
            self._waiting[request_id] = arrival_s
            heapq.heappush(self._heap, (arrival_s, request_id))

    def leave(self, request_id: str) -> None:
        self._waiting.pop(request_id, None)  # its heap entry goes when it reaches the top

    def first(self, request_id: str, arrival_s: float) -> bool:
        heap = self._heap
        while heap and self._waiting.get(heap[0][1]) != heap[0][0]:  # left (or left and came back)
            heapq.heappop(heap)
        return not heap or heap[0] >= (arrival_s, request_id)


async def admit(backend, live: InFlight) -> None:
    """Route and start, retrying from the admission queue until the deadline."""
    deadline = time.monotonic() + backend.admission_wait_s
    while True:
        plan = await route(backend, live, deadline)
        try:
            await start(backend, live, plan)  # frontend_start.py
            return
        except AdmissionRetry as retry:
            backend.release(live.req.request_id, completed=False)
            if time.monotonic() > deadline:
                backend.metrics.early_rejections.labels(retry.reason).inc()
                raise Rejection(f"decode reservation refused: {retry.reason}", 503, 1.0, retry.reason) from None
            await asyncio.sleep(retry.wait_s)
            if backend.stopping:
                raise Rejection("the server is stopping", 503, 1.0, "shutdown")
        except BaseException:
            backend.release(live.req.request_id, completed=False)
            raise


async def route(backend, live: InFlight, deadline: float) -> RoutePlan:
    """Route now, or wait in the admission queue while capacity is only momentarily short (or a
    dead worker is being started again: `admission_waits`); reject early (before any prefill work)
    when the wait runs out or no route can exist."""
    req = live.req
    hashes = backend._block_hashes(req.prompt_ids, req.params.tenant)
    pools = decode_pools(backend)
    if pools and not backend.away:  # with a worker away, the largest pool may be the one missing: waits below
        refuse_never_fitting(req, backend._block_size, backend.max_model_len, max(pools))  # a 400: it never fits
    if backend.tetri.mode == "dynamic" and backend.loads and not could_ever_fit(backend, req):  # its hold could never grow to it
        reject(backend, RouteRejection(req.request_id, backend.router.config.policy, RejectReason.NO_DECODE_CAPACITY,
                                       backend.router.config.retry_after_s, "max_tokens could never fit a decode worker"))
    line: AdmissionLine = backend.admission_line
    try:
        while True:
            if backend.stopping:
                raise Rejection("the server is stopping", 503, 1.0, "shutdown")
            if not line.first(req.request_id, live.arrival_s) and time.monotonic() <= deadline:
                line.join(req.request_id, live.arrival_s)  # behind a request that arrived earlier
                await asyncio.sleep(ADMISSION_POLL_S)
                continue
            heavy = backend.tetri.hold(req).heavy
            result = backend.router.route(RouteRequest(req.request_id, len(req.prompt_ids), backend.output_demand(req),
                                                       hashes, heavy=heavy))
            if not isinstance(result, RouteRejection):
                break
            waits = admission_waits(result.reason.value, backend.restarts, backend.away)
            fits = result.reason.value == "no_route" or could_ever_fit(backend, req)  # no_route: pools are away
            if not waits or time.monotonic() > deadline or not fits:
                reject(backend, result)
            line.join(req.request_id, live.arrival_s)
            await asyncio.sleep(ADMISSION_POLL_S)
    finally:
        line.leave(req.request_id)
    live.note(admission_wait_s=time.monotonic() - live.arrival_s)
    live.policy, live.prefill_id, live.decode_id = result.policy, result.prefill_id, result.decode_id
    live.note(prefix_hit_blocks=result.prefill_hit_blocks, decode_hit_blocks=result.decode_hit_blocks,
              prefix_hit_bytes=result.prefill_hit_blocks * backend._block_size * backend._bytes_per_token(),
              transfer_bytes_planned=result.transfer_bytes, predicted_ttft_s=result.predicted_ttft_s,
              predicted_tpot_s=result.predicted_tpot_s)
    if result.pd is not None:
        live.note(**result.pd.trace_fields())
    if result.prefix_terms is not None:  # the prefix policy's queue/host/fetch/prefill terms
        live.note(**result.prefix_terms.trace_fields())
    backend.tetri.note_route(live)
    return result


def could_ever_fit(backend, req: GenerationRequest) -> bool:
    """False when even an empty decode worker could not hold the request at its worst case
    (max_tokens, under --reserve dynamic too: its hold may grow that far): waiting is pointless."""
    pools = decode_pools(backend)
    return bool(pools) and worst_case_blocks(req, backend._block_size, backend.max_model_len) <= max(pools)


def decode_pools(backend) -> list[int]:
    """The K/V blocks of each registered worker that decodes."""
    return [w.num_blocks for w in backend.registered.values() if w.role in ("decode", "colocated", "mixed")]


def reject(backend, result: RouteRejection) -> None:
    backend.metrics.early_rejections.labels(result.reason.value).inc()
    backend.trace.write({"request_id": result.request_id, "rejected": result.reason.value, "detail": result.detail})
    raise Rejection(f"no feasible route: {result.reason.value} {result.detail}".strip(), 503,
                    result.retry_after_s, result.reason.value)
