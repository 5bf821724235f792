"""`pdserve bench compare`: one seeded workload against two endpoints, interleaved.

Contract: both endpoints see the identical request sequence and arrival schedule. At a fixed
rate, `repeats` rounds run A and B alternately in ABBA order (A B, B A, A B, ...) so slow drift in
the machine hits both equally; each round is windowed on its own and the measured records of all
rounds are pooled per endpoint. With a sweep, the two goodput searches advance in lock-step: each
step measures A's next rate, then B's. The report holds each side's report and `ratio_b_over_a`
for every numeric metric.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pdserve.bench.app import BenchConfig, RateRun, fresh_content, measure_rate, metadata
from pdserve.bench.http.client import EndpointConfig
from pdserve.bench.goodput import next_rate_any, result
from pdserve.bench.metrics import summarize
from pdserve.bench.report import goodput_fields, ratios, sweep_point
from pdserve.bench.workload import Workload, build_workload


@dataclass(frozen=True)
class CompareConfig:
    """Two endpoints, one benchmark configuration (its own endpoint is ignored)."""

    bench: BenchConfig
    endpoint_a: EndpointConfig
    endpoint_b: EndpointConfig
    repeats: int = 1


def run_compare(config: CompareConfig) -> dict:
    """The comparison report."""
    workload = build_workload(config.bench.workload)
    sides = (_side(config, config.endpoint_a), _side(config, config.endpoint_b))
    if config.bench.sweep is None:
        reports = _fixed_rate(sides, workload, config.repeats)
    else:
        reports = _sweeps(sides, workload)
    a, b = reports
    return {"a": a, "b": b, "ratio_b_over_a": ratios(a, b), "interleaving": _interleaving(config)}


def _side(config: CompareConfig, endpoint: EndpointConfig) -> BenchConfig:
    return replace(config.bench, endpoint=endpoint)


def _fixed_rate(sides: tuple[BenchConfig, BenchConfig], workload: Workload, repeats: int) -> list[dict]:
    pooled: list[list[RateRun]] = [[], []]
    for round_ in range(max(1, repeats)):
        order = (0, 1) if round_ % 2 == 0 else (1, 0)
        round_workload = fresh_content(sides[0].workload, workload, round_)  # same content for A and B
        for i in order:
            pooled[i].append(measure_rate(sides[i], round_workload, sides[i].rate, label=f"{'AB'[i]} round {round_ + 1}"))
    return [_pooled_report(side, runs) for side, runs in zip(sides, pooled)]


def _pooled_report(side: BenchConfig, runs: list[RateRun]) -> dict:
    measured = tuple(r for run in runs for r in run.measured)
    summary = summarize(measured, side.slo, duration_s=sum(run.summary["duration"] for run in runs))
    summary["denominator"] = len(measured)
    summary["num_rounds"] = len(runs)
    summary["offered_rate"] = runs[0].summary["offered_rate"]
    return {**metadata(side), **summary}


def _sweeps(sides: tuple[BenchConfig, BenchConfig], workload: Workload) -> list[dict]:
    runs: list[dict[float, RateRun]] = [{}, {}]
    while True:
        wanted = [next_rate_any(_points(runs[i]), sides[i].sweep) for i in (0, 1)]
        if wanted == [None, None]:
            break
        for i, rate in enumerate(wanted):
            if rate is not None:
                point = fresh_content(sides[i].workload, workload, len(runs[i]))
                runs[i][rate] = measure_rate(sides[i], point, rate, label=f"{'AB'[i]} {rate:g} req/s")
    return [_sweep_side_report(side, side_runs) for side, side_runs in zip(sides, runs)]


def _sweep_side_report(side: BenchConfig, runs: dict[float, RateRun]) -> dict:
    results = {d: result(_points(runs), side.sweep, d) for d in ("joint", "phase")}
    headline = runs.get(results["joint"].rate) or runs[min(runs)]
    report = {**metadata(side), **headline.summary, **goodput_fields(results, side.sweep)}
    report["sweep"] = [sweep_point(rate, runs[rate].summary) for rate in sorted(runs)]
    return report


def _points(runs: dict[float, RateRun]) -> dict:
    return {rate: run.attainment for rate, run in runs.items()}


def _interleaving(config: CompareConfig) -> str:
    if config.bench.sweep is not None:
        return "lock-step sweeps: each step measures A's next rate then B's"
    return f"{max(1, config.repeats)} round(s) in ABBA order, windows pooled per endpoint"
