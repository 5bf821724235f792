"""`pdserve simulate` and `pdserve bench-sim`: the discrete-event simulator from the shell.

`simulate` runs one workload (the benchmark's own specs and traces) through a colocated or
disaggregated deployment under a latency model JSON and prints the benchmark's metric keys
(one JSON line with --json). `bench-sim` measures the simulator itself: requests simulated per
wall second on a 1P1D configuration. Registration is argparse only; the simulator is imported
by the handlers.
"""

from __future__ import annotations

import argparse
import json
import time

from pdserve import argtypes

DEFAULT_SLO_TTFT_MS = 1000.0
DEFAULT_SLO_TPOT_MS = 100.0


def add_workload_args(parser: argparse.ArgumentParser, default_requests: int) -> None:
    """Workload flags with the benchmark's names (read by `pdserve.bench.cli_args.workload_config`)."""
    group = parser.add_argument_group("workload")
    source = group.add_mutually_exclusive_group()
    source.add_argument("--input-len", type=argtypes.tokens, help="fixed prompt length (tokens)")
    source.add_argument("--input-dist", metavar="SPEC", help="prompt length distribution, e.g. uniform:256,1024")
    source.add_argument("--trace", metavar="FILE", help="JSON-lines trace (prompt_len/output_len[/arrival_s])")
    output = group.add_mutually_exclusive_group()
    output.add_argument("--output-len", type=argtypes.tokens, help="fixed output length (tokens)")
    output.add_argument("--output-dist", metavar="SPEC", help="output length distribution")
    group.add_argument("--num-requests", type=argtypes.count, default=default_requests, help=f"requests (default {default_requests})")
    group.add_argument("--arrival", choices=("poisson", "gamma", "constant", "trace"), help="arrival process (default poisson)")
    group.add_argument("--burstiness", type=argtypes.positive, default=1.0, help="gamma arrivals: coefficient of variation")
    group.add_argument("--seed", type=int, default=0)
    group.add_argument("--num-conversations", type=argtypes.nonnegative_int, default=0, help="multi-turn: requests cycle over C conversations")
    group.add_argument("--shared-prefix-len", type=argtypes.int_in(0, argtypes.MAX_TOKENS), default=0, help="tokens of one system prefix shared by all")
    group.add_argument("--prefix-cache", action="store_true", help="count shared prefixes and earlier turns as cache hits")
    parser.set_defaults(prompt_format="ids", tokenizer_bytes_per_token=1.0, bos_tokens=1, sweep=False)


def add_slo_args(parser: argparse.ArgumentParser, required: bool = False) -> None:
    group = parser.add_argument_group("SLO")
    group.add_argument("--slo-ttft-ms", type=argtypes.positive, required=required, default=None if required else DEFAULT_SLO_TTFT_MS,
                       help="TTFT threshold (ms)" + ("" if required else f" (default {DEFAULT_SLO_TTFT_MS:g})"))
    group.add_argument("--slo-tpot-ms", type=argtypes.positive, required=required, default=None if required else DEFAULT_SLO_TPOT_MS,
                       help="TPOT threshold (ms)" + ("" if required else f" (default {DEFAULT_SLO_TPOT_MS:g})"))
    group.add_argument("--attainment", type=argtypes.fraction, default=0.9, help="required attainment p (default 0.9)")


def add_pd_decision_arg(parser: argparse.ArgumentParser, default: str) -> None:
    """`--pd-decision` of `pdserve plan` and `pdserve simulate` (search/planner.py's contract)."""
    parser.add_argument("--pd-decision", choices=("always", "margin"), default=default,
                        help=f"the disaggregated deployment's per-request routing (default {default}): 'margin' decides "
                             "each request with the router's own net margin (as `pdserve serve` does), priced from the "
                             "profiled --latency-model (hand off, or prefill on the decode worker); 'always' hands "
                             "every request off")


