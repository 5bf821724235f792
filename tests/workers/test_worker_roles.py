"""The worker's role switch state machine (workers/roles.py): legal and illegal requests."""

from __future__ import annotations

import pytest

from pdserve.workers.local_prefill import LocalPrefills
from pdserve.workers.roles import RoleChangeError, RoleState, RoleSwitch, sides


def test_a_switch_drains_then_takes_the_new_role_under_the_new_epoch():
    switch = RoleSwitch("prefill", 1)
    switch.request("colocated", 2)
    assert switch.draining and (switch.role, switch.epoch) == ("prefill", 1)  # still the old role while draining
    assert switch.finish() == ("prefill", "colocated")
    assert (switch.role, switch.epoch, switch.state, switch.num_changes) == ("colocated", 2, RoleState.SERVING, 1)


@pytest.mark.parametrize("role, epoch", [("router", 2), ("decode", 1), ("decode", 0)])
def test_an_unknown_role_or_an_epoch_that_does_not_advance_is_refused(role, epoch):
    switch = RoleSwitch("prefill", 1)
    with pytest.raises(RoleChangeError):
        switch.request(role, epoch)
    assert (switch.state, switch.role, switch.epoch) == (RoleState.SERVING, "prefill", 1)


def test_a_second_switch_while_one_drains_and_a_finish_without_one_are_refused():
    switch = RoleSwitch("decode", 3)
    with pytest.raises(RoleChangeError):
        switch.finish()
    switch.request("colocated", 4)
    with pytest.raises(RoleChangeError):
        switch.request("prefill", 5)
    assert switch.target == ("colocated", 4)


def test_each_role_builds_its_sides():
    assert [sides(r) for r in ("prefill", "decode", "colocated")] == [(True, False), (False, True), (True, True)]


def test_a_lendable_worker_builds_both_sides_and_takes_whole_requests_in_its_own_role():
    # Splitwise may lend it to the other pool without a role change (the spec's mixed state)
    assert [sides(r, lendable=True) for r in ("prefill", "decode")] == [(True, True), (True, True)]
    lent = LocalPrefills("prefill", lendable=True)
    lent.accept("r")
    assert lent.request_ids == {"r"}  # its local prefills count in its load like a decode worker's
    with pytest.raises(ValueError):
        LocalPrefills("prefill").accept("r")
