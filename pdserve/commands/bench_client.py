"""`pdserve bench-client`: check that the benchmark client is not the bottleneck.

Starts the stand-in server in its own process, replays an open-loop load against it, and reports
percentiles of (client-measured TTFT - server-side TTFT) and of (client TTFT - nominal delay).
"""

from __future__ import annotations

import argparse


def register(subparsers) -> None:
    """Add `bench-client`."""
    parser = subparsers.add_parser("bench-client", help="measure the benchmark client's own TTFT error")
    parser.add_argument("--rate", type=float, default=200.0, help="offered rate, req/s (default 200)")
    parser.add_argument("--num-requests", type=int, default=2000)
    parser.add_argument("--first-token-ms", type=float, default=20.0, help="stand-in's first-token delay")
    parser.add_argument("--inter-token-ms", type=float, default=5.0)
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--arrival", choices=("poisson", "constant"), default="poisson")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", dest="json_path", metavar="PATH", help="write the report here")
    parser.add_argument("--quiet", action="store_true")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Handler: run the check, print it, optionally write JSON; exit 1 if p99 error > 1 ms."""
    from pdserve.bench.report import write_json
    from pdserve.bench.selfcheck import ClientCheckConfig, check_client

    config = ClientCheckConfig(
        rate=args.rate, num_requests=args.num_requests, input_len=args.input_len, output_len=args.output_len,
        first_token_s=args.first_token_ms / 1e3, inter_token_s=args.inter_token_ms / 1e3,
        arrival=args.arrival, seed=args.seed,
    )
    report = check_client(config, quiet=args.quiet)
    for key, value in report.items():
        print(f"{key:<32}{value}")
    if args.json_path:
        write_json(args.json_path, report)
    return 0 if report["within_1ms_at_p99"] else 1
