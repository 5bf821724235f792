"""The router's block-hold ledger: decode reservations and prefill staging, taken before prefill.

A route holds blocks on up to two workers: at P the prompt blocks it must newly compute (they
stay resident until D has pulled them, so P's pool is the transfer buffer), at D the decode
reservation (prompt blocks D cannot already see + expected decode growth). Each hold gets a
per-worker grant sequence number. A worker applies grants in order and reports the highest one it
applied next to its free-block count, so a hold is "in flight" (and charged against the report by
the router) only until a report shows it applied; afterwards the report itself reflects it. That
keeps concurrent routes from oversubscribing a worker between two stale reports.

Route life cycle (illegal transitions raise):

    RESERVED --kv published at D (P hold released)--> PUBLISHED
    RESERVED | PUBLISHED --complete | abort | worker lost--> released (removed)

Colocated routes have no P hold and start PUBLISHED. A decode hold can grow (`grow`, reserve
dynamic: the request outgrew its predicted bucket): the decode worker took the blocks from its
unreserved free blocks before reporting it, so the growth is a grant that is applied already (its
own sequence number, never charged in flight) and is released with the route.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

from pdserve.router.errors import IllegalTransitionError, LeakError, UnknownRequestError
from pdserve.router.messages import BlockHold, new_frozen


class RouteState(str, enum.Enum):
    RESERVED = "reserved"
    PUBLISHED = "published"


@dataclass(frozen=True)
class HoldRequest:
    """What one route wants held on one worker; `tokens` and `seqs` are the load it adds there."""

    worker_id: str
    role_epoch: int
    blocks: int
    tokens: int = 0  # prompt tokens queued for prefill on this worker
    seqs: int = 0  # sequences joining this worker's decode batch


class InFlight(NamedTuple):
    """Sum of a worker's holds that its latest report does not reflect yet (a NamedTuple: this
    is updated on every grant and settle, so it must be cheap to build)."""

    blocks: int = 0
    tokens: int = 0
    seqs: int = 0

    def plus(self, hold: HoldRequest, sign: int) -> InFlight:
        blocks, tokens, seqs = self
        # tuple.__new__ skips the NamedTuple's Python-level __new__ (the same object, half the cost)
        return _new_tuple(InFlight, (blocks + sign * hold.blocks, tokens + sign * hold.tokens, seqs + sign * hold.seqs))


_NONE = InFlight()
_new_tuple = tuple.__new__


@dataclass(frozen=True)
class _Route:
    state: RouteState
    prefill: tuple[HoldRequest, int] | None  # (hold, grant seq)
    decode: tuple[HoldRequest, int]
    growth: tuple[tuple[HoldRequest, int], ...] = ()  # decode hold growths, applied at D when granted


class ReservationLedger:
    def __init__(self) -> None:
        self._routes: dict[str, _Route] = {}
        self._next_seq: dict[str, int] = {}
        self._unapplied: dict[str, dict[int, HoldRequest]] = {}  # worker -> grant seq -> hold
        self._in_flight: dict[str, InFlight] = {}
        self.num_granted = 0
        self.num_released = 0

    # ----- queries -----
    def in_flight(self) -> Mapping[str, InFlight]:
        """Per worker, the holds its latest report does not reflect yet (absent: none)."""
        return self._in_flight

    def headroom_blocks(self, worker_id: str, reported_free_blocks: int) -> int:
        return reported_free_blocks - self._in_flight.get(worker_id, _NONE).blocks

    def can_reserve(self, holds: Sequence[HoldRequest], reported_free: Mapping[str, int]) -> bool:
        in_flight = self._in_flight
        for h in holds:
            if h.blocks > reported_free[h.worker_id] - in_flight.get(h.worker_id, _NONE).blocks:
                return False
        return True

    def live_requests(self) -> tuple[str, ...]:
        return tuple(self._routes)

    def num_staging(self) -> int:
        """Routes still RESERVED: a prefill staging hold waits on an unpublished transfer."""
        return sum(1 for r in self._routes.values() if r.prefill is not None)

    def has_route(self, request_id: str) -> bool:
        return request_id in self._routes

    # ----- mutations -----
    def try_reserve(
        self, request_id: str, prefill: HoldRequest | None, decode: HoldRequest, reported_free: Mapping[str, int]
    ) -> tuple[BlockHold | None, BlockHold] | None:
        """`reserve`, or None (nothing taken) when a hold exceeds its worker's headroom."""
        self._validate(request_id, prefill, decode)
        wanted = (decode,) if prefill is None else (prefill, decode)
        return self._take(request_id, prefill, decode) if self.can_reserve(wanted, reported_free) else None

    def reserve(
        self, request_id: str, prefill: HoldRequest | None, decode: HoldRequest, reported_free: Mapping[str, int]
    ) -> tuple[BlockHold | None, BlockHold]:
        """Take both holds atomically; raises LeakError rather than oversubscribe a worker."""
        self._validate(request_id, prefill, decode)
        wanted = [h for h in (prefill, decode) if h is not None]
        if not self.can_reserve(wanted, reported_free):
            raise LeakError(f"request {request_id}: holds {wanted} exceed reported headroom")
        return self._take(request_id, prefill, decode)

    def _validate(self, request_id: str, prefill: HoldRequest | None, decode: HoldRequest) -> None:
        if request_id in self._routes:
            raise IllegalTransitionError(f"request {request_id} already holds a reservation")
        if prefill is not None and prefill.worker_id == decode.worker_id:
            raise ValueError("a disaggregated route needs two distinct workers; colocated passes prefill=None")

    def _take(self, request_id: str, prefill: HoldRequest | None, decode: HoldRequest) -> tuple[BlockHold | None, BlockHold]:
        p_grant = None if prefill is None else (prefill, self._grant(prefill))
        d_grant = (decode, self._grant(decode))
        state = RouteState.PUBLISHED if prefill is None else RouteState.RESERVED
        self._routes[request_id] = new_frozen(_Route, state=state, prefill=p_grant, decode=d_grant)
        return (None if p_grant is None else _as_block_hold(*p_grant)), _as_block_hold(*d_grant)

    def publish(self, request_id: str) -> None:
        """The K/V is visible at D: release the P staging hold (RESERVED -> PUBLISHED)."""
        route = self._route(request_id)
        if route.state is not RouteState.RESERVED or route.prefill is None:
            raise IllegalTransitionError(f"request {request_id}: publish from {route.state.value} is not allowed")
        self._ungrant(*route.prefill)
        self._routes[request_id] = _Route(RouteState.PUBLISHED, None, route.decode, route.growth)

    def grow(self, request_id: str, worker_id: str, blocks: int) -> int | None:
        """The route's decode worker took `blocks` more for it (the request outgrew its hold):
        record them as an applied grant on the route; returns its sequence number, or None when the
        route has no decode hold on `worker_id` (it moved, or was released)."""
        route = self._routes.get(request_id)
        if route is None or route.decode[0].worker_id != worker_id or blocks <= 0:
            return None
        hold = replace(route.decode[0], blocks=blocks, tokens=0, seqs=0)
        seq = self._grant(hold)
        self._settle(worker_id, seq)  # the worker applied it before reporting it
        self._routes[request_id] = replace(route, growth=(*route.growth, (hold, seq)))
        return seq

    def held_blocks(self, request_id: str) -> int:
        """Blocks the route holds at its decode worker: the reservation plus every growth."""
        route = self._route(request_id)
        return route.decode[0].blocks + sum(h.blocks for h, _ in route.growth)

    def release(self, request_id: str) -> None:
        """Completion or abort: drop every hold the route still has."""
        route = self._route(request_id)
        if route.prefill is not None:
            self._ungrant(*route.prefill)
        self._ungrant(*route.decode)
        for grown in route.growth:
            self._ungrant(*grown)
        del self._routes[request_id]

    def apply_ack(self, worker_id: str, applied_grant_seq: int) -> None:
        """A report from `worker_id` reflects every grant up to `applied_grant_seq`."""
        pending = self._unapplied.get(worker_id)
        while pending:
            seq = next(iter(pending))
            if seq > applied_grant_seq:
                break
            self._settle(worker_id, seq)

    def drop_worker(self, worker_id: str) -> list[str]:
        """A worker is gone: release every route holding blocks there; returns those request ids."""
        orphaned = [r for r, route in self._routes.items() if worker_id in _workers(route)]
        for request_id in orphaned:
            self.release(request_id)
        self._next_seq.pop(worker_id, None)  # a new epoch restarts its grant sequence
        return orphaned

    # ----- integrity -----
    def check_invariants(self) -> None:
        """In-flight totals equal the sum of unapplied holds, and every unapplied hold is live."""
        live = {(h.worker_id, seq) for r in self._routes.values() for h, seq in _grants(r)}
        for worker_id, pending in self._unapplied.items():
            total = InFlight()
            for seq, hold in pending.items():
                if (worker_id, seq) not in live:
                    raise LeakError(f"unapplied grant {worker_id}#{seq} belongs to no live route")
                total = total.plus(hold, +1)
            if total != self._in_flight.get(worker_id, InFlight()):
                raise LeakError(f"in-flight totals for {worker_id} drifted: {total}")
        if self.num_granted - self.num_released != len(live):
            raise LeakError(f"granted {self.num_granted} - released {self.num_released} != live {len(live)}")

    def assert_no_leaks(self) -> None:
        """The ledger is consistent and empty: every hold ever granted was released."""
        self.check_invariants()
        if self._routes or any(self._unapplied.values()) or any(v != InFlight() for v in self._in_flight.values()):
            raise LeakError(f"holds outstanding for requests {sorted(self._routes)}")

    # ----- internals -----
    def _route(self, request_id: str) -> _Route:
        if request_id not in self._routes:
            raise UnknownRequestError(f"request {request_id} has no live route")
        return self._routes[request_id]

    def _grant(self, hold: HoldRequest) -> int:
        worker_id = hold.worker_id
        seq = self._next_seq.get(worker_id, 0) + 1
        self._next_seq[worker_id] = seq
        pending = self._unapplied.get(worker_id)
        if pending is None:
            pending = self._unapplied[worker_id] = {}
        pending[seq] = hold
        self._in_flight[worker_id] = self._in_flight.get(worker_id, _NONE).plus(hold, +1)
        self.num_granted += 1
        return seq

    def _ungrant(self, hold: HoldRequest, seq: int) -> None:
        if seq in self._unapplied.get(hold.worker_id, {}):
            self._settle(hold.worker_id, seq)
        self.num_released += 1

    def _settle(self, worker_id: str, seq: int) -> None:
        hold = self._unapplied[worker_id].pop(seq)
        total = self._in_flight[worker_id].plus(hold, -1)
        if total == _NONE:
            del self._in_flight[worker_id]
        else:
            self._in_flight[worker_id] = total


def _grants(route: _Route) -> list[tuple[HoldRequest, int]]:
    return [g for g in (route.prefill, route.decode, *route.growth) if g is not None]


def _workers(route: _Route) -> set[str]:
    return {hold.worker_id for hold, _ in _grants(route)}


def _as_block_hold(hold: HoldRequest, seq: int) -> BlockHold:
    return new_frozen(BlockHold, worker_id=hold.worker_id, role_epoch=hold.role_epoch, blocks=hold.blocks, grant_seq=seq)
