"""A deliberately plain reference for the cost-aware policies: Python loops over every pair.

It shares only the scalar cost formulas and the per-worker prefix scan with the optimised code, so
agreement (same pair or same rejection) checks the vectorisation, the per-host decomposition and
the matrix prefix index.
"""

from __future__ import annotations

from pdserve.router.kv.prefix_index import leading_hit_blocks
from pdserve.router.messages import RejectReason, RouteRequest
from pdserve.router.policy.policies import Choice, PolicyContext, Refusal
from pdserve.router.state.snapshot import Snapshot


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def reference_cost_aware(snapshot: Snapshot, request: RouteRequest, ctx: PolicyContext) -> Choice | Refusal:
    """The pair `slo` and `prefix` (without placement costs) choose: both price each slot's own hit."""
    cost, bs, n = ctx.cost, ctx.cost.block_size_tokens, request.prompt_tokens
    P, D = snapshot.prefill, snapshot.decode
    if len(P) == 0 or len(D) == 0:
        return Refusal(RejectReason.NO_ROUTE, ctx.retry_after_s)
    raw_p = [leading_hit_blocks(request.block_hashes, h) for h in P.members.held_prefixes]
    p_hit = [min(h, (n - 1) // bs) for h in raw_p]
    if snapshot.colocated:
        d_hit = p_hit
    else:
        raw_d = [leading_hit_blocks(request.block_hashes, h) for h in D.members.held_prefixes]
        d_hit = [min(h, n // bs) for h in raw_d]
    total_blocks = _ceil_div(n + request.expected_output_tokens, bs)
    d_ok = [int(D.headroom_blocks[j]) >= total_blocks - d_hit[j] for j in range(len(D))]
    if not any(d_ok):
        return Refusal(RejectReason.NO_DECODE_CAPACITY, ctx.retry_after_s)
    if snapshot.colocated:
        p_ok = d_ok
    else:
        p_ok = [int(P.headroom_blocks[i]) >= _ceil_div(n, bs) - p_hit[i] for i in range(len(P))]
        if not any(p_ok):
            return Refusal(RejectReason.NO_TRANSFER_BUFFER, ctx.retry_after_s)
    tpot_slo = ctx.tpot_slo_s if request.tpot_slo_s is None else request.tpot_slo_s
    tpot = [cost.decode_step_s(int(D.active_batch[j]) + 1) for j in range(len(D))]
    d_ok = [ok and t <= tpot_slo for ok, t in zip(d_ok, tpot)]
    if not any(d_ok):
        return Refusal(RejectReason.TPOT_SLO, ctx.retry_after_s)
    best = None
    for i in range(len(P)):
        if not p_ok[i]:
            continue
        per_p = cost.queue_s(int(P.pending_tokens[i])) + cost.prefill_s(n - p_hit[i] * bs)
        for j in range(len(D)):
            if not d_ok[j] or (snapshot.colocated and i != j):
                continue
            admission = cost.admission_delay_s(int(D.active_batch[j]))
            if snapshot.colocated:
                ttft = per_p + admission
            else:
                nbytes = (n - d_hit[j] * bs) * cost.kv_bytes_per_token
                ttft = per_p + (cost.transfer_s(nbytes, int(P.members.host_ids[i] == D.members.host_ids[j])) + admission)
            if best is None or ttft < best[0]:
                best = (ttft, i, j)
    if best is None:
        return Refusal(RejectReason.TTFT_SLO, -1.0)  # no admitted pair at all (colocated mask split)
    ttft_slo = ctx.ttft_slo_s if request.ttft_slo_s is None else request.ttft_slo_s
    if best[0] > ttft_slo:
        return Refusal(RejectReason.TTFT_SLO, min(max(best[0] - ttft_slo, 0.1), ctx.max_retry_after_s))
    _, i, j = best
    return Choice(i, j, p_hit[i], d_hit[j])
