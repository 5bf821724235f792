"""Worker membership: registration, load reports, heartbeats, epochs and retirement.

Each worker is known under one role epoch at a time. Its life is a small state machine:

    REGISTERED --first load report--> LIVE --report--> LIVE
    LIVE --drain (a role change begins)--> DRAINING --report--> DRAINING
    REGISTERED | LIVE | DRAINING --missed heartbeats | deregister | newer epoch--> RETIRED

Only LIVE workers are offered to policies (a worker without a load report has unknown load; a
DRAINING one finishes what it holds and then takes a new role under a newer epoch).
A LIVE prefill or decode worker may be lent to the other dedicated pool (`lend`, Splitwise's
mixed state): it keeps its role and epoch and is offered in both pools until the loan ends
(`lend(..., None)`); nothing drains either way. A loan belongs to its epoch: a worker that
registers again (a restart, a role change) comes back unlent.
A retired epoch stays retired: any later message carrying it, or an older one, raises
`StaleEpochError`, so a late report from a dead incarnation can never resurrect it. Time comes
from an injected clock so expiry is tested without sleeping.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterable, Set
from dataclasses import dataclass, replace

from pdserve.router.errors import (
    DuplicateRegistrationError,
    IdentityMismatchError,
    IllegalTransitionError,
    RoleMismatchError,
    StaleEpochError,
    UnknownWorkerError,
)
from pdserve.router.messages import Role, WorkerInfo, WorkerLoad


class WorkerState(str, enum.Enum):
    REGISTERED = "registered"
    LIVE = "live"
    DRAINING = "draining"
    RETIRED = "retired"


_ALLOWED = {
    (WorkerState.REGISTERED, WorkerState.LIVE),
    (WorkerState.REGISTERED, WorkerState.RETIRED),
    (WorkerState.LIVE, WorkerState.LIVE),
    (WorkerState.LIVE, WorkerState.RETIRED),
    (WorkerState.LIVE, WorkerState.DRAINING),
    (WorkerState.DRAINING, WorkerState.DRAINING),
    (WorkerState.DRAINING, WorkerState.RETIRED),
}


def transition(current: WorkerState, target: WorkerState) -> WorkerState:
    if (current, target) not in _ALLOWED:
        raise IllegalTransitionError(f"worker state {current.value} -> {target.value} is not allowed")
    return target


@dataclass(frozen=True)
class WorkerEntry:
    info: WorkerInfo
    state: WorkerState
    last_seen_s: float
    load: WorkerLoad | None = None
    prefix_hashes: Set[int] = frozenset()  # the K/V index's live set for this worker (set_prefixes)
    lent_to: Role | None = None  # the other dedicated pool it serves as well while lent (lend)

    def serves(self, role: Role) -> bool:
        """Whether the worker takes `role`'s work: its own role, or the pool it is lent to."""
        return self.info.role is role or self.lent_to is role


@dataclass(frozen=True)
class RetiredWorker:
    worker_id: str
    role_epoch: int
    reason: str  # "heartbeat_timeout" | "deregistered" | "superseded"


@dataclass(frozen=True)
class ClusterIdentity:
    """What every worker must match to join: the model, the K/V ABI and the allowed roles."""

    model_identity: str
    kv_abi_hash: str
    roles: frozenset[Role]


