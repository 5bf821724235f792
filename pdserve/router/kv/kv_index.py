"""The cluster K/V index: which worker holds which prefix block, built from block events.

Contract:
- Each worker reports its prefix cache as numbered block events (engine/kv/kv_events.py) in its
  heartbeats. `apply(worker, epoch, delta)` applies a report whose numbers continue the last one
  applied for that worker epoch; a report that skips numbers (or a worker epoch with no baseline
  yet) changes nothing and answers RESYNC_NEEDED: the caller asks the worker for a resync (the
  whole key set in one report), which replaces everything the index held for it. Further
  reports before the resync answer AWAITING_RESYNC, and RESYNC_NEEDED again every
  `resync_retry_reports` of them (a lost request is asked again). Reports already applied
  (numbers at or below the last applied) and older epochs are ignored.
- An entry is one (block hash, worker) pair with its tier, under the worker's current epoch.
  `retire(worker, epoch)` drops every entry of that epoch (and older): a dead or re-registered
  worker's blocks vanish with it; a report under a newer epoch does the same first.
- At most `max_entries` entries after every call: past the bound the least recently used
  entries (any worker's) are evicted, counted in `num_evictions`; a later REMOVED for one is a
  no-op. Recency is a stamp per entry (an index-wide clock), kept in each worker's
  insertion-ordered dict, so the oldest entries are a merge of the workers' heads. An entry is
  used when it is STORED, DEMOTED or PROMOTED (its block moved tier: the worker touched it) and
  when a route reads it: `touch(worker, keys)` records that a request routed to the worker reuses
  the leading run of `keys` it holds. Touches are queued (the routing path only appends) and
  stamped before the next report is applied, leaf first so the run's root is the most recent:
  the first blocks of a shared system prompt stay while conversations on it are routed.
- `held(worker)` is the live set of block hashes the worker holds (a dict's keys view), mutated
  in place by later calls (the same object for a worker epoch's whole life): the snapshot's
  per-slot prefix sets are these views, patched by the `HeldChange`s every call returns (net
  additions and removals per worker, evictions included).
- `host_held(worker)` is the live subset of `held(worker)` whose tier is HOST (demoted into the
  worker's host tier and not promoted since), kept like `held`; `host_workers` names the workers
  with a non-empty one (the prefix policy prices their hits at the promotion time).
- Hashes are the routing keys: the first 8 bytes of the engine's 16-byte chain hash (`hash_key`).
- `stats()` reports entries and a memory estimate (`BYTES_PER_ENTRY` per entry: the worker
  dict's slot, the key and its stamp, measured with tracemalloc in the tests).
"""

from __future__ import annotations

import enum
import heapq
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import islice

from pdserve.engine.kv.kv_events import BlockEventKind, KvReport, KvTier

DEFAULT_MAX_ENTRIES = 1 << 19  # 128 workers x 4,096 blocks
BYTES_PER_ENTRY = 108  # estimate (see the contract); checked against tracemalloc in tests
BYTES_PER_WORKER = 1024
RESYNC_RETRY_REPORTS = 8
MAX_PENDING_TOUCHES = 1024  # queued route touches stamped at once past this many (else at the next report)

Event = tuple[int, int, int]  # (BlockEventKind, hash key, KvTier), plain ints
_STORED, _REMOVED = int(BlockEventKind.STORED), int(BlockEventKind.REMOVED)
_HOST = int(KvTier.HOST)


def hash_key(block_hash: bytes) -> int:
    """The router's key for an engine chain hash (also what requests' block hashes are mapped to)."""
    return int.from_bytes(block_hash[:8], "little")


class KvOutcome(str, enum.Enum):
    APPLIED = "applied"
    RESYNCED = "resynced"
    IGNORED = "ignored"  # already applied, or an older epoch
    RESYNC_NEEDED = "resync_needed"  # ask the worker for a resync now
    AWAITING_RESYNC = "awaiting_resync"  # asked already; nothing applied


