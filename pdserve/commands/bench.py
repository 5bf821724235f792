"""`pdserve bench` and `pdserve bench compare`: two-clock goodput against OpenAI-compatible servers.

Registration is argparse only; the benchmark code is imported by the handlers.
"""

from __future__ import annotations

import argparse
import os

from pdserve import argtypes

DESCRIPTION = """\
Replay a seeded workload against an OpenAI-compatible endpoint (streaming /v1/completions or
/v1/chat/completions) and report TTFT/TPOT percentiles, SLO attainment (TTFT alone, TPOT alone,
both per request) and, with --sweep, goodput: the largest offered rate whose attainment is >= p,
for the joint definition (request_goodput) and the separate-phase DistServe definition
(request_goodput_phase). `pdserve bench compare --endpoint-a A --endpoint-b B ...` runs the same
workload against two endpoints, interleaved, and reports ratios.
"""

EPILOG = """\
length SPEC: fixed:N | uniform:LO,HI (inclusive) | normal:MEAN,STD | lognormal:MU,SIGMA (of the
  log); samples are rounded and clipped to >= 1. Example: --input-dist uniform:1000,2000
trace FILE: JSON lines with "prompt" (text) or "prompt_len", "output_len", optional "arrival_s".
prompt lengths: text prompts assume --tokenizer-bytes-per-token bytes per token (default 1: a
  byte-level tokenizer, as pdserve's default model) plus --bos-tokens added by the server;
  --prompt-format ids sends token ids instead (exact lengths; ids are the bytes of 'a'..'z').
definitions: percentiles by numpy linear interpolation; latency statistics over successful
  requests; attainment over all measured requests (failures miss both clocks); TPOT =
  (E2E - TTFT)/(output tokens - 1), single-token outputs count as meeting TPOT; --warmup-s and
  --cooldown-s drop requests by scheduled arrival time and the report states the denominator.
"""


