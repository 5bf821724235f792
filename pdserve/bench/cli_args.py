"""Turning `pdserve bench` command-line arguments into configs, and printing the results.

Contract: pure translation plus output; all defaults that matter live in the config dataclasses
or in the parser (pdserve/commands/bench.py). `--model` absent means: ask GET /v1/models.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
from typing import TYPE_CHECKING

from pdserve.bench.arrivals import ArrivalSpec
from pdserve.bench.goodput import SearchPlan, geometric_ladder
from pdserve.bench.lengths import fixed, parse_length_spec
from pdserve.bench.metrics import Slo
from pdserve.bench.prompts import PromptStyle
from pdserve.bench.report import write_json
from pdserve.bench.trace import read_trace
from pdserve.bench.workload import WorkloadConfig

if TYPE_CHECKING:  # the HTTP client and the API's schema load with `pdserve bench`, not with simulate or plan
    from pdserve.bench.app import BenchConfig, BenchOutcome
    from pdserve.bench.http.client import EndpointConfig

SHOWN = (
    "denominator", "completed", "failed", "request_throughput", "output_throughput",
    "mean_ttft_ms", "p50_ttft_ms", "p90_ttft_ms", "p99_ttft_ms",
    "mean_tpot_ms", "p50_tpot_ms", "p90_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "p99_itl_ms", "mean_e2el_ms",
    "attainment_ttft", "attainment_tpot", "attainment_joint", "request_goodput", "request_goodput_phase",
)


def endpoint_config(args: argparse.Namespace, base_url: str, model: str | None) -> EndpointConfig:
    """The endpoint, discovering the model when not given."""
    from pdserve.bench.http.client import EndpointConfig, discover_model

    if not model:
        try:
            model = asyncio.run(discover_model(base_url))
        except Exception as exc:  # httpx's connect, HTTP status and JSON errors; a listing without ids
            raise SystemExit(f"error: cannot list the models at {base_url}/v1/models ({type(exc).__name__}: {exc}); "
                             f"is the server up? (--model names one without asking)") from None
    return EndpointConfig(
        base_url=base_url, model=model, api=args.api, ignore_eos=not args.no_ignore_eos,
        request_timeout_s=args.request_timeout_s, api_key=args.api_key, http_client=args.http_client,
        max_tokens=getattr(args, "max_tokens", None),
    )


def bench_config(args: argparse.Namespace, endpoint: EndpointConfig) -> BenchConfig:
    """Everything but the endpoint, from the arguments; raises SystemExit on inconsistent input."""
    from pdserve.bench.app import BenchConfig

    if args.slo_ttft_ms is None or args.slo_tpot_ms is None:
        raise SystemExit("pdserve bench: --slo-ttft-ms and --slo-tpot-ms are required")
    workload = workload_config(args)
    if not args.sweep and args.rate is None and workload.arrival.kind != "trace":
        raise SystemExit("pdserve bench: give --rate R or --sweep (or a trace with arrival times)")
    if args.sweep and args.rate is not None:
        raise SystemExit("pdserve bench: --rate and --sweep are exclusive")
    return BenchConfig(
        endpoint=endpoint, workload=workload,
        slo=Slo(args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3, args.attainment),
        rate=args.rate, sweep=search_plan(args) if args.sweep else None,
        warmup_s=args.warmup_s, cooldown_s=args.cooldown_s, quiet=args.quiet,
        include_records=args.include_records, max_concurrency=_max_concurrency(args),
    )


def _max_concurrency(args: argparse.Namespace) -> int | None:
    n = getattr(args, "max_concurrency", None)
    if n is not None and n < 1:
        raise SystemExit(f"pdserve bench: --max-concurrency must be >= 1, got {n}")
    return n


def workload_config(args: argparse.Namespace) -> WorkloadConfig:
    """The seeded workload the arguments describe."""
    if args.trace is None and args.num_requests <= 0:
        raise SystemExit("pdserve bench: --num-requests N is required without a trace")
    if args.trace is None and args.input_len is None and args.input_dist is None:
        raise SystemExit("pdserve bench: give --input-len, --input-dist or --trace")
    if args.trace is None and args.output_len is None and args.output_dist is None:
        raise SystemExit("pdserve bench: give --output-len or --output-dist")
    salt = getattr(args, "content_salt", 0)  # bench only: simulate and plan never read prompt content
    if salt < 0:
        raise SystemExit("pdserve bench: --content-salt must be >= 0")
    return WorkloadConfig(
        num_requests=args.num_requests,
        input_len=_length(args.input_len, args.input_dist),
        output_len=_length(args.output_len, args.output_dist),
        seed=args.seed,
        arrival=ArrivalSpec(_arrival_kind(args), args.burstiness),
        prompt_style=PromptStyle(args.prompt_format, args.tokenizer_bytes_per_token, args.bos_tokens),
        num_conversations=args.num_conversations,
        shared_prefix_len=args.shared_prefix_len,
        trace_path=args.trace,
        content_salt=salt,
    )


def search_plan(args: argparse.Namespace) -> SearchPlan:
    """The sweep ladder and bisection limits."""
    if args.sweep_rates:
        ladder = tuple(sorted(args.sweep_rates))
    else:
        if args.sweep_start > args.sweep_max:
            raise SystemExit(f"pdserve bench: --sweep-start {args.sweep_start:g} is above --sweep-max {args.sweep_max:g}")
        ladder = geometric_ladder(args.sweep_start, args.sweep_max, args.sweep_factor)
    return SearchPlan(ladder, args.attainment, args.sweep_rel_tol, args.max_bisections)


def emit(args: argparse.Namespace, report: dict, outcome: BenchOutcome, slo: Slo) -> None:
    """Print the headline numbers; write the JSON and the plots when asked."""
    print_summary(report)
    if args.json_path:
        write_json(args.json_path, report)
    if args.plot_dir:
        from pdserve.bench.plots import write_plots

        points = {r if r is not None else report.get("offered_rate") or 0.0: run.attainment for r, run in outcome.runs.items()}
        headline = outcome.runs.get(outcome.goodput["joint"].rate) if outcome.goodput else None
        headline = headline or next(iter(outcome.runs.values()))
        write_plots(args.plot_dir, points, headline.measured, slo, outcome.goodput)


def emit_compare(args: argparse.Namespace, report: dict) -> None:
    """Print A, B and B/A side by side; write the JSON when asked."""
    a, b, ratio = report["a"], report["b"], report["ratio_b_over_a"]
    print(f"{'metric':<26}{'A':>14}{'B':>14}{'B/A':>10}")
    for key in SHOWN:
        if key in a or key in b:
            print(f"{key:<26}{_fmt(a.get(key)):>14}{_fmt(b.get(key)):>14}{_fmt(ratio.get(key)):>10}")
    if args.json_path:
        write_json(args.json_path, report)


def print_summary(report: dict, stream=None) -> None:
    """The headline metrics, one per line (to `stream`, by default the current sys.stdout)."""
    stream = sys.stdout if stream is None else stream
    for key in SHOWN:
        if key in report:
            print(f"{key:<26}{_fmt(report[key]):>14}", file=stream)


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return "inf" if math.isinf(value) else f"{value:.4g}"
    return str(value)


def _length(n: int | None, spec: str | None):
    if spec is not None:
        try:
            return parse_length_spec(spec)
        except ValueError as exc:
            raise SystemExit(f"pdserve bench: {exc}") from exc
    return fixed(n) if n is not None else fixed(128)


def _arrival_kind(args: argparse.Namespace) -> str:
    if args.arrival is not None:
        return args.arrival
    if args.trace and all(e.arrival_s is not None for e in read_trace(args.trace)):
        return "trace" if args.rate is None and not args.sweep else "poisson"
    return "poisson"
