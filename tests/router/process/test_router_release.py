"""The release controller's states when a role change fails (router/process/release.py): a failed
disable leaves the release PINNED (requests already run whole), a failed rollback stays
ROLLING_BACK and runs again from the top, illegal moves and concurrent operations are refused."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from pdserve.router.config import Mode, RouterConfig
from pdserve.router.messages import Role, WorkerInfo, WorkerLoad
from pdserve.router.process import release, role_control
from pdserve.router.router import Router

LOAD = WorkerLoad(0, 0, 1000)


class Backend:
    def __init__(self):
        self.router = Router(RouterConfig(Mode.DISAGGREGATED, "m", "abi"))
        self.live, self.registered = {}, {}
        self.failed_workers, self.origin_roles = (lambda: []), {}
        self.metrics = type("M", (), {"rollback_seconds": type("H", (), {"observe": lambda self, v: None})()})()

    async def revoke_capabilities(self, ack_timeout_s: float) -> dict:
        return {"key_epoch": 2, "installed_at_s": {}}


def failing(calls):
    async def set_disaggregation(backend, enabled, drain_timeout_s, failed_ok=False):
        calls.append(enabled)
        if len(calls) in (1, 3):  # the first disable, and the rollback's first try
            raise role_control.RoleChangeFailed("prefill-0 did not register under epoch 2")
        backend.router.set_disaggregation(enabled)
        return []
    return set_disaggregation


def test_a_failed_disable_pins_the_release_and_a_failed_rollback_can_run_again(monkeypatch):
    async def scenario():
        calls = []
        monkeypatch.setattr(role_control, "set_disaggregation", failing(calls))
        control = release.ReleaseController(Backend())
        with pytest.raises(role_control.RoleChangeFailed):
            await control.set_disaggregation(False)
        pinned = control.state
        assert (await control.set_disaggregation(True))["state"] == "ACTIVE"
        with pytest.raises(role_control.RoleChangeFailed):
            await control.rollback()
        stuck = control.state
        done = await control.rollback()
        with pytest.raises(release.IllegalReleaseTransition):
            await control.rollback()
        return pinned, stuck, done, control

    pinned, stuck, done, control = asyncio.run(scenario())
    assert pinned == "PINNED" and control.backend.router.disaggregation is False
    assert stuck == "ROLLING_BACK" and done["state"] == "ROLLED_BACK"
    assert [s["name"] for s in done["steps"]][-1] == "ROLLBACK_COMPLETE"
    assert [h[0] for h in control.history] == ["ACTIVE", "PINNED", "ACTIVE", "ROLLING_BACK", "ROLLED_BACK"]


def test_a_rollback_that_finds_staging_still_held_fails_stays_rolling_back_and_runs_again(monkeypatch):
    """RECLAIM_UNPUBLISHED with a prefill staging hold still taken (a route the drain could not
    end) fails the rollback: ROLLING_BACK stays, the next move is refused, a retry runs from the
    top and completes once the hold is gone."""
    from pdserve.router.messages import Role, RouteRequest, WorkerInfo, WorkerLoad

    async def flip(backend, enabled, drain_timeout_s, failed_ok=False):
        backend.router.set_disaggregation(enabled)
        return []

    async def scenario():
        monkeypatch.setattr(role_control, "set_disaggregation", flip)
        backend = Backend()
        for wid, role in (("prefill-0", Role.PREFILL), ("decode-0", Role.DECODE)):
            backend.router.register(WorkerInfo(wid, "h0", role, 1, 1000, "m", "abi"))
            backend.router.report_load(wid, 1, WorkerLoad(0, 0, 1000))
        backend.router.route(RouteRequest("r", 64, 16, ()))
        held = backend.router.staging_holds()
        control = release.ReleaseController(backend, drain_timeout_s=0.05, drain_window_s=0.0)
        with pytest.raises(release.RollbackIncomplete, match="1 staging holds"):
            await control.rollback()
        stuck = control.state
        with pytest.raises(release.IllegalReleaseTransition):
            await control.set_disaggregation(True)
        backend.router.abort("r")
        done = await control.rollback()
        return held, stuck, done, control

    held, stuck, done, control = asyncio.run(scenario())
    assert held == 1 and stuck == "ROLLING_BACK"
    assert done["state"] == "ROLLED_BACK" and done["steps"][6]["detail"] == {"unpublished": 0, "staging_holds": 0}
    assert [h[0] for h in control.history] == ["ACTIVE", "ROLLING_BACK", "ROLLED_BACK"]
    assert control.backend.router.route_epoch == 3  # the retry ran from the top: the epoch advanced again


def test_a_role_change_waits_for_a_just_restarted_worker_to_send_its_first_report():
    """A worker its supervisor has just started again is REGISTERED until its first load report,
    and a REGISTERED worker cannot be drained: the rollback's switch to colocated waits for the
    report instead of failing with an illegal registered -> draining move (seen in CI when the
    restarted prefill worker's first report came after its registration reached the rollback)."""
    from types import SimpleNamespace

    from pdserve.router.messages import Role, WorkerInfo, WorkerLoad
    from pdserve.router.state.registry import WorkerState

    load = WorkerLoad(0, 0, 1000)

    class Restarted(Backend):
        def __init__(self):
            super().__init__()
            self.router.register(WorkerInfo("prefill-0", "h0", Role.PREFILL, 2, 1000, "m", "abi"))
            self.registered["prefill-0"] = SimpleNamespace(role="prefill", epoch=2)
            self.control_auth = SimpleNamespace(advance=lambda wid, epoch: None)
            counter = SimpleNamespace(inc=lambda: None)
            self.metrics.role_changes = SimpleNamespace(labels=lambda *a: counter)
            self.on_role_changed = lambda wid, role, epoch: None
            self.sent = []

        async def _send(self, wid, msg):
            self.sent.append(msg)
            self.router.register(WorkerInfo(wid, "h0", Role(msg.role), msg.epoch, 1000, "m", "abi"))
            self.router.report_load(wid, msg.epoch, load)
            self.registered[wid] = SimpleNamespace(role=msg.role, epoch=msg.epoch)

    async def main():
        backend = Restarted()
        assert backend.router.worker_state("prefill-0") is WorkerState.REGISTERED
        asyncio.get_running_loop().call_later(0.1, backend.router.report_load, "prefill-0", 2, load)
        change = await role_control.change_role(backend, "prefill-0", "colocated", drain_timeout_s=1.0,
                                                register_timeout_s=5.0)
        assert (change.from_role, change.to_role, change.from_epoch, change.to_epoch) == ("prefill", "colocated", 2, 3)
        assert backend.router.worker_state("prefill-0") is WorkerState.LIVE
        assert [type(m).__name__ for m in backend.sent] == ["ChangeRole"]

    asyncio.run(main())


def test_a_disable_posted_again_while_pinned_changes_the_workers_left_in_their_old_role(monkeypatch):
    """The release is PINNED but a worker is still prefill (its first change failed: a kill -9 in
    the change's window, before the change retried on the new incarnation): posting the disable
    again runs the role changes again instead of answering that nothing is to be done."""
    calls = []

    async def record(backend, enabled, drain_timeout_s, failed_ok=False):
        calls.append(enabled)
        backend.router.set_disaggregation(enabled)
        return []

    async def scenario():
        monkeypatch.setattr(role_control, "set_disaggregation", record)
        control = release.ReleaseController(Backend())
        await control.set_disaggregation(False)
        again = await control.set_disaggregation(False)
        return control, again

    control, again = asyncio.run(scenario())
    assert calls == [False, False] and again["state"] == "PINNED"
    assert [h[0] for h in control.history] == ["ACTIVE", "PINNED"]  # the reconcile is not a move


class _LivePrefill(Backend):
    """prefill-0 LIVE under epoch 1, restarts on; `_send` is the worker's side."""

    def __init__(self, on_role_changed=lambda wid, role, epoch: None):
        super().__init__()
        self.router.register(WorkerInfo("prefill-0", "h0", Role.PREFILL, 1, 1000, "m", "abi"))
        self.router.report_load("prefill-0", 1, LOAD)
        self.registered["prefill-0"] = SimpleNamespace(role="prefill", epoch=1)
        self.control_auth = SimpleNamespace(advance=lambda wid, epoch: None)
        counter = SimpleNamespace(inc=lambda: None)
        self.metrics.role_changes = SimpleNamespace(labels=lambda *a: counter)
        self.on_role_changed = on_role_changed
        self.restarts, self.away = True, set()

    def comes_back(self, wid: str, role: str, epoch: int) -> None:
        self.router.register(WorkerInfo(wid, "h0", Role(role), epoch, 1000, "m", "abi"))
        self.router.report_load(wid, epoch, LOAD)
        self.registered[wid] = SimpleNamespace(role=role, epoch=epoch)


def test_the_launcher_learns_the_new_role_and_epoch_before_the_worker_is_told():
    """A worker that switches and dies before the router sees it LIVE is restarted by its supervisor
    in the new role above the new epoch (never a second incarnation under that epoch): the launcher
    is told before the ChangeRole leaves."""
    events = []

    class Told(_LivePrefill):
        async def _send(self, wid, msg):
            events.append(("sent", msg.role, msg.epoch))
            self.comes_back(wid, msg.role, msg.epoch)

    backend = Told(lambda wid, role, epoch: events.append(("launcher", role, epoch)))
    change = asyncio.run(role_control.change_role(backend, "prefill-0", "colocated", 1.0, 5.0))
    assert events == [("launcher", "colocated", 2), ("sent", "colocated", 2)]
    assert (change.from_epoch, change.to_epoch) == (1, 2)


def test_a_worker_that_comes_back_in_its_old_role_mid_change_is_changed_on_its_new_incarnation():
    """The ChangeRole reached a process already dead: its restart registers in the launch role under
    the epoch the supervisor chose. The change runs again on that incarnation (one epoch above it)."""
    sent = []

    class Replaced(_LivePrefill):
        async def _send(self, wid, msg):
            sent.append((msg.role, msg.epoch))
            self.comes_back(wid, *(("prefill", 2) if len(sent) == 1 else (msg.role, msg.epoch)))  # first: a restart

    change = asyncio.run(role_control.change_role(Replaced(), "prefill-0", "colocated", 1.0, 5.0))
    assert sent == [("colocated", 2), ("colocated", 3)]
    assert (change.from_role, change.to_role, change.from_epoch, change.to_epoch) == ("prefill", "colocated", 2, 3)


def test_an_enable_interrupted_by_a_worker_that_fails_for_good_undoes_the_changes_it_made():
    """2P1D disabled (both prefill workers colocated). The enable makes prefill-0 prefill, then
    prefill-1 dies for good during its change (FAILED). Disaggregation stays off, so prefill-0
    would serve nothing as a prefill worker: the enable changes it back and says so (helper-44)."""
    sent = []
    failed: list[str] = []

    class TwoPrefill(Backend):
        def __init__(self):
            super().__init__()
            self.origin_roles = {"prefill-0": "prefill", "prefill-1": "prefill", "decode-0": "decode"}
            self.failed_workers = lambda: list(failed)
            self.control_auth = SimpleNamespace(advance=lambda wid, epoch: None)
            counter = SimpleNamespace(inc=lambda: None)
            self.metrics.role_changes = SimpleNamespace(labels=lambda *a: counter)
            self.on_role_changed = lambda wid, role, epoch: None
            self.restarts, self.away = True, set()
            for wid in ("prefill-0", "prefill-1"):
                self.comes_back(wid, "colocated", 2)
            self.router.set_disaggregation(False)  # disabled earlier

        def comes_back(self, wid, role, epoch):
            self.router.register(WorkerInfo(wid, "h0", Role(role), epoch, 1000, "m", "abi"))
            self.router.report_load(wid, epoch, LOAD)
            self.registered[wid] = SimpleNamespace(role=role, epoch=epoch)

        async def _send(self, wid, msg):
            sent.append((wid, msg.role, msg.epoch))
            if wid == "prefill-1":  # dies during its switch, past its crash limit
                failed.append(wid)
                del self.registered[wid]
                return
            self.comes_back(wid, msg.role, msg.epoch)

    backend = TwoPrefill()
    with pytest.raises(role_control.RoleChangeFailed, match="the enable was undone: prefill-0 of prefill-0 back to colocated"):
        asyncio.run(role_control.set_disaggregation(backend, True, 1.0))
    assert sent == [("prefill-0", "prefill", 3), ("prefill-1", "prefill", 3), ("prefill-0", "colocated", 4)]
    assert backend.registered["prefill-0"].role == "colocated" and backend.router.disaggregation is False
