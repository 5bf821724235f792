"""How the router process applies worker messages to in-flight requests, and how it recovers.

Contract: `dispatch` takes one message from a current worker epoch. Tokens are accepted only
from a worker that owns the request now; the first token from the prefill worker is the TTFT
event and triggers StartDecode at the decode worker. `recover` is the decode-start fallback
and the worker-loss path: recompute on a live decode-capable worker from the tokens already
streamed (same seed: the continuation is identical), or fail with an explicit error event.
`on_worker_lost` decides which of the two owns a request when a worker goes: `recover` once a
worker owns it, its admission while it has no owner yet.
"""

from __future__ import annotations

import time

from pdserve.router.contract import ErrorEvent, FinishEvent, TokenEvent
from pdserve.router.errors import UnknownRequestError
from pdserve.router.inflight import InFlight
from pdserve.workers import messages as m


async def dispatch(backend, msg) -> None:
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
    live.last_token_s = now
    live.output_ids.extend(item.token_ids)
    if item.token_ids or item.text:
        live.queue.put_nowait(TokenEvent(tuple(item.token_ids), item.text))
    if item.finished:
        if live.disaggregated and worker_id == live.prefill_id:
            await backend._send(live.decode_id, m.Abort(live.engine_id, "finished_at_prefill"))
        await _finish(backend, live, item.finish_reason or "stop", item.prompt_tokens)
    elif item.prefilled:
        await _prefilled(backend, live)


async def _prefilled(backend, live: InFlight) -> None:
    """First token from P: decode may start as soon as the K/V is published at D."""
    live.note(first_decode_enqueue_s=time.monotonic() - live.arrival_s)
    if live.kv_failed:
        await recover(backend, live, lost=None)
        return
    live.started_decode = True
    await backend._send(live.decode_id, m.StartDecode(live.engine_id, live.output_ids[0], live.seed))


async def _on_transfer_done(backend, msg: m.TransferDone) -> None:
    live = backend.lookup(msg.request_id)
    metrics = backend.metrics
    if msg.side == "source":
        if msg.published:
            metrics.kv_transfer_physical_bytes.inc(msg.physical_bytes)
            metrics.kv_transfer_seconds.observe(msg.transfer_s)
            metrics.kv_exposed_seconds.observe(msg.exposed_s)
        if live is not None:
            live.note(kv_bytes=msg.logical_bytes, kv_transfer_s=msg.transfer_s, kv_exposed_s=msg.exposed_s)
        return
    if live is None or live.done or msg.transfer_id != live.transfer_id:
        if not msg.published and msg.reason in ("stale_generation", "superseded"):
            metrics.publication_rejects.labels(msg.reason).inc()
        return
    if msg.published:
        live.published = True
        metrics.kv_transfer_bytes.inc(_logical_bytes(backend, live))
        try:
            backend.router.kv_published(live.req.request_id)
        except UnknownRequestError:
            pass
        return
    metrics.kv_transfer_failures.labels(msg.reason or "aborted").inc()
    live.kv_failed = True
    if live.first_token_s is not None and not live.done:
        await recover(backend, live, lost=None)


def _logical_bytes(backend, live: InFlight) -> int:
    return int(live.trace.get("transfer_bytes_planned", 0))


async def on_worker_lost(backend, worker_id: str, orphaned: tuple[str, ...]) -> None:
    """Move on every request the lost worker owned or held blocks for (`orphaned`: the router
    already released those holds). A request some worker owns is recovered. A request without
    owners is still in admission (its route chosen, the decode reservation not yet answered):
    its admission stays in charge and is woken so it routes again over the live workers.
    Recovering it here as well would run it twice, and the admission would wait out the whole
    reservation timeout for an answer the lost worker never sends."""
    affected = {rid for rid, live in backend.live.items() if worker_id in live.owners} | set(orphaned)
    for rid in affected:
        live = backend.live.get(rid)
        if live is None or live.done:
            continue
        if live.owners:
            await recover(backend, live, lost=worker_id)
        elif live.reserved is not None and not live.reserved.done():
            live.reserved.set_result(None)  # the admission sees its route lost (frontend._reserve)


async def recover(backend, live: InFlight, lost: str | None) -> None:
    """Recompute on a live decode-capable worker, resuming after the tokens already streamed."""
    rid = live.req.request_id
    if lost is not None and lost == live.prefill_id and live.disaggregated and live.published and live.started_decode:
        live.owners.discard(lost)  # the K/V already lives at the decode worker: nothing to recover
        return
    for wid in live.owners - {lost}:
        await backend._send(wid, m.Abort(live.engine_id, "rerouted"))
    target = _pick_decode_worker(backend, exclude={lost} if lost else set())
    if target is None:
        await _fail(backend, live, "no live decode worker can continue this request", "kv_not_visible")
        return
    kind = "recompute" if lost is None else "reroute"
    backend.metrics.fallbacks.labels(kind).inc()
    live.bump("reroutes" if lost else "retries")
    live.note(fallback=kind)
    live.generation += 1
    live.owners = {target}
    live.prefill_id = live.decode_id = target
    # a fresh engine id: tokens still in flight from the abandoned attempt can never be mistaken
    live.engine_id = backend.alias(live, f"{rid}#g{live.generation}")
    await backend._send(target, m.Generate(live.engine_id, live.req.prompt_ids, live.req.params, live.seed,
                                           resume_output_ids=tuple(live.output_ids)))


def _pick_decode_worker(backend, exclude: set[str]) -> str | None:
    candidates = [w for w in backend.registered.values() if w.worker_id not in exclude and w.role in ("decode", "colocated")]
    if not candidates:
        candidates = [w for w in backend.registered.values() if w.worker_id not in exclude]
    if not candidates:
        return None
    loads = backend.loads
    return min(candidates, key=lambda w: loads[w.worker_id].num_running if w.worker_id in loads else 0).worker_id


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
    live.queue.put_nowait(FinishEvent(reason, len(live.req.prompt_ids), n))


async def _fail(backend, live: InFlight, message: str, code: str) -> None:
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
    live.queue.put_nowait(ErrorEvent(message, code))
