"""Cross-worker prefix fetch planning: pure cost terms (issue 19, parts 2 and 5).

Contract:
- `plan_fetch` decides for one destination (the worker about to prefill a request): its own
  leading hit, the longest leading hit any other worker holds (the holder; ties go to a
  same-host holder, then the lowest worker id), and whether fetching the blocks it lacks beats
  recomputing them. Compute set = the prompt's tokens past the longest reachable prefix; transfer
  set = the holder's blocks past the destination's own hit. Fetch seconds are the cost model's
  `fetch_s` over the path (bytes / measured link bandwidth + setup + the measured per-fetch
  overhead, router/pricing/kv_rates.py); the prefill seconds saved are the destination's own prefill
  (its worker's TP size: the caller passes that worker's cost model, `Router.worker_cost`) of
  the tokens the fetch covers. A fetch is planned only when it is faster, so a tiny prefix whose
  fixed overhead outweighs its prefill is recomputed, and so is one whose destination prefills
  fast enough (a TP 2 worker) where a slower one (TP 1) would fetch it.
- `fetch_credit` is the same decision for every slot of a pool at once (the prefix policy's
  cost): per slot, the hit it would have after a worthwhile fetch and the fetch seconds it pays,
  each slot's saving at its own prefill terms (the snapshot's `Derived.prefill_coef`); the
  reference test checks it against `plan_fetch` slot by slot, each slot's worker cost model in
  hand. `fetch_gain` is the one formula of both.
- `plan_join` is the decision of a request whose planned fetch finds a running fetch to the same
  destination of a shorter prefix of its own chain: wait for it, then fetch the remainder or
  recompute it, whichever is cheaper, when that beats its own fetch of the whole prefix now
  (the remainder's terms), else None (its own fetch). Seconds compared: the running fetch's
  predicted remaining time + the cheaper of the remainder's fetch and its prefill, against the
  whole fetch.
- Hits are in blocks and already capped to what the engine can reuse (the prompt's last token is
  always computed). Block hashes are tenant-rooted, so a holder is always of the same tenant.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from pdserve.router.pricing.cost import CostModel, prefill_line

FETCH, LOCAL, RECOMPUTE = "fetch", "local", "recompute"


@dataclass(frozen=True)
class FetchTerms:
    """One destination's fetch decision and the terms it was made with (the trace line's)."""

    decision: str  # FETCH, LOCAL (nobody holds more than the destination) or RECOMPUTE (not worth it)
    holder: str | None
    local_blocks: int  # the destination's own leading hit
    remote_blocks: int  # the holder's leading hit (0: no holder)
    fetch_bytes: int
    fetch_s: float
    saved_s: float  # prefill seconds the fetched blocks save

    @property
    def fetch_blocks(self) -> int:
        return max(0, self.remote_blocks - self.local_blocks)

    def trace_fields(self) -> dict:
        return {"fetch": self.decision, "fetch_holder": self.holder, "fetch_local_blocks": self.local_blocks,
                "fetch_remote_blocks": self.remote_blocks, "fetch_predicted_s": round(self.fetch_s, 6),
                "fetch_saved_s": round(self.saved_s, 6)}


def leading_run(keys: Sequence[int], held: Container[int]) -> int:
    """How many of `keys`, from the first, `held` contains without a gap."""
    n = 0
    for key in keys:
        if key not in held:
            break
        n += 1
    return n


def fetch_gain(cost: CostModel, local_blocks, remote_blocks, same_host, prefill=None) -> tuple:
    """(fetch bytes, fetch seconds, prefill seconds saved) for fetching remote - local blocks;
    floats or numpy arrays alike (one formula for both callers). `prefill`: the destination's
    (prefill_overhead_s, prefill_s_per_token), scalars or [N] arrays of each destination's own
    (its TP size's); None: `cost`'s. The fetch terms are always `cost`'s (the measured link)."""
    overhead, per_token = (cost.prefill_overhead_s, cost.prefill_s_per_token) if prefill is None else prefill
    blocks = np.maximum(remote_blocks - local_blocks, 0)
    same_host = np.asarray(same_host, dtype=np.int64)  # 0/1: the cost model's path arithmetic
    tokens = blocks * cost.block_size_tokens
    nbytes = tokens * cost.kv_bytes_per_token
    fetch_s = cost.fetch_s(nbytes, same_host)
    saved_s = (prefill_line(overhead, per_token, tokens) - prefill_line(overhead, per_token, 0)) * (blocks > 0)
    return nbytes, fetch_s, saved_s


def plan_fetch(dest: str, keys: Sequence[int], held_by: Mapping[str, Container[int]], usable_blocks: int,
               cost: CostModel, same_host: Callable[[str], bool]) -> FetchTerms:
    """The fetch decision for `dest` over the request's block keys and each worker's held set."""
    keys = keys[:usable_blocks]
    local = leading_run(keys, held_by.get(dest, ()))
    best, holder = local, None
    for worker in sorted(held_by, key=lambda w: (not same_host(w), w)):
        if worker == dest:
            continue
        run = leading_run(keys, held_by[worker])
        if run > best:
            best, holder = run, worker
    if holder is None:
        return FetchTerms(LOCAL, None, local, 0, 0, 0.0, 0.0)
    nbytes, fetch_s, saved_s = fetch_gain(cost, local, best, bool(same_host(holder)))
    decision = FETCH if fetch_s < saved_s else RECOMPUTE
    return FetchTerms(decision, holder, local, best, int(nbytes), float(fetch_s), float(saved_s))


def fetch_credit(cost: CostModel, own: np.ndarray, best: int, same_host: np.ndarray,
                 prefill_coef: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per slot [N]: (hit blocks after a worthwhile fetch of the `best` reachable prefix, fetch
    seconds paid). `own` [N] is each slot's own usable hit, `same_host` [N] whether the holder of
    `best` shares its host, `prefill_coef` [2, N] each slot's own (prefill_overhead_s,
    prefill_s_per_token) (its worker's TP size). A slot that holds `best` itself, or for which
    fetching does not beat recomputing at its own prefill price, keeps its own hit and pays nothing."""
    if np.shape(prefill_coef) != (2, len(own)):
        raise ValueError(f"prefill_coef must be [2, {len(own)}] (one column per slot), got {np.shape(prefill_coef)}")
    _, fetch_s, saved_s = fetch_gain(cost, own, best, same_host, (prefill_coef[0], prefill_coef[1]))
    worth = fetch_s < saved_s
    return np.where(worth, best, own), np.where(worth, fetch_s, 0.0)


def plan_join(terms: FetchTerms, covered: int, wait_s: float, cost: CostModel, same_host: bool) -> FetchTerms | None:
    """For a planned fetch (`terms`) and a running fetch to its destination that lands the first
    `covered` blocks of its chain (local < covered < remote) in about `wait_s`: the remainder's
    terms (FETCH: covered..remote fetched once that one landed; RECOMPUTE: prefilled) when joining
    is cheaper than the whole fetch now, else None (module contract)."""
    nbytes, fetch_s, saved_s = fetch_gain(cost, covered, terms.remote_blocks, same_host)
    rest = FetchTerms(FETCH if fetch_s < saved_s else RECOMPUTE, terms.holder, covered, terms.remote_blocks,
                      int(nbytes), float(fetch_s), float(saved_s))
    return rest if wait_s + min(rest.fetch_s, rest.saved_s) < terms.fetch_s else None
