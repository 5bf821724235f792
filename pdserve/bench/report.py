"""Assembling the benchmark's JSON report.

Contract: reports are plain JSON-serialisable dicts. Top-level metric keys follow
`vllm bench serve` (`completed`, `mean_ttft_ms`, `p99_tpot_ms`, `request_throughput`, ...) with
two deliberate differences: `request_goodput` here is the *largest offered rate* meeting the SLO
(found by a sweep), not vLLM's per-run count of good requests per second, which we report as
`good_request_throughput`; and attainments carry their own keys (`attainment_ttft`, ...).
`definitions` states every choice a reader needs to compare two reports.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path

from pdserve.bench.goodput import GoodputResult, SearchPlan
from pdserve.bench.metrics import PERCENTILE_METHOD, Slo, Window
from pdserve.bench.records import RequestRecord

DEFINITIONS = {
    "percentiles": PERCENTILE_METHOD,
    "latency_population": "successful requests only",
    "attainment_denominator": "all measured requests; failed, rejected and cut-off requests miss both clocks",
    "slo_met": "latency <= threshold",
    "tpot": "(e2e - ttft) / (output_tokens - 1)",
    "single_token_outputs": "no TPOT: excluded from TPOT statistics, counted as meeting the TPOT objective",
    "window": "requests scheduled in [warmup_s, last_arrival - cooldown_s] are measured",
    "throughput_duration": "first measured arrival to last measured completion",
    "request_goodput": "largest offered rate (req/s) with joint per-request attainment >= p",
    "request_goodput_phase": "largest offered rate with TTFT attainment >= p and TPOT attainment >= p (DistServe)",
    "good_request_throughput": "requests meeting both clocks per second of the window (vLLM's per-run goodput)",
}


def window_fields(window: Window, num_requests: int) -> dict:
    """The denominator bookkeeping of one run."""
    return {
        "num_requests": num_requests,
        "num_excluded_warmup": window.num_warmup,
        "num_excluded_cooldown": window.num_cooldown,
        "denominator": len(window.measured),
    }


def slo_fields(slo: Slo) -> dict:
    """The SLO in milliseconds, as reported."""
    return {"slo_ttft_ms": slo.ttft_s * 1e3, "slo_tpot_ms": slo.tpot_s * 1e3, "slo_attainment": slo.attainment}


def sweep_point(rate: float, summary: dict) -> dict:
    """One row of the sweep table."""
    keys = (
        "completed", "failed", "denominator", "attainment_ttft", "attainment_tpot", "attainment_joint",
        "request_throughput", "output_throughput", "p99_ttft_ms", "p99_tpot_ms",
    )
    return {"rate": rate, **{k: summary.get(k) for k in keys}}


def goodput_fields(results: dict[str, GoodputResult], plan: SearchPlan) -> dict:
    """request_goodput (joint) and request_goodput_phase plus how they were found."""
    joint, phase = results["joint"], results["phase"]
    return {
        "request_goodput": joint.rate,
        "request_goodput_phase": phase.rate,
        "goodput_search": {
            "ladder": list(plan.ladder),
            "rel_tol": plan.rel_tol,
            "max_bisections": plan.max_bisections,
            "joint": asdict(joint),
            "phase": asdict(phase),
        },
    }


def record_dicts(records: tuple[RequestRecord, ...]) -> list[dict]:
    """Per-request records, with tpot_s added, for offline analysis."""
    return [{**asdict(r), "itls_s": list(r.itls_s), "tpot_s": r.tpot_s} for r in records]


def ratios(a: dict, b: dict) -> dict:
    """b / a for every numeric key both reports have (None where a is 0 or either is missing)."""
    out = {}
    for key, va in a.items():
        vb = b.get(key)
        if _is_number(va) and _is_number(vb):
            out[key] = vb / va if va else None
    return out


def write_json(path: str | Path, report: dict) -> None:
    """Write `report` as indented JSON (NaN/inf become null), creating parent folders."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_finite(report), indent=2) + "\n")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _finite(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
