"""`pdserve plan`: colocate or disaggregate, with which parallelism and how many replicas.

Searches colocated (replicas x TP/PP x chunk budget) and disaggregated (high and low node
affinity) deployments of a model on a GPU budget (or for a target rate) under TTFT and TPOT
SLOs, with the simulator and the benchmark's goodput search, and prints the decision (a table,
or one JSON line with --json). Progress goes to stderr. `--validate` runs the recommended and
runner-up configurations with the local runtime and the benchmark.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pdserve import argtypes
from pdserve.commands.simulate import add_pd_decision_arg, add_slo_args, add_workload_args, latency_model_arg

MAX_GPUS = 4096  # the search enumerates replicas per GPU: a budget of 10**18 never ends


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("plan", help="placement search: colocate or disaggregate, parallelism, replicas")
    p.add_argument("--model", required=True,
                   help="tiny | small | llama-13b-class | llama-70b-class | DIR | config.json | HF id aiconfigurator ships")
    p.add_argument("--hardware", default=None,
                   help="a100-80g | h100 | h200 | PROFILE.json (default: the aic system's, else a100-80g)")
    p.add_argument("--latency-model", type=latency_model_arg, metavar="FILE.json|aic:SYSTEM[:BACKEND[:VERSION]]|distserve:ENGINE:CHECKOUT",
                   help="FILE.json: this latency model (e.g. a profile fit) for tp1pp1 only; aic:h200_sxm (etc.): "
                        "aiconfigurator's measured step times for every TP x PP shape (pip install 'pdserve[aic]'); "
                        "distserve:distserve|vllm:CHECKOUT: DistServe's fitted A100 step times of its engine or of "
                        "vLLM 0.2, from a LLMServe/DistServe checkout (OPT-13B, OPT-66B)")
    p.add_argument("--gpus", type=argtypes.int_in(1, MAX_GPUS), required=True, help="GPU budget")
    p.add_argument("--gpus-per-node", type=argtypes.positive_int, help="override the hardware profile's GPUs per node")
    p.add_argument("--link-gbps", type=argtypes.positive, help="inter-node K/V link per GPU, Gbit/s (default: the profile's NIC)")
    p.add_argument("--target-rate", type=argtypes.positive, help="size replicas for this rate instead of filling the budget")
    p.add_argument("--margin", type=argtypes.nonnegative, default=0.1, help="disaggregate only if per-GPU goodput beats colocated by this fraction")
    p.add_argument("--definition", choices=("joint", "phase"), default="joint", help="goodput definition")
    p.add_argument("--chunk-budgets", type=_budgets, default=(256, 512, 1024, 2048), help="colocated chunk budgets to search")
    p.add_argument("--max-seqs", type=argtypes.positive_int, default=256, help="decode batch limit")
    p.add_argument("--colocated-scheduler", choices=("mixed", "prefill-first"), default="mixed",
                   help="colocated candidates: chunked prefill mixed with decode (default), or prefill-first "
                        "without mixing (vLLM 0.2, DistServe's baseline: whole prompts, up to the chunk budget, in "
                        "iterations of their own while decodes wait)")
    p.add_argument("--transfer", choices=("request", "layer"), default="layer", help="K/V transfer overlap")
    p.add_argument("--decode-token-cap", type=int, default=None, metavar="TOKENS",
                   help="hold a decode batch to this many tokens of context per pipeline stage (DistServe's search "
                        "uses 50000); default: the K/V that fits decides")
    p.add_argument("--prefill-batch", type=int, default=1, metavar="N",
                   help="prompts a prefill instance runs in one iteration (DistServe batches every queued prompt: "
                        "a large N); default 1, as the served prefill worker; needs --pd-decision always when > 1")
    add_pd_decision_arg(p, "margin")
    add_workload_args(p, 400)
    add_slo_args(p, required=True)
    p.add_argument("--json", action="store_true", help="print one JSON line")
    p.add_argument("--plot", type=argtypes.output_file, metavar="PATH", help="write a goodput-vs-rate PNG here")
    p.add_argument("--emit-config", type=argtypes.output_file, metavar="FILE.json",
                   help="write the chosen deployment as a serve configuration (`pdserve serve --config FILE`)")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr")
    p.add_argument("--validate", action="store_true", help="measure the top two configurations with the local runtime")
    v = p.add_argument_group("validation (--validate: the local runtime and `pdserve bench --sweep`)")
    v.add_argument("--serve-model", default=None,
                   help="model for the local server (default: the --latency-model profile's model, else small)")
    v.add_argument("--serve-dtype", choices=("bfloat16", "float32"), default=None,
                   help="server dtype (default: the --latency-model profile's dtype, else float32)")
    v.add_argument("--validate-rates", type=argtypes.rates, metavar="R1,R2,...",
                   help="bench sweep ladder for every configuration (default: 0.25/0.5/1/1.5 x each prediction)")
    v.add_argument("--validate-requests", type=argtypes.count, help="requests per bench run (default --num-requests)")
    v.add_argument("--validate-max-bisections", type=argtypes.nonnegative_int, default=1, help="bench bisections after the ladder (default 1)")
    v.add_argument("--validate-tolerance", type=argtypes.positive, default=None, metavar="T",
                   help="instead of a sweep, check |predicted - measured| <= T x measured with two bench runs per "
                        "configuration (at pred/(1+T) and pred/(1-T)); e.g. 0.15")
    v.add_argument("--validate-calibrate", nargs="?", const="burst", choices=("burst", "load"), default=None,
                   help="re-time the --latency-model profile against each running server and re-make the "
                        "prediction just before its benchmark: 'burst' (the default): bursts of one request per "
                        "worker at the workload's median lengths against the simulator's clocks for the same "
                        "burst; 'load': a Poisson replay of the workload on another seed at half the prediction, "
                        "compared request by request with the simulator's clocks for the same arrivals")
    v.add_argument("--validate-recalibrate", action="store_true",
                   help="with --validate-tolerance and --validate-calibrate: one server per configuration, a "
                        "calibration before each bench run, and each run held to the prediction for its own window "
                        "(the calibration carried over by the engine's step log: the machine drifts)")
    v.add_argument("--validate-max-points", type=int, default=4, metavar="N",
                   help="with --validate-recalibrate: bench points per configuration at most (default 4); each "
                        "point is held to the prediction for its own window, from the engine's step logs")
    v.add_argument("--validate-dir", metavar="DIR", help="keep each configuration's server log and bench report here")
    v.add_argument("--validate-max-workers", type=argtypes.positive_int, default=None,
                   help="skip configurations needing more worker processes (default: CPU count)")
    p.set_defaults(func=run_plan)


def _budgets(text: str) -> tuple[int, ...]:
    """`--chunk-budgets`: comma-separated token budgets, each >= 1."""
    budgets = tuple(argtypes.positive_int(x) for x in text.split(",") if x.strip())
    if not budgets:
        raise argparse.ArgumentTypeError(f"expected comma-separated token budgets, got {text!r}")
    return budgets


def plan_inputs(args: argparse.Namespace):
    import dataclasses

    from pdserve.bench.cli_args import workload_config
    from pdserve.bench.metrics import Slo
    from pdserve.latency.geometry import load_model_spec
    from pdserve.latency.hardware import load_hardware
    from pdserve.latency.spec import resolve_latency
    from pdserve.search.planner import PlanInputs

    if args.trace is None and (args.input_len is None and args.input_dist is None):
        raise SystemExit("pdserve plan: give --input-len/--input-dist and --output-len, or --trace")
    hardware = load_hardware(args.hardware or _hardware_of(args.latency_model))
    if args.gpus_per_node:
        hardware = dataclasses.replace(hardware, gpus_per_node=args.gpus_per_node)
    model = load_model_spec(args.model)
    fixed, family = resolve_latency(args.latency_model, model) if args.latency_model else (None, None)
    return PlanInputs(
        model=model, hardware=hardware, gpus=args.gpus, workload=workload_config(args),
        slo=Slo(args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3, args.attainment), target_rps=args.target_rate,
        link_bytes_per_s=args.link_gbps * 1e9 / 8 if args.link_gbps else None,
        chunk_budgets=args.chunk_budgets,
        definition=args.definition, margin=args.margin, max_seqs=args.max_seqs, transfer_overlap=args.transfer,
        fixed_model=fixed, family=family, prefix_cache=args.prefix_cache,
        mixed_batches=args.colocated_scheduler == "mixed", pd_decision=args.pd_decision,
        decode_token_cap=args.decode_token_cap, prefill_max_batch=args.prefill_batch,
        latency_label=args.latency_model if family else ("file" if fixed else "roofline"),
    )


# what a plan does not decide: the server's defaults apply (listed in the file's source.undecided)
UNDECIDED = ("policy", "reserve", "prefill_runahead", "compute_dtype")


def serve_config_of(result, model: str) -> dict:
    """The deployment the plan chose, as a serve configuration (commands/deploy_config.py):
    `model` is what the plan was made for (the plan's --model)."""
    inputs = result.inputs
    common = {"model": model, "dtype": "bfloat16" if inputs.model.geometry.dtype_bytes == 2 else "float32",
              "max_num_seqs": inputs.max_seqs,
              "source": {"decision": result.decision, "gpus": inputs.gpus, "latency_model": inputs.latency_label,
                         "undecided": list(UNDECIDED)}}
    if result.decision == "colocate" and result.colocated is not None:
        colo = result.colocated
        return {"mode": "colocated", "replicas": colo.replicas, "tp": colo.score.par.tp, "pp": colo.score.par.pp,
                "max_num_batched_tokens": colo.score.chunk_tokens or None, **common}
    dis = result.disaggregated
    return {"mode": "disaggregated", "prefill": dis.n_prefill, "decode": dis.n_decode, "pd_decision": result.pd_decision,
            "max_num_batched_tokens": inputs.pd_chunk_tokens,  # the step budget the decision was priced with
            "prefill_tp": dis.prefill.par.tp, "prefill_pp": dis.prefill.par.pp, "decode_tp": dis.decode.par.tp,
            "decode_pp": dis.decode.par.pp, **common}


def _hardware_of(latency_model: str | None) -> str:
    """The built-in hardware profile (node size, NIC) matching an aic system; a100-80g otherwise."""
    from pdserve.latency.aic import HARDWARE_OF, AicSpec

    if not latency_model or not latency_model.startswith("aic:"):
        return "a100-80g"
    system = AicSpec.parse(latency_model).system
    if system not in HARDWARE_OF:
        raise ValueError(f"no built-in hardware profile for aic system {system!r}: give --hardware "
                         f"({', '.join(sorted(HARDWARE_OF))} have one)")
    return HARDWARE_OF[system]


def run_plan(args: argparse.Namespace) -> int:
    from pdserve.search.plan_report import plan_summary, plan_table, plot_plan
    from pdserve.search.planner import plan

    progress = (lambda _m: None) if args.quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    try:
        result = plan(plan_inputs(args), progress)
    except ValueError as exc:
        raise SystemExit(f"pdserve plan: {exc}") from exc
    summary = plan_summary(result)
    if args.plot:
        plot_plan(result, args.plot)
    if args.emit_config:
        from pdserve.commands import deploy_config

        deploy_config.write(args.emit_config, serve_config_of(result, args.model))
    if args.validate:
        summary["validation"] = _validate(args, result, summary)
    print(json.dumps(summary) if args.json else plan_table(summary))
    return 0


def _validate(args: argparse.Namespace, result, summary: dict) -> list[dict]:
    import os

    from pdserve.validate.plan_calibrator import live_model, plan_calibrator
    from pdserve.search.planner import sample_goodput
    from pdserve.validate.run import validate
    from pdserve.validate.runtime import LocalConfig

    meta = _profile_meta(args.latency_model)
    model = args.serve_model or meta.get("model") or "small"
    dtype = args.serve_dtype or meta.get("dtype") or "float32"
    # the simulator routes round-robin, so the server does too
    serve = ["--dtype", dtype, "--max-num-seqs", str(args.max_seqs), "--policy", "round_robin", *_engine_args_of(meta)]
    num_requests = args.validate_requests or args.num_requests
    configs = []
    for name, plan_ in _ranked(result):
        simulated = (summary.get(name) or {}).get("simulated_goodput_rps")
        sample = sample_goodput(result.inputs, plan_, num_requests).rate
        if name == "colocated":  # the plan's chunk budget; disaggregated: the profile's prefill chunking
            chunk = _budget_args(plan_.score.chunk_tokens)
            configs.append(LocalConfig(name, "colocated", replicas=plan_.replicas, predicted_goodput_rps=plan_.goodput_rps,
                                       simulated_goodput_rps=simulated, sample_goodput_rps=sample,
                                       extra_serve_args=(*serve, *chunk)))
        else:
            chunk = _budget_args(meta.get("chunk_tokens"))
            chunk += ["--pd-decision", result.pd_decision]  # the routing the plan simulated, timed by the same profile
            chunk += ["--pd-profile", args.latency_model] if result.pd_decision == "margin" else []
            configs.append(LocalConfig(name, "disaggregated", prefill=plan_.n_prefill, decode=plan_.n_decode,
                                       predicted_goodput_rps=plan_.goodput_rps, simulated_goodput_rps=simulated,
                                       sample_goodput_rps=sample, extra_serve_args=(*serve, *chunk)))
    workload = _workload_args(args)
    bench = ["--num-requests", str(num_requests), "--slo-ttft-ms", str(args.slo_ttft_ms),
             "--slo-tpot-ms", str(args.slo_tpot_ms), "--attainment", str(args.attainment), "--seed", str(args.seed),
             "--max-bisections", str(args.validate_max_bisections), "--prompt-format", "ids", *workload]
    rates = list(args.validate_rates) if args.validate_rates else None
    limit = args.validate_max_workers or os.cpu_count() or 1
    progress = (lambda _m: None) if args.quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    runnable = [c for c in configs if c.workers <= limit]
    calibrator = plan_calibrator(result, num_requests, args.validate_calibrate, workload) if args.validate_calibrate else None
    if args.validate_recalibrate and (args.validate_tolerance is None or calibrator is None):
        raise SystemExit("pdserve plan: --validate-recalibrate needs --validate-tolerance and --validate-calibrate")
    if args.validate_max_points < 1:
        raise SystemExit("pdserve plan: --validate-max-points must be at least 1")
    live = live_model(result, num_requests) if args.validate_recalibrate else None
    rows = validate(runnable, model, bench, rates, progress, tolerance=args.validate_tolerance, calibrator=calibrator,
                    keep_dir=Path(args.validate_dir) if args.validate_dir else None,
                    recalibrate=args.validate_recalibrate, live=live, max_points=args.validate_max_points)
    for c in configs:
        if c.workers > limit:
            rows.append({"name": c.name, "mode": c.mode, "layout": c.layout, "workers": c.workers,
                         "predicted_goodput_rps": c.predicted_goodput_rps, "simulated_goodput_rps": c.simulated_goodput_rps,
                         "error": f"skipped: needs {c.workers} worker processes, limit {limit} (--validate-max-workers)"})
    return rows


def _workload_args(args) -> list[str]:
    """The bench flags that give the plan's workload (lengths, arrivals, prefixes), seed aside."""
    workload = ["--arrival", args.arrival, "--burstiness", str(args.burstiness)] if args.arrival else []
    if args.trace:
        workload += ["--trace", args.trace]
    else:
        workload += ["--input-dist", args.input_dist] if args.input_dist else ["--input-len", str(args.input_len)]
        workload += ["--output-dist", args.output_dist] if args.output_dist else ["--output-len", str(args.output_len)]
    if args.shared_prefix_len:
        workload += ["--shared-prefix-len", str(args.shared_prefix_len)]
    if args.num_conversations:
        workload += ["--num-conversations", str(args.num_conversations)]
    return workload


def _budget_args(tokens) -> list[str]:
    return ["--max-num-batched-tokens", str(int(tokens))] if tokens else []


def _engine_args_of(meta: dict) -> list[str]:
    """Serve flags that make the server's engine match the profiled one (numerics, chunking)."""
    extra = ["--kv-cache-mb", str(int(meta["kv_cache_mb"]))] if meta.get("kv_cache_mb") else []
    if meta.get("compute_dtype"):
        extra += ["--compute-dtype", str(meta["compute_dtype"])]
    if meta.get("batch_invariant") is False:
        extra.append("--no-batch-invariant")
    return extra


def _profile_meta(path: str | None) -> dict:
    if not path:
        return {}
    try:
        with open(path) as f:
            return json.load(f).get("meta") or {}
    except (OSError, ValueError):
        return {}


def _ranked(result) -> list[tuple[str, object]]:
    """(name, plan) of the recommendation first, then the runner-up (the other kind)."""
    plans = [("colocated", result.colocated), ("disaggregated", result.disaggregated)]
    if result.decision == "disaggregate":
        plans.reverse()
    return [(n, p) for n, p in plans if p is not None]
