"""The two state machines of a handoff: the request transaction and each chunk.

Contract: states only move along the edges listed here; any other move raises
`HandoffError(ILLEGAL_TRANSITION)`, except the two ownership edges that get their own reason
(aborting a published transaction, publishing an aborted one).

    transaction: PLANNED -> RESERVED -> TRANSFERRING -> VALIDATED -> PUBLISHED
                 any state before PUBLISHED -> ABORTED
    chunk:       DECLARED -> CREDIT_ACQUIRED -> SENT -> RECEIVED -> DEVICE_VISIBLE
                 any state before DEVICE_VISIBLE -> CANCELLED   (abort only)

Transitions are ordered, so a side that learns of a later state from a peer (a destination
receiving a frame witnesses CREDIT_ACQUIRED and SENT) walks every edge with `advance_to`.
"""

from __future__ import annotations

from enum import IntEnum

from pdserve.handoff.errors import HandoffError, RejectReason


class TxnState(IntEnum):
    PLANNED = 0
    RESERVED = 1
    TRANSFERRING = 2
    VALIDATED = 3
    PUBLISHED = 4
    ABORTED = 5


class ChunkState(IntEnum):
    DECLARED = 0
    CREDIT_ACQUIRED = 1
    SENT = 2
    RECEIVED = 3
    DEVICE_VISIBLE = 4
    CANCELLED = 5


_TXN_EDGES = {
    TxnState.PLANNED: {TxnState.RESERVED, TxnState.ABORTED},
    TxnState.RESERVED: {TxnState.TRANSFERRING, TxnState.ABORTED},
    TxnState.TRANSFERRING: {TxnState.VALIDATED, TxnState.ABORTED},
    TxnState.VALIDATED: {TxnState.PUBLISHED, TxnState.ABORTED},
    TxnState.PUBLISHED: set(),
    TxnState.ABORTED: set(),
}

_CHUNK_EDGES = {
    ChunkState.DECLARED: {ChunkState.CREDIT_ACQUIRED, ChunkState.CANCELLED},
    ChunkState.CREDIT_ACQUIRED: {ChunkState.SENT, ChunkState.CANCELLED},
    ChunkState.SENT: {ChunkState.RECEIVED, ChunkState.CANCELLED},
    ChunkState.RECEIVED: {ChunkState.DEVICE_VISIBLE, ChunkState.CANCELLED},
    ChunkState.DEVICE_VISIBLE: set(),
    ChunkState.CANCELLED: set(),
}


def check_txn_move(old: TxnState, new: TxnState) -> TxnState:
    """Return `new` if `old -> new` is an edge; raise with the most specific reason otherwise."""
    if new in _TXN_EDGES[old]:
        return new
    if old is TxnState.PUBLISHED:
        raise HandoffError(RejectReason.ALREADY_PUBLISHED, f"{old.name} -> {new.name}")
    if old is TxnState.ABORTED:
        raise HandoffError(RejectReason.TXN_ABORTED, f"{old.name} -> {new.name}")
    raise HandoffError(RejectReason.ILLEGAL_TRANSITION, f"transaction {old.name} -> {new.name}")


def check_chunk_move(old: ChunkState, new: ChunkState) -> ChunkState:
    if new in _CHUNK_EDGES[old]:
        return new
    raise HandoffError(RejectReason.ILLEGAL_TRANSITION, f"chunk {old.name} -> {new.name}")


def txn_path(old: TxnState, new: TxnState) -> list[TxnState]:
    """The forward edges from `old` to `new` (exclusive of `old`); raises if `new` is behind."""
    if new is TxnState.ABORTED or new <= old:
        return [check_txn_move(old, new)]
    return [TxnState(s) for s in range(old + 1, new + 1)]


class ChunkTable:
    """State of every chunk of one transfer, keyed by chunk id; moves are checked edge by edge."""

    def __init__(self, chunk_ids: list[str]):
        self._states = {cid: ChunkState.DECLARED for cid in chunk_ids}

    def __contains__(self, chunk_id: str) -> bool:
        return chunk_id in self._states

    def state(self, chunk_id: str) -> ChunkState:
        return self._states[chunk_id]

    def move(self, chunk_id: str, new: ChunkState) -> None:
        self._states[chunk_id] = check_chunk_move(self._states[chunk_id], new)

    def advance_to(self, chunk_id: str, target: ChunkState) -> None:
        """Walk every edge from the current state up to `target` (which must lie ahead)."""
        current = self._states[chunk_id]
        if target <= current or target is ChunkState.CANCELLED:
            self.move(chunk_id, target)
            return
        for step in range(current + 1, target + 1):
            self.move(chunk_id, ChunkState(step))

    def ids_in(self, *states: ChunkState) -> list[str]:
        return [cid for cid, s in self._states.items() if s in states]

    def all_in(self, state: ChunkState) -> bool:
        return all(s is state for s in self._states.values())

    def cancel_open(self) -> list[str]:
        """Cancel every chunk that is not yet visible; returns the cancelled ids."""
        open_ids = [cid for cid, s in self._states.items() if s < ChunkState.DEVICE_VISIBLE]
        for cid in open_ids:
            self.move(cid, ChunkState.CANCELLED)
        return open_ids
