"""How the router process applies worker messages to in-flight requests, and how it recovers.

Contract: `dispatch` takes one message from a current worker epoch. Tokens are accepted only
from a worker that owns the request now; the first token from the prefill worker is the TTFT
event and decode starts as the fallback chain decides (router/process/recovery.py: normally StartDecode
at once). A failed transfer, reported by either side, and a lost worker go through the same chain
(wait within the TTFT budget, reroute to visible K/V, recompute, or fail `kv_not_visible`).
`on_worker_lost` decides who owns a request when a worker goes: the chain once a worker owns
it, its admission while it has no owner yet.
"""

from __future__ import annotations

import time

from pdserve.engine.tp_tally import PHASES
from pdserve.handoff.errors import CAPABILITY_DENIALS
from pdserve.router.contract import FinishEvent, TokenEvent
from pdserve.router.errors import UnknownRequestError
from pdserve.router.process import recovery
from pdserve.router.process.inflight import InFlight
from pdserve.workers import messages as m


async def dispatch(backend, msg) -> None:
    if backend.runahead is not None and await backend.runahead.intercept(backend, msg):
        return  # a KV-Runahead chain's own message (router/runahead/runahead.py)
    if isinstance(msg, m.Heartbeat):
        backend.report_load(msg)
    elif isinstance(msg, m.Tokens):
        for item in msg.items:
            await _on_tokens(backend, msg.worker_id, item)
    elif isinstance(msg, m.Reserved):
        live = backend.lookup(msg.request_id)
        if live is not None and live.reserved is not None and not live.reserved.done() and msg.transfer_id == live.transfer_id:
            live.reserved.set_result(msg)
    elif isinstance(msg, m.TransferDone):
        await _on_transfer_done(backend, msg)
    elif isinstance(msg, m.ControlAck):
        backend.acks.on_ack(msg)  # a rollback step waits for it (router/process/control_acks.py)
    elif isinstance(msg, (m.FetchReserved, m.FetchPinned, m.FetchDone)):
        backend.fetches.on_message(msg)  # cross-worker prefix fetch (router/kv/fetch_runner.py)
    elif isinstance(msg, m.WorkerError):
        live = backend.lookup(msg.request_id)
        if live is not None and live.reserved is not None and not live.reserved.done():
            live.reserved.set_result(m.Reserved(msg.worker_id, msg.epoch, msg.request_id, live.transfer_id, False, msg.code))
        elif live is not None and msg.worker_id in live.owners:
            await _fail(backend, live, msg.message, msg.code)


async def _on_tokens(backend, worker_id: str, item: m.TokenItem) -> None:
    live = backend.lookup(item.request_id)
    if live is None or live.done or worker_id not in live.owners:
        return  # late tokens from an abandoned route
    now = time.monotonic()
    if live.first_token_s is None:
        live.first_token_s = now
        backend.metrics.ttft.observe(now - live.arrival_s)
        backend.clocks.first_token(now - live.arrival_s)
    elif item.index == 0 and item.token_ids and live.last_token_s is not None:
        backend.clocks.tokens(now - live.last_token_s, len(item.token_ids))  # the gaps the client sees
    if item.index == 0 and item.token_ids and worker_id == live.decode_id and len(live.output_ids) >= 2:
        backend.itl.observe(worker_id, (now - live.last_token_s) / len(item.token_ids))  # the batch's gaps (decode_clocks.py)
    live.last_token_s = now
    if item.cached_tokens:  # prompt tokens the worker's prefix cache served (its tenant's only)
        live.note(cached_tokens=max(live.trace.get("cached_tokens", 0), item.cached_tokens))
    if item.index == 0:  # n > 1: sequence 0's tokens are the ones a recompute resumes from
        live.output_ids.extend(item.token_ids)
    if item.forks:
        live.forks = tuple(item.forks)
    if item.token_ids or item.text:
        live.outputs.put(TokenEvent(tuple(item.token_ids), item.text, item.index, item.finish_reason,
                                    tuple(item.logprobs), item.prompt_logprobs))
    backend.tetri.on_tokens(live, worker_id, item)  # hold growths, preemptions, prediction score (tetri_runtime.py)
    if item.finished:
        if live.disaggregated and worker_id == live.prefill_id:
            await backend._send(live.decode_id, m.Abort(live.engine_id, "finished_at_prefill"))
        await _finish(backend, live, item.finish_reason or "stop", item.prompt_tokens)
    elif item.prefilled:
        await _prefilled(backend, live)


async def _prefilled(backend, live: InFlight) -> None:
    """First token from P: decode starts as the fallback chain decides (normally at once: D
    admits the K/V as soon as it is published)."""
    live.note(first_decode_enqueue_s=time.monotonic() - live.arrival_s)
    await recovery.decide(backend, live, "transfer_failed" if live.kv_failed else "first_token")


