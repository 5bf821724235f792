"""Turn a policy's `Choice` into the holds to take and the `RoutePlan` to hand the runtime."""

from __future__ import annotations

import numpy as np

from pdserve.router.messages import BlockHold, RoutePlan, RouteRequest, new_frozen
from pdserve.router.policy import demand
from pdserve.router.policy.policies import Choice
from pdserve.router.pricing.cost import CostModel
from pdserve.router.state.reservations import HoldRequest
from pdserve.router.state.snapshot import Snapshot


def hold_requests(
    snapshot: Snapshot, request: RouteRequest, choice: Choice, block_size: int
) -> tuple[HoldRequest | None, HoldRequest]:
    """(staging hold at P or None when colocated, decode reservation at D)."""
    p_hit, d_hit = choice.prefill_hit_blocks, choice.decode_hit_blocks
    tokens = int(demand.compute_tokens(request, p_hit, block_size))
    if snapshot.colocated:
        w = snapshot.decode
        blocks = int(demand.colocated_blocks(request, p_hit, block_size))
        slot = choice.decode_slot
        return None, _hold(w.worker_ids[slot], w.role_epochs[slot], blocks, tokens, 1)
    p, d = snapshot.prefill, snapshot.decode
    ps, ds = choice.prefill_slot, choice.decode_slot
    p_blocks = int(demand.prefill_blocks(request, p_hit, block_size))
    d_blocks = int(demand.decode_blocks(request, d_hit, block_size))
    return (
        _hold(p.worker_ids[ps], p.role_epochs[ps], p_blocks, tokens, 0),
        _hold(d.worker_ids[ds], d.role_epochs[ds], d_blocks, 0, 1),
    )


def local_hold(snapshot: Snapshot, request: RouteRequest, choice: Choice, block_size: int) -> HoldRequest:
    """The one hold of a local prefill on the chosen decode worker (the P/D decision said no
    handoff): prompt and growth in D's pool less what its prefix cache reuses, the prompt tokens
    it computes, one sequence; the same hold a colocated worker or a recompute takeover takes."""
    d, ds = snapshot.decode, choice.decode_slot
    usable = demand.usable_prefill_hit(request, choice.decode_hit_blocks, block_size)
    blocks = int(demand.colocated_blocks(request, usable, block_size))
    tokens = int(demand.compute_tokens(request, usable, block_size))
    return _hold(d.worker_ids[ds], d.role_epochs[ds], blocks, tokens, 1)


def _hold(worker_id: str, role_epoch: int, blocks: int, tokens: int, seqs: int) -> HoldRequest:
    return new_frozen(HoldRequest, worker_id=worker_id, role_epoch=role_epoch, blocks=blocks, tokens=tokens, seqs=seqs)


def predicted_clocks(snapshot: Snapshot, request: RouteRequest, choice: Choice, cost: CostModel) -> tuple[float, float]:
    """(TTFT s, TPOT s) for the chosen pair, with the same formulas the cost-aware policies use."""
    bs = cost.block_size_tokens
    p, d = snapshot.prefill, snapshot.decode
    ps, ds = choice.prefill_slot, choice.decode_slot
    compute = int(demand.compute_tokens(request, choice.prefill_hit_blocks, bs))
    per_p = cost.queue_s(int(p.pending_tokens[ps])) + cost.prefill_s(compute)
    batch = int(d.active_batch[ds])
    tpot_s = cost.decode_step_s(batch + 1)
    if snapshot.colocated:
        return per_p + cost.admission_delay_s(batch), tpot_s
    transfer_bytes = int(demand.transfer_tokens(request, choice.decode_hit_blocks, bs)) * cost.kv_bytes_per_token
    same = int(snapshot.same_host[ps, ds])
    return per_p + (cost.transfer_s(transfer_bytes, same) + cost.admission_delay_s(batch)), tpot_s


