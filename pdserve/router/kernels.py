"""Compiled inner loops of the cost-aware policies (numba), used when numba is installed.

The policies' numpy path costs one interpreter round trip per array operation (0.5-2 us each,
30-40 of them per prefix-aware decision at 64 x 64 workers); these kernels do the same arithmetic
in one compiled call. Without numba, `AVAILABLE` (and `enabled`) is False and the policies and the
prefix index keep their numpy path; the tests run both against the plain double-loop reference.

Contracts (the floating-point operations are the reference's, in the reference's order, with no
fastmath, so results agree bit for bit with `plan.predicted_clocks`):

    leading_counts(rows, held, cols)
                                 per slot, how many of `rows` (matrix rows of a request's leading
                                 block hashes, in order) the slot holds before its first miss
                                 (slot i reads column cols[i] of `held`)
    fastest_pair(...)            the admitted (P, D) with the smallest
                                     per_p[P] = queue_p[P] + (overhead[P] + (prompt - p_hit[P] * B) * rate[P])
                                     x[P, D]  = transfer(bytes[D], path(P, D)) + admission[D]
                                     ttft     = per_p[P] + x[P, D]
                                 (overhead, rate: p_coef's rows, each prefill slot's worker's
                                 own prefill terms, router/snapshot.Derived.prefill_coef),
                                 scanning P then D in slot order with a strict `<`, so ties go to
                                 the lower prefill slot, then the lower decode slot; colocated
                                 pools pair (w, w) with ttft = per_p[w] + admission[w]. Returns
                                 (-1, -1, inf) when no pair is admitted.
    prefix_pair(rows, held, cols, split, p_cap, d_cap, ...)
                                 the prefix-aware decision in one call: leading_counts over every
                                 slot (prefill slots before `split`, decode slots from it; a
                                 colocated pool is all prefill), capped at p_cap / d_cap (demand.py's
                                 usable and visible hits), then fastest_pair; returns its (p, d, ttft)
                                 and the chosen slots' hits

Compilation is lazy and cached on disk (`cache=True`); `warm_up()` compiles the variants the
router uses so that the first routed request does not pay for it.
"""

from __future__ import annotations

import math

import numpy as np

try:
    import numba
except ImportError:  # the policies fall back to their numpy path
    numba = None

AVAILABLE = numba is not None
enabled = AVAILABLE  # read on every call: tests turn it off to check the numpy path
# coefficient vector layout for fastest_pair (CostModel.kernel_coefficients builds it); the prefill
# terms come per slot ([2, P] p_coef: overhead, rate)
TRANSFER_OVERHEAD, SAME_HOST_BW, CROSS_HOST_BW = range(3)


def _leading_counts(rows, held, cols):  # rows: [R] int64, held: [rows, columns] bool, cols: [S] int64 -> [S] int64
    num_slots = len(cols)
    counts = np.full(num_slots, len(rows), dtype=np.int64)
    alive = np.arange(num_slots)  # the first `num_alive` entries: slots holding every row so far
    num_alive = num_slots
    for k in range(len(rows)):
        held_row = held[rows[k]]
        kept = 0
        for i in range(num_alive):
            slot = alive[i]
            if held_row[cols[slot]]:
                alive[kept] = slot
                kept += 1
            else:
                counts[slot] = k
        num_alive = kept
        if num_alive == 0:
            break
    return counts


def _transfer_plus_admission(nbytes, bandwidth, transfer_overhead, admission):
    if nbytes > 0:
        return (transfer_overhead + nbytes / bandwidth) + admission
    return 0.0 + admission  # the reference multiplies the transfer by (bytes > 0): 0.0


