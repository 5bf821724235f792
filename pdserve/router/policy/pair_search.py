"""The hard gates and the fastest admitted pair: the arithmetic every cost-aware policy shares.

Contract (policies.py states the gates' order and the TTFT and TPOT clocks):
    capacity_gates   masks of prefill and decode slots with headroom for the request, or the
                     refusal (no_route, no_decode_capacity, no_transfer_buffer)
    tpot_admitted    the decode slots that also meet the TPOT target, or a tpot_slo refusal
    fastest_pair     (p, d, TTFT) of the admitted pair with the smallest predicted TTFT, lowest
                     slots on ties (the compiled kernel, or a grouped minimum per host)
    ttft_gate        a ttft_slo refusal when the fastest pair misses the target
Masks that admit every slot are one shared read-only array per pool size (`all_slots`), so
`admits_all` knows them by identity and the common case skips the masking.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from pdserve.router import kernels
from pdserve.router.messages import RejectReason, RouteRequest
from pdserve.router.policy import demand
from pdserve.router.policy.choice import Hits, PolicyContext, Refusal
from pdserve.router.pricing.cost import CostModel, prefill_line
from pdserve.router.state.snapshot import Derived, Pool, Snapshot

_count = np.count_nonzero  # on small bool masks: several times cheaper than ndarray.any() / .all()
_EVERYONE: dict[int, np.ndarray] = {}  # pool size -> a shared read-only all-true mask
_NOBODY: dict[int, np.ndarray] = {}  # pool size -> a shared read-only all-zero hit vector


def all_slots(size: int) -> np.ndarray:
    """The mask admitting every slot of a pool of `size` (shared, so `admits_all` knows it by identity)."""
    mask = _EVERYONE.get(size)
    if mask is None:
        mask = _EVERYONE[size] = np.ones(size, dtype=bool)
        mask.flags.writeable = False
    return mask


def zero_hits(size: int) -> np.ndarray:
    hits = _NOBODY.get(size)
    if hits is None:
        hits = _NOBODY[size] = np.zeros(size, dtype=np.int64)
        hits.flags.writeable = False
    return hits


def admits_all(mask: np.ndarray) -> bool:
    return mask is _EVERYONE.get(len(mask)) or _count(mask) == len(mask)


def capacity_gates(
    snapshot: Snapshot, request: RouteRequest, ctx: PolicyContext, p_hit: Hits, d_hit: Hits
) -> tuple[np.ndarray, np.ndarray] | Refusal:
    """Masks of prefill and decode slots with headroom for this request, or why there are none.
    Hits are per-slot arrays, or 0 where no slot holds any of the prompt. A hit only lowers a slot's
    demand, so when the pool's least headroom covers the no-hit demand every slot is admitted
    without looking at the hits (the common case: capacity is a backstop)."""
    bs = ctx.cost.block_size_tokens
    prefill, decode = snapshot.prefill, snapshot.decode
    if len(prefill) == 0 or len(decode) == 0:
        return Refusal(RejectReason.NO_ROUTE, ctx.retry_after_s, "no live worker for a phase")
    if snapshot.colocated:
        ok = _fits(decode, demand.colocated_blocks, request, d_hit, bs)
        return (ok, ok) if ok is not None else _full(RejectReason.NO_DECODE_CAPACITY, ctx)
    d_ok = _fits(decode, demand.decode_blocks, request, d_hit, bs)
    if d_ok is None:
        return _full(RejectReason.NO_DECODE_CAPACITY, ctx)
    p_ok = _fits(prefill, demand.prefill_blocks, request, p_hit, bs)
    if p_ok is None:
        return _full(RejectReason.NO_TRANSFER_BUFFER, ctx)
    return p_ok, d_ok


def _fits(pool: Pool, blocks: Callable[..., Hits], request: RouteRequest, hit: Hits, bs: int) -> np.ndarray | None:
    """The mask of slots with headroom for `blocks(request, hit, bs)` (a demand module function),
    or None when no slot has any."""
    most_blocks = blocks(request, 0, bs)  # the demand with no hit: the most any slot can need
    if pool.least_headroom >= most_blocks:
        return all_slots(len(pool))
    ok = pool.headroom_blocks >= (blocks(request, hit, bs) if isinstance(hit, np.ndarray) else most_blocks)
    return ok if _count(ok) else None


def tpot_admitted(terms: Derived, request: RouteRequest, ctx: PolicyContext, d_ok: np.ndarray) -> np.ndarray | Refusal:
    """The decode slots with capacity that also meet the TPOT target, or a refusal if none does."""
    tpot_slo_s = ctx.tpot_slo_s if request.tpot_slo_s is None else request.tpot_slo_s
    if terms.worst_tpot_s <= tpot_slo_s:  # every decode slot meets the TPOT target
        return d_ok
    tpot_s = terms.tpot_d
    admitted = d_ok & (tpot_s <= tpot_slo_s)
    if not _count(admitted):
        best = float(tpot_s[d_ok].min())
        return Refusal(RejectReason.TPOT_SLO, ctx.retry_after_s, f"best TPOT {best:.4f}s > {tpot_slo_s}s")
    return admitted


def fastest_pair(
    snapshot: Snapshot,
    request: RouteRequest,
    cost: CostModel,
    terms: Derived,
    p_hit: Hits,
    d_hit: Hits,
    p_ok: np.ndarray,
    d_ok: np.ndarray,
) -> tuple[int, int, float]:
    """(p, d, TTFT) of the admitted pair with the smallest predicted TTFT, lowest slots on ties.

    TTFT(P, D) = per_p[P] + x[P, D] with x = transfer_s(bytes[D], path) + admission_s[D], where
    the path is same-host or cross-host. Same-host is never slower (CostModel enforces it), so the
    best x for a P on host h is min(min of same-host x over D on h, min of cross-host x over all D):
    one grouped minimum per host instead of a [P, D] matrix. Adding per_p[P] is monotone under
    rounding, so this is the exact minimum the pairwise loop would find; the decode slot is then
    read off the chosen P's row so ties break exactly as in the loop.

    The prefill time at P is each slot's own (`terms.prefill_coef`: its worker's TP size).
    The load-only terms (queue, admission) come precomputed with the snapshot; masks are applied
    only when some slot is actually excluded (the common case admits every slot).
    """
    bs = cost.block_size_tokens
    if kernels.enabled:  # the same pair in one compiled call: the reference's double loop
        p_hits = p_hit if isinstance(p_hit, np.ndarray) else zero_hits(len(terms.queue_p))
        d_hits = d_hit if isinstance(d_hit, np.ndarray) else zero_hits(len(terms.admission_d))
        return kernels.fastest_pair(
            terms.queue_p, terms.prefill_coef, p_hits, p_ok, terms.admission_d, d_hits, d_ok, snapshot.same_host, snapshot.colocated,
            request.prompt_tokens, bs, cost.kv_bytes_per_token, cost.kernel_coefficients,
        )  # fmt: skip
    overhead, rate = terms.prefill_coef  # [P] each: each slot's worker's own prefill terms (cost.prefill_s's form)
    per_p = terms.queue_p + prefill_line(overhead, rate, demand.compute_tokens(request, p_hit, bs))  # [P]
    if not admits_all(p_ok):
        per_p = np.where(p_ok, per_p, np.inf)
    admission_s = terms.admission_d  # [D]
    d_all = admits_all(d_ok)
    if snapshot.colocated:
        ttft_s = per_p + admission_s
        if not d_all:
            ttft_s = np.where(d_ok, ttft_s, np.inf)
        w = int(ttft_s.argmin())
        return w, w, float(ttft_s[w])
    same_x, cross_x = _decode_x(request, cost, admission_s, d_hit, d_ok, d_all)
    hosts = snapshot.hosts
    same_best = np.minimum.reduceat(same_x[hosts.decode_order], hosts.group_starts)
    if not hosts.all_grouped:
        same_best = np.append(same_best, np.inf)
    best_x = np.minimum(same_best[hosts.prefill_group], cross_x[cross_x.argmin()])  # [P]
    p = int((per_p + best_x).argmin())
    row = per_p[p] + np.where(snapshot.same_host[p], same_x, cross_x)  # [D]
    d = int(row.argmin())
    return p, d, float(row[d])


def _decode_x(
    request: RouteRequest, cost: CostModel, admission_s: np.ndarray, d_hit: Hits, d_ok: np.ndarray, d_all: bool
) -> tuple[np.ndarray, np.ndarray]:
    """Per decode slot, transfer + admission seconds over a same-host and a cross-host path
    (inf where the slot is not admitted). Shapes [D], [D]."""
    bs = cost.block_size_tokens
    transfer_bytes = demand.transfer_bytes(request, d_hit, bs, cost.kv_bytes_per_token)  # [D] or scalar
    if isinstance(d_hit, np.ndarray) and demand.always_transfers(request, bs):
        x = cost.transfer_s_stacked(transfer_bytes) + admission_s  # [2, D]: both paths in one pass
    else:
        same_s, cross_s = cost.transfer_s_paths(transfer_bytes)
        x = (same_s + admission_s, cross_s + admission_s)
    if not d_all:
        x = np.where(d_ok, x, np.inf)  # [2, D]
    return x[0], x[1]


def ttft_gate(ctx: PolicyContext, request: RouteRequest, best_ttft_s: float) -> Refusal | None:
    slo_s = ctx.ttft_slo_s if request.ttft_slo_s is None else request.ttft_slo_s
    if best_ttft_s <= slo_s:
        return None
    retry_s = min(max(best_ttft_s - slo_s, 0.1), ctx.max_retry_after_s)
    return Refusal(RejectReason.TTFT_SLO, retry_s, f"best TTFT {best_ttft_s:.4f}s > {slo_s}s")


def _full(reason: RejectReason, ctx: PolicyContext) -> Refusal:
    return Refusal(reason, ctx.retry_after_s, "no worker has headroom for this request")
