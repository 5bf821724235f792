"""Registration, heartbeats with an injected clock, epochs, retirement and stale-epoch rejection."""

from __future__ import annotations

import pytest

from pdserve.router.errors import (
    DuplicateRegistrationError,
    IdentityMismatchError,
    IllegalTransitionError,
    RoleMismatchError,
    StaleEpochError,
    UnknownWorkerError,
)
from pdserve.router.messages import Role, WorkerInfo, WorkerLoad
from pdserve.router.state.registry import ClusterIdentity, Registry, WorkerState, transition

IDENTITY = ClusterIdentity("m", "abi", frozenset({Role.PREFILL, Role.DECODE}))
LOAD = WorkerLoad(0, 0, 100)


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def info(worker_id="p0", epoch=1, role=Role.PREFILL, model="m", abi="abi") -> WorkerInfo:
    return WorkerInfo(worker_id, "h0", role, epoch, 100, model, abi)


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def registry(clock):
    return Registry(IDENTITY, heartbeat_timeout_s=3.0, clock=clock)


def test_worker_is_offered_only_after_its_first_load_report(registry):
    registry.register(info())
    assert registry.live([Role.PREFILL]) == ()
    registry.report_load("p0", 1, LOAD)
    assert [e.info.worker_id for e in registry.live([Role.PREFILL])] == ["p0"]


def test_identity_and_role_are_checked(registry):
    with pytest.raises(IdentityMismatchError):
        registry.register(info(model="other"))
    with pytest.raises(IdentityMismatchError):
        registry.register(info(abi="other"))
    with pytest.raises(RoleMismatchError):
        registry.register(info(role=Role.COLOCATED))
    with pytest.raises(DuplicateRegistrationError):
        registry.register(info())
        registry.register(info())


def test_missed_heartbeats_retire_the_epoch(registry, clock):
    registry.register(info("p0"))
    registry.register(info("p1"))
    clock.now_s = 2.0
    registry.heartbeat("p1", 1)
    clock.now_s = 3.5
    retired = registry.expire()
    assert [(r.worker_id, r.role_epoch, r.reason) for r in retired] == [("p0", 1, "heartbeat_timeout")]
    assert registry.expire() == []
    clock.now_s = 5.5
    assert [r.worker_id for r in registry.expire()] == ["p1"]


def test_a_load_report_counts_as_a_heartbeat(registry, clock):
    registry.register(info())
    clock.now_s = 2.9
    registry.report_load("p0", 1, LOAD)
    clock.now_s = 5.0
    assert registry.expire() == []


def test_late_messages_from_a_retired_epoch_are_rejected(registry, clock):
    registry.register(info())
    clock.now_s = 10.0
    registry.expire()
    for late in (lambda: registry.heartbeat("p0", 1), lambda: registry.report_load("p0", 1, LOAD)):
        with pytest.raises(StaleEpochError):
            late()
    with pytest.raises(StaleEpochError):
        registry.register(info(epoch=1))  # a dead incarnation cannot come back
    assert registry.num_stale_rejected == 3
    registry.register(info(epoch=2))  # a new epoch can
    registry.report_load("p0", 2, LOAD)


def test_a_newer_epoch_supersedes_and_fences_the_older(registry):
    registry.register(info(epoch=1))
    superseded = registry.register(info(epoch=2, role=Role.DECODE))
    assert (superseded.role_epoch, superseded.reason) == (1, "superseded")
    with pytest.raises(StaleEpochError):
        registry.report_load("p0", 1, LOAD)
    with pytest.raises(StaleEpochError):
        registry.register(info(epoch=1))
    with pytest.raises(UnknownWorkerError):
        registry.heartbeat("p0", 3)  # never registered


def test_deregister_retires(registry):
    registry.register(info())
    assert registry.deregister("p0", 1).reason == "deregistered"
    with pytest.raises(StaleEpochError):
        registry.heartbeat("p0", 1)
    with pytest.raises(UnknownWorkerError):
        registry.heartbeat("nobody", 1)


def test_worker_state_machine_rejects_illegal_transitions():
    assert transition(WorkerState.REGISTERED, WorkerState.LIVE) is WorkerState.LIVE
    with pytest.raises(IllegalTransitionError):
        transition(WorkerState.RETIRED, WorkerState.LIVE)
    with pytest.raises(IllegalTransitionError):
        transition(WorkerState.LIVE, WorkerState.REGISTERED)
