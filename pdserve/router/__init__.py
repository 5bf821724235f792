"""The control plane's pure core: which (prefill, decode) pair serves a request, and what it holds.

Nothing here does I/O; the process edge feeds `Router` worker messages and request events.

    messages.py      typed messages: WorkerInfo, WorkerLoad, RouteRequest, RoutePlan, RouteRejection
    errors.py        typed errors (stale epoch, unknown worker/request, illegal transition, leak)
    config.py        serving mode, cluster shape (xPyD or N replicas), SLO targets, heartbeat timing
    cost.py          CostModel: queue, prefill, decode-step and transfer seconds (fit later)
    registry.py      membership: registration, load reports, heartbeats, epochs, retirement
    prefix_index.py  leading prefix-block hits per worker for one request (hash -> row of a bool matrix)
    snapshot.py      the per-decision view policies read (numpy arrays, in-flight holds charged)
    kernels.py       numba-compiled prefix lookup and pair search (numpy fallback)
    demand.py        tokens and blocks a request needs at P and D given prefix hits
    policies.py      round_robin, jsq, slo, prefix: pure functions snapshot -> Choice | Refusal
    plan.py          Choice -> block holds + RoutePlan with predicted TTFT/TPOT
    reservations.py  the hold ledger (decode reservation, prefill staging), assert_no_leaks()
    fallback.py      decode-start fallback: enqueue, wait, reroute, recompute or kv_not_visible
    router.py        the Router facade and its counters
    synthetic.py     seeded random clusters and requests for the benchmark and tests
"""
