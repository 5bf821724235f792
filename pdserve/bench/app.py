"""Running `pdserve bench`: one offered rate, or a goodput sweep, against one endpoint.

Contract: `run_bench(config)` replays the seeded workload (at `rate`, or at every rate the
goodput search asks for), applies the measurement window, and returns a `BenchOutcome` whose
`report` is the JSON document; `runs` keeps every rate's records for plotting. With a sweep the
report's top-level metrics are those of the run at the joint goodput rate (the lowest measured
rate if none passed), and `sweep` lists every measured rate.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass, replace

from pdserve.bench.http.client import EndpointConfig, scripted_eos_ignored
from pdserve.bench.goodput import GoodputResult, SearchPlan, next_rate_any, result
from pdserve.bench.metrics import Attainment, Slo, attainment, select_window, summarize
from pdserve.bench.records import RequestRecord
from pdserve.bench.report import DEFINITIONS, goodput_fields, record_dicts, slo_fields, sweep_point, window_fields
from pdserve.bench.runner import run_requests_sync
from pdserve.bench.workload import Workload, WorkloadConfig, build_workload


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark: where, what workload, which SLO, and at what rate(s)."""

    endpoint: EndpointConfig
    workload: WorkloadConfig
    slo: Slo
    rate: float | None = None
    sweep: SearchPlan | None = None
    warmup_s: float = 0.0
    cooldown_s: float = 0.0
    quiet: bool = False
    include_records: bool = False
    max_concurrency: int | None = None  # at most this many requests in flight (runner.py); None: open loop


@dataclass(frozen=True)
class RateRun:
    """One replay at one offered rate (None: a trace's own timing), after windowing."""

    rate: float | None
    records: tuple[RequestRecord, ...]
    measured: tuple[RequestRecord, ...]
    summary: dict
    attainment: Attainment


@dataclass(frozen=True)
class BenchOutcome:
    """The report plus the runs behind it."""

    report: dict
    runs: dict[float | None, RateRun]
    goodput: dict[str, GoodputResult] | None = None


def measure_rate(config: BenchConfig, workload: Workload, rate: float | None, label: str = "") -> RateRun:
    """Replay `workload` at `rate` and summarise its measurement window."""
    requests = workload.at_rate(rate)
    result_ = run_requests_sync(requests, config.endpoint, quiet=config.quiet, label=label or _rate_label(rate),
                                max_concurrency=config.max_concurrency)
    window = select_window(result_.records, config.warmup_s, config.cooldown_s)
    summary = {**window_fields(window, len(requests)), **summarize(window.measured, config.slo)}
    summary["offered_rate"] = rate if rate is not None else workload.native_rate
    summary["max_send_lag_ms"] = result_.max_send_lag_s * 1e3
    if config.endpoint.max_tokens is not None:  # pdserve's scripted EOS header: did the server honour it?
        summary["scripted_eos_ignored"] = ignored = scripted_eos_ignored(result_.records, requests)
        if ignored:
            print(f"pdserve bench: the server ignored the scripted end of sequence on {ignored} of {len(requests)} "
                  f"requests (it ran them to --max-tokens {config.endpoint.max_tokens}): output lengths differ from "
                  "the workload's", file=sys.stderr)
    att = attainment(window.measured, config.slo)
    return RateRun(rate, result_.records, window.measured, summary, att)


def run_bench(config: BenchConfig) -> BenchOutcome:
    """The whole benchmark `config` describes."""
    workload = build_workload(config.workload)
    if config.sweep is None:
        run = measure_rate(config, workload, config.rate)
        return BenchOutcome(_report(config, run), {config.rate: run})
    runs = sweep(config, workload)
    results = {d: result({r: run.attainment for r, run in runs.items()}, config.sweep, d) for d in ("joint", "phase")}
    return BenchOutcome(_sweep_report(config, runs, results), runs, results)


def sweep(config: BenchConfig, workload: Workload) -> dict[float, RateRun]:
    """Measure every rate the goodput search asks for."""
    runs: dict[float, RateRun] = {}
    while (rate := next_rate_any({r: run.attainment for r, run in runs.items()}, config.sweep)) is not None:
        runs[rate] = measure_rate(config, fresh_content(config.workload, workload, len(runs)), rate)
    return runs


def fresh_content(config: WorkloadConfig, first: Workload, point: int) -> Workload:
    """The workload for the `point`-th run of a sweep: the first as built, later ones with their
    own prompt content (same lengths and arrivals), so no run is served from an earlier one's cache."""
    return first if point == 0 else build_workload(replace(config, content_salt=config.content_salt + point))


def metadata(config: BenchConfig) -> dict:
    """What was measured and how, for the report."""
    workload = asdict(config.workload)
    workload["input_len"] = str(config.workload.input_len)
    workload["output_len"] = str(config.workload.output_len)
    endpoint = {k: v for k, v in asdict(config.endpoint).items() if k != "api_key"}
    return {
        "endpoint": endpoint,
        "workload": workload,
        **slo_fields(config.slo),
        "warmup_s": config.warmup_s,
        "cooldown_s": config.cooldown_s,
        "max_concurrency": config.max_concurrency,
        "definitions": DEFINITIONS,
    }


def _report(config: BenchConfig, run: RateRun) -> dict:
    report = {**metadata(config), **run.summary}
    if config.include_records:
        report["records"] = record_dicts(run.records)
    return report


def _sweep_report(config: BenchConfig, runs: dict[float, RateRun], results: dict[str, GoodputResult]) -> dict:
    joint_rate = results["joint"].rate
    headline = runs[joint_rate] if joint_rate in runs else runs[min(runs)]
    report = _report(config, headline)
    report.update(goodput_fields(results, config.sweep))
    report["sweep"] = [sweep_point(rate, runs[rate].summary) for rate in sorted(runs)]
    return report


def _rate_label(rate: float | None) -> str:
    return "trace timing" if rate is None else f"{rate:g} req/s"
