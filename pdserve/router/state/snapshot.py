"""The view of the cluster that policies read: one `Pool` per phase, loads as numpy arrays.

Loads are "effective": each worker's latest report plus the holds the router granted that the
report does not reflect yet (see reservations.py), so back-to-back routes between two reports see
each other. Slots are ordered by worker id; ties in every policy break toward the lower slot.

A snapshot is a per-decision view, valid until the next router call. Its arrays are read-only
views of the builder's live buffers, and its `PrefixIndex` is the builder's own: the builder
patches both in place (a copy per load report would cost as much as the decision itself), so do
not keep a snapshot across router calls. `SnapshotBuilder` rebuilds everything only when
membership changes; a load report or a changed in-flight total patches one slot, and `build`
applies the pending patches (reported load + in-flight holds) before it hands the view out.
A slot's prefix set is the cluster K/V index's live set for that worker (router/kv/kv_index.py).
The prefix matrix is the router's one `WorkerPrefixes` (a column per worker, patched by the router
with each change the K/V index reports), shared by its builders: a membership change only maps
the new slots to their workers' columns (`SlotView`), so it moves no matrix byte. A builder made
without one (tests, tools) owns its own, filled from the entries at each rebuild and patched by
`note_prefix`.
A builder made with `mixed_in` also puts LIVE `mixed` workers into the prefill and/or the decode
pool (router/splitwise/mixed_pool.py); a worker in both has two slots, its twin in the decode pool, which
every load report, in-flight charge and prefix change patches alike. A worker Splitwise lent to
the other pool (registry.py's `lend`) is in both pools the same way, whatever the builder.
A builder given the router's `TpPricing` prices each slot's load-only terms (`Derived`) at its
worker's own TP size (`WorkerInfo.tp`; router/pricing/tp_pricing.py), the prefill terms a cost-aware
policy adds per request included (`Derived.prefill_coef`); without one, every slot at `cost`.
`note_cost` re-prices one worker's slots at the price its own collectives give
(router/pricing/live_collectives.py), kept across rebuilds until it is withdrawn.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence, Set
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from pdserve.router.kv.prefix_index import SlotView, WorkerPrefixes
from pdserve.router.messages import Role, WorkerLoad
from pdserve.router.pricing.cost import CostModel
from pdserve.router.pricing.tp_pricing import TpPricing
from pdserve.router.state.host_groups import HostGroups
from pdserve.router.state.registry import Registry, WorkerEntry
from pdserve.router.state.reservations import InFlight


@dataclass(frozen=True)
class Members:
    """The static part of a pool: who is in it, in slot order."""

    worker_ids: tuple[str, ...]
    role_epochs: tuple[int, ...]
    host_ids: tuple[str, ...]
    held_prefixes: tuple[Set[int], ...]  # live views of the K/V index's per-worker sets
    tp_sizes: tuple[int, ...]  # each worker's tensor-parallel size (what its terms are priced at)


@dataclass(frozen=True)
class Pool:
    members: Members
    pending_tokens: np.ndarray  # [W] prompt tokens queued for prefill
    active_batch: np.ndarray  # [W] sequences in (or joining) the decode batch
    headroom_blocks: np.ndarray  # [W] free blocks not promised to anyone
    least_headroom: int  # at most min(headroom_blocks): when a demand is within it, every slot fits

    def __len__(self) -> int:
        return len(self.members.worker_ids)

    @property
    def worker_ids(self) -> tuple[str, ...]:
        return self.members.worker_ids

    @property
    def role_epochs(self) -> tuple[int, ...]:
        return self.members.role_epochs


class Derived(NamedTuple):
    """Cost-model terms that depend only on a snapshot's loads, not on the request."""

    queue_p: np.ndarray  # [P] cost.queue_s(prefill pending tokens)
    admission_d: np.ndarray  # [D] cost.admission_delay_s(decode active batch)
    tpot_d: np.ndarray  # [D] cost.decode_step_s(decode active batch + 1)
    worst_tpot_s: float  # at least max(tpot_d): when it meets a target, every slot does
    prefill_coef: np.ndarray  # [2, P] (prefill_overhead_s, prefill_s_per_token) of each prefill slot's worker

    @classmethod
    def compute(cls, prefill: Pool, decode: Pool, cost: CostModel) -> Derived:
        arrays = (
            cost.queue_s(prefill.pending_tokens),
            cost.admission_delay_s(decode.active_batch),
            cost.decode_step_s(decode.active_batch + 1),
        )
        queue_p, admission_d, tpot_d = (_readonly(np.asarray(a, dtype=np.float64)) for a in arrays)
        return cls(queue_p, admission_d, tpot_d, _worst(tpot_d), prefill_coefficients([cost] * len(prefill)))


