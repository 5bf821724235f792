"""A latency model fitted to measurements of our own engine (`pdserve profile`).

Contract: prefill_s = a_p + b_p * new_rows + c_p * causal_pairs and
decode_step_s = a_d + b_d * batch + c_d * context_tokens, with every coefficient >= 0 (a
least-squares fit that drops terms which would come out negative and refits). A colocated
iteration costs the prefill form over chunk + decode rows plus the decode context term. The JSON
form keeps the raw points next to the coefficients so a fit can be audited.

Decode cost is often not affine in the batch on a CPU: a one-row step is a matrix-vector product,
while a few rows run a small-M GEMM that can cost several times more (this machine's MKL takes
~8x longer for 4 rows than for 1). When the profile measured at least two batch sizes, the fit
also keeps one base per measured size next to a shared context coefficient
(decode_step_s = base(batch) + c * context), interpolated linearly between measured sizes and
extended past the largest with the affine fit's per-sequence slope.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from pdserve.latency.base import LatencyModel, causal_pairs


@dataclass(frozen=True)
class ProfiledLatency(LatencyModel):
    """Linear-in-work fit of one engine on one machine."""

    prefill_coef: tuple[float, float, float]  # (base s, s per row, s per causal pair)
    decode_coef: tuple[float, float, float]  # (base s, s per sequence, s per context token)
    kv_bytes_per_token: int = 0
    kv_capacity_tokens: int | None = None
    meta: dict = field(default_factory=dict, compare=False)
    # ((batch, base s), ...) in increasing batch, and the context coefficient that goes with them
    decode_batch_base: tuple[tuple[int, float], ...] = ()
    decode_context_s: float = 0.0

    def prefill_batch_s(self, new_tokens: Sequence[int], cached_tokens: Sequence[int]) -> float:
        a, b, c = self.prefill_coef
        pairs = sum(causal_pairs(n, k) for n, k in zip(new_tokens, cached_tokens))
        return a + b * sum(new_tokens) + c * pairs

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        if batch <= 0:
            return 0.0
        if self.decode_batch_base:
            return _interpolate(self.decode_batch_base, batch, self.decode_coef[1]) + self.decode_context_s * context_tokens
        a, b, c = self.decode_coef
        return a + b * batch + c * context_tokens

    def mixed_step_s(self, chunk_tokens: int, chunk_pairs: int, chunk_kv_tokens: int, chunk_fraction: float,
                     batch: int, context_tokens: int) -> float:
        a, b, c = self.prefill_coef
        return a + b * (chunk_tokens + batch) + c * chunk_pairs + self.decode_coef[2] * context_tokens

    def to_dict(self) -> dict:
        return {
            "kind": "profiled",
            "prefill_coef": list(self.prefill_coef),
            "decode_coef": list(self.decode_coef),
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "kv_capacity_tokens": self.kv_capacity_tokens,
            "decode_batch_base": [list(x) for x in self.decode_batch_base],
            "decode_context_s": self.decode_context_s,
            "meta": self.meta,
        }

    @classmethod
    def from_dict(cls, d: dict) -> ProfiledLatency:
        cap = d.get("kv_capacity_tokens")
        return cls(
            prefill_coef=tuple(float(x) for x in d["prefill_coef"]),
            decode_coef=tuple(float(x) for x in d["decode_coef"]),
            kv_bytes_per_token=int(d.get("kv_bytes_per_token", 0)),
            kv_capacity_tokens=None if cap is None else int(cap),
            meta=dict(d.get("meta", {})),
            decode_batch_base=tuple((int(b), float(t)) for b, t in d.get("decode_batch_base", ())),
            decode_context_s=float(d.get("decode_context_s", 0.0)),
        )


def nonnegative_fit(features: np.ndarray, targets: np.ndarray) -> tuple[float, ...]:
    """Least squares with every coefficient >= 0: drop the most negative term, refit, repeat."""
    active = list(range(features.shape[1]))
    coef = np.zeros(features.shape[1])
    while active:
        solution, *_ = np.linalg.lstsq(features[:, active], targets, rcond=None)
        if (solution >= 0).all():
            coef[active] = solution
            break
        active.pop(int(np.argmin(solution)))
    return tuple(float(x) for x in coef)


def fit_profile(
    prefill_points: Sequence[tuple[int, float]],
    decode_points: Sequence[tuple[int, int, float]],
    **extra,
) -> ProfiledLatency:
    """Fit from (prompt tokens, seconds) and (batch, context tokens, seconds) measurements."""
    if len(prefill_points) < 2 or len(decode_points) < 2:
        raise ValueError("a profile fit needs at least two prefill and two decode points")
    p = np.array([[1.0, n, causal_pairs(n, 0)] for n, _ in prefill_points])
    d = np.array([[1.0, b, c] for b, c, _ in decode_points])
    meta = dict(extra.pop("meta", {}))
    meta["prefill_points"] = [list(x) for x in prefill_points]
    meta["decode_points"] = [list(x) for x in decode_points]
    bases, context_s = per_batch_fit(decode_points)
    return ProfiledLatency(
        prefill_coef=nonnegative_fit(p, np.array([t for _, t in prefill_points])),
        decode_coef=nonnegative_fit(d, np.array([t for *_, t in decode_points])),
        meta=meta,
        decode_batch_base=bases,
        decode_context_s=context_s,
        **extra,
    )


def per_batch_fit(decode_points: Sequence[tuple[int, int, float]]) -> tuple[tuple[tuple[int, float], ...], float]:
    """(((batch, base s), ...), context s per token): one intercept per measured batch size and a
    shared context slope, all >= 0; ((), 0.0) when fewer than two batch sizes were measured."""
    sizes = sorted({b for b, _, _ in decode_points})
    if len(sizes) < 2:
        return (), 0.0
    column = {b: i for i, b in enumerate(sizes)}
    features = np.zeros((len(decode_points), len(sizes) + 1))
    for row, (b, c, _) in enumerate(decode_points):
        features[row, column[b]] = 1.0
        features[row, -1] = c
    coef = nonnegative_fit(features, np.array([t for *_, t in decode_points]))
    return tuple(zip(sizes, coef[:-1])), coef[-1]


def _interpolate(points: Sequence[tuple[int, float]], batch: int, slope_past_end: float) -> float:
    """Piecewise-linear in batch through `points`; flat below the first, `slope_past_end` after the last."""
    if batch <= points[0][0]:
        return points[0][1]
    for (b0, t0), (b1, t1) in zip(points, points[1:]):
        if batch <= b1:
            return t0 + (t1 - t0) * (batch - b0) / (b1 - b0)
    last_b, last_t = points[-1]
    return last_t + slope_past_end * (batch - last_b)
