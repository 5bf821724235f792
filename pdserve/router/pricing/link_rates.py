"""The handoff link's price, measured from the transfers the workers report (issue 36, part 3).

Contract: `LinkRates` fits the cost model's three link terms (router/pricing/cost.py
`same_host_bytes_per_s`, `cross_host_bytes_per_s`, `transfer_overhead_s`) to the published
prefill -> decode transfers; nothing else in the cost model changes.
- `observe(nbytes, seconds, same_host)`: one published serialized transfer as its source reported
  it (TransferDone: the manifest's logical bytes, the bytes the cost model prices, over the
  sender's seconds from start to the publish ack). A layer-wise transfer is not a sample: it
  starts with the prefill, so its seconds are the prefill's as much as the link's.
- `price`: the fit of the last `window` samples, or None before the first (then the cost model's
  own numbers stand: the documented prior, 20 GB/s same host, 5 GB/s cross host, 1 ms). The
  model is seconds = overhead + bytes / bandwidth of the sample's path, one overhead for both
  paths (the cost model has one); `fit_link` solves it by least squares over the paths that have
  samples (numpy's lstsq). When that fit is not a price (fewer distinct byte counts than unknowns,
  a negative overhead, a bandwidth that is not positive) the overhead is the fit's, or the prior's
  when it had too few points, clamped into [0, the fastest sample], and each path's bandwidth is
  its bytes over its seconds beyond that overhead (capped at `MAX_BYTES_PER_S`). A path without
  samples keeps the prior, and the cross-host rate is never above the same-host one (the
  policies' per-host decomposition relies on it).
- `apply(cost)`: `cost` with the measured link (`CostModel.with_link`), the same object until the
  price changes, so callers may compare by identity; `cost` itself before the first sample, and
  for a model that is not `fitted`: as kv_rates.py's placement rates, a measured link is weighed
  only against this machine's own prefill terms, never against the placeholders (this CPU's link
  overhead of a few ms against a GPU's placeholder prefill would call every 1P1D fetch of a short
  history too slow; `--pd-profile none` keeps placeholders against placeholders).
The router applies it to every model it routes, decides and plans with (router.py), and
KV-Runahead prices its chain links with it (router/runahead/runahead.py `Runahead.link`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from pdserve.router.pricing.cost import CostModel

WINDOW = 32  # transfers the fit reads (the most recent)
MAX_BYTES_PER_S = 1.0e12  # a fallback bandwidth never above this (no transfer took longer than its overhead)


@dataclass(frozen=True)
class LinkPrice:
    same_host_bytes_per_s: float
    cross_host_bytes_per_s: float
    overhead_s: float
    num_samples: int

    def trace_fields(self) -> dict:
        return {"link_same_host_bytes_per_s": self.same_host_bytes_per_s,
                "link_cross_host_bytes_per_s": self.cross_host_bytes_per_s, "link_overhead_s": self.overhead_s}


def fit_link(samples, prior: CostModel) -> LinkPrice:
    """The module contract's fit of (bytes, seconds, same_host) samples (at least one)."""
    x = np.array([s[0] for s in samples], dtype=np.float64)
    t = np.array([s[1] for s in samples], dtype=np.float64)
    same = np.array([bool(s[2]) for s in samples])
    paths = [p for p in (True, False) if (same == p).any()]  # same host first
    design = np.column_stack([np.ones_like(x)] + [np.where(same == p, x, 0.0) for p in paths])  # [n, 1 + paths]
    solution, _, rank, _ = np.linalg.lstsq(design, t, rcond=None)
    overhead, per_byte = float(solution[0]), [float(u) for u in solution[1:]]
    if rank < design.shape[1] or overhead < 0 or min(per_byte) <= 0:
        overhead = min(max(overhead if rank == design.shape[1] else prior.transfer_overhead_s, 0.0), float(t.min()))
        per_byte = [max(float((t[same == p] - overhead).sum() / x[same == p].sum()), 1.0 / MAX_BYTES_PER_S) for p in paths]
    rates = dict(zip(paths, (1.0 / u for u in per_byte)))
    same_bps = rates.get(True, max(prior.same_host_bytes_per_s, rates.get(False, 0.0)))
    cross_bps = min(rates.get(False, prior.cross_host_bytes_per_s), same_bps)
    return LinkPrice(same_bps, cross_bps, overhead, len(samples))


class LinkRates:
    def __init__(self, prior: CostModel, window: int = WINDOW):
        if window < 1:
            raise ValueError(f"need window >= 1, got {window}")
        self.prior = prior  # whose link terms stand before the first sample
        self._samples: deque[tuple[int, float, bool]] = deque(maxlen=window)
        self.price: LinkPrice | None = None
        self._cached: dict[int, tuple[CostModel, CostModel]] = {}  # id(cost) -> (cost, with the link)

    def observe(self, nbytes: int, seconds: float, same_host: bool) -> None:
        if nbytes <= 0 or seconds <= 0:
            return
        self._samples.append((nbytes, seconds, same_host))
        self.price = fit_link(self._samples, self.prior)
        self._cached.clear()

    def apply(self, cost: CostModel) -> CostModel:
        price = self.price
        if price is None or not cost.fitted:
            return cost
        hit = self._cached.get(id(cost))
        if hit is not None and hit[0] is cost:
            return hit[1]
        priced = cost.with_link(price.same_host_bytes_per_s, price.cross_host_bytes_per_s, price.overhead_s)
        if len(self._cached) >= 64:  # a few models live at once (pairs of TP sizes, live collectives)
            self._cached.clear()
        self._cached[id(cost)] = (cost, priced)
        return priced
