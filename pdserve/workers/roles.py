"""A worker's role, its role epoch, and the drained switch from one role to another.

Contract: one mechanism serves every role change the runtime makes — Splitwise lending and
role changes, live disable/enable of disaggregation and the rollback drill. A switch is a small
state machine:

    SERVING --request(role, epoch)--> DRAINING --finish() once quiet--> SERVING (role, epoch)

While DRAINING the worker still serves what it holds (the router routes nothing new to it); the
worker aborts what the router could not drain in time, waits until no handoff thread still reads
or writes its blocks, and only then takes the new role under the new epoch and registers again.
The epoch is the one the handoff's identity fence carries (DecodeEndpoint, TransferPlan's
dest_epoch), so a transfer fenced under the old role is rejected, and the router's registry drops
every later message of the old epoch. Illegal requests (an unknown role, an epoch that does not
advance, a second switch while one drains) raise `RoleChangeError`.

A Splitwise loan is not a role change. A `lendable` worker (`pdserve serve --mode splitwise`)
builds both sides whatever its dedicated role, so the router can lend it to the other pool: it
keeps its role and epoch, takes the borrowed phase as well (the mixed state), and goes back to
its own phase when the loan ends, with nothing drained (router/state/registry.py's `lend`). Only
a loan that becomes lasting (Splitwise's adoption) changes the role, through this switch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

ROLES = ("prefill", "decode", "colocated", "mixed")  # mixed: both sides, Splitwise's mixed pool


class RoleChangeError(ValueError):
    """A role change the worker cannot take (the router sent an illegal one)."""


class RoleState(str, enum.Enum):
    SERVING = "serving"
    DRAINING = "draining"


def sides(role: str, lendable: bool = False) -> tuple[bool, bool]:
    """(has a prefill side, has a decode side) for a role: what the worker builds for it. A
    lendable worker has both (it may be lent to the other pool; module contract)."""
    if role not in ROLES:
        raise RoleChangeError(f"unknown role {role!r}; expected one of {ROLES}")
    if lendable:
        return True, True
    return role in ("prefill", "colocated", "mixed"), role in ("decode", "colocated", "mixed")


@dataclass
class RoleSwitch:
    role: str
    epoch: int
    state: RoleState = RoleState.SERVING
    target: tuple[str, int] | None = None
    num_changes: int = 0

    def request(self, role: str, epoch: int) -> None:
        """Begin draining toward `role` under `epoch`."""
        sides(role)
        if self.state is not RoleState.SERVING:
            raise RoleChangeError(f"a switch to {self.target} is still draining")
        if epoch <= self.epoch:
            raise RoleChangeError(f"a role change must advance the epoch: {epoch} <= {self.epoch}")
        self.state, self.target = RoleState.DRAINING, (role, epoch)

    @property
    def draining(self) -> bool:
        return self.state is RoleState.DRAINING

    def finish(self) -> tuple[str, str]:
        """Take the target role and epoch; returns (old role, new role)."""
        if self.state is not RoleState.DRAINING or self.target is None:
            raise RoleChangeError("no role change is draining")
        old = self.role
        (self.role, self.epoch), self.target = self.target, None
        self.state = RoleState.SERVING
        self.num_changes += 1
        return old, self.role
