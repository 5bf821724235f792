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
per host and one argmin over P, not a Python double loop (pair_search.py: the gates and that
search); a plain double-loop reference in the tests must pick the identical pair.

Every policy reads the same cache view: each slot's leading hit in the cluster K/V index (device
and host tier; `prefix_hits`). The hits lower each slot's capacity demand in the gates, and the
choice carries the chosen slots' hits, which the plan's holds and the P/D decision read, whatever
ranked the pair (round robin's turn, JSQ's queues, a TTFT). `slo` prices each slot's hit in its
TTFT as it is (a hit is computed no more); `prefix` adds the placement costs, so the longest hit
still loses to a shorter queue or a
cheaper transfer path when that is faster (Mooncake); with K/V sharing on (`kv_sharing`) a prefix
another worker holds counts too, priced at its fetch time, and a hit in a worker's host tier is
priced at its promotion time (`_prefix_priced`, prefix_terms.py; the rates are `kv_cost`'s).
Ties break toward the lower prefill slot, then the lower decode slot. With the compiled kernels,
an `slo` or `prefix` decision (without placement costs) whose capacity gates admit every slot without any hit runs the lookup,
the hit caps and the pair search in one call (`_prefix_fused`); it decides exactly as the general
path does (tests/router/policy/test_router_fused.py and the double-loop reference).
"""

from __future__ import annotations

import numpy as np

from pdserve.router import kernels
from pdserve.router.kv.fetch_plan import fetch_credit
from pdserve.router.kv.prefix_terms import PrefixTerms, host_blocks
from pdserve.router.messages import RouteRequest
from pdserve.router.policy import demand
from pdserve.router.policy.choice import Choice, Hits, Policy, PolicyContext, Refusal, hit_at, new_choice
from pdserve.router.policy.pair_search import (
    admits_all,
    capacity_gates,
    fastest_pair,
    tpot_admitted,
    ttft_gate,
    zero_hits,
)
from pdserve.router.pricing.cost import prefill_line
from pdserve.router.state.snapshot import Snapshot

__all__ = ["POLICIES", "Choice", "PolicyContext", "Refusal", "capacity_gates", "prefix_hits"]  # the router's names

_NO_FIT = np.iinfo(np.int64).max
_count = np.count_nonzero  # on small bool masks: several times cheaper than ndarray.any() / .all()


def round_robin(snapshot: Snapshot, request: RouteRequest, ctx: PolicyContext) -> Choice | Refusal:
    p_hit, d_hit = prefix_hits(snapshot, request, ctx.cost.block_size_tokens)
    gates = capacity_gates(snapshot, request, ctx, p_hit, d_hit)
    if isinstance(gates, Refusal):
        return gates
    p, d = _nth_admitted(gates[0], ctx.turn), _nth_admitted(gates[1], ctx.turn)
    return _with_hits(snapshot, p, d, p_hit, d_hit)


def _with_hits(snapshot: Snapshot, p: int, d: int, p_hit: Hits, d_hit: Hits) -> Choice:
    """The choice of (p, d) with the caches' hits at those slots: what the plan's holds and the
    P/D decision read, whatever ranked the pair."""
    d = p if snapshot.colocated else d
    return new_choice(p, d, hit_at(p_hit, p), hit_at(d_hit, d))


def _nth_admitted(mask: np.ndarray, turn: int) -> int:
    """The (turn mod count)-th admitted slot."""
    if admits_all(mask):
        return turn % len(mask)
    slots = np.flatnonzero(mask)
    return int(slots[turn % len(slots)])


def join_shortest_queue(snapshot: Snapshot, request: RouteRequest, ctx: PolicyContext) -> Choice | Refusal:
    """Prefill by fewest pending prompt tokens, decode by smallest batch; colocated by their sum."""
    p_hit, d_hit = prefix_hits(snapshot, request, ctx.cost.block_size_tokens)
    gates = capacity_gates(snapshot, request, ctx, p_hit, d_hit)
    if isinstance(gates, Refusal):
        return gates
    p_ok, d_ok = gates
    pool = snapshot.prefill
    if snapshot.colocated:
        w = _argmin_admitted(pool.pending_tokens + pool.active_batch, p_ok)
        return _with_hits(snapshot, w, w, p_hit, d_hit)
    p, d = _argmin_admitted(pool.pending_tokens, p_ok), _argmin_admitted(snapshot.decode.active_batch, d_ok)
    return _with_hits(snapshot, p, d, p_hit, d_hit)


def _argmin_admitted(values: np.ndarray, mask: np.ndarray) -> int:
    """The lowest admitted slot with the smallest value."""
    return int(values.argmin() if admits_all(mask) else np.where(mask, values, _NO_FIT).argmin())


def slo_aware(snapshot: Snapshot, request: RouteRequest, ctx: PolicyContext) -> Choice | Refusal:
    """The fastest pair with each slot's own cached prefix priced (no placement costs: `prefix`)."""
    if kernels.enabled and request.block_hashes:
        rows = snapshot.prefix.probe(request.block_hashes)
        if rows is None:  # nobody holds the first block: no hit anywhere (what prefix_hits gives)
            return _cost_aware(snapshot, request, ctx, 0, 0)
        fused = _prefix_fused(snapshot, request, ctx, rows)
        if fused is not None:
            return fused
    return _cost_aware(snapshot, request, ctx, *prefix_hits(snapshot, request, ctx.cost.block_size_tokens))


def prefix_aware(snapshot: Snapshot, request: RouteRequest, ctx: PolicyContext) -> Choice | Refusal:
    if request.block_hashes and (ctx.kv_sharing or ctx.host_held is not None):
        return _prefix_priced(snapshot, request, ctx)
    return slo_aware(snapshot, request, ctx)  # no placement cost to add: each slot's own hit, priced


def _prefix_fused(
    snapshot: Snapshot, request: RouteRequest, ctx: PolicyContext, rows: np.ndarray
) -> Choice | Refusal | None:
    """The prefix-aware decision with the lookup of the probed `rows`, the hit caps and the pair
    search in one compiled call (kernels.prefix_pair), when the capacity gates cannot depend on
    the hits: every slot of both pools fits the request even with no hit (a hit only lowers
    demand). None: capacity is tight somewhere; take the general path."""
    gates = capacity_gates(snapshot, request, ctx, 0, 0)
    if isinstance(gates, Refusal) or not (admits_all(gates[0]) and admits_all(gates[1])):
        return None
    terms = snapshot.derived(ctx.cost)
    d_ok = tpot_admitted(terms, request, ctx, gates[1])
    if isinstance(d_ok, Refusal):
        return d_ok
    cost, bs, prompt = ctx.cost, ctx.cost.block_size_tokens, request.prompt_tokens
    p, d, ttft_s, p_hit, d_hit = kernels.prefix_pair(
        rows, snapshot.prefix.held, snapshot.prefix.cols, len(snapshot.prefill), (prompt - 1) // bs, prompt // bs, terms.queue_p,
        terms.prefill_coef, gates[0],
        terms.admission_d, d_ok, snapshot.same_host, snapshot.colocated, prompt, bs, cost.kv_bytes_per_token,
        cost.kernel_coefficients,
    )  # fmt: skip
    refusal = ttft_gate(ctx, request, ttft_s)
    return refusal or new_choice(p, p if snapshot.colocated else d, int(p_hit), int(d_hit), ttft_s)


def _prefix_priced(snapshot: Snapshot, request: RouteRequest, ctx: PolicyContext) -> Choice | Refusal:
    """The prefix policy with placement costs (Mooncake): a prefill slot's cost is its queue + the
    promotion of its hit's host-tier blocks + (K/V sharing) the fetch of the longest reachable
    prefix it lacks (fetch_plan.fetch_credit: only when that beats recomputing it at the slot's
    own prefill terms, its worker's TP size) + the prefill
    of the rest (+ transfer and admission at D). Capacity and the plan's holds count the slot's
    own hit only: fetched blocks take room like computed ones."""
    p_hit, d_hit = prefix_hits(snapshot, request, ctx.cost.block_size_tokens)
    gates = capacity_gates(snapshot, request, ctx, p_hit, d_hit)
    if isinstance(gates, Refusal):
        return gates
    terms = snapshot.derived(ctx.cost)
    d_ok = tpot_admitted(terms, request, ctx, gates[1])
    if isinstance(d_ok, Refusal):
        return d_ok
    kv, bs = ctx.kv_cost or ctx.cost, ctx.cost.block_size_tokens
    own = p_hit if isinstance(p_hit, np.ndarray) else zero_hits(len(snapshot.prefill))
    eff, fetch_s = own, np.zeros(len(own))
    if ctx.kv_sharing:
        eff, fetch_s = fetch_credit(kv, own, *_best_holder(snapshot, request, own, d_hit, bs), terms.prefill_coef)
    host_n = zero_hits(len(own))
    if ctx.host_held is not None:
        host_n = host_blocks(request.block_hashes, own, snapshot.prefill.worker_ids, ctx.host_held)
    host_s = kv.promote_s(host_n)  # [P]
    queue_p, (overhead, rate) = terms.queue_p, terms.prefill_coef
    terms = terms._replace(queue_p=queue_p + host_s + fetch_s)  # [P]: promotion and fetch precede the prefill
    d_eff = eff if snapshot.colocated else d_hit
    p, d, ttft_s = fastest_pair(snapshot, request, ctx.cost, terms, eff, d_eff, gates[0], d_ok)
    refusal = ttft_gate(ctx, request, ttft_s)
    if refusal:
        return refusal
    fetched = int(eff[p] - own[p])
    why = PrefixTerms(float(queue_p[p]), int(eff[p]), int(host_n[p]), float(host_s[p]), kv.host_copy_bytes_per_s,
                      fetched, float(fetch_s[p]), float(prefill_line(overhead[p], rate[p], demand.compute_tokens(request, int(eff[p]), bs))),
                      float(ttft_s))
    return new_choice(p, p if snapshot.colocated else d, hit_at(p_hit, p), hit_at(d_hit, d), ttft_s, why)


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


def _cost_aware(snapshot: Snapshot, request: RouteRequest, ctx: PolicyContext, p_hit: Hits, d_hit: Hits) -> Choice | Refusal:
    gates = capacity_gates(snapshot, request, ctx, p_hit, d_hit)
    if isinstance(gates, Refusal):
        return gates
    p_ok = gates[0]
    terms = snapshot.derived(ctx.cost)  # load-only cost terms, computed once per load change
    d_ok = tpot_admitted(terms, request, ctx, gates[1])
    if isinstance(d_ok, Refusal):
        return d_ok
    p, d, best_ttft_s = fastest_pair(snapshot, request, ctx.cost, terms, p_hit, d_hit, p_ok, d_ok)
    refusal = ttft_gate(ctx, request, best_ttft_s)
    return refusal or new_choice(p, p if snapshot.colocated else d, hit_at(p_hit, p), hit_at(d_hit, d), best_ttft_s)


