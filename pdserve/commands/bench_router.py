"""`pdserve bench-router`: router decision overhead (p50/p99 microseconds per decision).

Two measurements per policy and cluster size, on seeded random loads and prefix sets:
    policy  the policy function alone over a ready snapshot
    route   `Router.route` end to end: snapshot refresh after a load report, policy, holds, plan
Each is timed twice: wall clock, and this thread's CPU time (which excludes time the OS gave to
other processes, so it is the stabler number on a shared machine). The whole measurement is
repeated `--runs` times (fresh cluster, same seed); a row reports the median over runs of each
run's p50 and p99, and the per-run p99s, because a shared machine's speed drifts between runs.
The timed loops run with the start-up heap frozen (`pdserve.heap.frozen_heap`), as the serving
process does once its workers have registered.
Target: route p99 <= 200 us at 64 prefill x 64 decode workers.

Block events (`--kv-events N`, N events per worker report; 0 skips it): at 64 x 64, `route`
timed in three arms interleaved decision by decision, so all see the same machine: `quiet`
(nothing before it), `events` (one worker report arrives before the route and is handled as the
serving process handles it: its events converted from the heartbeat's engine form, queued, and
applied by the applier's turn, router/kv/kv_inbox.py and frontend_upkeep.apply_kv_slice; stored,
removed, demoted to and promoted from a host tier, so the prefix policy also prices host-tier
hits; synthetic.EventFlow) and `control` (the same handling into a detached router built alike:
the cost of that work in the thread, with the routing router's state untouched); `kv_apply` is
the applier's turn. One report per route is 512 routes/s against 128 workers heartbeating every
0.25 s; the reports are made before the timed loop (they are the workers' work, not the router's).
Target: route p99 with events <= 1.2 x without (`p99/quiet`).

Membership changes (`--membership`, on by default): at 64 prefill x 64 decode workers, each
holding 4,096 distinct blocks in the cluster K/V index (its bound, 128 x 4,096 entries), a decode
worker restarts (deregistered, registered under its next epoch, its resync applied) and another
moves to the prefill role (drained, registered as prefill under its next epoch, resync applied),
with a route after each step (the snapshot's rebuild for the new membership). Each step is one
synchronous call on the router's event loop; the figure is the longest (`stall_ms`).
Target: no step above 50 ms.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

SIZES = ((8, 8), (64, 64))
TARGET_P99_US = 200.0
TARGET_EVENTS_RATIO = 1.2
EVENTS_SIZE = (64, 64)
MEMBERSHIP_SIZE, MEMBERSHIP_BLOCKS = (64, 64), 4096
TARGET_STALL_MS = 50.0


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench-router", help="router decision overhead microbenchmark")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    parser.add_argument("--decisions", type=int, default=2000, help="timed decisions per policy and size")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--runs", type=int, default=5, help="repeat the whole measurement; rows report medians")
    parser.add_argument("--kv-events", type=int, default=64,
                        help="block events per worker report for the route-with-events comparison at 64x64 (0: skip)")
    parser.add_argument("--no-membership", dest="membership", action="store_false",
                        help="skip the restart / role-move stall measurement at 128 workers x 4,096 blocks")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pdserve.router import kernels

    if args.runs < 1 or args.decisions < 1:
        raise SystemExit("bench-router: --runs and --decisions must be at least 1")
    kernels.warm_up()
    runs = [[row for size in SIZES for row in bench_size(*size, args.decisions, args.seed)] for _ in range(args.runs)]
    rows = [_median_row(same) for same in zip(*runs)]
    events = bench_events(args) if args.kv_events > 0 else []
    membership = bench_membership(args.seed) if args.membership else None
    if args.json:
        report = {"target_p99_us": TARGET_P99_US, "runs": args.runs, "compiled_kernels": kernels.enabled, "results": rows,
                  "kv_events": {"events_per_report": args.kv_events, "target_ratio": TARGET_EVENTS_RATIO, "results": events}}
        if membership is not None:
            report["membership"] = membership
        print(json.dumps(report, indent=2))
        return 0
    _print_table(args.runs, kernels.enabled, rows)
    if events:
        _print_events(args.kv_events, events)
    if membership is not None:
        _print_membership(membership)
    return 0


def _print_membership(result: dict) -> None:
    print(f"\nmembership change at {result['workers']} workers x {result['blocks_per_worker']} blocks "
          f"(index memory {result['kv_index_memory_bytes'] / 2**20:.1f} MiB): longest step (ms)")
    for kind in ("restart", "role_move"):
        steps = " ".join(f"{name}={ms:.1f}" for name, ms in result[kind].items())
        print(f"{kind:>10} {steps}")
    print(f"{'stall_ms':>10} {result['stall_ms']:.1f} (target <= {TARGET_STALL_MS:.0f})")


def bench_membership(seed: int) -> dict:
    """Each step of a restart and a role move, timed as one call on the router (ms)."""
    from pdserve.router.config import Mode, RouterConfig
    from pdserve.router.kv.kv_index import KvDelta
    from pdserve.router.messages import Role, WorkerInfo, WorkerLoad
    from pdserve.router.router import Router
    from pdserve.router.synthetic import ABI, MODEL, Workload

    num_prefill, num_decode = MEMBERSHIP_SIZE
    router = Router(RouterConfig(Mode.DISAGGREGATED, MODEL, ABI, policy="prefix", ttft_slo_s=5.0, tpot_slo_s=0.05))
    rng, workload = random.Random(seed), Workload.make(seed)
    infos = [WorkerInfo(f"{role.value[0]}{i:03d}", f"host{i % 8}", role, 1, 20_000, MODEL, ABI)
             for i, role in enumerate([Role.PREFILL] * num_prefill + [Role.DECODE] * num_decode)]

    def resync(info: WorkerInfo) -> KvDelta:
        keys = (rng.getrandbits(63) for _ in range(MEMBERSHIP_BLOCKS))
        return KvDelta(MEMBERSHIP_BLOCKS, tuple((0, key, 0) for key in keys), resync=True)

    def join(info: WorkerInfo) -> None:  # registered, then LIVE with its first load report
        router.register(info)
        router.report_load(info.worker_id, info.role_epoch, WorkerLoad(rng.randint(0, 20_000), rng.randint(0, 64), 10_000))

    for info in infos:
        join(info)
        router.report_kv(info.worker_id, 1, resync(info))
    requests = iter(workload.request(rng, f"r{i}") for i in range(100))

    def route() -> None:
        result = router.route(next(requests))
        if hasattr(result, "decode_hold"):
            router.complete(result.request_id)

    route()
    steps: dict[str, dict[str, float]] = {"restart": {}, "role_move": {}}
    timed = _step_timer(steps)
    restart, moved = infos[num_prefill], infos[num_prefill + 1]
    again = WorkerInfo(restart.worker_id, restart.host_id, restart.role, 2, restart.kv_capacity_blocks, MODEL, ABI)
    timed("restart", "retire", lambda: router.deregister(restart.worker_id, 1))
    timed("restart", "route_after_retire", route)
    timed("restart", "register", lambda: join(again))
    timed("restart", "route_after_register", route)
    timed("restart", "resync", lambda: router.report_kv(again.worker_id, 2, resync(again)))
    timed("restart", "route_after_resync", route)
    prefill = WorkerInfo(moved.worker_id, moved.host_id, Role.PREFILL, 2, moved.kv_capacity_blocks, MODEL, ABI)
    timed("role_move", "drain", lambda: router.drain(moved.worker_id, 1))
    timed("role_move", "route_after_drain", route)
    timed("role_move", "register", lambda: join(prefill))
    timed("role_move", "route_after_register", route)
    timed("role_move", "resync", lambda: router.report_kv(prefill.worker_id, 2, resync(prefill)))
    timed("role_move", "route_after_resync", route)
    router.assert_no_leaks()
    stall = max(ms for kind in steps.values() for ms in kind.values())
    return {"workers": len(infos), "blocks_per_worker": MEMBERSHIP_BLOCKS, "target_stall_ms": TARGET_STALL_MS,
            "kv_index_memory_bytes": router.kv_index_stats().memory_bytes, **steps, "stall_ms": stall}


def _step_timer(steps: dict[str, dict[str, float]]):
    def timed(kind: str, name: str, call) -> None:
        start = time.perf_counter()
        call()
        steps[kind][name] = (time.perf_counter() - start) * 1000.0
    return timed


def _print_table(runs: int, compiled: bool, rows: list[dict]) -> None:
    print(f"median of {runs} runs; compiled kernels: {compiled}")
    print(f"{'cluster':>7} {'policy':>12} {'what':>6} {'p50_us':>8} {'p99_us':>8} {'cpu_p50_us':>10} {'cpu_p99_us':>10}  p99 per run")
    for r in rows:
        times = f"{r['p50_us']:8.1f} {r['p99_us']:8.1f} {r['cpu_p50_us']:10.1f} {r['cpu_p99_us']:10.1f}"
        per_run = " ".join(f"{v:.0f}" for v in r["p99_us_per_run"])
        print(f"{r['cluster']:>7} {r['policy']:>12} {r['what']:>6} {times}  {per_run}")


def _print_events(per_report: int, rows: list[dict]) -> None:
    print(f"\nroute (us) with {per_report} block events per report before one decision in three (64x64, interleaved)")
    print(f"{'policy':>12} {'quiet_p50':>9} {'quiet_p99':>9} {'events_p50':>10} {'events_p99':>10} {'ctrl_p50':>8} "
          f"{'ctrl_p99':>8} {'p99/quiet':>9} {'p99/ctrl':>8} {'cpu_p99/quiet':>13} {'apply_p50':>9} {'apply_p99':>9}")
    for r in rows:
        print(f"{r['policy']:>12} {r['quiet_p50_us']:9.1f} {r['quiet_p99_us']:9.1f} {r['events_p50_us']:10.1f} "
              f"{r['events_p99_us']:10.1f} {r['control_p50_us']:8.1f} {r['control_p99_us']:8.1f} {r['p99_ratio']:9.2f} "
              f"{r['p99_ratio_to_control']:8.2f} {r['cpu_p99_ratio']:13.2f} {r['kv_apply_p50_us']:9.1f} {r['kv_apply_p99_us']:9.1f}")


def bench_events(args: argparse.Namespace) -> list[dict]:
    """Per policy: route p50/p99 with and without block events (medians over runs) and the p99 ratio."""
    from pdserve.router.policy.policies import POLICIES

    rows = []
    for policy in POLICIES:
        runs = [_measure_events(*EVENTS_SIZE, policy, args.decisions, args.seed, args.kv_events) for _ in range(args.runs)]
        row = {"cluster": "x".join(map(str, EVENTS_SIZE)), "policy": policy}
        for key in runs[0]:
            row[key] = statistics.median(r[key] for r in runs)
        row["p99_ratio"] = row["events_p99_us"] / row["quiet_p99_us"]
        row["p99_ratio_per_run"] = [r["events_p99_us"] / r["quiet_p99_us"] for r in runs]
        row["p99_ratio_to_control"] = row["events_p99_us"] / row["control_p99_us"]
        row["cpu_p99_ratio"] = row["events_cpu_p99_us"] / row["quiet_cpu_p99_us"]  # thread CPU time: no preemption
        rows.append(row)
    return rows


def _measure_events(num_prefill: int, num_decode: int, policy: str, decisions: int, seed: int, per_report: int) -> dict:
    """Three arms, interleaved decision by decision: `quiet` (nothing before the route), `events`
    (a worker report received, queued and applied by one applier turn first) and `control` (the
    same into a detached router: what the work costs the next route whatever it changes)."""
    from pdserve.heap import frozen_heap
    from pdserve.router.kv.kv_inbox import KvInbox
    from pdserve.router.kv.kv_index import KvDelta
    from pdserve.router.synthetic import EventFlow, random_load, random_router

    router, workload = random_router(seed, num_prefill, num_decode, policy)
    detached, _ = random_router(seed, num_prefill, num_decode, policy)
    snapshot = router.snapshot()
    members = snapshot.prefill.members, snapshot.decode.members
    held = {w: frozenset(h) for m in members for w, h in zip(m.worker_ids, m.held_prefixes)}
    flows = {"events": EventFlow(held, workload, per_report), "control": EventFlow(held, workload, per_report)}
    targets = {"events": (router, KvInbox()), "control": (detached, KvInbox())}
    worker_ids, rng = tuple(held), random.Random(seed + 1)
    requests = [workload.request(rng, f"r{i}") for i in range(3 * decisions)]
    arms = ("quiet", "events", "control")
    reports = [None if arms[i % 3] == "quiet" else _report(flows[arms[i % 3]], rng, worker_ids)
               for i in range(len(requests))]
    samples: dict[str, tuple[list[int], list[int]]] = {name: ([], []) for name in (*arms, "kv_apply")}
    with frozen_heap():
        for i, (request, report) in enumerate(zip(requests, reports)):
            router.report_load(rng.choice(worker_ids), 1, random_load(rng, 20_000, None))
            arm = arms[i % 3]
            if report is not None:
                target, inbox = targets[arm]
                inbox.put(report[0], 1, KvDelta.from_report(report[1]))  # the heartbeat handler's part
                with _timed(samples["kv_apply"] if arm == "events" else ([], [])):
                    inbox.drain(target)  # the applier's turn
            with _timed(samples[arm]):
                result = router.route(request)
            if hasattr(result, "decode_hold"):
                router.complete(request.request_id)
    router.assert_no_leaks()
    stats = ((name, {**_stats(wall, ""), **_stats(cpu, "cpu_")}) for name, (wall, cpu) in samples.items())
    return {f"{name}_{k}": v for name, both in stats for k, v in both.items()}


def _report(flow, rng: random.Random, worker_ids: tuple[str, ...]) -> tuple[str, object]:
    """A random worker's next report, in the form its heartbeat carries (engine/kv/kv_events.py)."""
    from pdserve.router.synthetic import engine_report

    worker_id = rng.choice(worker_ids)
    return worker_id, engine_report(flow.report(rng, worker_id))


