"""Adapts a decode engine's block manager to the handoff's `DestinationBlocks` interface.

Contract: the worker first calls `engine.reserve_import` (prefix hits at the destination are
acquired, fresh blocks allocated, decode growth reserved as capacity) and `expect(...)` here;
the handoff endpoint then calls `reserve(owner=transfer_id, ...)`, which hands out exactly those
fresh blocks. `free` before commit is the abort path (`cancel_import` returns every block and
the growth reservation); after `committed(...)` the decoding sequence owns the blocks and frees
them itself when it finishes, so the endpoint's later `free` (on retire) only closes the entry.
All calls happen under the worker's lock.
"""

from __future__ import annotations

from pdserve.engine.engine import Engine
from pdserve.engine.outputs import ImportReservation
from pdserve.handoff.errors import HandoffError, RejectReason
from pdserve.handoff.reservations import Reservation


class EngineDestinationBlocks:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._expected: dict[str, tuple[str, ImportReservation]] = {}  # transfer id -> (request, engine reservation)
        self._held: dict[str, tuple[str, Reservation]] = {}  # reservation id -> (request, reservation)
        self._committed: set[str] = set()

    def expect(self, transfer_id: str, request_id: str, reservation: ImportReservation) -> None:
        self._expected[transfer_id] = (request_id, reservation)

    def can_reserve(self, num_blocks: int) -> bool:
        return True  # capacity was checked when the engine reservation was made

    def reserve(self, owner: str, num_prompt_blocks: int, num_growth_blocks: int = 0) -> Reservation:
        if owner not in self._expected:
            raise HandoffError(RejectReason.RESERVATION_EXHAUSTED, f"no engine reservation for {owner}")
        request_id, res = self._expected.pop(owner)
        blocks = res.transfer_block_ids
        if len(blocks) != num_prompt_blocks:
            self.engine.cancel_import(request_id)
            raise HandoffError(RejectReason.RESERVATION_EXHAUSTED, f"{len(blocks)} blocks held, {num_prompt_blocks} asked")
        reservation = Reservation(f"{owner}/res", owner, tuple(blocks), len(blocks))
        self._held[reservation.reservation_id] = (request_id, reservation)
        return reservation

    def committed(self, reservation_id: str) -> None:
        """Decode admitted the published blocks: the engine sequence owns them now."""
        self._committed.add(reservation_id)

    def free(self, reservation_id: str) -> None:
        if reservation_id not in self._held:
            raise HandoffError(RejectReason.WRONG_RESERVATION, f"{reservation_id} is not reserved")
        request_id, _ = self._held.pop(reservation_id)
        if reservation_id in self._committed:
            self._committed.discard(reservation_id)
        elif request_id in self.engine.imports:
            self.engine.cancel_import(request_id)

    def drop_expected(self, transfer_id: str) -> None:
        """The endpoint never reserved (refused early): return the engine reservation."""
        entry = self._expected.pop(transfer_id, None)
        if entry is not None and entry[0] in self.engine.imports:
            self.engine.cancel_import(entry[0])

    def is_reserved(self, reservation_id: str) -> bool:
        return reservation_id in self._held

    def assert_no_leaks(self) -> None:
        assert not self._expected, f"engine reservations never claimed: {sorted(self._expected)}"
        assert not self._held, f"reservations held: {sorted(self._held)}"
