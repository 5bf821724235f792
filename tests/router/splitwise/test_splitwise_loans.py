"""Splitwise's loan in the pure router (registry.py's `lend`, the spec's MIXED(origin) state): a
lent worker keeps its role and epoch, is offered in its own pool and the one it is lent to, and
its routes run on across the lend and the return; the loan ends without a drain, and a worker
that registers again comes back unlent. Round robin makes every choice exact: the pools' slots
are their own workers first, then mixed and lent ones, and turn t takes (t mod |P|, t mod |D|)."""

from __future__ import annotations

import pytest

from pdserve.router.config import Mode, RouterConfig
from pdserve.router.errors import IllegalTransitionError
from pdserve.router.messages import Role, WorkerInfo, WorkerLoad
from pdserve.router.policy.pd_decision import PdPolicy
from pdserve.router.router import Router
from pdserve.router.state.registry import WorkerState
from tests.router.router_fixtures import route

LOAD = WorkerLoad(0, 0, 1000)
ROLE = {"p": Role.PREFILL, "d": Role.DECODE, "m": Role.MIXED}


def router(*workers: str, policy: str = "round_robin") -> Router:
    r = Router(RouterConfig(Mode.DISAGGREGATED, "m", "abi", policy=policy, pd=PdPolicy("always")))
    for wid in workers:
        r.register(WorkerInfo(wid, "h0", ROLE[wid[0]], 1, 1000, "m", "abi"))
        r.report_load(wid, 1, LOAD)
    return r


def pools(r: Router) -> tuple[tuple[str, ...], tuple[str, ...]]:
    snap = r.snapshot()
    return snap.prefill.worker_ids, snap.decode.worker_ids


def test_a_lent_decode_worker_serves_both_pools_under_its_own_role_and_epoch():
    r = router("p0", "d0", "d1")
    assert pools(r) == (("p0",), ("d0", "d1"))
    route(r, "held")  # turn 0: (p0, d0), decoding at d0 when the loan begins
    r.lend("d0", 1, Role.PREFILL)
    assert r.lent_to("d0") is Role.PREFILL and r.worker_state("d0") is WorkerState.LIVE
    assert pools(r) == (("p0", "d0"), ("d0", "d1"))  # its own pool still, and the prompt pool after p0
    assert r.snapshot().decode.role_epochs == (1, 1)  # no new epoch
    plans = [route(r, f"q{t}") for t in (1, 2, 3)]
    assert [(p.prefill_id, p.decode_id) for p in plans] == [("d0", "d1"), ("p0", "d0"), ("d0", "d1")]
    assert plans[0].prefill_hold.worker_id == "d0" and plans[0].pd.disaggregate  # d0 prefills and hands off
    assert r.live_requests() == ("held", "q1", "q2", "q3")  # nothing drained or orphaned
    for rid in ("held", "q1", "q2", "q3"):
        r.complete(rid)
    r.assert_no_leaks()


def test_a_return_stops_the_borrowed_phase_and_leaves_its_routes_running():
    r = router("p0", "d0", "d1")
    route(r, "a")  # turn 0: (p0, d0)
    r.lend("d0", 1, Role.PREFILL)
    borrowed = route(r, "b")  # turn 1: (d0, d1): d0 prefills for d1
    assert (borrowed.prefill_id, borrowed.decode_id) == ("d0", "d1")
    r.lend("d0", 1, None)  # the loan ends: no drain, the same epoch, its prefill for "b" runs on
    assert r.lent_to("d0") is None and r.worker_state("d0") is WorkerState.LIVE
    assert pools(r) == (("p0",), ("d0", "d1"))
    assert {route(r, f"q{t}").prefill_id for t in range(2, 6)} == {"p0"}
    assert r.live_requests() == ("a", "b", "q2", "q3", "q4", "q5")
    r.kv_published("b")  # the borrowed prefill's hand-off lands after the return
    for rid in r.live_requests():
        r.complete(rid)
    r.assert_no_leaks()


def test_a_lent_prefill_worker_decodes_and_runs_whole_requests_when_both_phases_choose_it():
    r = router("p0", "d0")
    r.lend("p0", 1, Role.DECODE)
    assert pools(r) == (("p0",), ("d0", "p0"))
    plans = [route(r, f"q{t}") for t in range(2)]
    assert [(p.prefill_id, p.decode_id) for p in plans] == [("p0", "d0"), ("p0", "p0")]
    whole = plans[1]  # both phases on the lent worker: one hold there, no hand-off (mixed_pool.WHOLE_ON_MIXED)
    assert whole.prefill_hold is None and (whole.pd.disaggregate, whole.pd.reason) == (False, "mixed_whole")
    for rid in ("q0", "q1"):
        r.complete(rid)
    r.assert_no_leaks()


def test_a_lent_worker_in_both_pools_carries_one_load_in_both_slots():
    r = router("p0", "d0", "d1", policy="jsq")
    r.lend("d1", 1, Role.PREFILL)
    r.report_load("d1", 1, WorkerLoad(300, 2, 40))
    snap = r.snapshot()
    p, d = snap.prefill.worker_ids.index("d1"), snap.decode.worker_ids.index("d1")
    assert (snap.prefill.pending_tokens[p], snap.decode.pending_tokens[d]) == (300, 300)
    assert (snap.prefill.headroom_blocks[p], snap.decode.headroom_blocks[d]) == (40, 40)
    assert r.lent_to("d1") is Role.PREFILL  # a load report keeps the loan


def test_a_worker_that_registers_again_comes_back_unlent_and_illegal_loans_are_refused():
    r = router("p0", "d0", "m0")
    r.lend("d0", 1, Role.PREFILL)
    r.register(WorkerInfo("d0", "h0", Role.DECODE, 2, 1000, "m", "abi"))  # restarted under epoch 2
    r.report_load("d0", 2, LOAD)
    assert r.lent_to("d0") is None and pools(r)[0] == ("p0",)
    for wid, epoch, to in [("d0", 2, Role.DECODE), ("m0", 1, Role.PREFILL), ("p0", 1, Role.MIXED)]:
        with pytest.raises(IllegalTransitionError):
            r.lend(wid, epoch, to)
    r.drain("p0", 1)
    with pytest.raises(IllegalTransitionError):  # a draining worker is not lent
        r.lend("p0", 1, Role.DECODE)