class Registry:
    def __init__(
        self, identity: ClusterIdentity, heartbeat_timeout_s: float, clock: Callable[[], float] = time.monotonic
    ):
        self._identity = identity
        self._timeout_s = heartbeat_timeout_s
        self._clock = clock
        self._entries: dict[str, WorkerEntry] = {}
        self._retired_epoch: dict[str, int] = {}  # highest retired epoch per worker id
        self.membership_generation = 0  # bumped whenever the set of LIVE workers changes
        self.num_stale_rejected = 0

    def register(self, info: WorkerInfo) -> RetiredWorker | None:
        """Admit `info`; returns the superseded epoch's retirement when a worker re-registers."""
        self._check_identity(info)
        self._check_not_retired(info.worker_id, info.role_epoch)
        previous = self._entries.get(info.worker_id)
        superseded = None
        if previous is not None:
            if info.role_epoch == previous.info.role_epoch:
                raise DuplicateRegistrationError(f"{info.worker_id} already registered epoch {info.role_epoch}")
            if info.role_epoch < previous.info.role_epoch:
                self._stale(f"{info.worker_id} epoch {info.role_epoch} < live epoch {previous.info.role_epoch}")
            superseded = self._retire(info.worker_id, "superseded")
        self._entries[info.worker_id] = WorkerEntry(info, WorkerState.REGISTERED, self._clock())
        return superseded

    def heartbeat(self, worker_id: str, role_epoch: int) -> None:
        entry = self._current(worker_id, role_epoch)
        self._entries[worker_id] = replace(entry, last_seen_s=self._clock())

    def report_load(self, worker_id: str, role_epoch: int, load: WorkerLoad) -> None:
        """Record a load report; a report is also a heartbeat."""
        entry = self._current(worker_id, role_epoch)
        state = transition(entry.state, WorkerState.DRAINING if entry.state is WorkerState.DRAINING else WorkerState.LIVE)
        self._entries[worker_id] = WorkerEntry(entry.info, state, self._clock(), load, entry.prefix_hashes, entry.lent_to)
        if entry.state is WorkerState.REGISTERED:
            self.membership_generation += 1

    def set_prefixes(self, worker_id: str, held: Set[int]) -> None:
        """The worker's prefix set is now `held` (the K/V index's live set; router/kv/kv_index.py)."""
        entry = self._entries.get(worker_id)
        if entry is not None and entry.prefix_hashes is not held:
            self._entries[worker_id] = replace(entry, prefix_hashes=held)

    def drain(self, worker_id: str, role_epoch: int) -> None:
        """Stop offering the worker to policies: a role change begins (workers/roles.py)."""
        entry = self._current(worker_id, role_epoch)
        self._entries[worker_id] = replace(entry, state=transition(entry.state, WorkerState.DRAINING))
        self.membership_generation += 1

    def lend(self, worker_id: str, role_epoch: int, to: Role | None) -> None:
        """Lend a LIVE prefill or decode worker to the other dedicated pool (`to`), or end its
        loan (None): it keeps its role and epoch, and nothing it runs is drained (module contract)."""
        entry = self._current(worker_id, role_epoch)
        if to is not None:
            other = {Role.PREFILL: Role.DECODE, Role.DECODE: Role.PREFILL}.get(entry.info.role)
            if entry.state is not WorkerState.LIVE or to is not other:
                raise IllegalTransitionError(f"{worker_id} ({entry.info.role.value}, {entry.state.value}) "
                                             f"cannot be lent to the {to.value} pool")
        if entry.lent_to is not to:
            self._entries[worker_id] = replace(entry, lent_to=to)
            self.membership_generation += 1

    def deregister(self, worker_id: str, role_epoch: int) -> RetiredWorker:
        self._current(worker_id, role_epoch)
        return self._retire(worker_id, "deregistered")

    def excuse(self, seconds: float) -> None:
        """The router itself did not run for `seconds` (its process stopped, its event loop held):
        that time is no worker's silence, so every worker's last heartbeat moves that much later
        (never past now). Heartbeats sent meanwhile are still queued for the router to read."""
        now = self._clock()
        for worker_id, entry in self._entries.items():
            self._entries[worker_id] = replace(entry, last_seen_s=min(now, entry.last_seen_s + seconds))

    def expire(self) -> list[RetiredWorker]:
        """Retire every worker not heard from within the heartbeat timeout."""
        deadline_s = self._clock() - self._timeout_s
        late = [w for w, e in self._entries.items() if e.last_seen_s < deadline_s]
        return [self._retire(worker_id, "heartbeat_timeout") for worker_id in late]

    def live(self, roles: Iterable[Role]) -> tuple[WorkerEntry, ...]:
        """LIVE workers of the given roles or lent to one of them, ordered by worker id (the
        policies' slot order)."""
        wanted = set(roles)
        chosen = (e for e in self._entries.values()
                  if e.state is WorkerState.LIVE and (e.info.role in wanted or e.lent_to in wanted))
        return tuple(sorted(chosen, key=lambda e: e.info.worker_id))

    def entry(self, worker_id: str) -> WorkerEntry:
        if worker_id not in self._entries:
            raise UnknownWorkerError(f"worker {worker_id} is not registered")
        return self._entries[worker_id]

    def is_current(self, worker_id: str, role_epoch: int) -> bool:
        entry = self._entries.get(worker_id)
        return entry is not None and entry.info.role_epoch == role_epoch

    def _current(self, worker_id: str, role_epoch: int) -> WorkerEntry:
        self._check_not_retired(worker_id, role_epoch)
        entry = self.entry(worker_id)
        if role_epoch < entry.info.role_epoch:
            self._stale(f"{worker_id} epoch {role_epoch} superseded by {entry.info.role_epoch}")
        if role_epoch > entry.info.role_epoch:
            raise UnknownWorkerError(f"{worker_id} epoch {role_epoch} was never registered")
        return entry

    def _check_not_retired(self, worker_id: str, role_epoch: int) -> None:
        if role_epoch <= self._retired_epoch.get(worker_id, -1):
            self._stale(f"{worker_id} epoch {role_epoch} is retired")

    def _check_identity(self, info: WorkerInfo) -> None:
        ident = self._identity
        if (info.model_identity, info.kv_abi_hash) != (ident.model_identity, ident.kv_abi_hash):
            raise IdentityMismatchError(
                f"{info.worker_id}: model/ABI {info.model_identity}/{info.kv_abi_hash} "
                f"!= cluster {ident.model_identity}/{ident.kv_abi_hash}"
            )
        if info.role not in ident.roles:
            raise RoleMismatchError(f"{info.worker_id}: role {info.role.value} not served in this mode")

    def _retire(self, worker_id: str, reason: str) -> RetiredWorker:
        entry = self._entries.pop(worker_id)
        transition(entry.state, WorkerState.RETIRED)
        epoch = entry.info.role_epoch
        self._retired_epoch[worker_id] = max(epoch, self._retired_epoch.get(worker_id, -1))
        self.membership_generation += 1
        return RetiredWorker(worker_id, epoch, reason)

    def _stale(self, message: str) -> None:
        self.num_stale_rejected += 1
        raise StaleEpochError(message)