@dataclass(frozen=True)
class KvDelta:
    """One worker report in router terms: events numbered `last_seq - len(events) + 1 .. last_seq`."""

    last_seq: int
    events: tuple[Event, ...] = ()
    resync: bool = False

    @classmethod
    def from_report(cls, report: KvReport) -> KvDelta:
        events = tuple((int(e.kind), hash_key(e.block_hash), int(e.tier)) for e in report.events)
        return cls(report.last_seq, events, report.resync)


@dataclass(frozen=True)
class Location:
    worker_id: str
    tier: KvTier
    epoch: int


@dataclass(frozen=True)
class HeldChange:
    """A worker's held set gained `added` and lost `removed` (net, over one call)."""

    worker_id: str
    added: tuple[int, ...]
    removed: tuple[int, ...]


@dataclass(frozen=True)
class KvApplied:
    outcome: KvOutcome
    changes: tuple[HeldChange, ...] = ()


@dataclass(frozen=True)
class KvIndexStats:
    entries: int
    workers: int
    max_entries: int
    num_evictions: int
    num_resyncs_requested: int
    num_resyncs_applied: int
    memory_bytes: int


class _WorkerKv:
    __slots__ = ("epoch", "applied_seq", "stamps", "held", "host", "waiting")

    def __init__(self, epoch: int):
        self.epoch = epoch
        self.applied_seq: int | None = None  # None: no baseline, a resync is needed
        self.stamps: dict[int, int] = {}  # key -> the index clock at its last STORED, oldest first
        self.held = self.stamps.keys()  # the live view handed out (`held`)
        self.host: set[int] = set()  # the subset of `held` in the host tier
        self.waiting = 0  # reports seen since the resync was asked for


class _Changes:
    """Net additions and removals per worker over one call."""

    def __init__(self) -> None:
        self.added: dict[str, set[int]] = {}
        self.removed: dict[str, set[int]] = {}

    def sets(self, worker_id: str) -> tuple[set[int], set[int]]:
        """The worker's (added, removed) sets, to update inline on the hot path."""
        return self.added.setdefault(worker_id, set()), self.removed.setdefault(worker_id, set())

    def add(self, worker_id: str, key: int) -> None:
        removed = self.removed.get(worker_id)
        if removed is not None and key in removed:
            removed.discard(key)
        else:
            self.added.setdefault(worker_id, set()).add(key)

    def remove(self, worker_id: str, key: int) -> None:
        added = self.added.get(worker_id)
        if added is not None and key in added:
            added.discard(key)
        else:
            self.removed.setdefault(worker_id, set()).add(key)

    def result(self) -> tuple[HeldChange, ...]:
        workers = sorted(self.added.keys() | self.removed.keys())
        changes = (HeldChange(w, tuple(self.added.get(w, ())), tuple(self.removed.get(w, ()))) for w in workers)
        return tuple(c for c in changes if c.added or c.removed)


