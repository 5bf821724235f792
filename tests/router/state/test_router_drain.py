"""Draining a worker (a role change begins) and switching disaggregation off in the pure router:
a DRAINING worker is never offered; with disaggregation off, whole requests go to decode and
colocated workers only; the registry's state machine refuses illegal moves."""

from __future__ import annotations

import pytest

from pdserve.router.config import Mode, RouterConfig
from pdserve.router.errors import IllegalTransitionError
from pdserve.router.messages import Role, RoutePlan, RouteRequest, WorkerInfo, WorkerLoad
from pdserve.router.policy.pd_decision import PdPolicy
from pdserve.router.router import Router
from pdserve.router.state.registry import WorkerState, transition
from tests.router.router_fixtures import route

LOAD = WorkerLoad(0, 0, 1000)


def router(roles: dict[str, Role], pd: str = "always") -> Router:
    r = Router(RouterConfig(Mode.DISAGGREGATED, "m", "abi", policy="jsq", pd=PdPolicy(pd)))
    for wid, role in roles.items():
        r.register(WorkerInfo(wid, "h0", role, 1, 1000, "m", "abi"))
        r.report_load(wid, 1, LOAD)
    return r


def test_a_draining_worker_gets_no_new_route_and_keeps_its_state_on_reports():
    r = router({"p0": Role.PREFILL, "p1": Role.PREFILL, "d0": Role.DECODE})
    r.drain("p0", 1)
    r.report_load("p0", 1, LOAD)  # a report does not make it LIVE again
    assert r.worker_state("p0") is WorkerState.DRAINING
    assert {route(r, f"q{i}").prefill_id for i in range(6)} == {"p1"}
    for i in range(6):
        r.complete(f"q{i}")
    r.assert_no_leaks()


def test_with_disaggregation_off_whole_requests_go_to_decode_and_colocated_workers():
    r = router({"p0": Role.PREFILL, "d0": Role.DECODE})
    r.set_disaggregation(False)
    assert {(p.prefill_id, p.decode_id) for p in (route(r, f"q{i}") for i in range(4))} == {("d0", "d0")}
    r.register(WorkerInfo("c0", "h0", Role.COLOCATED, 1, 1000, "m", "abi"))  # a prefill worker after its switch
    r.report_load("c0", 1, LOAD)
    chosen = {route(r, f"w{i}").decode_id for i in range(8)}
    assert chosen == {"d0", "c0"}
    r.set_disaggregation(True)
    plan = route(r, "back")
    assert (plan.prefill_id, plan.decode_id) == ("p0", "d0")  # the colocated worker is not a prefill slot


def test_registry_drain_transitions():
    assert transition(WorkerState.LIVE, WorkerState.DRAINING) is WorkerState.DRAINING
    assert transition(WorkerState.DRAINING, WorkerState.RETIRED) is WorkerState.RETIRED
    for bad in [(WorkerState.REGISTERED, WorkerState.DRAINING), (WorkerState.DRAINING, WorkerState.LIVE),
                (WorkerState.RETIRED, WorkerState.DRAINING)]:
        with pytest.raises(IllegalTransitionError):
            transition(*bad)


def test_a_colocated_cluster_has_no_disaggregation_to_enable():
    r = Router(RouterConfig(Mode.COLOCATED, "m", "abi"))
    with pytest.raises(ValueError):
        r.set_disaggregation(True)


@pytest.mark.parametrize("pd", ["margin", "never"])
def test_an_empty_prompt_pool_sends_whole_requests_to_the_decode_workers(pd):
    r = router({"p0": Role.PREFILL, "d0": Role.DECODE, "d1": Role.DECODE}, pd)
    r.drain("p0", 1)  # the last prompt worker goes to the token pool (Splitwise, splitwise.py)
    plans = [route(r, f"q{i}") for i in range(4)]
    assert {(p.prefill_id, p.decode_id) for p in plans} == {("d0", "d0"), ("d1", "d1")}
    for i in range(4):
        r.complete(f"q{i}")
    r.assert_no_leaks()


def test_with_every_request_on_the_handoff_an_empty_prompt_pool_refuses():
    r = router({"p0": Role.PREFILL, "d0": Role.DECODE})
    r.drain("p0", 1)
    assert not isinstance(r.route(RouteRequest("q", 64, 16, ())), RoutePlan)
    r.assert_no_leaks()
