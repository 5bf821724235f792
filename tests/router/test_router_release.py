"""The release controller's states when a role change fails (router/release.py): a failed
disable leaves the release PINNED (requests already run whole), a failed rollback stays
ROLLING_BACK and runs again from the top, illegal moves and concurrent operations are refused."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.router import release, role_control
from pdserve.router.config import Mode, RouterConfig
from pdserve.router.router import Router


class Backend:
    def __init__(self):
        self.router = Router(RouterConfig(Mode.DISAGGREGATED, "m", "abi"))
        self.live, self.registered = {}, {}

    async def revoke_capabilities(self) -> int:
        return 2


def failing(calls):
    async def set_disaggregation(backend, enabled, drain_timeout_s):
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
        control.backend.metrics = type("M", (), {"rollback_seconds": type("H", (), {"observe": lambda self, v: None})()})()
        done = await control.rollback()
        with pytest.raises(release.IllegalReleaseTransition):
            await control.rollback()
        return pinned, stuck, done, control

    pinned, stuck, done, control = asyncio.run(scenario())
    assert pinned == "PINNED" and control.backend.router.disaggregation is False
    assert stuck == "ROLLING_BACK" and done["state"] == "ROLLED_BACK"
    assert [s["name"] for s in done["steps"]][-1] == "ROLLBACK_COMPLETE"
    assert [h[0] for h in control.history] == ["ACTIVE", "PINNED", "ACTIVE", "ROLLING_BACK", "ROLLED_BACK"]