def register(subparsers) -> None:
    """Add `bench` (with its nested `compare`)."""
    bench = subparsers.add_parser(
        "bench", help="two-clock goodput benchmark", description=DESCRIPTION, epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_argument("--endpoint", help="base URL, e.g. http://127.0.0.1:8000")
    bench.add_argument("--model", help="model name (default: first of GET /v1/models)")
    add_run_args(bench)
    bench.set_defaults(func=run_bench_command)
    nested = bench.add_subparsers(dest="bench_command", metavar="{compare}")
    compare = nested.add_parser(
        "compare", help="same seeded workload against two endpoints, interleaved",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    compare.add_argument("--endpoint-a", required=True, help="base URL of system A (the baseline)")
    compare.add_argument("--endpoint-b", required=True, help="base URL of system B")
    compare.add_argument("--model-a", help="model at A (default: first of its /v1/models)")
    compare.add_argument("--model-b", help="model at B (default: first of its /v1/models)")
    compare.add_argument("--repeats", type=argtypes.positive_int, default=2, help="fixed-rate rounds, ABBA order (default 2)")
    add_run_args(compare)
    compare.set_defaults(func=run_compare_command)


def add_run_args(parser: argparse.ArgumentParser) -> None:
    """Workload, load, SLO and output options shared by `bench` and `bench compare`."""
    _add_client_args(parser.add_argument_group("client"))
    _add_load_args(parser.add_argument_group("load"))
    _add_workload_args(parser.add_argument_group("workload"))
    slo = parser.add_argument_group("SLO")
    slo.add_argument("--slo-ttft-ms", type=argtypes.positive, help="TTFT threshold (ms), required")
    slo.add_argument("--slo-tpot-ms", type=argtypes.positive, help="TPOT threshold (ms), required")
    slo.add_argument("--attainment", type=argtypes.fraction, default=0.9, help="required attainment p (default 0.9)")
    out = parser.add_argument_group("output")
    out.add_argument("--json", dest="json_path", type=argtypes.output_file, metavar="PATH", help="write the JSON report here")
    out.add_argument("--plot-dir", metavar="DIR", help="write PNG plots here")
    out.add_argument("--include-records", action="store_true", help="add per-request records to the JSON")
    out.add_argument("--quiet", action="store_true", help="no progress bar")


def _add_client_args(group) -> None:
    group.add_argument("--api", choices=("completions", "chat"), default="completions")
    group.add_argument("--http-client", choices=("raw", "httpx"), default="raw",
                       help="raw: minimal asyncio HTTP/1.1 client (lowest overhead, default); httpx")
    group.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer token ($OPENAI_API_KEY)")
    group.add_argument("--request-timeout-s", type=argtypes.positive, default=600.0)
    group.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos")
    group.add_argument("--max-tokens", type=argtypes.tokens, default=None, metavar="N",
                       help="ask every request for N tokens and end it at its own (trace) length with pdserve's "
                            "scripted_eos_tokens, as a model's EOS would: the server reserves for N")


def _add_load_args(group) -> None:
    group.add_argument("--num-requests", type=argtypes.int_in(0, argtypes.MAX_COUNT), default=0, help="requests per run (a trace: default all lines)")
    group.add_argument("--rate", type=argtypes.rate, help="offered rate, req/s ('inf' sends all at once)")
    group.add_argument("--max-concurrency", type=argtypes.positive_int, default=None, metavar="N",
                       help="at most N requests in flight; a request due while N are waits for one to end "
                            "(with --rate inf: a closed loop of N clients, as vllm bench serve --max-concurrency)")
    group.add_argument("--sweep", action="store_true", help="find goodput by a rate sweep plus bisection")
    group.add_argument("--sweep-rates", type=argtypes.rates, help="comma-separated ladder, e.g. 1,2,4,8 (default: geometric)")
    group.add_argument("--sweep-start", type=argtypes.positive, default=1.0, help="geometric ladder start (req/s)")
    group.add_argument("--sweep-max", type=argtypes.positive, default=256.0, help="geometric ladder end (req/s)")
    group.add_argument("--sweep-factor", type=_factor, default=2.0, help="geometric ladder factor")
    group.add_argument("--sweep-rel-tol", type=argtypes.fraction, default=0.05, help="bisection stops within this of the bracket top")
    group.add_argument("--max-bisections", type=argtypes.int_in(0, 64), default=6)
    group.add_argument("--arrival", choices=("poisson", "gamma", "constant", "trace"),
                       help="arrival process (default: trace times if the trace has them, else poisson)")
    group.add_argument("--burstiness", type=argtypes.positive, default=1.0,
                       help="gamma arrivals: coefficient of variation of gaps (1 = Poisson; vLLM's shape = 1/CV^2)")
    group.add_argument("--seed", type=int, default=0)
    group.add_argument("--warmup-s", type=argtypes.nonnegative, default=0.0, help="exclude requests scheduled before this")
    group.add_argument("--cooldown-s", type=argtypes.nonnegative, default=0.0, help="exclude requests scheduled in the last S seconds")


def _add_workload_args(group) -> None:
    source = group.add_mutually_exclusive_group()
    source.add_argument("--input-len", type=argtypes.tokens, help="fixed prompt length (tokens)")
    source.add_argument("--input-dist", metavar="SPEC", help="prompt length distribution")
    source.add_argument("--trace", metavar="FILE", help="JSON-lines trace")
    output = group.add_mutually_exclusive_group()
    output.add_argument("--output-len", type=argtypes.tokens, help="fixed output length (tokens)")
    output.add_argument("--output-dist", metavar="SPEC", help="output length distribution")
    group.add_argument("--num-conversations", type=argtypes.nonnegative_int, default=0, help="multi-turn: requests cycle over C conversations")
    group.add_argument("--shared-prefix-len", type=argtypes.int_in(0, argtypes.MAX_TOKENS), default=0, help="tokens of one system prefix shared by all")
    group.add_argument("--closed-loop", action="store_true",
                       help="multi-turn closed loop (bench/closed_loop.py): C conversations at once, each turn sent "
                            "after the previous answer, its prompt carrying that answer; needs --num-conversations, "
                            "--input-len, --output-len; reports TTFT per turn (no rate, no SLO)")
    group.add_argument("--num-turns", type=argtypes.positive_int, default=4, help="closed loop: turns per conversation")
    group.add_argument("--turn-len", type=argtypes.tokens, default=64, help="closed loop: new user tokens per later turn")
    group.add_argument("--prompt-format", choices=("text", "ids"), default="text")
    group.add_argument("--tokenizer-bytes-per-token", type=argtypes.positive, default=1.0)
    group.add_argument("--bos-tokens", type=argtypes.nonnegative_int, default=1, help="tokens the server adds to a text prompt")
    group.add_argument("--content-salt", type=int, default=0, metavar="K",
                       help="other prompt content, same lengths and arrivals (a sweep's later points add their index)")


def _factor(text: str) -> float:
    """`--sweep-factor`: a geometric ladder grows, so > 1."""
    value = argtypes.finite(text)
    if value <= 1:
        raise argparse.ArgumentTypeError(f"must be > 1, got {text!r}")
    return value


def run_bench_command(args: argparse.Namespace) -> int:
    """Handler of `pdserve bench`."""
    from pdserve.bench.app import run_bench
    from pdserve.bench import cli_args as bench_args

    if not args.endpoint:
        raise SystemExit("pdserve bench: --endpoint is required")
    if getattr(args, "closed_loop", False):
        return run_closed_loop_command(args)
    config = bench_args.bench_config(args, bench_args.endpoint_config(args, args.endpoint, args.model))
    outcome = run_bench(config)
    bench_args.emit(args, outcome.report, outcome, config.slo)
    return 0


def run_closed_loop_command(args: argparse.Namespace) -> int:
    """`pdserve bench --closed-loop`: multi-turn conversations, each turn carrying the last answer."""
    import json

    from pdserve.bench import cli_args as bench_args
    from pdserve.bench.closed_loop import ClosedLoopConfig, run_closed_loop, summarize_turns
    from pdserve.loop import run as run_loop

    if args.input_len is None or args.output_len is None or args.num_conversations < 1:
        raise SystemExit("pdserve bench --closed-loop: give --num-conversations, --input-len and --output-len")
    endpoint = bench_args.endpoint_config(args, args.endpoint, args.model)
    config = ClosedLoopConfig(args.num_conversations, args.num_turns, args.input_len, args.turn_len, args.output_len,
                              args.shared_prefix_len, args.tokenizer_bytes_per_token, args.seed)
    turns = run_loop(run_closed_loop(endpoint, config))
    report = {"closed_loop": config.__dict__, **summarize_turns(turns),
              "records": [{"conversation": t.conversation, "turn": t.turn, "ttft_s": t.record.ttft_s,
                           "e2e_s": t.record.e2e_s, "success": t.record.success, "error": t.record.error,
                           "prompt_tokens": t.record.prompt_tokens} for t in turns]}
    print(json.dumps({k: report[k] for k in ("turns", "later_turns", "failed")}, indent=1))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump(report, f, indent=1)
    return 0


def run_compare_command(args: argparse.Namespace) -> int:
    """Handler of `pdserve bench compare`."""
    from pdserve.bench.compare import CompareConfig, run_compare
    from pdserve.bench import cli_args as bench_args

    endpoint_a = bench_args.endpoint_config(args, args.endpoint_a, args.model_a)
    endpoint_b = bench_args.endpoint_config(args, args.endpoint_b, args.model_b)
    config = CompareConfig(bench_args.bench_config(args, endpoint_a), endpoint_a, endpoint_b, args.repeats)
    report = run_compare(config)
    bench_args.emit_compare(args, report)
    return 0