def prefill_coefficients(costs: Sequence[CostModel]) -> np.ndarray:
    """[2, P] read-only: each prefill slot's (prefill_overhead_s, prefill_s_per_token)."""
    coef = np.array([[c.prefill_overhead_s for c in costs], [c.prefill_s_per_token for c in costs]], dtype=np.float64)
    return _readonly(coef.reshape(2, len(costs)))


@dataclass(frozen=True)
class Snapshot:
    prefill: Pool
    decode: Pool
    same_host: np.ndarray  # [P, D] bool: the pair shares a host
    hosts: HostGroups
    prefix: SlotView  # slots: prefill 0..P-1 then decode P..P+D-1 (colocated: the one pool)
    colocated: bool  # colocated mode: prefill and decode are the same pool, routes are (w, w)
    derived_cache: list = field(default_factory=list, compare=False, repr=False)  # [(cost, Derived)]

    def derived(self, cost: CostModel) -> Derived:
        """The load-only cost terms for `cost` (precomputed by the builder for the router's cost)."""
        steps = cost.steps_of  # a model with a measured link carries its base's step terms (cost.py)
        for known, terms in self.derived_cache:
            if known is cost or known is steps:
                return terms
        for known, terms in self.derived_cache:
            if known == cost:
                return terms
        terms = Derived.compute(self.prefill, self.decode, cost)
        self.derived_cache.append((cost, terms))
        return terms

    def leading_hits(self, block_hashes: Sequence[int]) -> tuple[np.ndarray | int, np.ndarray | int]:
        """Raw leading prefix hits (blocks) per prefill slot and per decode slot, or (0, 0) when no
        slot holds the first block (0 stands for an all-zero array)."""
        hits = self.prefix.lookup(block_hashes) if block_hashes else None  # [P + D], or [P] when colocated
        if hits is None:
            return 0, 0
        if self.colocated:
            return hits, hits
        split = len(self.prefill)
        return hits[:split], hits[split:]


_new_tuple = tuple.__new__


def _worst(tpot_s: np.ndarray) -> float:
    return float(tpot_s[tpot_s.argmax()]) if len(tpot_s) else -np.inf  # (indexing beats .max() on small arrays)


def _least(headroom: np.ndarray) -> int:
    return int(headroom[headroom.argmin()]) if len(headroom) else 0


def _readonly(array: np.ndarray) -> np.ndarray:
    array.flags.writeable = False
    return array


def make_snapshot(prefill: Sequence[WorkerEntry], decode: Sequence[WorkerEntry], colocated: bool = False) -> Snapshot:
    """A snapshot straight from entries (tests and tools); the router uses `SnapshotBuilder`."""
    builder = SnapshotBuilder(colocated)
    builder.reset(list(prefill) if colocated else list(prefill) + list(decode), len(prefill))
    return builder.current({})