def _fastest_pair(queue_p, p_coef, p_hit, p_ok, admission_d, d_hit, d_ok, same_host, colocated, prompt, block, bpt,
                  coeff):
    overhead, rate = p_coef[0], p_coef[1]  # [P] each
    t_over, same_bw, cross_bw = coeff[TRANSFER_OVERHEAD], coeff[SAME_HOST_BW], coeff[CROSS_HOST_BW]
    best_p, best_d, best = -1, -1, math.inf
    if colocated:
        for w in range(len(queue_p)):
            if p_ok[w] and d_ok[w]:
                ttft = (queue_p[w] + (overhead[w] + (prompt - p_hit[w] * block) * rate[w])) + admission_d[w]
                if ttft < best:
                    best_p, best_d, best = w, w, ttft
        return best_p, best_d, best
    num_decode = len(admission_d)
    same_x = np.empty(num_decode)  # [D] transfer + admission over a same-host path
    cross_x = np.empty(num_decode)  # [D] over a cross-host path
    for d in range(num_decode):
        nbytes = prompt * bpt - d_hit[d] * (block * bpt)
        same_x[d] = _transfer_plus_admission(nbytes, same_bw, t_over, admission_d[d])
        cross_x[d] = _transfer_plus_admission(nbytes, cross_bw, t_over, admission_d[d])
    for p in range(len(queue_p)):
        if not p_ok[p]:
            continue
        per_p = queue_p[p] + (overhead[p] + (prompt - p_hit[p] * block) * rate[p])
        for d in range(num_decode):
            if d_ok[d]:
                ttft = per_p + (same_x[d] if same_host[p, d] else cross_x[d])
                if ttft < best:
                    best_p, best_d, best = p, d, ttft
    return best_p, best_d, best


def _prefix_pair(rows, held, cols, split, p_cap, d_cap, queue_p, p_coef, p_ok, admission_d, d_ok, same_host, colocated,
                 prompt, block, bpt, coeff):
    counts = leading_counts(rows, held, cols)  # [P + D], or [W] for a colocated pool (split = W)
    p_hit = np.minimum(counts[:split], p_cap)  # [P]
    d_hit = p_hit if colocated else np.minimum(counts[split:], d_cap)  # [D]
    p, d, ttft = fastest_pair(queue_p, p_coef, p_hit, p_ok, admission_d, d_hit, d_ok, same_host, colocated, prompt,
                              block, bpt, coeff)
    if p < 0:
        return p, d, ttft, 0, 0
    return p, d, ttft, p_hit[p], d_hit[d]


if AVAILABLE:
    _transfer_plus_admission = numba.njit(cache=True, inline="always")(_transfer_plus_admission)
    leading_counts = numba.njit(cache=True)(_leading_counts)
    fastest_pair = numba.njit(cache=True)(_fastest_pair)
    prefix_pair = numba.njit(cache=True)(_prefix_pair)
else:
    leading_counts = _leading_counts
    fastest_pair = _fastest_pair
    prefix_pair = _prefix_pair


_warm = False


def warm_up() -> None:
    """Compile (or load from the disk cache) the variants the router calls: read-only snapshot
    arrays with writable or read-only hit vectors and masks. Once per process."""
    global _warm
    if not AVAILABLE or _warm:
        return
    _warm = True
    held = np.zeros((3, 2), dtype=bool)
    leading_counts(np.array([1, 2], dtype=np.int64), held, np.arange(2, dtype=np.int64))
    coeff = np.ones(3)
    p_coef = _readonly(np.ones((2, 2)))
    floats, ints, mask = _readonly(np.zeros(2)), np.zeros(2, dtype=np.int64), np.ones(2, dtype=bool)
    same_host = _readonly(np.eye(2, dtype=bool))
    for hit in (ints, _readonly(ints.copy())):
        for ok in (mask, _readonly(mask.copy())):
            fastest_pair(floats, p_coef, hit, ok, floats, hit, ok, same_host, False, 17, 16, 8, coeff)
    rows, everyone = np.array([1], dtype=np.int64), _readonly(mask.copy())
    for colocated in (False, True):
        for d_ok in (everyone, mask):  # the shared all-admitted mask, or one the TPOT gate narrowed
            prefix_pair(rows, np.zeros((3, 4), dtype=bool), np.arange(4, dtype=np.int64), 2, 1, 1, floats, p_coef, everyone, floats, d_ok, same_host,
                        colocated, 17, 16, 8, coeff)


def _readonly(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array
