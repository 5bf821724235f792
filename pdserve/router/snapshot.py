"""The view of the cluster that policies read: one `Pool` per phase, loads as numpy arrays.

Loads are "effective": each worker's latest report plus the holds the router granted that the
report does not reflect yet (see reservations.py), so back-to-back routes between two reports see
each other. Slots are ordered by worker id; ties in every policy break toward the lower slot.

A snapshot is a per-decision view. Its arrays are read-only copies, but its `PrefixIndex` is
shared with the builder, which patches it in place when a worker reports a new prefix set (a full
copy per report would cost more than the decision), so do not keep a snapshot across router
calls. `SnapshotBuilder` rebuilds everything only when membership changes; a load report patches
one slot; each `build` copies the reported arrays and charges in-flight holds on the copies.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from pdserve.router.messages import Role, WorkerLoad
from pdserve.router.prefix_index import PrefixIndex
from pdserve.router.registry import Registry, WorkerEntry
from pdserve.router.reservations import InFlight


@dataclass(frozen=True)
class Members:
    """The static part of a pool: who is in it, in slot order."""

    worker_ids: tuple[str, ...]
    role_epochs: tuple[int, ...]
    host_ids: tuple[str, ...]
    held_prefixes: tuple[frozenset[int], ...]


@dataclass(frozen=True)
class Pool:
    members: Members
    pending_tokens: np.ndarray  # [W] prompt tokens queued for prefill
    active_batch: np.ndarray  # [W] sequences in (or joining) the decode batch
    headroom_blocks: np.ndarray  # [W] free blocks not promised to anyone

    def __len__(self) -> int:
        return len(self.members.worker_ids)

    @property
    def worker_ids(self) -> tuple[str, ...]:
        return self.members.worker_ids

    @property
    def role_epochs(self) -> tuple[int, ...]:
        return self.members.role_epochs


@dataclass(frozen=True)
class HostGroups:
    """Decode slots grouped by host, for per-host minima (np.minimum.reduceat)."""

    decode_order: np.ndarray  # decode slots sorted by host
    group_starts: np.ndarray  # where each host's run starts in decode_order
    prefill_group: np.ndarray  # [P] the group of P's host, or len(group_starts) if no decode there

    @classmethod
    def build(cls, prefill_hosts: Sequence[str], decode_hosts: Sequence[str]) -> HostGroups:
        names = sorted(set(decode_hosts))
        group_of = {name: g for g, name in enumerate(names)}
        order = sorted(range(len(decode_hosts)), key=lambda j: (group_of[decode_hosts[j]], j))
        sizes = [sum(1 for h in decode_hosts if h == name) for name in names]
        starts = np.cumsum([0] + sizes[:-1]) if sizes else np.zeros(0)
        groups = [group_of.get(h, len(names)) for h in prefill_hosts]
        return cls(*(_readonly(np.array(a, dtype=np.int64)) for a in (order, starts, groups)))


@dataclass(frozen=True)
class Snapshot:
    prefill: Pool
    decode: Pool
    same_host: np.ndarray  # [P, D] bool: the pair shares a host
    hosts: HostGroups
    prefix: PrefixIndex  # slots: prefill 0..P-1 then decode P..P+D-1 (colocated: the one pool)
    colocated: bool  # colocated mode: prefill and decode are the same pool, routes are (w, w)

    def leading_hits(self, block_hashes: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Raw leading prefix hits (blocks) per prefill slot and per decode slot."""
        hits = self.prefix.leading_hits(block_hashes)
        if self.colocated:
            return hits, hits
        split = len(self.prefill)
        return hits[:split], hits[split:]


