"""The Router facade driven the way the runtime will drive it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pdserve.engine.kv.kv_abi import KvAbi
from pdserve.router.config import ClusterShape, Mode, RouterConfig
from pdserve.router.errors import StaleEpochError, UnknownRequestError
from pdserve.router.messages import RejectReason, Role, RoutePlan, RouteRejection, RouteRequest, WorkerInfo, WorkerLoad
from pdserve.router.pricing.cost import CostModel
from pdserve.router.router import Router


class Clock:
    now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def make_router(mode=Mode.DISAGGREGATED, policy="jsq", workers=(("p0", "h0"), ("p1", "h0"), ("d0", "h1"), ("d1", "h1")), free=100):
    clock = Clock()
    router = Router(RouterConfig(mode, "m", "abi", policy=policy), clock=clock)
    for worker_id, host in workers:
        role = {"p": Role.PREFILL, "d": Role.DECODE, "w": Role.COLOCATED}[worker_id[0]]
        router.register(WorkerInfo(worker_id, host, role, 1, free, "m", "abi"))
        router.report_load(worker_id, 1, WorkerLoad(0, 0, free))
    return router, clock


def test_plan_carries_the_decode_reservation_and_prefill_staging():
    router, _ = make_router()
    plan = router.route(RouteRequest("r1", prompt_tokens=100, expected_output_tokens=60))
    assert isinstance(plan, RoutePlan) and not plan.colocated
    assert plan.decode_hold.blocks == 10  # ceil(160 / 16)
    assert plan.prefill_hold.blocks == 7  # ceil(100 / 16)
    assert plan.transfer_bytes == 100 * router.config.cost.kv_bytes_per_token
    router.kv_published("r1")
    router.complete("r1")
    router.assert_no_leaks()


def test_back_to_back_routes_see_each_other_between_reports():
    router, _ = make_router()
    first = router.route(RouteRequest("a", 100, 10))
    second = router.route(RouteRequest("b", 100, 10))
    assert (first.prefill_id, first.decode_id) == ("p0", "d0")
    assert (second.prefill_id, second.decode_id) == ("p1", "d1")  # in-flight holds count as load


def test_concurrent_routes_stop_at_reported_capacity():
    router, _ = make_router(workers=(("p0", "h0"), ("d0", "h1")), free=25)
    results = [router.route(RouteRequest(f"r{i}", 100, 60)) for i in range(3)]
    assert [type(r) for r in results] == [RoutePlan, RoutePlan, RouteRejection]
    assert results[2].reason is RejectReason.NO_DECODE_CAPACITY
    router.abort("r0")
    assert isinstance(router.route(RouteRequest("r3", 100, 60)), RoutePlan)
    for request_id in ("r1", "r3"):
        router.complete(request_id)
    router.assert_no_leaks()


def test_applied_grants_move_from_in_flight_into_the_report():
    router, _ = make_router(workers=(("p0", "h0"), ("d0", "h1")), free=25)
    plan = router.route(RouteRequest("r0", 100, 60))
    assert router.snapshot().decode.headroom_blocks[0] == 15
    router.report_load("d0", 1, WorkerLoad(0, 1, 15, applied_grant_seq=plan.decode_hold.grant_seq))
    assert router.snapshot().decode.headroom_blocks[0] == 15  # counted once, not twice
    assert router.snapshot().decode.active_batch[0] == 1


def test_heartbeat_expiry_orphans_routes_and_fences_the_epoch():
    router, clock = make_router(workers=(("p0", "h0"), ("d0", "h1"), ("d1", "h1")))
    plan = router.route(RouteRequest("r0", 100, 10))
    clock.now_s = 2.0
    for worker in ("p0", "d1"):
        router.heartbeat(worker, 1)
    clock.now_s = 3.5
    (retirement,) = router.expire()
    assert (retirement.worker.worker_id, retirement.orphaned_request_ids) == (plan.decode_id, ("r0",))
    with pytest.raises(UnknownRequestError):
        router.complete("r0")  # already released with the orphaned route
    with pytest.raises(StaleEpochError):
        router.report_load("d0", 1, WorkerLoad(0, 0, 100))
    assert router.route(RouteRequest("r1", 100, 10)).decode_id == "d1"
    router.complete("r1")
    router.assert_no_leaks()
    counters = router.counters()
    assert counters.workers_retired == {"heartbeat_timeout": 1}
    assert counters.num_stale_rejected == 1 and counters.num_orphaned == 1


def test_colocated_mode_uses_the_same_api():
    workers = (("w0", "h0"), ("w1", "h1"))
    router, _ = make_router(mode=Mode.COLOCATED, policy="round_robin", workers=workers)
    plans = [router.route(RouteRequest(f"r{i}", 100, 10)) for i in range(2)]
    assert [(p.prefill_id, p.decode_id) for p in plans] == [("w0", "w0"), ("w1", "w1")]
    assert all(p.colocated and p.transfer_bytes == 0 and p.prefill_hold is None for p in plans)
    for plan in plans:
        router.complete(plan.request_id)
    router.assert_no_leaks()


def test_route_decisions_are_counted_by_policy_and_result():
    router, _ = make_router(workers=(("p0", "h0"), ("d0", "h1")), free=10)
    router.route(RouteRequest("a", 10, 10))
    router.route(RouteRequest("b", 10, 10), policy="slo")
    router.route(RouteRequest("c", 1000, 10))
    assert router.counters().route_total == {("jsq", "routed"): 1, ("slo", "routed"): 1, ("jsq", "no_decode_capacity"): 1}


def test_cluster_shapes():
    assert ClusterShape.disaggregated(2, 3).roles() == [Role.PREFILL] * 2 + [Role.DECODE] * 3
    assert ClusterShape.colocated(4).roles() == [Role.COLOCATED] * 4
    with pytest.raises(ValueError):
        ClusterShape(Mode.DISAGGREGATED, num_prefill=1)


def test_cost_model_from_kv_abi():
    abi = KvAbi(num_layers=2, num_kv_heads=4, head_dim=8, block_size=16, dtype="bfloat16")
    cost = CostModel.from_abi(abi, prefill_s_per_token=2e-4)
    assert (cost.kv_bytes_per_token, cost.block_size_tokens) == (abi.bytes_per_token, 16)
    assert cost.prefill_s(100) == pytest.approx(cost.prefill_overhead_s + 0.02)
    assert cost.transfer_s(0, 0) == 0 and cost.admission_delay_s(0) == 0
    assert cost.transfer_s(10**9, 1) < cost.transfer_s(10**9, 0)
    with pytest.raises(ValueError):
        CostModel(same_host_bytes_per_s=1.0, cross_host_bytes_per_s=2.0)


def test_bench_router_command_smoke():
    """One invocation for all parts of the report, as a user runs it: in a process of its own. Its
    timed loops collect the heap before each measurement (`frozen_heap`), which in the test
    session's process walks every object the suite has made so far, a second or so each time."""
    done = subprocess.run([sys.executable, "-m", "pdserve", "bench-router", "--json", "--decisions", "20", "--runs", "3",
                           "--kv-events", "8"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    clusters = {(r["cluster"], r["policy"], r["what"]) for r in report["results"]}
    assert ("64x64", "prefix", "route") in clusters and ("8x8", "slo", "policy") in clusters
    assert report["runs"] == 3 and report["compiled_kernels"] is True
    for row in report["results"]:
        assert len(row["p99_us_per_run"]) == 3 and row["p99_us"] == sorted(row["p99_us_per_run"])[1]
    # route latency with and without block events flowing (issue 19's index update cost)
    events = report["kv_events"]
    assert events["events_per_report"] == 8 and events["target_ratio"] == 1.2
    assert [r["policy"] for r in events["results"]] == ["round_robin", "jsq", "slo", "prefix"]
    for row in events["results"]:
        assert row["cluster"] == "64x64" and len(row["p99_ratio_per_run"]) == 3
        assert row["p99_ratio"] == row["events_p99_us"] / row["quiet_p99_us"]
        assert all(row[f"{arm}_p99_us"] >= row[f"{arm}_p50_us"] > 0 for arm in ("quiet", "events", "control", "kv_apply"))
    # a restart and a role move at 128 workers x 4,096 blocks (issue 36): each step timed
    membership = report["membership"]
    assert (membership["workers"], membership["blocks_per_worker"], membership["target_stall_ms"]) == (128, 4096, 50.0)
    steps = [ms for kind in ("restart", "role_move") for ms in membership[kind].values()]
    assert len(steps) == 12 and membership["stall_ms"] == max(steps) > 0
