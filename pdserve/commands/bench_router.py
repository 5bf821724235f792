"""`pdserve bench-router`: router decision overhead (p50/p99 microseconds per decision).

Two measurements per policy and cluster size, on seeded random loads and prefix sets:
    policy  the policy function alone over a ready snapshot
    route   `Router.route` end to end: snapshot refresh after a load report, policy, holds, plan
Each is timed twice: wall clock, and this thread's CPU time (which excludes time the OS gave to
other processes, so it is the stabler number on a shared machine).
Target: route p99 <= 200 us at 64 prefill x 64 decode workers.
"""

from __future__ import annotations

import argparse
import json
import random
import time

SIZES = ((8, 8), (64, 64))
TARGET_P99_US = 200.0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench-router", help="router decision overhead microbenchmark")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    parser.add_argument("--decisions", type=int, default=2000, help="timed decisions per policy and size")
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    rows = [row for size in SIZES for row in bench_size(*size, args.decisions, args.seed)]
    if args.json:
        print(json.dumps({"target_p99_us": TARGET_P99_US, "results": rows}, indent=2))
    else:
        print(f"{'cluster':>7} {'policy':>12} {'what':>6} {'p50_us':>8} {'p99_us':>8} {'cpu_p50_us':>10} {'cpu_p99_us':>10}")
        for r in rows:
            times = f"{r['p50_us']:8.1f} {r['p99_us']:8.1f} {r['cpu_p50_us']:10.1f} {r['cpu_p99_us']:10.1f}"
            print(f"{r['cluster']:>7} {r['policy']:>12} {r['what']:>6} {times}")
    return 0


def bench_size(num_prefill: int, num_decode: int, decisions: int, seed: int) -> list[dict]:
    from pdserve.router.policies import POLICIES

    rows = []
    for mode in ("disaggregated", "colocated"):
        for policy in POLICIES:
            cluster = f"{num_prefill}x{num_decode}" if mode == "disaggregated" else f"co{num_prefill}"
            for what, (wall, cpu) in _measure(num_prefill, num_decode, policy, mode, decisions, seed).items():
                stats = {**_stats(wall, ""), **_stats(cpu, "cpu_")}
                rows.append({"cluster": cluster, "mode": mode, "policy": policy, "what": what, **stats})
    return rows


def _measure(num_prefill: int, num_decode: int, policy: str, mode: str, decisions: int, seed: int) -> dict:
    from pdserve.router.policies import POLICIES, PolicyContext
    from pdserve.router.synthetic import random_load, random_router

    router, workload = random_router(seed, num_prefill, num_decode, policy, colocated=mode == "colocated")
    rng = random.Random(seed + 1)
    requests = [workload.request(rng, f"r{i}") for i in range(decisions)]
    snapshot, ctx = router.snapshot(), PolicyContext(router.config.cost, 5.0, 0.05)
    policy_ns: tuple[list[int], list[int]] = ([], [])
    for request in requests:
        with _timed(policy_ns):
            POLICIES[policy](snapshot, request, ctx)
    worker_ids = snapshot.prefill.worker_ids + (() if snapshot.colocated else snapshot.decode.worker_ids)
    route_ns: tuple[list[int], list[int]] = ([], [])
    for request in requests:
        router.report_load(rng.choice(worker_ids), 1, random_load(rng, 20_000, None))
        with _timed(route_ns):
            result = router.route(request)
        if hasattr(result, "decode_hold"):
            router.complete(request.request_id)
    router.assert_no_leaks()
    return {"policy": policy_ns, "route": route_ns}


class _timed:
    """Appends (wall ns, thread CPU ns) of the block to two lists."""

    def __init__(self, out: tuple[list[int], list[int]]):
        self.out = out

    def __enter__(self) -> None:
        self.wall, self.cpu = time.perf_counter_ns(), time.thread_time_ns()

    def __exit__(self, *exc: object) -> None:
        self.out[1].append(time.thread_time_ns() - self.cpu)
        self.out[0].append(time.perf_counter_ns() - self.wall)


def _stats(samples_ns: list[int], prefix: str) -> dict:
    ordered = sorted(samples_ns)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1000.0  # noqa: E731
    return {f"{prefix}p50_us": pick(0.50), f"{prefix}p99_us": pick(0.99)}
