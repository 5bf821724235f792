"""How the router process starts an admitted request on its workers (split out of frontend.py;
each function takes the `ClusterBackend`).

Contract: `start` runs the plan of one route attempt. A local route (colocated, or the P/D
decision's local prefill) is one Generate at the decode worker. A disaggregated route reserves at
D first (ReserveKv; the answer within `RESERVE_TIMEOUT_S`), then sends P its Prefill with the
transfer plan the capability issuer signed for that reservation (or a KV-Runahead chain takes
it). A worker of the route lost meanwhile raises `RouteLost` (the admission routes again), a
capacity refusal at D raises `CapacityShort` (it waits in admission), any other refusal
rejects the request; a reservation abandoned after it was sent is aborted at D so its blocks
come back. Before any route, `refuse_never_fitting` answers a 400 for a request whose worst case
exceeds the largest decode worker's whole pool: waiting cannot help, so it is no 503.
"""

from __future__ import annotations

import asyncio
import time

from pdserve.engine.errors import InvalidRequest
from pdserve.ledger.kv import fork_blocks
from pdserve.router.messages import RoutePlan
from pdserve.router.process.inflight import InFlight
from pdserve.workers import messages as m

RESERVE_TIMEOUT_S = 10.0


async def start(backend, live: InFlight, plan: RoutePlan) -> None:
    """Fetch a prefix the prefill worker lacks (if the plan says so), then Generate at the one
    worker of a local route, or reserve at D and send P the signed transfer plan."""
    req = live.req
    await backend.fetches.prepare(live, plan.prefill_id)  # the prefill worker gets a prefix it lacks
    if not route_alive(backend, plan):
        raise RouteLost("worker_lost")
    if not live.disaggregated:
        live.owners = {plan.decode_id}
        await backend._send(plan.decode_id, m.Generate(req.request_id, req.prompt_ids, req.params, live.seed,
                                                       grant_seq=plan.decode_hold.grant_seq))
        return
    if not backend.router.handoff_enabled:  # rolled back: the router routes whole requests only
        raise RouteLost("handoff_disabled")
    live.generation = next(backend._gen)
    live.transfer_id = f"{req.request_id}/g{live.generation}"
    reserved = await _reserve(backend, live, plan)
    dest, src = backend.registered[plan.decode_id], backend.registered[plan.prefill_id]
    same_host = dest.host_id == src.host_id and dest.shm_name is not None and backend.transport != "tcp"
    transfer = m.TransferPlan(
        live.transfer_id, live.generation, m.FIRST_ATTEMPT, req.tenant, plan.decode_id, dest.epoch, reserved.reservation_id,
        reserved.dest_blocks, reserved.num_visible_blocks, "shm" if same_host else "tcp",
        tuple(dest.handoff_address), dest.shm_name, dest.num_blocks,
    )
    transfer = backend.capabilities.issue(transfer, plan.prefill_id, src.epoch, dest.abi_hash,
                                          same_host and src.shm_name is not None, dest.bytes_per_token * dest.block_size)
    live.start_transfer(plan.prefill_id, plan.decode_id)
    backend.metrics.kv_transfer_attempts.inc()
    grant = plan.prefill_hold.grant_seq if plan.prefill_hold else 0
    if backend.runahead is not None and await backend.runahead.start(backend, live, plan, transfer, grant):
        return  # a KV-Runahead chain prefills it (router/runahead/runahead.py)
    await backend._send(plan.prefill_id, m.Prefill(req.request_id, req.prompt_ids, req.params, live.seed, transfer, grant))