def _median_row(same_row_per_run: tuple[dict, ...]) -> dict:
    """One row: medians over runs of every timing, plus each run's p99."""
    first = same_row_per_run[0]
    row = {k: v for k, v in first.items() if not k.endswith("_us")}
    for key in (k for k in first if k.endswith("_us")):
        row[key] = statistics.median(r[key] for r in same_row_per_run)
    row["p99_us_per_run"] = [r["p99_us"] for r in same_row_per_run]
    return row


def bench_size(num_prefill: int, num_decode: int, decisions: int, seed: int) -> list[dict]:
    from pdserve.router.policy.policies import POLICIES

    rows = []
    for mode in ("disaggregated", "colocated"):
        for policy in POLICIES:
            cluster = f"{num_prefill}x{num_decode}" if mode == "disaggregated" else f"co{num_prefill}"
            for what, (wall, cpu) in _measure(num_prefill, num_decode, policy, mode, decisions, seed).items():
                stats = {**_stats(wall, ""), **_stats(cpu, "cpu_")}
                rows.append({"cluster": cluster, "mode": mode, "policy": policy, "what": what, **stats})
    return rows


def _measure(num_prefill: int, num_decode: int, policy: str, mode: str, decisions: int, seed: int) -> dict:
    from pdserve.heap import frozen_heap
    from pdserve.router.policy.policies import POLICIES, PolicyContext
    from pdserve.router.synthetic import random_load, random_router

    router, workload = random_router(seed, num_prefill, num_decode, policy, colocated=mode == "colocated")
    rng = random.Random(seed + 1)
    requests = [workload.request(rng, f"r{i}") for i in range(decisions)]
    snapshot, ctx = router.snapshot(), PolicyContext(router.config.cost, 5.0, 0.05)
    policy_ns: tuple[list[int], list[int]] = ([], [])
    with frozen_heap():
        for request in requests:
            with _timed(policy_ns):
                POLICIES[policy](snapshot, request, ctx)
    worker_ids = snapshot.prefill.worker_ids + (() if snapshot.colocated else snapshot.decode.worker_ids)
    route_ns: tuple[list[int], list[int]] = ([], [])
    with frozen_heap():
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