class KvIndex:
    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, resync_retry_reports: int = RESYNC_RETRY_REPORTS):
        if max_entries < 1:
            raise ValueError(f"the K/V index needs room for an entry, got max_entries={max_entries}")
        self.max_entries = max_entries
        self.resync_retry_reports = resync_retry_reports
        self._size = 0  # entries, over all workers
        self._clock = 0  # stamps STORED events: the LRU order over every worker's entries
        self._workers: dict[str, _WorkerKv] = {}
        self.host_workers: set[str] = set()  # workers with a host-tier entry
        self.num_evictions = 0
        self.num_resyncs_requested = 0
        self.num_resyncs_applied = 0
        self._touches: list[tuple[str, tuple[int, ...] | list[int]]] = []  # routes' reads, not stamped yet

    # ---- reports ------------------------------------------------------------------------
    def touch(self, worker_id: str, keys: tuple[int, ...] | list[int]) -> None:
        """A request routed to the worker reuses the leading run of `keys` it holds (queued)."""
        self._touches.append((worker_id, keys))
        if len(self._touches) >= MAX_PENDING_TOUCHES:
            self._stamp_touches()

    def apply(self, worker_id: str, epoch: int, delta: KvDelta) -> KvApplied:
        self._stamp_touches()
        changes = _Changes()
        state = self._state(worker_id, epoch, changes)
        if state is None:
            return KvApplied(KvOutcome.IGNORED)
        applied = state.applied_seq
        if applied is not None and delta.last_seq <= applied and not (delta.resync and delta.last_seq == applied):
            return KvApplied(KvOutcome.IGNORED, changes.result())
        if delta.resync:
            self._resync(worker_id, state, delta, changes)
            return KvApplied(KvOutcome.RESYNCED, changes.result())
        first = delta.last_seq - len(delta.events) + 1
        if applied is None or first > applied + 1:
            return KvApplied(self._ask(state), changes.result())
        self._events(worker_id, state, delta.events[applied + 1 - first :], changes)
        state.applied_seq = delta.last_seq
        return KvApplied(KvOutcome.APPLIED, changes.result())

    def replace(self, worker_id: str, epoch: int, hashes: Iterable[int]) -> tuple[HeldChange, ...]:
        """An in-process full set (tests, synthetic clusters): like a resync, numbers untouched."""
        self._stamp_touches()
        changes = _Changes()
        state = self._state(worker_id, epoch, changes)
        if state is not None:
            events = tuple((_STORED, key, 0) for key in hashes)
            self._resync(worker_id, state, KvDelta(state.applied_seq or 0, events, True), changes, count=False)
        return changes.result()

    def retire(self, worker_id: str, epoch: int) -> tuple[HeldChange, ...]:
        """Drop every entry of the worker's `epoch` or an older one."""
        state = self._workers.get(worker_id)
        if state is None or state.epoch > epoch:
            return ()
        del self._workers[worker_id]
        self.host_workers.discard(worker_id)
        self._size -= len(state.stamps)
        return (HeldChange(worker_id, (), tuple(state.held)),) if state.held else ()

    # ---- views --------------------------------------------------------------------------
    def held(self, worker_id: str) -> set[int] | frozenset[int]:
        state = self._workers.get(worker_id)
        return frozenset() if state is None else state.held

    def host_held(self, worker_id: str) -> set[int] | frozenset[int]:
        state = self._workers.get(worker_id)
        return frozenset() if state is None else state.host

    def holders(self, key: int) -> tuple[Location, ...]:
        """Where the block is held, by worker id."""
        tier = lambda s: KvTier.HOST if key in s.host else KvTier.DEVICE  # noqa: E731
        return tuple(Location(w, tier(s), s.epoch) for w, s in sorted(self._workers.items()) if key in s.stamps)

    def __len__(self) -> int:
        return self._size

    def stats(self) -> KvIndexStats:
        memory = self._size * BYTES_PER_ENTRY + len(self._workers) * BYTES_PER_WORKER
        return KvIndexStats(self._size, len(self._workers), self.max_entries, self.num_evictions,
                            self.num_resyncs_requested, self.num_resyncs_applied, memory)

    def check_invariants(self) -> None:
        if self._size != sum(len(s.stamps) for s in self._workers.values()):
            raise AssertionError("the entry count and the per-worker sets disagree")
        for w, s in self._workers.items():
            stamps = list(s.stamps.values())
            if stamps != sorted(stamps) or (stamps and stamps[-1] >= self._clock):
                raise AssertionError(f"{w}: entries out of LRU order")
            if not s.host <= s.held:
                raise AssertionError(f"{w}: host-tier keys outside the held set")
            if bool(s.host) != (w in self.host_workers):
                raise AssertionError(f"{w}: host_workers is stale")
        if self._size > self.max_entries:
            raise AssertionError(f"{self._size} entries > bound {self.max_entries}")

    # ---- internals ----------------------------------------------------------------------
    def _state(self, worker_id: str, epoch: int, changes: _Changes) -> _WorkerKv | None:
        """The worker's state under `epoch` (a newer epoch retires the old one); None if older."""
        state = self._workers.get(worker_id)
        if state is not None and epoch < state.epoch:
            return None
        if state is None or epoch > state.epoch:
            for change in self.retire(worker_id, epoch - 1):
                for key in change.removed:
                    changes.remove(worker_id, key)
            state = self._workers[worker_id] = _WorkerKv(epoch)
        return state

    def _stamp_touches(self) -> None:
        """Stamp the queued route reads: per touch, the leading run of its keys the worker holds,
        leaf first (the root ends most recent)."""
        touches, self._touches = self._touches, []
        clock = self._clock
        for worker_id, keys in touches:
            state = self._workers.get(worker_id)
            if state is None:
                continue
            stamps = state.stamps
            run = 0
            for key in keys:
                if key not in stamps:
                    break
                run += 1
            for key in reversed(keys[:run]):
                del stamps[key]
                stamps[key] = clock
                clock += 1
        self._clock = clock

    def _ask(self, state: _WorkerKv) -> KvOutcome:
        state.applied_seq = None  # nothing applies until the resync
        state.waiting += 1
        if state.waiting % self.resync_retry_reports == 1 or self.resync_retry_reports == 1:
            self.num_resyncs_requested += 1
            return KvOutcome.RESYNC_NEEDED
        return KvOutcome.AWAITING_RESYNC

    def _resync(self, worker_id: str, state: _WorkerKv, delta: KvDelta, changes: _Changes, count: bool = True) -> None:
        wanted = {key for _, key, _ in delta.events}
        gone = [(_REMOVED, key, 0) for key in state.held if key not in wanted]
        self._events(worker_id, state, gone + [(_STORED, key, tier) for _, key, tier in delta.events], changes)
        state.applied_seq, state.waiting = delta.last_seq, 0
        self.num_resyncs_applied += int(count)

    def _events(self, worker_id: str, state: _WorkerKv, events, changes: _Changes) -> None:
        """Apply events in order (one loop, inlined, over plain ints: this is the per-heartbeat
        cost), then the bound. A STORED takes the next clock stamp and moves to the end of the
        worker's dict; DEMOTED / PROMOTED change the tier and take the next stamp too."""
        stamps, host, clock, before = state.stamps, state.host, self._clock, len(state.stamps)
        added, removed = changes.sets(worker_id)
        for kind, key, tier in events:
            if kind == _STORED:
                if stamps.pop(key, None) is None:
                    if key in removed:
                        removed.discard(key)
                    else:
                        added.add(key)
                stamps[key] = clock
                clock += 1
                if tier == _HOST:
                    host.add(key)
                elif host:
                    host.discard(key)
            elif kind == _REMOVED:
                if stamps.pop(key, None) is not None:
                    if host:
                        host.discard(key)
                    if key in added:
                        added.discard(key)
                    else:
                        removed.add(key)
            elif key in stamps:  # DEMOTED / PROMOTED: the block moved tier (used: newest stamp)
                del stamps[key]
                stamps[key] = clock
                clock += 1
                if tier == _HOST:
                    host.add(key)
                else:
                    host.discard(key)
        self._clock = clock
        self._size += len(stamps) - before
        self._evict(changes)
        if host:
            self.host_workers.add(worker_id)
        else:
            self.host_workers.discard(worker_id)

    def _evict(self, changes: _Changes) -> None:
        """Past the bound: the entries with the oldest stamps, any worker's (each worker's dict
        is in stamp order, so a merge of their heads finds them)."""
        excess = self._size - self.max_entries
        if excess <= 0:
            return
        heads = [_aged(w, s.stamps) for w, s in self._workers.items()]
        for _, key, owner in list(islice(heapq.merge(*heads), excess)):
            state = self._workers[owner]
            del state.stamps[key]
            if key in state.host:
                state.host.discard(key)
                if not state.host:
                    self.host_workers.discard(owner)
            changes.remove(owner, key)
        self._size -= excess
        self.num_evictions += excess


def _aged(worker_id: str, stamps: dict[int, int]) -> Iterator[tuple[int, int, str]]:
    """(stamp, key, worker) of a worker's entries, oldest first."""
    return ((stamp, key, worker_id) for key, stamp in stamps.items())
