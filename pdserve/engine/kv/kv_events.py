"""Block events of one engine's prefix cache, numbered, for the router's cluster K/V index.

Contract: the block manager records one event per change of its prefix cache: STORED when a
full block's chain hash enters the cache, REMOVED when it leaves (eviction, or the host tier's
own eviction, tier HOST). With a host tier (engine/kv/host_tier.py) an evicted block is DEMOTED
(tier HOST) instead, and PROMOTED (tier DEVICE) when a hit copies it back. Every recorded event
takes the next sequence number (the first is 1) for the life of the log: one log per block
manager, so the numbers run on across a worker's role epochs.

`take()` hands out the events recorded since the previous take as one `KvReport` whose
`last_seq` is the newest number it reflects. The log holds at most `capacity` events: past that
it drops them and the next take is a resync instead (every hash the cache holds now, all
STORED, `resync=True`), as it is when the caller asks for one. A reader that applies every
report in order (a resync replacing what it held) holds exactly the cache's key set.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

import msgspec

EVENTS_PER_REPORT = 4096  # the most events one report carries before a resync replaces them


class BlockEventKind(enum.IntEnum):
    STORED = 1
    REMOVED = 2
    DEMOTED = 3  # evicted from the device pool into the host tier (engine/kv/host_tier.py)
    PROMOTED = 4  # back from the host tier on a hit


class KvTier(enum.IntEnum):
    DEVICE = 0  # the engine's K/V pool
    HOST = 1  # the host-memory tier (engine/kv/host_tier.py)


class BlockEvent(msgspec.Struct, frozen=True, array_like=True):
    kind: BlockEventKind
    block_hash: bytes  # the chain hash (engine/kv/block_manager.py)
    tier: KvTier = KvTier.DEVICE


class KvReport(msgspec.Struct, frozen=True):
    """Events numbered `last_seq - len(events) + 1 .. last_seq`; a resync is the whole cache
    as of `last_seq` (every event STORED) and replaces what the reader held."""

    last_seq: int
    events: tuple[BlockEvent, ...] = ()
    resync: bool = False

    @property
    def first_seq(self) -> int:
        return self.last_seq - len(self.events) + 1


class BlockEventLog:
    __slots__ = ("capacity", "seq", "_pending", "_overflowed")

    def __init__(self, capacity: int = EVENTS_PER_REPORT):
        if capacity < 1:
            raise ValueError(f"event log capacity must be positive, got {capacity}")
        self.capacity = capacity
        self.seq = 0  # number of the newest recorded event
        self._pending: list[BlockEvent] = []
        self._overflowed = False

    def record(self, kind: BlockEventKind, block_hash: bytes, tier: KvTier = KvTier.DEVICE) -> None:
        self.seq += 1
        if self._overflowed:
            return  # the next take is a resync: nothing pending is needed
        if len(self._pending) >= self.capacity:
            self._pending.clear()
            self._overflowed = True
            return
        self._pending.append(BlockEvent(kind, block_hash, tier))

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def take(self, held: Iterable[bytes], resync: bool = False, host_held: Iterable[bytes] = ()) -> KvReport:
        """The report since the previous take; a resync over `held` (the device cache's keys now)
        and `host_held` (the host tier's) when asked or when the log overflowed."""
        if resync or self._overflowed:
            self._pending, self._overflowed = [], False
            stored = tuple(BlockEvent(BlockEventKind.STORED, h) for h in held) + tuple(
                BlockEvent(BlockEventKind.STORED, h, KvTier.HOST) for h in host_held)
            return KvReport(self.seq, stored, resync=True)
        events, self._pending = tuple(self._pending), []
        return KvReport(self.seq, events)
