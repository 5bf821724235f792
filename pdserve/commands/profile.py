"""`pdserve profile`: time our engine on this machine and save a fitted latency model JSON.

The JSON (kind "profiled") is what `pdserve simulate --latency-model` and
`pdserve plan --latency-model` read. `--quick` measures a handful of points on the tiny model.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("profile", help="measure the engine and fit a latency model (JSON)")
    p.add_argument("--model", default=None, help="tiny | small | checkpoint dir (default small; tiny with --quick)")
    p.add_argument("--out", required=True, metavar="FILE.json", help="where to write the fitted model")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    p.add_argument("--quick", action="store_true", help="a few points only (tests)")
    p.add_argument("--repeats", type=int, help="timings per point (median after one warm-up)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="engine dtype; profile with the dtype you will serve with")
    p.set_defaults(func=run_profile_command)


def run_profile_command(args: argparse.Namespace) -> int:
    import dataclasses

    from pdserve.sim.engine_profile import ProfilePlan, run_profile

    plan = ProfilePlan.quick(args.model or "tiny", args.threads, dtype=args.dtype) if args.quick else ProfilePlan(
        model=args.model or "small", threads=args.threads, dtype=args.dtype)
    if args.repeats:
        plan = dataclasses.replace(plan, repeats=args.repeats)
    model = run_profile(plan)
    Path(args.out).write_text(json.dumps(model.to_dict(), indent=2) + "\n")
    print(json.dumps({"out": args.out, "prefill_coef": model.prefill_coef, "decode_coef": model.decode_coef}))
    return 0
