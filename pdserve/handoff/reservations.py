"""Destination block reservations: capacity held for a transfer's prompt K/V and decode growth.

Contract: `DestinationBlocks` is the small interface the decode engine's block manager adapts
to. A reservation is made before any byte moves and is independent of byte credits: returning
credits never frees reserved blocks. An unpublished reservation is freed by the abort path; a
published one belongs to the decode directory until decode finishes with it.

    can_reserve(n) / reserve(owner, n)  check-then-act; `reserve` raises RESERVATION_EXHAUSTED
    free(reservation_id)                return every block of the reservation
    assert_no_leaks()                   free + reserved == total, and nothing reserved
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass
from typing import Protocol

from pdserve.handoff.errors import HandoffError, RejectReason


@dataclass(frozen=True)
class Reservation:
    reservation_id: str
    owner: str
    block_ids: tuple[int, ...]  # prompt blocks first, then decode-growth blocks
    num_prompt_blocks: int

    @property
    def prompt_blocks(self) -> tuple[int, ...]:
        return self.block_ids[: self.num_prompt_blocks]

    @property
    def growth_blocks(self) -> tuple[int, ...]:
        return self.block_ids[self.num_prompt_blocks :]


class DestinationBlocks(Protocol):
    def can_reserve(self, num_blocks: int) -> bool: ...

    def reserve(self, owner: str, num_prompt_blocks: int, num_growth_blocks: int = 0) -> Reservation: ...

    def free(self, reservation_id: str) -> None: ...

    def is_reserved(self, reservation_id: str) -> bool: ...

    def assert_no_leaks(self) -> None: ...


class PooledDestinationBlocks:
    """A free-list implementation of `DestinationBlocks` over block ids [0, num_blocks)."""

    def __init__(self, num_blocks: int, name: str = "dst"):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self._reserved: dict[str, Reservation] = {}
        self._ids = itertools.count()
        self._name = name
        self._lock = threading.Lock()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_reserve(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def reserve(self, owner: str, num_prompt_blocks: int, num_growth_blocks: int = 0) -> Reservation:
        total = num_prompt_blocks + num_growth_blocks
        with self._lock:
            if not self.can_reserve(total):
                raise HandoffError(RejectReason.RESERVATION_EXHAUSTED, f"need {total}, free {len(self._free)}")
            blocks = tuple(self._free.pop() for _ in range(total))
            rid = f"{self._name}-r{next(self._ids)}"
            self._reserved[rid] = Reservation(rid, owner, blocks, num_prompt_blocks)
            self._check()
            return self._reserved[rid]

    def free(self, reservation_id: str) -> None:
        with self._lock:
            if reservation_id not in self._reserved:
                raise HandoffError(RejectReason.WRONG_RESERVATION, f"{reservation_id} is not reserved")
            self._free.extend(reversed(self._reserved.pop(reservation_id).block_ids))
            self._check()

    def is_reserved(self, reservation_id: str) -> bool:
        return reservation_id in self._reserved

    def _check(self) -> None:
        held = sum(len(r.block_ids) for r in self._reserved.values())
        assert held + len(self._free) == self.num_blocks, (held, len(self._free))

    def assert_no_leaks(self) -> None:
        self._check()
        assert not self._reserved, f"reservations leaked: {sorted(self._reserved)}"
        assert len(set(self._free)) == self.num_blocks
