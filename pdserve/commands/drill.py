"""`pdserve drill`: disable, enable and roll back disaggregation under steady load; report how
every request ended and how long each admin operation took.

Prints one JSON object (see pdserve/api/exercises/drill.py). Exit status 1 when an admin call failed, any
request hung or was cut, or anything leaked.
"""

from __future__ import annotations

import argparse
import json
import sys

from pdserve import argtypes
from pdserve.commands.serve import add_cluster_args


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("drill", help="disable / enable / roll back disaggregation under load (release drill)")
    add_cluster_args(p)
    p.add_argument("--minutes", type=argtypes.positive, default=4.0, help="how long the load runs (operations at 1/4, 1/2, 3/4)")
    p.add_argument("--rate", type=argtypes.positive, default=1.0, help="requests per second (Poisson)")
    p.add_argument("--max-in-flight", type=argtypes.positive_int, default=16)
    p.add_argument("--hang-s", type=argtypes.positive, default=60.0, help="a stream silent this long counts as hung")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=run, pd_decision="always")  # every request takes the handoff until the switch


def run(args: argparse.Namespace) -> int:
    import asyncio

    from pdserve.api.exercises.chaos import ChaosSpec
    from pdserve.api.exercises.drill import healthy, run_drill
    from pdserve.commands.serve import serve_config

    from pdserve.api.preflight import check_local
    from pdserve.ports import free_local_port

    try:
        config = serve_config(args, port=free_local_port())  # run_* serves on a free port of its own
        config.shape()
        check_local(config)
        if config.mode != "disaggregated":
            raise ValueError("the drill switches disaggregation: use --mode disaggregated")
        spec = ChaosSpec(duration_s=args.minutes * 60, kill_every_s=args.minutes * 60, rate=args.rate,
                         max_in_flight=args.max_in_flight, hang_s=args.hang_s, seed=args.seed)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    report = asyncio.run(run_drill(config, spec))
    print(json.dumps(report))
    return 0 if healthy(report) else 1