class SnapshotBuilder:
    """Keeps the effective loads (report + in-flight holds) and, when given the router's cost
    model, their load-only cost terms, patched slot by slot: a load report or a changed in-flight
    total dirties one slot, and `current` rebuilds only those slots. A snapshot is published as
    read-only copies and reused as is while nothing changed."""

    def __init__(self, colocated: bool, cost: CostModel | None = None, roles: tuple[Role, ...] | None = None,
                 mixed_in: tuple[bool, bool] = (False, False), pricing: TpPricing | None = None,
                 prefixes: WorkerPrefixes | None = None):
        """`roles`: the worker roles this builder routes over (default: the mode's own). A
        colocated builder puts every such worker in its one pool: a disaggregated cluster whose
        disaggregation is switched off routes whole requests over its decode and colocated workers.
        `mixed_in`: (prefill pool, decode pool) that also take the LIVE mixed workers.
        `pricing`: each slot's terms at its worker's TP size (needs `cost`: the model policies ask for).
        `prefixes`: the router's shared prefix matrix, patched by its owner (None: one of its own)."""
        self._own_prefixes = prefixes is None
        self._prefixes = prefixes
        self._colocated = colocated
        self._cost = cost
        self._pricing = pricing if cost is not None else None
        self._roles = roles or ((Role.COLOCATED,) if colocated else (Role.PREFILL, Role.DECODE))
        self._mixed_in = mixed_in
        if any(mixed_in):
            self._roles = (*self._roles, Role.MIXED)
        self._membership_gen = -1
        self._live_costs: dict[str, CostModel] = {}  # a worker's price from its own collectives (note_cost)
        self.reset([], 0)

    def build(self, registry: Registry, in_flight: Mapping[str, InFlight]) -> Snapshot:
        if registry.membership_generation != self._membership_gen:
            entries = registry.live(self._roles)
            if self._colocated:  # colocated workers, then decode workers (live disable's whole requests)
                self.reset(sorted(entries, key=lambda e: (e.info.role is Role.DECODE, e.info.worker_id)), len(entries))
            else:  # prefill pool, then decode pool; each: its own role's workers, then mixed and lent
                # ones (ties break toward the lower slot: a worker of the pool's own role), in worker id order
                prefill = [e for e in entries if e.serves(Role.PREFILL) or e.info.role is Role.COLOCATED
                           or (self._mixed_in[0] and e.info.role is Role.MIXED)]
                decode = [e for e in entries if e.serves(Role.DECODE) or (self._mixed_in[1] and e.info.role is Role.MIXED)]
                self.reset(sorted(prefill, key=_guests_last(Role.PREFILL)) + sorted(decode, key=_guests_last(Role.DECODE)),
                           len(prefill))
            self._membership_gen = registry.membership_generation
        return self.current(in_flight)

    def note_load(self, worker_id: str, load: WorkerLoad) -> None:
        """Patch one worker's slot after a report the registry accepted."""
        slot = self._slot_of.get(worker_id)
        if slot is None:
            return  # not LIVE in the current membership; the next rebuild reads it from the registry
        self._reported[slot] = (load.pending_prompt_tokens, load.active_batch, load.free_blocks)
        self._dirty.add(slot)
        if self._twin_of and worker_id in self._twin_of:  # a mixed worker in both pools
            twin = self._twin_of[worker_id]
            self._reported[twin] = self._reported[slot]
            self._dirty.add(twin)

    def note_cost(self, worker_id: str, cost: CostModel | None) -> None:
        """Price the worker's slots at `cost` (its collectives as its steps show them,
        router/pricing/live_collectives.py) from now on, across rebuilds; None: at its TP size again."""
        if self._pricing is None:
            return
        if cost is None:
            self._live_costs.pop(worker_id, None)
        else:
            self._live_costs[worker_id] = cost
        slot = self._slot_of.get(worker_id)
        if slot is None:
            return
        for s in (slot, self._twin_of[worker_id]) if worker_id in self._twin_of else (slot,):
            self._slot_costs[s] = cost or self._pricing.worker(self._entries[s].info.tp)
            self._dirty.add(s)
        if slot < self._num_prefill:
            self._prefill_coef = prefill_coefficients(self._slot_costs[:self._num_prefill])

    def note_prefix(self, worker_id: str, held: Set[int], added: Iterable[int], removed: Iterable[int]) -> None:
        """The worker's prefix set (`held`, already changed) gained `added` and lost `removed`."""
        slot = self._slot_of.get(worker_id)
        if slot is None:
            return
        slots = (slot, self._twin_of[worker_id]) if worker_id in self._twin_of else (slot,)
        if self._own_prefixes:
            self._prefixes.patch(worker_id, added, removed)
        if held is self._held[slot]:
            return
        for s in slots:  # a new set object: the members carry it
            self._held[s] = held
        self._members = None
        self._snapshot = None
        self._stale_pools[:] = (True, True)  # the pools carry the members

    def invalidate(self) -> None:
        """Rebuild everything from the registry at the next `build` (a builder not in use skips
        the patches meanwhile)."""
        self._membership_gen = -1

    def reset(self, entries: Sequence[WorkerEntry], num_prefill: int) -> None:
        """Rebuild slots, static members and the prefix index for a new membership."""
        self._entries = tuple(entries)
        self._num_prefill = num_prefill
        self._slot_of: dict[str, int] = {}
        self._twin_of: dict[str, int] = {}  # a mixed worker's second slot (in the decode pool)
        for i, e in enumerate(entries):
            (self._twin_of if e.info.worker_id in self._slot_of else self._slot_of)[e.info.worker_id] = i
        self._worker_of = [e.info.worker_id for e in entries]
        pricing = self._pricing  # each slot's cost model: its worker's TP size's, or the one `cost`
        self._slot_costs = [self._cost if pricing is None else self._live_costs.get(e.info.worker_id) or pricing.worker(e.info.tp)
                            for e in entries]
        self._prefill_coef = None if self._cost is None else prefill_coefficients(self._slot_costs[:num_prefill])
        self._reported = [(e.load.pending_prompt_tokens, e.load.active_batch, e.load.free_blocks) for e in entries]
        # effective [pending, batch, headroom] x slot and [queue_s, admission_s, tpot_s] x slot, one
        # array per pool so a publish copies whole arrays and unpacks rows (no per-field slicing)
        num_decode = 0 if self._colocated else len(entries) - num_prefill
        self._loads = (np.zeros((3, num_prefill), dtype=np.int64), np.zeros((3, num_decode), dtype=np.int64))
        self._terms = (np.zeros((3, num_prefill)), np.zeros((3, num_decode)))
        self._load_rows = tuple(tuple(a) for a in self._loads)  # writable row views, to patch one slot
        self._term_rows = tuple(tuple(a) for a in self._terms)
        # what snapshots get: read-only views of the same buffers, made once per membership
        self._load_views = tuple(tuple(_readonly(a.view())) for a in self._loads)
        self._term_views = tuple(tuple(_readonly(a.view())) for a in self._terms)
        self._stale_pools = [True, True]  # which pool a patch touched since the last publish
        self._published: list[tuple[Pool, float] | None] = [None, None]  # (pool, worst tpot bound)
        # per pool, bounds on min headroom and max TPOT: tightened by each patch, made exact again
        # (one reduction) once a pool has had as many patches as slots, so amortised O(1) per patch
        self._least: list[float] = [np.inf, np.inf]
        self._worst: list[float] = [-np.inf, -np.inf]
        self._patches = [0, 0]
        self._charged: dict[str, InFlight] = {}  # the in-flight totals charged on `_loads`
        self._dirty = set(range(len(entries)))
        self._snapshot: Snapshot | None = None
        self._held = [e.prefix_hashes for e in entries]
        if self._own_prefixes:  # a standalone builder: its matrix from the entries' sets
            self._prefixes = WorkerPrefixes()
            for e in entries:
                self._prefixes.patch(e.info.worker_id, e.prefix_hashes, ())
        self._prefix = self._prefixes.view(self._worker_of)
        hosts = [e.info.host_id for e in entries]
        p_hosts, d_hosts = hosts[:num_prefill], (hosts[:num_prefill] if self._colocated else hosts[num_prefill:])
        same = np.array([[p == d for d in d_hosts] for p in p_hosts], dtype=bool)
        self._same_host = _readonly(same.reshape(len(p_hosts), len(d_hosts)))
        self._hosts = HostGroups.build(p_hosts, d_hosts)
        self._members = None

    def current(self, in_flight: Mapping[str, InFlight]) -> Snapshot:
        """The snapshot now: reported loads with in-flight holds charged (on a copy)."""
        dirty, charged = self._dirty, self._charged
        if in_flight != charged:
            slot_of = self._slot_of
            for worker_id in charged.keys() | in_flight.keys():
                if charged.get(worker_id) != in_flight.get(worker_id):
                    slot = slot_of.get(worker_id)
                    if slot is not None:
                        dirty.add(slot)
                        if worker_id in self._twin_of:
                            dirty.add(self._twin_of[worker_id])
            self._charged = charged = dict(in_flight)
        if not dirty and self._snapshot is not None:
            return self._snapshot
        costs, reported, worker_of, n = self._slot_costs, self._reported, self._worker_of, self._num_prefill
        stale, least, worst, patches = self._stale_pools, self._least, self._worst, self._patches
        for slot in dirty:
            pending, batch, free = reported[slot]
            flight = charged.get(worker_of[slot])
            if flight is not None:
                pending, batch, free = pending + flight.tokens, batch + flight.seqs, free - flight.blocks
            pool, i = (0, slot) if slot < n else (1, slot - n)
            stale[pool] = True
            pending_row, batch_row, free_row = self._load_rows[pool]
            pending_row[i], batch_row[i], free_row[i] = pending, batch, free
            patches[pool] += 1
            if free < least[pool]:
                least[pool] = free
            cost = costs[slot]
            if cost is not None:  # the same formulas as Derived.compute, on one slot's ints (at its TP size)
                queue_row, admission_row, tpot_row = self._term_rows[pool]
                queue_row[i] = cost.queue_s(pending)
                admission_row[i] = cost.admission_delay_s(batch)
                tpot_row[i] = tpot_s = cost.decode_step_s(batch + 1)
                if tpot_s > worst[pool]:
                    worst[pool] = tpot_s
        dirty.clear()
        self._snapshot = snapshot = self._publish()
        return snapshot

    def _publish(self) -> Snapshot:
        """A new snapshot over the live views. A pool object is rebuilt only when its members or
        its least-headroom bound changed; the bounds are re-tightened (one reduction) once a pool
        has had as many patches as slots."""
        published, stale = self._published, self._stale_pools
        members = self._pool_members()
        for pool in (0,) if self._colocated else (0, 1):
            if not stale[pool] and published[pool] is not None:
                continue
            pending, batch, headroom = self._load_views[pool]
            if self._patches[pool] >= len(headroom):
                self._least[pool], self._patches[pool] = _least(headroom), 0
                self._worst[pool] = -np.inf if self._cost is None else _worst(self._term_views[pool][2])
            old = published[pool]
            if old is None or old[0].members is not members[pool] or old[0].least_headroom != self._least[pool]:
                published[pool] = (_pool(members[pool], pending, batch, headroom, self._least[pool]), self._worst[pool])
            else:
                published[pool] = (old[0], self._worst[pool])
            stale[pool] = False
        prefill = published[0][0]
        decode, worst_tpot_s = published[0] if self._colocated else published[1]
        if self._cost is None:
            cache = []
        else:  # Derived(...) without the NamedTuple's Python-level __new__ (hot path)
            p_terms, d_terms = self._term_views[0], self._term_views[0 if self._colocated else 1]
            cache = [(self._cost, _new_tuple(Derived, (p_terms[0], d_terms[1], d_terms[2], worst_tpot_s, self._prefill_coef)))]
        snapshot = object.__new__(Snapshot)  # a frozen dataclass, built without its __init__ (hot path)
        snapshot.__dict__.update(
            prefill=prefill, decode=decode, same_host=self._same_host, hosts=self._hosts, prefix=self._prefix,
            colocated=self._colocated, derived_cache=cache,
        )
        return snapshot

    def _pool_members(self) -> tuple[Members, Members]:
        if self._members is None:
            n = self._num_prefill
            prefill = _members(self._entries[:n], self._held[:n])
            decode = prefill if self._colocated else _members(self._entries[n:], self._held[n:])
            self._members = (prefill, decode)
        return self._members


def _guests_last(pool: Role) -> Callable[[WorkerEntry], tuple[bool, str]]:
    """The sort key of one pool: the pool's own workers first, then mixed ones and workers lent
    to it (registry.py's `lend`), each in worker id order."""
    return lambda e: (e.info.role is Role.MIXED or e.lent_to is pool, e.info.worker_id)


def _pool(members: Members, pending: np.ndarray, batch: np.ndarray, headroom: np.ndarray, least: int) -> Pool:
    pool = object.__new__(Pool)  # a frozen dataclass, built without its __init__ (hot path)
    pool.__dict__.update(
        members=members, pending_tokens=pending, active_batch=batch, headroom_blocks=headroom, least_headroom=least
    )
    return pool


def _members(entries: Sequence[WorkerEntry], held: Sequence[Set[int]]) -> Members:
    return Members(
        worker_ids=tuple(e.info.worker_id for e in entries),
        role_epochs=tuple(e.info.role_epoch for e in entries),
        host_ids=tuple(e.info.host_id for e in entries),
        held_prefixes=tuple(held),
        tp_sizes=tuple(e.info.tp for e in entries),
    )