async def _reserve(backend, live: InFlight, plan: RoutePlan) -> m.Reserved:
    """ReserveKv at D and its answer; a refusal or a lost route raises (AdmissionRetry below)."""
    req, src = live.req, backend.registered[plan.prefill_id]
    live.reserved = asyncio.get_running_loop().create_future()
    t0 = time.monotonic()
    await backend._send(plan.decode_id, m.ReserveKv(req.request_id, live.transfer_id, live.generation, req.prompt_ids,
                                                    req.params, plan.prefill_id, src.epoch, m.FIRST_ATTEMPT, req.tenant,
                                                    plan.decode_hold.grant_seq, reserve_tokens=backend.tetri.reserve_tokens(req)))
    try:
        reserved = await asyncio.wait_for(live.reserved, RESERVE_TIMEOUT_S)
    except asyncio.TimeoutError:
        reserved = None
    live.note(reserve_wait_s=time.monotonic() - t0)
    if not route_alive(backend, plan):  # woken by the worker-loss path, or lost while the answer waited
        await backend._send(plan.decode_id, m.Abort(req.request_id, "route_lost"))  # a live D returns its blocks
        raise RouteLost("worker_lost")
    if reserved is None or not reserved.ok:
        await backend._send(plan.decode_id, m.Abort(req.request_id, "reservation_abandoned"))  # a late grant is returned
        reason = "no_decode_capacity" if reserved is None else (reserved.reason or "no_decode_capacity")
        if reason in ("no_kv_capacity", "no_decode_capacity"):
            raise CapacityShort(reason)
        backend.metrics.early_rejections.labels(reason).inc()
        raise InvalidRequest(f"decode worker refused the request: {reason}")
    return reserved


def route_alive(backend, plan: RoutePlan) -> bool:
    """Each worker the plan holds blocks on is still registered in the epoch of its hold."""
    for hold in (plan.prefill_hold, plan.decode_hold):
        reg = None if hold is None else backend.registered.get(hold.worker_id)
        if hold is not None and (reg is None or reg.epoch != hold.role_epoch):
            return False
    return True


# ---- when a request in admission routes again instead of being refused -------------------------
# The rejections worth waiting out, and the signals a route that cannot start raises
# (frontend.py's admission loop catches them, releases the route's holds and routes the request
# again until its deadline).
ADMISSION_POLL_S = 0.02
WAITABLE = {"no_decode_capacity", "no_transfer_buffer"}  # capacity that completions will free


def worst_case_blocks(req, block_size: int, max_model_len: int) -> int:
    """K/V blocks a request holds on one decode worker at its worst case (max_tokens for each of its
    n choices): the engine's own count (ledger/kv.py `fork_blocks`: the prompt once, each choice's
    growth, a copy of a partial last prompt block for every choice but the first)."""
    prompt_blocks, growth, _ = fork_blocks(len(req.prompt_ids), req.params.max_tokens, req.params.n, block_size,
                                           max_model_len)
    return prompt_blocks + growth


def refuse_never_fitting(req, block_size: int, max_model_len: int, largest_pool: int) -> None:
    """Raise a 400 (InvalidRequest) when the request's worst case exceeds the whole pool of the
    largest decode worker: no wait or retry could ever place it, so it is no 503 (which clients
    retry). The caller decides only over a complete set of workers (none away)."""
    need = worst_case_blocks(req, block_size, max_model_len)
    if need <= largest_pool:
        return
    n, most = req.params.n, req.params.max_tokens
    asked = f"{n} choices of up to {most} tokens each" if n > 1 else f"up to {most} tokens"
    raise InvalidRequest(
        f"The request could never fit a decode worker: a {len(req.prompt_ids)}-token prompt with {asked} needs "
        f"{need} K/V blocks of {block_size} tokens; the largest decode worker holds {largest_pool}. "
        f"Lower {'n or max_tokens' if n > 1 else 'max_tokens'} or shorten the prompt.",
        param="n" if n > 1 else "max_tokens", code="context_length_exceeded")


def admission_waits(reason: str, restarts: bool, away: set[str]) -> bool:
    """A rejection worth waiting out in admission: capacity that completions will free, or no
    complete route only because a worker is dead and the supervisor is starting it again."""
    return reason in WAITABLE or (reason == "no_route" and restarts and bool(away))


class AdmissionRetry(Exception):
    """The route being admitted cannot start; the admission routes the request again after
    `wait_s` (until its deadline). Its holds are released by the admission, not by the raiser."""

    wait_s = ADMISSION_POLL_S

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class CapacityShort(AdmissionRetry):
    """A worker had less K/V room than its last report said: wait for completions to free some."""


class RouteLost(AdmissionRetry):
    """A worker on the route was lost (or re-registered) before the request started there: no
    worker owns the request yet, so it is routed again over the live workers at once."""

    wait_s = 0.0
