"""The decode directory: which transfer owns each request's published K/V at a decode worker.

Contract:
  * `publish(...)` is one atomic compare-and-swap under the request's generation: the same
    transfer id again is idempotent (returns the existing handle); a different transfer at an
    older or equal generation is STALE_GENERATION; a newer generation supersedes the entry and
    the displaced handle is returned to the caller to free. Never two owners.
  * `fence(request, generation)` raises the floor after a reroute, so a late completion of an
    abandoned generation is rejected even before the new one publishes.
  * `admit(request)` hands decode only a PUBLISHED handle; anything else is NOT_PUBLISHED.
  * `retire(request)` removes the entry when decode finishes; the caller frees its blocks.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from pdserve.handoff.errors import HandoffError, RejectReason


@dataclass(frozen=True)
class PublishedHandle:
    request_id: str
    generation: int
    transfer_id: str
    reservation_id: str
    block_table: tuple[int, ...]  # destination block of every prompt block, reused ones first
    growth_blocks: tuple[int, ...]
    num_tokens: int


@dataclass(frozen=True)
class PublishResult:
    handle: PublishedHandle
    duplicate: bool  # True when this transfer id had already published
    displaced: PublishedHandle | None  # an older generation's handle that the caller must free


class DecodeDirectory:
    def __init__(self) -> None:
        self._entries: dict[str, PublishedHandle] = {}
        self._floor: dict[str, int] = {}
        self._admitted: set[str] = set()
        self._lock = threading.Lock()

    def fence(self, request_id: str, generation: int) -> None:
        with self._lock:
            self._floor[request_id] = max(self._floor.get(request_id, 0), generation)

    def lookup(self, request_id: str) -> PublishedHandle | None:
        return self._entries.get(request_id)

    def publish(self, handle: PublishedHandle) -> PublishResult:
        with self._lock:
            current = self._entries.get(handle.request_id)
            if current is not None and current.transfer_id == handle.transfer_id:
                return PublishResult(current, duplicate=True, displaced=None)
            self._check_current(handle, current)
            self._entries[handle.request_id] = handle
            self._admitted.discard(handle.request_id)
            return PublishResult(handle, duplicate=False, displaced=current)

    def _check_current(self, handle: PublishedHandle, current: PublishedHandle | None) -> None:
        if handle.generation < self._floor.get(handle.request_id, 0):
            raise HandoffError(RejectReason.STALE_GENERATION, f"below fence {self._floor[handle.request_id]}")
        if current is not None and current.generation >= handle.generation:
            raise HandoffError(RejectReason.STALE_GENERATION,
                               f"{handle.transfer_id}@{handle.generation} vs owner {current.transfer_id}@{current.generation}")
        if current is not None and current.request_id in self._admitted:
            raise HandoffError(RejectReason.ALREADY_PUBLISHED, f"{current.transfer_id} is already decoding")

    def admit(self, request_id: str) -> PublishedHandle:
        with self._lock:
            handle = self._entries.get(request_id)
            if handle is None:
                raise HandoffError(RejectReason.NOT_PUBLISHED, request_id)
            self._admitted.add(request_id)
            return handle

    def retire(self, request_id: str) -> PublishedHandle:
        with self._lock:
            if request_id not in self._entries:
                raise HandoffError(RejectReason.NOT_PUBLISHED, request_id)
            self._admitted.discard(request_id)
            return self._entries.pop(request_id)

    def owners(self) -> dict[str, str]:
        return {rid: h.transfer_id for rid, h in self._entries.items()}

    def assert_no_leaks(self) -> None:
        assert not self._entries, f"published handles never retired: {self.owners()}"
