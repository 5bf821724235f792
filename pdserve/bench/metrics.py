"""Two-clock SLO metrics as pure functions over `RequestRecord`s.

Definitions (fixed here so two systems are always compared on the same denominator):

- Percentiles use numpy's default method ("linear" interpolation between order statistics).
- Latency statistics (TTFT, TPOT, ITL, E2E) are over *successful* requests only.
- TPOT = (E2E - TTFT) / (output tokens - 1). A successful single-token output has no TPOT: it is
  left out of TPOT statistics and counts as *meeting* the TPOT objective (it had no gaps to miss).
- Attainment denominators are *all measured requests*: failed, rejected and cut-off requests are
  misses on both clocks. A request meets an objective when its latency is <= the threshold.
- Joint attainment counts requests meeting both clocks; it is never above either marginal.
- The measurement window drops requests *scheduled* to arrive in the first `warmup_s` seconds or
  in the last `cooldown_s` seconds of the arrival schedule; the report states the counts.
- Throughputs divide by the window's duration: from the first measured arrival to the last
  measured completion (successful or not).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pdserve.bench.records import RequestRecord

PERCENTILES = (50.0, 90.0, 99.0)
PERCENTILE_METHOD = "numpy linear interpolation (numpy.percentile default)"


@dataclass(frozen=True)
class Slo:
    """TTFT and TPOT thresholds (seconds) and the required attainment fraction p."""

    ttft_s: float
    tpot_s: float
    attainment: float = 0.9


@dataclass(frozen=True)
class Attainment:
    """Fractions of measured requests meeting TTFT, TPOT, and both (per request)."""

    ttft: float
    tpot: float
    joint: float
    num_requests: int

    def meets_joint(self, p: float) -> bool:
        """Joint definition: at least p of requests meet both clocks."""
        return self.joint >= p

    def meets_phase(self, p: float) -> bool:
        """Separate-phase (DistServe) definition: each marginal attainment is at least p."""
        return self.ttft >= p and self.tpot >= p


@dataclass(frozen=True)
class Window:
    """The requests measured and how many were excluded on each side."""

    measured: tuple[RequestRecord, ...]
    num_warmup: int
    num_cooldown: int


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) by numpy's default linear interpolation; None when empty."""
    if len(values) == 0:
        return None
    return float(np.percentile(np.asarray(values, dtype=float), q))


def ttft_met(record: RequestRecord, slo: Slo) -> bool:
    """Successful and TTFT <= the TTFT threshold."""
    return record.success and record.ttft_s is not None and record.ttft_s <= slo.ttft_s


def tpot_met(record: RequestRecord, slo: Slo) -> bool:
    """Successful and TPOT <= the threshold (single-token outputs count as met)."""
    if not record.success:
        return False
    tpot = record.tpot_s
    return tpot is None or tpot <= slo.tpot_s


def attainment(records: Sequence[RequestRecord], slo: Slo) -> Attainment:
    """Attainment of each clock and of both jointly; 0.0 for an empty sequence."""
    n = len(records)
    if n == 0:
        return Attainment(0.0, 0.0, 0.0, 0)
    ttft_ok = [ttft_met(r, slo) for r in records]
    tpot_ok = [tpot_met(r, slo) for r in records]
    joint_ok = sum(a and b for a, b in zip(ttft_ok, tpot_ok))
    return Attainment(sum(ttft_ok) / n, sum(tpot_ok) / n, joint_ok / n, n)


def select_window(records: Sequence[RequestRecord], warmup_s: float = 0.0, cooldown_s: float = 0.0) -> Window:
    """Drop requests scheduled before `warmup_s` or after (last arrival - `cooldown_s`)."""
    if not records:
        return Window((), 0, 0)
    last_s = max(r.arrival_s for r in records)
    warm = [r for r in records if r.arrival_s < warmup_s]
    cool = [r for r in records if r.arrival_s >= warmup_s and r.arrival_s > last_s - cooldown_s]
    measured = tuple(r for r in records if warmup_s <= r.arrival_s <= last_s - cooldown_s)
    return Window(measured, len(warm), len(cool))


def window_duration_s(records: Sequence[RequestRecord]) -> float:
    """First arrival to last completion of `records`; 0.0 when empty."""
    if not records:
        return 0.0
    return max(r.finish_s for r in records) - min(r.arrival_s for r in records)


def latency_stats(name: str, values_s: Sequence[float], percentiles: Sequence[float] = PERCENTILES) -> dict:
    """mean/median/std/pXX of `values_s` in milliseconds, keyed like ``mean_ttft_ms``."""
    values_ms = np.asarray(values_s, dtype=float) * 1e3
    empty = len(values_ms) == 0
    stats = {
        f"mean_{name}_ms": None if empty else float(values_ms.mean()),
        f"median_{name}_ms": percentile(values_ms, 50.0),
        f"std_{name}_ms": None if empty else float(values_ms.std()),
    }
    for q in percentiles:
        stats[f"p{q:g}_{name}_ms"] = percentile(values_ms, q)
    return stats


def summarize(records: Sequence[RequestRecord], slo: Slo, duration_s: float | None = None) -> dict:
    """The per-run metrics dictionary (key names follow `vllm bench serve` where one exists)."""
    ok = [r for r in records if r.success]
    duration_s = window_duration_s(records) if duration_s is None else duration_s
    att = attainment(records, slo)
    good = sum(ttft_met(r, slo) and tpot_met(r, slo) for r in records)
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    summary = {
        "num_measured": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "failure_reasons": dict(Counter(r.error for r in records if not r.success)),
        "duration": duration_s,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": _per_s(len(ok), duration_s),
        "output_throughput": _per_s(out_tokens, duration_s),
        "total_token_throughput": _per_s(in_tokens + out_tokens, duration_s),
        "good_request_throughput": _per_s(good, duration_s),
        "attainment_ttft": att.ttft,
        "attainment_tpot": att.tpot,
        "attainment_joint": att.joint,
    }
    summary.update(latency_stats("ttft", [r.ttft_s for r in ok if r.ttft_s is not None]))
    summary.update(latency_stats("tpot", [r.tpot_s for r in ok if r.tpot_s is not None]))
    summary.update(latency_stats("itl", [g for r in ok for g in r.itls_s]))
    summary.update(latency_stats("e2el", [r.e2e_s for r in ok]))
    return summary


def _per_s(count: float, duration_s: float) -> float:
    return count / duration_s if duration_s > 0 else 0.0