def latency_model_arg(text: str) -> str:
    """`--latency-model`: an ``aic:``/``distserve:`` spec as typed (read with --model later), or a
    latency model JSON file, read now: a file that is missing or malformed is refused at the parse."""
    from pdserve.latency.load import load_latency_model
    from pdserve.latency.spec import is_family

    if is_family(text):
        return text
    try:
        load_latency_model(text)
    except (OSError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def link_bytes_per_s(gbps: float | None) -> float:
    """--link-gbps is gigabits per second; None means an unconstrained link."""
    return float("inf") if gbps is None else gbps * 1e9 / 8


def register(subparsers: argparse._SubParsersAction) -> None:
    sim = subparsers.add_parser("simulate", help="simulate a deployment under a latency model (discrete events)")
    sim.add_argument("--latency-model", required=True, type=latency_model_arg,
                     metavar="FILE.json|aic:SYSTEM[:BACKEND[:VERSION]]|distserve:ENGINE:CHECKOUT",
                     help="constant, roofline or profiled model JSON; or aiconfigurator's measured step times "
                          "(e.g. aic:h200_sxm), or DistServe's fitted A100 step times (distserve:vllm:CHECKOUT); "
                          "the last two need --model, and --tp/--pp for the instance shape")
    sim.add_argument("--model", help="with aic:...: a config.json, DIR or Hugging Face id aiconfigurator ships")
    sim.add_argument("--tp", type=argtypes.positive_int, default=1, help="with aic:...: tensor-parallel degree of every instance")
    sim.add_argument("--pp", type=argtypes.positive_int, default=1, help="with aic:...: pipeline-parallel degree of every instance")
    sim.add_argument("--mode", choices=("colocated", "disaggregated"), default="disaggregated")
    sim.add_argument("--replicas", type=argtypes.positive_int, default=1, help="colocated instances")
    sim.add_argument("--prefill", type=argtypes.positive_int, default=1, help="prefill instances (disaggregated)")
    sim.add_argument("--decode", type=argtypes.positive_int, default=1, help="decode instances (disaggregated)")
    sim.add_argument("--max-prefill-batch", type=argtypes.positive_int, default=1, help="requests per prefill batch")
    sim.add_argument("--max-prefill-tokens", type=argtypes.positive_int, help="new tokens per prefill batch")
    sim.add_argument("--prefill-policy", choices=("fcfs", "sjf"), default="fcfs")
    sim.add_argument("--chunk-tokens", type=argtypes.positive_int, default=512, help="colocated per-iteration token budget")
    sim.add_argument("--max-seqs", type=argtypes.positive_int, default=256, help="decode batch limit")
    sim.add_argument("--link-gbps", type=argtypes.positive, help="K/V link per decode instance, Gbit/s (default unconstrained)")
    sim.add_argument("--transfer", choices=("request", "layer"), default="request", help="K/V transfer overlap")
    sim.add_argument("--layers", type=argtypes.positive_int, default=1, help="layers for layer-wise transfer")
    sim.add_argument("--rate", type=argtypes.rate, help="offered rate req/s (default: a trace's own rate)")
    sim.add_argument("--sweep", action="store_true",
                     help="find goodput instead (the benchmark's sweep + bisection on simulated runs): "
                          "request_goodput (joint) and request_goodput_phase")
    sim.add_argument("--sweep-rates", type=argtypes.rates, metavar="R1,R2,...", help="sweep ladder (default: 1/64 .. 64 req/s, x2 steps)")
    sim.add_argument("--sweep-rel-tol", type=argtypes.fraction, default=0.01, help="bisection stops within this of the bracket top")
    add_workload_args(sim, 1000)
    add_slo_args(sim)
    add_pd_decision_arg(sim, "always")
    sim.add_argument("--json", action="store_true", help="print one JSON line")
    sim.set_defaults(func=run_simulate)
    bench = subparsers.add_parser("bench-sim", help="measure simulator speed: requests simulated per wall second")
    bench.add_argument("--num-requests", type=argtypes.count, default=50000)
    bench.add_argument("--json", action="store_true")
    bench.set_defaults(func=run_bench_sim)


def sim_config(args: argparse.Namespace):
    from pdserve.sim.prefill_pool import PrefillPolicy
    from pdserve.sim.simulator import SimConfig
    from pdserve.sim.transfer import LinkSpec

    return SimConfig(
        mode=args.mode, replicas=args.replicas, prefill_replicas=args.prefill, decode_replicas=args.decode,
        prefill=PrefillPolicy(args.prefill_policy, args.max_prefill_batch, args.max_prefill_tokens),
        chunk_tokens=args.chunk_tokens, max_decode_seqs=args.max_seqs,
        link=LinkSpec(link_bytes_per_s(args.link_gbps), args.transfer, args.layers),
    )


def run_simulate(args: argparse.Namespace) -> int:
    from pdserve.bench.cli_args import workload_config
    from pdserve.bench.metrics import Slo, summarize
    from pdserve.sim.requests import build_requests
    from pdserve.sim.simulator import simulate

    if args.trace is None and args.input_len is None and args.input_dist is None:
        raise SystemExit("pdserve simulate: give --input-len, --input-dist or --trace")
    try:
        model = _latency_model(args)
        requests = build_requests(workload_config(args), prefix_cache=args.prefix_cache)
        if args.sweep:
            _emit(_sweep(args, requests, model), args.json)
            return 0
        started = time.perf_counter()
        router = _router(args, model)
        result = simulate(requests, args.rate, sim_config(args), model, decide=router)
        wall_s = time.perf_counter() - started
    except ValueError as exc:
        raise SystemExit(f"pdserve simulate: {exc}") from exc
    report = summarize(result.records, Slo(args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3, args.attainment))
    report.update(num_arrived=result.num_arrived, num_finished=result.num_finished, num_rejected=result.num_rejected,
                  num_preempted=result.num_preempted, mean_transfer_exposed_ms=result.mean_transfer_exposed_s * 1e3,
                  offered_rate=args.rate, sim_wall_s=wall_s)
    if router is not None:
        report.update(pd_decision="margin", pd_local_requests=len(result.local_requests))
    _emit(report, args.json)
    return 0


def _latency_model(args: argparse.Namespace):
    """The --latency-model file, or the aic:... model of one --tp x --pp instance of --model."""
    from pdserve.latency.geometry import load_model_spec
    from pdserve.latency.spec import resolve_latency

    if args.tp < 1 or args.pp < 1:
        raise ValueError("--tp and --pp must be at least 1")
    fixed, family = resolve_latency(args.latency_model, load_model_spec(args.model) if args.model else None)
    return fixed if family is None else family(args.tp, args.pp)


def _router(args: argparse.Namespace, model):
    """A fresh margin router for one disaggregated run (None: every request handed off), priced as
    `pdserve serve --pd-profile` prices from this profile and --model's K/V geometry."""
    from pdserve.latency.geometry import load_model_spec
    from pdserve.search.margin_routing import MarginRouter, served_pricing

    if args.pd_decision != "margin" or args.mode != "disaggregated":
        return None
    if model.to_dict().get("kind") != "profiled" or not args.model:
        raise ValueError("--pd-decision margin needs a profiled --latency-model and --model (its K/V geometry)")
    cost, policy = served_pricing(load_model_spec(args.model), model.to_dict(), args.chunk_tokens)
    return MarginRouter(cost, policy, args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3)


def _sweep(args: argparse.Namespace, requests, model) -> dict:
    """Goodput of the simulated deployment under both definitions, with every measured point."""
    from pdserve.bench.goodput import geometric_ladder
    from pdserve.bench.metrics import Slo
    from pdserve.sim.goodput import goodput_rps
    from pdserve.sim.simulator import simulate

    if args.rate is not None:
        raise ValueError("--rate and --sweep are exclusive")
    if args.sweep_rates:
        ladder = tuple(sorted(set(args.sweep_rates)))
    else:
        ladder = geometric_ladder(1 / 64, 64.0)
    slo = Slo(args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3, args.attainment)
    config = sim_config(args)
    started = time.perf_counter()
    report: dict = {"slo_ttft_ms": args.slo_ttft_ms, "slo_tpot_ms": args.slo_tpot_ms, "attainment": args.attainment,
                    "num_requests": len(requests.prompt_tokens)}
    simulated: dict[float, list] = {}  # rate -> records, shared by both definitions' searches

    def run(rate: float) -> list:
        if rate not in simulated:
            simulated[rate] = simulate(requests, rate, config, model, decide=_router(args, model)).records
        return simulated[rate]

    for definition, key in (("joint", "request_goodput"), ("phase", "request_goodput_phase")):
        found = goodput_rps(run, slo, ladder, definition, rel_tol=args.sweep_rel_tol)
        report[key] = found.rate
        report[f"{key}_saturated"] = found.saturated
        report.setdefault("points", {}).update(
            {f"{rate:.6g}": {"ttft": a.ttft, "tpot": a.tpot, "joint": a.joint} for rate, a in sorted(found.points.items())})
    report["sim_wall_s"] = time.perf_counter() - started
    return report


def run_bench_sim(args: argparse.Namespace) -> int:
    from pdserve.sim.benchsim import bench_sim

    _emit(bench_sim(args.num_requests), args.json)
    return 0


def _emit(report: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(report))
        return
    for key, value in report.items():
        shown = f"{value:.4g}" if isinstance(value, float) else value
        print(f"{key:<28}{shown}")
