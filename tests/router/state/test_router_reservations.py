"""The hold ledger: grants, in-flight accounting, release, and never oversubscribing a worker."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pdserve.router.config import Mode, RouterConfig
from pdserve.router.errors import IllegalTransitionError, LeakError, UnknownRequestError
from pdserve.router.messages import Role, RoutePlan, RouteRequest, WorkerInfo, WorkerLoad
from pdserve.router.router import Router
from pdserve.router.state.reservations import HoldRequest, InFlight, ReservationLedger

FREE = {"p0": 10, "d0": 10}


def holds(p_blocks=3, d_blocks=4):
    return HoldRequest("p0", 1, p_blocks, tokens=40), HoldRequest("d0", 1, d_blocks, seqs=1)


def test_grants_are_charged_until_a_report_reflects_them():
    ledger = ReservationLedger()
    p_hold, d_hold = ledger.reserve("r1", *holds(), FREE)
    assert (p_hold.grant_seq, d_hold.grant_seq) == (1, 1)
    assert ledger.in_flight()["d0"] == InFlight(blocks=4, seqs=1)
    ledger.reserve("r2", *holds(), FREE)
    assert ledger.headroom_blocks("d0", 10) == 2
    ledger.apply_ack("d0", 1)  # d0's report now counts r1's blocks itself
    assert ledger.headroom_blocks("d0", 6) == 2
    ledger.check_invariants()


def test_reserve_refuses_to_oversubscribe():
    ledger = ReservationLedger()
    ledger.reserve("r1", *holds(d_blocks=8), FREE)
    assert not ledger.can_reserve([HoldRequest("d0", 1, 3)], FREE)
    with pytest.raises(LeakError):
        ledger.reserve("r2", *holds(d_blocks=3), FREE)
    ledger.release("r1")
    ledger.assert_no_leaks()


def test_route_state_machine():
    ledger = ReservationLedger()
    ledger.reserve("r1", *holds(), FREE)
    ledger.publish("r1")
    assert "p0" not in ledger.in_flight()
    with pytest.raises(IllegalTransitionError):
        ledger.publish("r1")
    with pytest.raises(IllegalTransitionError):
        ledger.reserve("r1", *holds(), FREE)
    ledger.release("r1")
    with pytest.raises(UnknownRequestError):
        ledger.release("r1")
    ledger.reserve("c1", None, HoldRequest("d0", 1, 2, tokens=5, seqs=1), FREE)
    with pytest.raises(IllegalTransitionError):
        ledger.publish("c1")  # colocated routes have nothing to publish
    ledger.release("c1")
    ledger.assert_no_leaks()


def test_leak_check_names_outstanding_requests():
    ledger = ReservationLedger()
    ledger.reserve("r1", *holds(), FREE)
    with pytest.raises(LeakError, match="r1"):
        ledger.assert_no_leaks()


def test_dropping_a_worker_releases_whole_routes():
    ledger = ReservationLedger()
    ledger.reserve("r1", *holds(), FREE)
    ledger.reserve("r2", None, HoldRequest("p0", 1, 1, seqs=1), FREE)
    assert ledger.drop_worker("d0") == ["r1"]
    assert ledger.live_requests() == ("r2",)
    ledger.release("r2")
    ledger.assert_no_leaks()


CAPACITY = {"p0": 40, "p1": 25, "d0": 60, "d1": 30}


class RouterModel(RuleBasedStateMachine):
    """Random routes, completions, aborts, publications, worker reports and worker loss.

    The simulated workers are truthful: each applies the grants it has received when told to and
    reports capacity minus the live holds it applied. However stale the reports, the blocks held on
    a worker by live routes must never exceed its capacity.
    """

    @initialize(policy=st.sampled_from(["round_robin", "jsq", "slo", "prefix"]))
    def start(self, policy):
        self.router = Router(RouterConfig(Mode.DISAGGREGATED, "m", "abi", policy=policy, ttft_slo_s=1e9, tpot_slo_s=1e9))
        self.epoch = {w: 1 for w in CAPACITY}
        self.applied = {w: 0 for w in CAPACITY}
        self.plans: dict[str, RoutePlan] = {}
        self.count = 0
        for worker in CAPACITY:
            self._join(worker)

    def _join(self, worker):
        role = Role.PREFILL if worker.startswith("p") else Role.DECODE
        self.router.register(WorkerInfo(worker, "h0", role, self.epoch[worker], CAPACITY[worker], "m", "abi"))
        self.applied[worker] = 0
        self.report(worker)

    def _live_holds(self, worker):
        for plan in self.plans.values():
            for hold in (plan.prefill_hold, plan.decode_hold):
                if hold is not None and hold.worker_id == worker:
                    yield hold

    @rule(prompt=st.integers(1, 200), output=st.integers(0, 200))
    def route(self, prompt, output):
        self.count += 1
        result = self.router.route(RouteRequest(f"r{self.count}", prompt, output))
        if isinstance(result, RoutePlan):
            self.plans[result.request_id] = result

    @precondition(lambda self: self.plans)
    @rule(data=st.data(), abort=st.booleans())
    def finish(self, data, abort):
        request_id = data.draw(st.sampled_from(sorted(self.plans)))
        (self.router.abort if abort else self.router.complete)(request_id)
        del self.plans[request_id]

    @precondition(lambda self: any(p.prefill_hold for p in self.plans.values()))
    @rule(data=st.data())
    def publish(self, data):
        request_id = data.draw(st.sampled_from(sorted(r for r, p in self.plans.items() if p.prefill_hold)))
        self.router.kv_published(request_id)
        plan = self.plans[request_id]
        self.plans[request_id] = RoutePlan(**{**plan.__dict__, "prefill_hold": None})

    @rule(worker=st.sampled_from(sorted(CAPACITY)))
    def apply_grants(self, worker):
        seqs = [h.grant_seq for h in self._live_holds(worker)]
        self.applied[worker] = max([self.applied[worker], *seqs])

    @rule(worker=st.sampled_from(sorted(CAPACITY)))
    def report(self, worker):
        used = sum(h.blocks for h in self._live_holds(worker) if h.grant_seq <= self.applied[worker])
        load = WorkerLoad(0, 0, CAPACITY[worker] - used, applied_grant_seq=self.applied[worker])
        self.router.report_load(worker, self.epoch[worker], load)

    @rule(worker=st.sampled_from(sorted(CAPACITY)))
    def lose_worker(self, worker):
        retirement = self.router.deregister(worker, self.epoch[worker])
        for request_id in retirement.orphaned_request_ids:
            del self.plans[request_id]
        self.epoch[worker] += 1
        self._join(worker)

    @invariant()
    def never_oversubscribed(self):
        for worker, capacity in CAPACITY.items():
            assert sum(h.blocks for h in self._live_holds(worker)) <= capacity
        assert set(self.router.live_requests()) == set(self.plans)
        self.router.check_invariants()

    def teardown(self):
        for request_id in list(self.plans):
            self.router.complete(request_id)
        self.router.assert_no_leaks()


TestRouterNeverOversubscribes = RouterModel.TestCase
TestRouterNeverOversubscribes.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
