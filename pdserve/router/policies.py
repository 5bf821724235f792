"""Route policies: pure functions (snapshot, request, context) -> Choice | Refusal.

Every policy works in both serving modes; in colocated mode the prefill and decode pools are the
same pool and a choice is always (w, w). Hard gates apply to all policies, checked in this order:

    no_route            a pool is empty
    no_decode_capacity  no decode worker has headroom for the decode reservation
    no_transfer_buffer  no prefill worker has headroom for the prompt's new blocks
                        (P keeps the prompt K/V in its own pool until D pulls it)

The cost-aware policies add the two SLO clocks (section 0x08E):

    TTFT(P, D) = queue(P) + prefill(compute tokens at P) + [transfer(bytes to D, host path)
                 + admission(D)]
    TPOT(D)    = decode_step(active_batch(D) + 1)

    tpot_slo  no decode worker with capacity meets the TPOT target
    ttft_slo  the fastest pair left misses the TTFT target (retry after roughly the excess)

and pick the admitted pair with the smallest TTFT. The TTFT splits into a per-P vector plus a
per-D vector for each host path (same or cross host), so the P x D search is a grouped minimum
per host and one argmin over P (see `_fastest_pair`), not a Python double loop; a plain
double-loop reference in the tests must pick the identical pair. `slo` assumes no prefix reuse;
`prefix` reads the workers' prefix indexes, so the longest hit still loses to a shorter queue or a
cheaper transfer path when that is faster (Mooncake); with K/V sharing on (`kv_sharing`) a prefix
another worker holds counts too, priced at its fetch time, and a hit in a worker's host tier is
priced at its promotion time (`_prefix_priced`, prefix_terms.py; the rates are `kv_cost`'s).
Ties break toward the lower prefill slot, then the lower decode slot. With the compiled kernels,
a prefix-aware decision whose capacity gates admit every slot without any hit runs the lookup,
the hit caps and the pair search in one call (`_prefix_fused`); it decides exactly as the general
path does (tests/router/test_router_fused.py and the double-loop reference).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from pdserve.router import demand, kernels
from pdserve.router.cost import CostModel
from pdserve.router.fastnew import new_frozen
from pdserve.router.fetch_plan import fetch_credit
from pdserve.router.prefix_terms import HostHeld, PrefixTerms, host_blocks
from pdserve.router.messages import RejectReason, RouteRequest
from pdserve.router.snapshot import Derived, Pool, Snapshot

_NO_FIT = np.iinfo(np.int64).max
_count = np.count_nonzero  # on small bool masks: several times cheaper than ndarray.any() / .all()
_EVERYONE: dict[int, np.ndarray] = {}  # pool size -> a shared read-only all-true mask
_NOBODY: dict[int, np.ndarray] = {}  # pool size -> a shared read-only all-zero hit vector


def _everyone(size: int) -> np.ndarray:
    """The mask admitting every slot of a pool of `size` (shared, so `_all` knows it by identity)."""
    mask = _EVERYONE.get(size)
    if mask is None:
        mask = _EVERYONE[size] = np.ones(size, dtype=bool)
        mask.flags.writeable = False
    return mask


def _no_hits(size: int) -> np.ndarray:
    hits = _NOBODY.get(size)
    if hits is None:
        hits = _NOBODY[size] = np.zeros(size, dtype=np.int64)
        hits.flags.writeable = False
    return hits


def _all(mask: np.ndarray) -> bool:
    return mask is _EVERYONE.get(len(mask)) or _count(mask) == len(mask)


@dataclass(frozen=True)
class PolicyContext:
    cost: CostModel
    ttft_slo_s: float = math.inf  # defaults for requests that carry none
    tpot_slo_s: float = math.inf
    turn: int = 0  # routes this policy made before; round robin's cursor
    retry_after_s: float = 1.0  # suggestion when capacity, not a clock, is the problem
    max_retry_after_s: float = 30.0
    kv_sharing: bool = False  # prefix policy: a prefix another worker holds counts, at its fetch cost
    kv_cost: CostModel | None = None  # prefix policy's fetch and host-copy terms (measured); None: `cost`
    host_held: HostHeld | None = None  # worker id -> its host-tier keys; None: no host-tier entry anywhere


@dataclass(frozen=True)
class Choice:
    prefill_slot: int
    decode_slot: int
    prefill_hit_blocks: int  # usable leading prefix reused at P
    decode_hit_blocks: int  # leading prefix already visible at D (not transferred)
    # the cost-aware policies' TTFT for the pair, the very sum `plan.predicted_clocks` would compute
    # (same formulas, same rounding), handed on so the plan need not recompute it; None: recompute
    ttft_s: float | None = field(default=None, compare=False)
    terms: PrefixTerms | None = field(default=None, compare=False)  # the prefix policy's, for the trace


@dataclass(frozen=True)
class Refusal:
    reason: RejectReason
    retry_after_s: float
    detail: str = ""


Hits = "np.ndarray | int"  # per-slot hit blocks, or one value for every slot
Policy = Callable[[Snapshot, RouteRequest, PolicyContext], "Choice | Refusal"]


def round_robin(snapshot: Snapshot, request: RouteRequest, ctx: PolicyContext) -> Choice | Refusal:
    gates = capacity_gates(snapshot, request, ctx, 0, 0)
    if isinstance(gates, Refusal):
        return gates
    p, d = _nth_admitted(gates[0], ctx.turn), _nth_admitted(gates[1], ctx.turn)
    return _choice(p, p if snapshot.colocated else d, 0, 0)


def _nth_admitted(mask: np.ndarray, turn: int) -> int:
    """The (turn mod count)-th admitted slot."""
    if _all(mask):
        return turn % len(mask)
    slots = np.flatnonzero(mask)
    return int(slots[turn % len(slots)])


def join_shortest_queue(snapshot: Snapshot, request: RouteRequest, ctx: PolicyContext) -> Choice | Refusal:
    """Prefill by fewest pending prompt tokens, decode by smallest batch; colocated by their sum."""
    gates = capacity_gates(snapshot, request, ctx, 0, 0)
    if isinstance(gates, Refusal):
        return gates
    p_ok, d_ok = gates
    pool = snapshot.prefill
    if snapshot.colocated:
        w = _argmin_admitted(pool.pending_tokens + pool.active_batch, p_ok)
        return _choice(w, w, 0, 0)
    return _choice(_argmin_admitted(pool.pending_tokens, p_ok), _argmin_admitted(snapshot.decode.active_batch, d_ok), 0, 0)


def _argmin_admitted(values: np.ndarray, mask: np.ndarray) -> int:
    """The lowest admitted slot with the smallest value."""
    return int(values.argmin() if _all(mask) else np.where(mask, values, _NO_FIT).argmin())


def slo_aware(snapshot: Snapshot, request: RouteRequest, ctx: PolicyContext) -> Choice | Refusal:
    return _cost_aware(snapshot, request, ctx, 0, 0)


def prefix_aware(snapshot: Snapshot, request: RouteRequest, ctx: PolicyContext) -> Choice | Refusal:
    if request.block_hashes and (ctx.kv_sharing or ctx.host_held is not None):
        return _prefix_priced(snapshot, request, ctx)
    if kernels.enabled and request.block_hashes:
        rows = snapshot.prefix.probe(request.block_hashes)
        if rows is None:  # nobody holds the first block: no hit anywhere (what prefix_hits gives)
            return _cost_aware(snapshot, request, ctx, 0, 0)
        fused = _prefix_fused(snapshot, request, ctx, rows)
        if fused is not None:
            return fused
    p_hit, d_hit = prefix_hits(snapshot, request, ctx.cost.block_size_tokens)
    return _cost_aware(snapshot, request, ctx, p_hit, d_hit)


def _prefix_fused(
    snapshot: Snapshot, request: RouteRequest, ctx: PolicyContext, rows: np.ndarray
) -> Choice | Refusal | None:
    """The prefix-aware decision with the lookup of the probed `rows`, the hit caps and the pair
    search in one compiled call (kernels.prefix_pair), when the capacity gates cannot depend on
    the hits: every slot of both pools fits the request even with no hit (a hit only lowers
    demand). None: capacity is tight somewhere; take the general path."""
    gates = capacity_gates(snapshot, request, ctx, 0, 0)
    if isinstance(gates, Refusal) or not (_all(gates[0]) and _all(gates[1])):
        return None
    terms = snapshot.derived(ctx.cost)
    d_ok = _tpot_admitted(terms, request, ctx, gates[1])
    if isinstance(d_ok, Refusal):
        return d_ok
    cost, bs, prompt = ctx.cost, ctx.cost.block_size_tokens, request.prompt_tokens
    p, d, ttft_s, p_hit, d_hit = kernels.prefix_pair(
        rows, snapshot.prefix.held, len(snapshot.prefill), (prompt - 1) // bs, prompt // bs, terms.queue_p, gates[0],
        terms.admission_d, d_ok, snapshot.same_host, snapshot.colocated, prompt, bs, cost.kv_bytes_per_token,
        cost.kernel_coefficients,
    )  # fmt: skip
    refusal = _ttft_gate(ctx, request, ttft_s)
    return refusal or _choice(p, p if snapshot.colocated else d, int(p_hit), int(d_hit), ttft_s)


def _prefix_priced(snapshot: Snapshot, request: RouteRequest, ctx: PolicyContext) -> Choice | Refusal:
    """The prefix policy with placement costs (Mooncake): a prefill slot's cost is its queue + the
    promotion of its hit's host-tier blocks + (K/V sharing) the fetch of the longest reachable
    prefix it lacks (fetch_plan.fetch_credit: only when that beats recomputing it) + the prefill
    of the rest (+ transfer and admission at D). Capacity and the plan's holds count the slot's
    own hit only: fetched blocks take room like computed ones."""
    p_hit, d_hit = prefix_hits(snapshot, request, ctx.cost.block_size_tokens)
    gates = capacity_gates(snapshot, request, ctx, p_hit, d_hit)
    if isinstance(gates, Refusal):
        return gates
    terms = snapshot.derived(ctx.cost)
    d_ok = _tpot_admitted(terms, request, ctx, gates[1])
    if isinstance(d_ok, Refusal):
        return d_ok
    kv, bs = ctx.kv_cost or ctx.cost, ctx.cost.block_size_tokens
    own = p_hit if isinstance(p_hit, np.ndarray) else _no_hits(len(snapshot.prefill))
    eff, fetch_s = own, np.zeros(len(own))
    if ctx.kv_sharing:
        eff, fetch_s = fetch_credit(kv, own, *_best_holder(snapshot, request, own, d_hit, bs))
    host_n = _no_hits(len(own))
    if ctx.host_held is not None:
        host_n = host_blocks(request.block_hashes, own, snapshot.prefill.worker_ids, ctx.host_held)
    host_s = kv.promote_s(host_n)  # [P]
    queue_p = terms.queue_p
    terms = terms._replace(queue_p=queue_p + host_s + fetch_s)  # [P]: promotion and fetch precede the prefill
    d_eff = eff if snapshot.colocated else d_hit
    p, d, ttft_s = _fastest_pair(snapshot, request, ctx.cost, terms, eff, d_eff, gates[0], d_ok)
    refusal = _ttft_gate(ctx, request, ttft_s)
    if refusal:
        return refusal
    fetched = int(eff[p] - own[p])
    why = PrefixTerms(float(queue_p[p]), int(eff[p]), int(host_n[p]), float(host_s[p]), kv.host_copy_bytes_per_s,
                      fetched, float(fetch_s[p]), float(ctx.cost.prefill_s(demand.compute_tokens(request, int(eff[p]), bs))),
                      float(ttft_s))
    return _choice(p, p if snapshot.colocated else d, _at(p_hit, p), _at(d_hit, d), ttft_s, why)


def _best_holder(snapshot: Snapshot, request: RouteRequest, own: np.ndarray, d_hit: Hits, bs: int) -> tuple[int, np.ndarray]:
    """(the longest usable prefix any worker holds, [P] whether its holder shares each prefill
    slot's host). Colocated: one pool. Disaggregated: a decode worker's visible prefix counts too
    (level 3: history decoded there moves back to the prefill side); a holder in the prefill pool
    is priced over the cross-host path (the snapshot pairs hosts only across the two pools)."""
    best_p = int(own.max()) if len(own) else 0
    if snapshot.colocated:  # any holder of the longest prefix on the slot's host will do
        return best_p, snapshot.same_host[:, own == best_p].any(axis=1).astype(np.int64)
    d_usable = np.minimum(d_hit, (request.prompt_tokens - 1) // bs) if isinstance(d_hit, np.ndarray) else None
    if d_usable is not None and int(d_usable.max()) > best_p:
        best_d = int(d_usable.max())
        return best_d, snapshot.same_host[:, d_usable == best_d].any(axis=1).astype(np.int64)
    return best_p, np.zeros(len(own), dtype=np.int64)


POLICIES: dict[str, Policy] = {
    "round_robin": round_robin,
    "jsq": join_shortest_queue,
    "slo": slo_aware,
    "prefix": prefix_aware,
}


def prefix_hits(snapshot: Snapshot, request: RouteRequest, block_size: int) -> tuple[Hits, Hits]:
    """(usable hit blocks per prefill slot, visible hit blocks per decode slot). A side with no hit
    anywhere is 0: it gives the same blocks, tokens and clocks as an all-zero array (integer terms
    are exact) with far fewer array operations."""
    raw_p, raw_d = snapshot.leading_hits(request.block_hashes)
    if isinstance(raw_p, int):
        return 0, 0
    # a raw hit never exceeds len(block_hashes): when that is within a cap, the cap is a no-op
    within = len(request.block_hashes)
    p_hit = raw_p
    if within > (request.prompt_tokens - 1) // block_size:
        p_hit = demand.usable_prefill_hit(request, raw_p, block_size)
    p_hit = p_hit if _count(p_hit) else 0
    if snapshot.colocated:
        return p_hit, p_hit  # one pool: the decode side reuses exactly what prefill reused
    d_hit = raw_d
    if within > request.prompt_tokens // block_size:
        d_hit = demand.visible_decode_hit(request, raw_d, block_size)
    return p_hit, d_hit if _count(d_hit) else 0


def capacity_gates(
    snapshot: Snapshot, request: RouteRequest, ctx: PolicyContext, p_hit: Hits, d_hit: Hits
) -> tuple[np.ndarray, np.ndarray] | Refusal:
    """Masks of prefill and decode slots with headroom for this request, or why there are none.
    Hits are per-slot arrays, or 0 for policies that assume no reuse. A hit only lowers a slot's
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
        return _everyone(len(pool))
    ok = pool.headroom_blocks >= (blocks(request, hit, bs) if isinstance(hit, np.ndarray) else most_blocks)
    return ok if _count(ok) else None


def _cost_aware(snapshot: Snapshot, request: RouteRequest, ctx: PolicyContext, p_hit: Hits, d_hit: Hits) -> Choice | Refusal:
    gates = capacity_gates(snapshot, request, ctx, p_hit, d_hit)
    if isinstance(gates, Refusal):
        return gates
    p_ok = gates[0]
    terms = snapshot.derived(ctx.cost)  # load-only cost terms, computed once per load change
    d_ok = _tpot_admitted(terms, request, ctx, gates[1])
    if isinstance(d_ok, Refusal):
        return d_ok
    p, d, best_ttft_s = _fastest_pair(snapshot, request, ctx.cost, terms, p_hit, d_hit, p_ok, d_ok)
    refusal = _ttft_gate(ctx, request, best_ttft_s)
    return refusal or _choice(p, p if snapshot.colocated else d, _at(p_hit, p), _at(d_hit, d), best_ttft_s)


def _tpot_admitted(terms: Derived, request: RouteRequest, ctx: PolicyContext, d_ok: np.ndarray) -> np.ndarray | Refusal:
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


def _fastest_pair(
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

    The load-only terms (queue, admission) come precomputed with the snapshot; masks are applied
    only when some slot is actually excluded (the common case admits every slot).
    """
    bs = cost.block_size_tokens
    if kernels.enabled:  # the same pair in one compiled call: the reference's double loop
        p_hits = p_hit if isinstance(p_hit, np.ndarray) else _no_hits(len(terms.queue_p))
        d_hits = d_hit if isinstance(d_hit, np.ndarray) else _no_hits(len(terms.admission_d))
        return kernels.fastest_pair(
            terms.queue_p, p_hits, p_ok, terms.admission_d, d_hits, d_ok, snapshot.same_host, snapshot.colocated,
            request.prompt_tokens, bs, cost.kv_bytes_per_token, cost.kernel_coefficients,
        )  # fmt: skip
    per_p = terms.queue_p + cost.prefill_s(demand.compute_tokens(request, p_hit, bs))  # [P]
    if not _all(p_ok):
        per_p = np.where(p_ok, per_p, np.inf)
    admission_s = terms.admission_d  # [D]
    d_all = _all(d_ok)
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


def _ttft_gate(ctx: PolicyContext, request: RouteRequest, best_ttft_s: float) -> Refusal | None:
    slo_s = ctx.ttft_slo_s if request.ttft_slo_s is None else request.ttft_slo_s
    if best_ttft_s <= slo_s:
        return None
    retry_s = min(max(best_ttft_s - slo_s, 0.1), ctx.max_retry_after_s)
    return Refusal(RejectReason.TTFT_SLO, retry_s, f"best TTFT {best_ttft_s:.4f}s > {slo_s}s")


def _full(reason: RejectReason, ctx: PolicyContext) -> Refusal:
    return Refusal(reason, ctx.retry_after_s, "no worker has headroom for this request")


def _choice(p: int, d: int, p_hit: int, d_hit: int, ttft_s: float | None = None, terms: PrefixTerms | None = None) -> Choice:
    return new_frozen(Choice, prefill_slot=p, decode_slot=d, prefill_hit_blocks=p_hit, decode_hit_blocks=d_hit,
                      ttft_s=ttft_s, terms=terms)


def _at(hits: Hits, slot: int) -> int:
    return int(hits[slot]) if isinstance(hits, np.ndarray) else int(hits)