async def _on_transfer_done(backend, msg: m.TransferDone) -> None:
    """Either side's end of a transfer. A failure on either side (the source could not connect,
    the destination refused or gave up) marks the K/V lost; once the first token is known the
    fallback chain decides, and it tells the other side to abort."""
    live = backend.lookup(msg.request_id)
    metrics = backend.metrics
    current = live is not None and not live.done and msg.transfer_id == live.transfer_id
    if msg.side == "source":
        metrics.kv_transfer_physical_bytes.inc(msg.physical_bytes)  # on the wire, published or not
        metrics.kv_transfer_retries.inc(msg.resends)
        if msg.published:
            backend.router.signals.transfer_ended(failed=False)  # the P/D decision's observed failure rate
            metrics.kv_transfer_bytes.inc(msg.logical_bytes)  # the manifest's bytes, now at D
            metrics.kv_transfer_seconds.observe(msg.transfer_s)
            metrics.kv_exposed_seconds.observe(msg.exposed_s)
            _price_link(backend, msg)
        if current:
            live.note(kv_bytes=msg.logical_bytes, kv_physical_bytes=msg.physical_bytes, kv_resends=msg.resends,
                      kv_transfer_s=msg.transfer_s, kv_exposed_s=msg.exposed_s)
        if msg.published or not current or live.published:
            return  # published at D (a lost ack cannot undo that), or an attempt already abandoned
    elif not current:
        if not msg.published and msg.reason in ("stale_generation", "superseded"):
            metrics.publication_rejects.labels(msg.reason).inc()
        return
    elif msg.published:
        live.published = True
        live.note(kv_published_s=time.monotonic() - live.arrival_s)
        try:
            backend.router.kv_published(live.req.request_id)
        except UnknownRequestError:
            pass
        return
    if live.kv_failed:
        return  # the other side's report of the same failure
    metrics.kv_transfer_failures.labels(f"{msg.side}:{msg.reason or 'aborted'}").inc()
    if msg.reason in CAPABILITY_DENIALS:  # the memory owner's check refused the transfer (counted once)
        metrics.capability_denials.labels(msg.reason).inc()
    backend.router.signals.transfer_ended(failed=True)
    live.kv_failed = True
    live.note(kv_failure=f"{msg.side}:{msg.reason or 'aborted'}")
    if live.first_token_s is not None:
        await recovery.decide(backend, live, f"transfer_failed:{msg.side}:{msg.reason or 'aborted'}")


def _price_link(backend, msg: m.TransferDone) -> None:
    """A published serialized transfer is a sample of the handoff link (router/pricing/link_rates.py)."""
    src, dest = backend.registered.get(msg.worker_id), backend.registered.get(msg.dest_worker)
    if msg.serialized and src is not None and dest is not None:
        backend.router.observe_transfer(msg.logical_bytes, msg.transfer_s, src.host_id == dest.host_id)


async def on_worker_lost(backend, worker_id: str, orphaned: tuple[str, ...]) -> None:
    """Move on every request the lost worker owned or held blocks for (`orphaned`: the router
    already released those holds). A request some worker owns is recovered. A request without
    owners is still in admission (its route chosen, the decode reservation not yet answered):
    its admission stays in charge and is woken so it routes again over the live workers.
    Recovering it here as well would run it twice, and the admission would wait out the whole
    reservation timeout for an answer the lost worker never sends."""
    if backend.runahead is not None:
        await backend.runahead.on_worker_lost(backend, worker_id)
    affected = {rid for rid, live in backend.live.items() if worker_id in live.owners} | set(orphaned)
    for rid in affected:
        live = backend.live.get(rid)
        if live is None or live.done:
            continue
        if live.owners:
            await recover(backend, live, lost=worker_id)
        elif live.reserved is not None and not live.reserved.done():
            live.reserved.set_result(None)  # the admission sees its route lost (frontend_start._reserve)


async def recover(backend, live: InFlight, lost: str) -> None:
    """A worker the request depends on is gone: the decode-start fallback chain decides."""
    await recovery.decide(backend, live, f"worker_lost:{lost}", lost=lost)


async def _finish(backend, live: InFlight, reason: str, prompt_tokens: int) -> None:
    live.done = True
    backend.live.pop(live.req.request_id, None)
    backend.engine_ids.pop(live.engine_id, None)
    backend.release(live.req.request_id, completed=True)
    n = len(live.output_ids)
    if live.first_token_s is not None and n > 1:
        backend.metrics.tpot.observe((live.last_token_s - live.first_token_s) / (n - 1))
    backend.metrics.requests.labels("completed").inc()
    backend.trace.write(live.record(reason))
    prompt = len(live.req.prompt_ids)
    cached = min(prompt, live.trace.get("cached_tokens", 0))
    backend.hits.on_finished(live.prefill_id or live.decode_id, live.trace.get("fetch_holder"), prompt, cached,
                             live.trace.get("fetch_landed_blocks", 0) * backend._block_size)
    backend.clocks.finished(time.monotonic() - live.arrival_s)
    live.outputs.put(FinishEvent(reason, prompt, n, cached_tokens=cached))


async def _fail(backend, live: InFlight, message: str, code: str) -> None:
    await recovery.fail(backend, live, message, code)


def forget_worker(backend, worker_id: str) -> None:
    """The worker's incarnation was retired: its last load report and per-worker gauges go with it
    (a dead or FAILED worker shows no batch, queue or blocks; the next incarnation reports anew)."""
    backend.loads.pop(worker_id, None)
    metrics = backend.metrics
    for gauge in (metrics.queue_depth, metrics.active_decode, metrics.free_blocks):
        gauge.remove(worker_id)  # absent labels: nothing to do
    for cause in ("prompt_priority", "memory"):
        metrics.preemptions.remove(worker_id, cause)
    forget_live_collectives(backend, worker_id)
    backend.hits.forget(worker_id)  # finished requests' tokens waiting on its report settle as device tokens


def forget_live_collectives(backend, worker_id: str) -> None:
    """The worker's epoch ended (or a new one registered): its live collective gauges go with it."""
    for phase in PHASES:
        drop_phase(backend, worker_id, phase)


def drop_phase(backend, worker_id: str, phase: str) -> None:
    for term in ("step", "row"):
        backend.metrics.tp_collectives.remove(worker_id, phase, term)  # absent labels: nothing to do