def route_plan(
    snapshot: Snapshot,
    request: RouteRequest,
    choice: Choice,
    cost: CostModel,
    policy: str,
    holds: tuple[BlockHold | None, BlockHold],
    pd: object = None,
) -> RoutePlan:
    bs = cost.block_size_tokens
    if choice.ttft_s is None:
        ttft_s, tpot_s = predicted_clocks(snapshot, request, choice, cost)
    else:  # the cost-aware policy's own sum for this pair: what predicted_clocks would compute
        ttft_s, tpot_s = choice.ttft_s, cost.decode_step_s(snapshot.decode.active_batch.item(choice.decode_slot) + 1)
    prefill_id = snapshot.prefill.worker_ids[choice.prefill_slot]
    decode_id = snapshot.decode.worker_ids[choice.decode_slot]
    transfer = 0 if snapshot.colocated else int(demand.transfer_tokens(request, choice.decode_hit_blocks, bs))
    return new_frozen(  # RoutePlan(...) without the frozen __init__ (hot path)
        RoutePlan,
        request_id=request.request_id,
        policy=policy,
        prefill_id=prefill_id,
        decode_id=decode_id,
        prefill_hit_blocks=choice.prefill_hit_blocks,
        decode_hit_blocks=choice.decode_hit_blocks,
        compute_tokens=int(demand.compute_tokens(request, choice.prefill_hit_blocks, bs)),
        transfer_tokens=transfer,
        transfer_bytes=transfer * cost.kv_bytes_per_token,
        predicted_ttft_s=float(ttft_s),
        predicted_tpot_s=float(tpot_s),
        prefill_hold=holds[0],
        decode_hold=holds[1],
        pd=pd,
        prefix_terms=choice.terms,
    )


def local_route_plan(
    snapshot: Snapshot, request: RouteRequest, choice: Choice, cost: CostModel, policy: str, hold: BlockHold, pd: object
) -> RoutePlan:
    """A route whose prefill runs on its decode worker: prefill_id == decode_id, nothing moves.
    Predicted TTFT: D's queued prompt tokens plus its own prefill (at D's TP size); TPOT: D's next step."""
    d, ds, bs = snapshot.decode, choice.decode_slot, cost.block_size_tokens
    usable = int(demand.usable_prefill_hit(request, choice.decode_hit_blocks, bs))
    compute = int(demand.compute_tokens(request, usable, bs))
    at_d = cost.at_decode_worker()
    ttft_s = at_d.queue_s(int(d.pending_tokens[ds])) + at_d.prefill_s(compute)
    return RoutePlan(
        request.request_id, policy, d.worker_ids[ds], d.worker_ids[ds], usable, choice.decode_hit_blocks, compute, 0, 0,
        float(ttft_s), float(cost.decode_step_s(int(d.active_batch[ds]) + 1)), None, hold, pd,
    )


def takeover_holds(
    snapshot: Snapshot, request: RouteRequest, exclude: frozenset[str], block_size: int
) -> tuple[tuple[HoldRequest, ...], tuple[HoldRequest, ...]]:
    """The decode-start fallback's candidates: a decode hold on each live decode worker (not in
    `exclude`) that could take the request over by itself, with headroom for it, least loaded first.
    Split into (those whose prefix cache holds every full prompt block: the K/V is visible there,
    only the partial tail is recomputed; every other one: a full recompute)."""
    d = snapshot.decode
    _, raw_hits = snapshot.leading_hits(request.block_hashes)
    full_blocks = request.prompt_tokens // block_size
    visible: list[HoldRequest] = []
    others: list[HoldRequest] = []
    for slot in sorted(range(len(d)), key=lambda s: (int(d.active_batch[s]), s)):
        if d.worker_ids[slot] in exclude:
            continue
        hit = int(raw_hits[slot]) if isinstance(raw_hits, np.ndarray) else 0
        usable = demand.usable_prefill_hit(request, hit, block_size)
        blocks = int(demand.colocated_blocks(request, usable, block_size))
        if blocks > int(d.headroom_blocks[slot]):
            continue
        hold = _hold(d.worker_ids[slot], d.role_epochs[slot], blocks, int(demand.compute_tokens(request, usable, block_size)), 1)
        (visible if full_blocks and hit >= full_blocks else others).append(hold)
    return tuple(visible), tuple(others)