def _readonly(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


def make_snapshot(prefill: Sequence[WorkerEntry], decode: Sequence[WorkerEntry], colocated: bool = False) -> Snapshot:
    """A snapshot straight from entries (tests and tools); the router uses `SnapshotBuilder`."""
    builder = SnapshotBuilder(colocated)
    builder.reset(list(prefill) if colocated else list(prefill) + list(decode), len(prefill))
    return builder.current({})


class SnapshotBuilder:
    def __init__(self, colocated: bool):
        self._colocated = colocated
        self._roles = (Role.COLOCATED,) if colocated else (Role.PREFILL, Role.DECODE)
        self._membership_gen = -1
        self.reset([], 0)

    def build(self, registry: Registry, in_flight: Mapping[str, InFlight]) -> Snapshot:
        if registry.membership_generation != self._membership_gen:
            entries = registry.live(self._roles)
            num_prefill = sum(e.info.role in (Role.PREFILL, Role.COLOCATED) for e in entries)
            self.reset(sorted(entries, key=lambda e: (e.info.role is Role.DECODE, e.info.worker_id)), num_prefill)
            self._membership_gen = registry.membership_generation
        return self.current(in_flight)

    def note_load(self, worker_id: str, load: WorkerLoad) -> None:
        """Patch one worker's slot after a report the registry accepted."""
        slot = self._slot_of.get(worker_id)
        if slot is None:
            return  # not LIVE in the current membership; the next rebuild reads it from the registry
        self._reported[:, slot] = (load.pending_prompt_tokens, load.active_batch, load.free_blocks)
        if load.prefix_hashes is not None and load.prefix_hashes != self._held[slot]:
            self._prefix.replace_slot(slot, self._held[slot], load.prefix_hashes)
            self._held[slot] = load.prefix_hashes
            self._members = None

    def reset(self, entries: Sequence[WorkerEntry], num_prefill: int) -> None:
        """Rebuild slots, static members and the prefix index for a new membership."""
        self._entries = tuple(entries)
        self._num_prefill = num_prefill
        self._slot_of = {e.info.worker_id: i for i, e in enumerate(entries)}
        loads = [e.load for e in entries]
        self._reported = np.array(
            [[ld.pending_prompt_tokens for ld in loads], [ld.active_batch for ld in loads], [ld.free_blocks for ld in loads]],
            dtype=np.int64,
        ).reshape(3, len(entries))  # [pending, batch, free] x slot
        self._held = [e.prefix_hashes for e in entries]
        self._prefix = PrefixIndex.build(self._held)
        hosts = [e.info.host_id for e in entries]
        p_hosts, d_hosts = hosts[:num_prefill], (hosts[:num_prefill] if self._colocated else hosts[num_prefill:])
        same = np.array([[p == d for d in d_hosts] for p in p_hosts], dtype=bool)
        self._same_host = _readonly(same.reshape(len(p_hosts), len(d_hosts)))
        self._hosts = HostGroups.build(p_hosts, d_hosts)
        self._members = None

    def current(self, in_flight: Mapping[str, InFlight]) -> Snapshot:
        """The snapshot now: reported loads with in-flight holds charged on a copy."""
        loads = self._reported.copy()
        for worker_id, flight in in_flight.items():
            slot = self._slot_of.get(worker_id)
            if slot is not None:
                loads[0, slot] += flight.tokens
                loads[1, slot] += flight.seqs
                loads[2, slot] -= flight.blocks
        _readonly(loads)
        prefill_members, decode_members = self._pool_members()
        n = self._num_prefill
        prefill = Pool(prefill_members, loads[0, :n], loads[1, :n], loads[2, :n])
        decode = prefill if self._colocated else Pool(decode_members, loads[0, n:], loads[1, n:], loads[2, n:])
        return Snapshot(prefill, decode, self._same_host, self._hosts, self._prefix, self._colocated)

    def _pool_members(self) -> tuple[Members, Members]:
        if self._members is None:
            n = self._num_prefill
            prefill = _members(self._entries[:n], self._held[:n])
            decode = prefill if self._colocated else _members(self._entries[n:], self._held[n:])
            self._members = (prefill, decode)
        return self._members


def _members(entries: Sequence[WorkerEntry], held: Sequence[frozenset[int]]) -> Members:
    return Members(
        worker_ids=tuple(e.info.worker_id for e in entries),
        role_epochs=tuple(e.info.role_epoch for e in entries),
        host_ids=tuple(e.info.host_id for e in entries),
        held_prefixes=tuple(held),
    )
