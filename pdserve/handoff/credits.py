"""Byte credits: a window that bounds unpublished transfer bytes owned by network and staging.

Contract:
  * `can_acquire(n)` / `acquire(chunk_id, n)` is the check-then-act pair; acquiring past the
    capacity raises CREDIT_OVERRUN, so 0 <= in_flight <= capacity holds at every instant.
  * A credit is a byte range [offset, offset + n) of the window: held ranges never overlap, so a
    staging transport (shm) maps the window one to one onto its staging area and a chunk's
    offset names where its bytes wait until the destination copies them out. `acquire` returns
    the offset (first fit); `can_acquire(n)` is true only when a free range of n bytes exists.
  * `release(chunk_id, event)` returns a chunk's credit only at DEVICE_VISIBLE; an earlier event
    (a network receive) raises CREDIT_EARLY_RETURN and keeps the credit held.
  * `reclaim(chunk_id)` is the abort path's release, used only after late callbacks are fenced.
  * Credits never touch destination block reservations; those live in `reservations`.
Life cycle: acquire before a chunk is issued -> release when the destination reports it
visible (or reclaim on abort) -> `assert_no_leaks()` when the scenario ends.
"""

from __future__ import annotations

import threading

from pdserve.handoff.errors import HandoffError, RejectReason
from pdserve.handoff.states import ChunkState


class ByteCredits:
    def __init__(self, capacity_bytes: int):
        if capacity_bytes <= 0:
            raise ValueError("credit capacity must be positive")
        self.capacity_bytes = capacity_bytes
        self._held: dict[str, tuple[int, int]] = {}  # chunk id -> (offset, nbytes)
        self._in_flight = 0
        self.peak_in_flight = 0
        self._lock = threading.Lock()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def holds(self, chunk_id: str) -> bool:
        return chunk_id in self._held

    def offset_of(self, chunk_id: str) -> int:
        return self._held[chunk_id][0]

    def can_acquire(self, nbytes: int) -> bool:
        return self._first_fit(nbytes) is not None

    def _first_fit(self, nbytes: int) -> int | None:
        """Lowest offset of a free range of `nbytes` inside the window, or None."""
        start = 0
        for offset, size in sorted(self._held.values()):
            if offset - start >= nbytes:
                return start
            start = max(start, offset + size)
        return start if self.capacity_bytes - start >= nbytes else None

    def acquire(self, chunk_id: str, nbytes: int) -> int:
        """Hold `nbytes` of the window for `chunk_id`; returns the range's offset."""
        if nbytes > self.capacity_bytes:
            raise HandoffError(RejectReason.CREDIT_OVERRUN, f"chunk of {nbytes} B exceeds window {self.capacity_bytes}")
        with self._lock:
            if chunk_id in self._held:
                raise HandoffError(RejectReason.ILLEGAL_TRANSITION, f"credit for {chunk_id} already held")
            offset = self._first_fit(nbytes)
            if offset is None:
                raise HandoffError(RejectReason.CREDIT_OVERRUN, f"{self._in_flight}+{nbytes} > {self.capacity_bytes}")
            self._held[chunk_id] = (offset, nbytes)
            self._in_flight += nbytes
            self.peak_in_flight = max(self.peak_in_flight, self._in_flight)
            self._check()
            return offset

    def release(self, chunk_id: str, event: ChunkState) -> int:
        if event is not ChunkState.DEVICE_VISIBLE:
            raise HandoffError(RejectReason.CREDIT_EARLY_RETURN, f"{chunk_id} at {event.name}")
        return self._drop(chunk_id)

    def reclaim(self, chunk_id: str) -> int:
        """Abort-path return of a credit whose chunk will never become visible."""
        return self._drop(chunk_id)

    def _drop(self, chunk_id: str) -> int:
        with self._lock:
            if chunk_id not in self._held:
                raise HandoffError(RejectReason.CREDIT_UNKNOWN, chunk_id)
            _, nbytes = self._held.pop(chunk_id)
            self._in_flight -= nbytes
            self._check()
            return nbytes

    def _check(self) -> None:
        assert 0 <= self._in_flight <= self.capacity_bytes, self._in_flight
        assert self._in_flight == sum(n for _, n in self._held.values())
        end = 0
        for offset, size in sorted(self._held.values()):
            assert offset >= end, "credit ranges overlap"
            end = offset + size
        assert end <= self.capacity_bytes, end

    def assert_no_leaks(self) -> None:
        assert self._in_flight == 0 and not self._held, f"credits leaked: {self._held}"
