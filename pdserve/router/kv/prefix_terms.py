"""The prefix policy's per-slot K/V placement terms and the trace line's record of them (issue 19,
part 5).

Contract:
- `host_blocks(keys, hits, worker_ids, host_held)` [P]: per prefill slot, how many of the first
  `hits[slot]` block keys of the request that slot's worker holds only in its host tier (the
  cluster K/V index's HOST entries, `host_held(worker_id)`). Such a block is still a hit (the
  engine promotes it instead of recomputing it), but not a free one: the cost model prices it at
  `CostModel.promote_s` (bytes / the measured host -> pool copy rate, router/pricing/kv_rates.py).
- `PrefixTerms` is the chosen slot's decision in cost-model terms, the same numbers the policy
  summed: queue, host-tier promotion, fetch (0 when none pays), prefill of the rest, and the
  predicted TTFT; `trace_fields()` is what the request's trace line carries.
- The holder's side of a fetch is priced by the measured fetch rate and overhead alone (a holder
  promotes its own host-tier blocks before sending them, inside that measured wall time).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence, Set
from dataclasses import dataclass

import numpy as np

HostHeld = Callable[[str], Set[int]]


def host_blocks(keys: Sequence[int], hits: np.ndarray, worker_ids: Sequence[str], host_held: HostHeld) -> np.ndarray:
    """[P] host-tier blocks within each slot's leading hit `hits` [P]."""
    out = np.zeros(len(worker_ids), dtype=np.int64)
    for slot in np.flatnonzero(hits):
        held = host_held(worker_ids[slot])
        if held:
            out[slot] = sum(1 for key in keys[: hits[slot]] if key in held)
    return out


@dataclass(frozen=True)
class PrefixTerms:
    """The prefix policy's terms for the slot it chose (seconds; blocks of the request's prefix)."""

    queue_s: float
    hit_blocks: int  # the slot's hit after a fetch that pays (own hit otherwise)
    host_blocks: int  # of the slot's own hit, those in its host tier
    host_s: float  # their promotion (cost.promote_s)
    host_bytes_per_s: float  # the host -> pool copy rate it was priced at (measured, router/pricing/kv_rates.py)
    fetch_blocks: int  # fetched from another worker (0: no fetch pays)
    fetch_s: float  # cost.fetch_s of those blocks, 0 when none
    prefill_s: float  # prefill of the tokens past the hit
    ttft_s: float  # the policy's predicted TTFT for the pair (with transfer and admission at D)

    def trace_fields(self) -> dict:
        return {"route_queue_s": round(self.queue_s, 6), "route_hit_blocks": self.hit_blocks,
                "route_host_blocks": self.host_blocks, "route_host_s": round(self.host_s, 6),
                "route_host_bytes_per_s": self.host_bytes_per_s,
                "route_fetch_blocks": self.fetch_blocks, "route_fetch_s": round(self.fetch_s, 6),
                "route_prefill_s": round(self.prefill_s, 6), "route_ttft_s": round(self.ttft_s, 6)}
