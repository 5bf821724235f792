"""`pdserve chaos`: kill -9 and SIGSTOP random workers under steady load and count how every
request ended.

Prints one JSON object: requests completed / ended with an explicit error / hung / silently cut,
kills, stops and restarts, whether every killed worker (and every one stopped past the heartbeat
timeout) came back under a newer epoch, workers FAILED by the crash-loop limit, and the pools or
router holds left unreleased (see pdserve/api/exercises/chaos.py). Exit status 1 when any request hung or
was cut, anything leaked, or a struck worker did not come back.
"""

from __future__ import annotations

import argparse
import json
import sys

from pdserve import argtypes
from pdserve.commands.serve import add_cluster_args


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("chaos", help="kill -9 and SIGSTOP random workers under steady load; report how every "
                                            "request ended")
    add_cluster_args(p)
    p.add_argument("--minutes", type=argtypes.positive, default=10.0, help="how long the load runs")
    p.add_argument("--kill-every", type=argtypes.positive, default=20.0, help="seconds between faults")
    p.add_argument("--faults", default="kill,stop",
                   help="faults struck in turn: kill (kill -9), stop (SIGSTOP, SIGCONT --stop-s later)")
    p.add_argument("--stop-s", type=argtypes.positive, default=15.0,
                   help="how long a stopped worker stays stopped (past --heartbeat-timeout-s it is replaced)")
    p.add_argument("--rate", type=argtypes.positive, default=1.0, help="requests per second (Poisson)")
    p.add_argument("--max-in-flight", type=argtypes.positive_int, default=16)
    p.add_argument("--hang-s", type=argtypes.positive, default=60.0, help="a stream silent this long counts as hung")
    p.add_argument("--seed", type=int, default=0)
    # kills land mid-handoff too: every request takes it; the soak's own strikes are not a crash loop,
    # so a worker struck often within the window is not FAILED unless --max-crashes asks for it
    p.set_defaults(func=run, pd_decision="always", max_crashes=100)


def run(args: argparse.Namespace) -> int:
    import asyncio

    from pdserve.api.exercises.chaos import ChaosSpec, run_chaos
    from pdserve.commands.serve import serve_config

    from pdserve.api.preflight import check_local
    from pdserve.ports import free_local_port

    try:
        config = serve_config(args, port=free_local_port())  # run_* serves on a free port of its own
        config.shape()
        check_local(config)
        spec = ChaosSpec(duration_s=args.minutes * 60, kill_every_s=args.kill_every, rate=args.rate,
                         max_in_flight=args.max_in_flight, hang_s=args.hang_s, seed=args.seed,
                         faults=tuple(f for f in args.faults.split(",") if f), stop_s=args.stop_s)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.no_restart:
        print("error: chaos needs worker restarts (drop --no-restart)", file=sys.stderr)
        return 2
    report = asyncio.run(run_chaos(config, spec))
    print(json.dumps(report))
    return 0 if healthy(report) else 1


def healthy(report: dict) -> bool:
    return (report["hung"] == 0 and report["cut"] == 0 and not report["leaked_workers"] and report["router_holds_clean"]
            and report["all_replaced"])
