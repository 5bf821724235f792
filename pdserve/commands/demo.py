"""`pdserve demo`: start a local disaggregated cluster, drive it over HTTP, check exactness.

What it does, in order:
1. starts the cluster (1 prefill + 1 decode by default) behind the OpenAI-compatible API;
2. sends a mixed, seeded workload (prompt lengths, output lengths, greedy and sampled requests)
   concurrently with streaming, recording TTFT and TPOT per request;
3. starts the colocated baseline on the same engine and sends the same requests;
4. checks that every disaggregated completion equals the colocated one token for token, and
   prints a summary (or one JSON line with --json).
"""

from __future__ import annotations

import argparse
import json
import sys

from pdserve import argtypes
from pdserve.commands.serve import add_cluster_args


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("demo", help="run a mixed workload on a local P/D cluster and check it against colocated")
    add_cluster_args(p)
    p.add_argument("--num-requests", type=argtypes.int_in(1, 10_000), default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON line")
    p.set_defaults(func=run, pd_decision="always")  # the demo exercises the handoff: every request takes it


def run(args: argparse.Namespace) -> int:
    import asyncio

    from pdserve.commands.serve import serve_config
    from pdserve.api.exercises.demo import DemoSpec, run_demo

    from pdserve.api.preflight import check_local
    from pdserve.ports import free_local_port

    try:
        config = serve_config(args, port=free_local_port())  # run_* serves on a free port of its own
        config.shape()
        check_local(config)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    summary = asyncio.run(run_demo(config, DemoSpec(num_requests=args.num_requests, seed=args.seed)))
    if args.json:
        print(json.dumps(summary))
    else:
        _print(summary)
    return 0 if summary["failed"] == 0 and summary["exact_match"] else 1


def _print(s: dict) -> None:
    print(f"completed {s['completed']}  failed {s['failed']}  exact matches {s['num_exact']}/{s['completed']} "
          f"(exact_match={s['exact_match']})")
    print(f"TTFT ms  p50 {s['ttft_ms']['p50']:.1f}  p90 {s['ttft_ms']['p90']:.1f}")
    print(f"TPOT ms  p50 {s['tpot_ms']['p50']:.1f}  p90 {s['tpot_ms']['p90']:.1f}")
    print(f"K/V bytes moved {s['kv_bytes']:,}  exposed transfer p50 {s['exposed_transfer_ms']['p50']:.2f} ms")
