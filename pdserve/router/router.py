"""The `Router` facade: the control plane's pure, synchronous core.

The process edge (zmq, HTTP) feeds it worker messages and request events and forwards its
answers; nothing here does I/O or sleeps. One call per event:

    register / heartbeat / report_load / deregister   worker membership (registry.py)
    report_collectives                                a TP worker's live collective seconds, its
                                                      price from them (live_pricing.py)
    report_kv                                         a worker's block events into the cluster
                                                      K/V index (kv_index.py), which feeds the
                                                      snapshot's per-worker prefix sets
    expire()                                          retire silent workers, orphan their routes
    route(request)                                    policy over a snapshot -> plan with holds, or
                                                      an early rejection before any prefill work
    kv_published(request_id)                          K/V visible at D: release P's staging hold
    signals                                           what the P/D decision reads between routes:
                                                      handoff outcomes, the decode workers' clocks,
                                                      the traffic (pd_signals.py)
    observe_transfer(bytes, seconds, same_host)       a published handoff's size and time: the
                                                      link price every model the router routes,
                                                      decides and plans with carries (link_rates.py)
    takeover_holds(request, exclude) / retake(...)    decode-start fallback: candidates, and the
                                                      old route's holds swapped for the new one
    complete(request_id) / abort(request_id)          release every hold of the route
    drain(worker) / set_disaggregation(enabled)       a role change begins (no new routes to the
                                                      worker) / live disable: whole requests on
                                                      the decode and colocated workers
    set_mixed_offer(offer)                            Splitwise's mixed workers: the pools they join
                                                      now (mixed_pool.py; a refused route retries
                                                      with them in both pools)
    lend(worker, epoch, to) / lent_to(worker)         Splitwise's loan: a prefill or decode worker
                                                      serves the other pool too, keeping its role,
                                                      epoch and running work (None ends the loan)

Every route decision is counted by (policy, result) in `RouterCounters`. In disaggregated mode
each routed request also gets a P/D decision (pd_decision.py, over the same snapshot, before any
hold): disaggregate (holds at P and D) or prefill locally on the chosen decode worker (one hold
at D, as a colocated worker would take); counted by decision in `pd_decisions`.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import replace

from pdserve.engine.tp_tally import CollectiveReport
from pdserve.router import kernels
from pdserve.router.answers import Retirement, RouterCounters
from pdserve.router.config import Mode, RouterConfig
from pdserve.router.errors import UnknownWorkerError
from pdserve.router.kv.kv_index import HeldChange, KvApplied, KvDelta, KvIndex, KvIndexStats, KvOutcome, Location
from pdserve.router.kv.prefix_index import WorkerPrefixes
from pdserve.router.messages import (
    BlockHold,
    RejectReason,
    Role,
    RoutePlan,
    RouteRejection,
    RouteRequest,
    WorkerInfo,
    WorkerLoad,
    new_frozen,
)
from pdserve.router.policy.live_pricing import LivePricing
from pdserve.router.policy.pd_decision import PdDecision
from pdserve.router.policy.pd_signals import PdSignals
from pdserve.router.policy.plan import hold_requests, local_hold, local_route_plan, route_plan, takeover_holds
from pdserve.router.policy.policies import POLICIES, Choice, PolicyContext, Refusal
from pdserve.router.pricing.cost import CostModel
from pdserve.router.pricing.link_rates import LinkRates
from pdserve.router.splitwise.mixed_pool import WHOLE_ON_MIXED, MixedOffer, MixedPools
from pdserve.router.state.registry import ClusterIdentity, Registry, RetiredWorker, WorkerState
from pdserve.router.state.reservations import HoldRequest, ReservationLedger
from pdserve.router.state.snapshot import Snapshot, SnapshotBuilder
from pdserve.router.tetri.decode_choice import CHOICES, HeavyLight, Sampler, p2c_choice

ROUTED = "routed"
_MAX_RETRY_AFTER_S = PolicyContext(CostModel()).max_retry_after_s  # the policies' default


class Router:
    def __init__(self, config: RouterConfig, clock: Callable[[], float] = time.monotonic):
        if config.policy not in POLICIES:
            raise ValueError(f"unknown policy {config.policy!r}; expected one of {sorted(POLICIES)}")
        if config.decode_choice not in CHOICES:
            raise ValueError(f"unknown decode choice {config.decode_choice!r}; expected one of {CHOICES}")
        self.config = config
        kernels.warm_up()  # compile (or load) the policies' kernels now, not on the first request
        identity = ClusterIdentity(config.model_identity, config.kv_abi_hash, config.mode.roles)
        self._registry = Registry(identity, config.heartbeat_timeout_s, clock)
        self._ledger = ReservationLedger()
        self._kv = KvIndex(config.kv_index_max_entries)  # who holds which prefix block (kv_index.py)
        self._prefixes = WorkerPrefixes()  # the K/V index's held sets as one matrix, every builder's (prefix_index.py)
        self._snapshots = SnapshotBuilder(colocated=config.mode is Mode.COLOCATED, cost=config.cost, pricing=config.pricing,
                                          prefixes=self._prefixes)
        self.kv_cost = config.cost  # the prefix policy's fetch and host-copy terms, measured (kv_rates.py)
        self.link = LinkRates(config.cost)  # the handoff link measured from published transfers (link_rates.py)
        # a disaggregated cluster with disaggregation switched off routes whole requests over its
        # decode and colocated workers (set_disaggregation; the role change mechanism: workers/roles.py)
        self._whole = SnapshotBuilder(colocated=True, cost=config.cost, roles=(Role.COLOCATED, Role.DECODE, Role.MIXED),
                                      pricing=config.pricing, prefixes=self._prefixes)
        self._mixed = MixedPools(config.cost, config.pricing, self._prefixes)  # Splitwise's mixed workers, offered as the pools' pressure says
        self.mixed_offer = MixedOffer()  # set by the pool controller (role_control.py; mixed_pool.py's rule)
        self.disaggregation = config.mode is Mode.DISAGGREGATED
        self.handoff_enabled = self.disaggregation  # off after a rollback: no transfer plan is issued
        self.route_epoch = 1  # advanced by a rollback; capabilities bind it
        self._route_total: Counter[tuple[str, str]] = Counter()
        self._retired: Counter[str] = Counter()
        self._events: Counter[str] = Counter()
        self._turns: Counter[str] = Counter()  # decisions per policy: round robin's cursor
        self._pd_total: Counter[str] = Counter()
        self._clock = clock
        self.signals = PdSignals(clock)  # what the P/D decision reads of the traffic and the decode clocks
        self._heavy_light = HeavyLight()  # live routes per decode worker, heavy or light (--decode-choice p2c)
        self._p2c = Sampler()
        # TP workers' collectives as their own steps show them, priced into the builders' slots
        self._prices = LivePricing(config.pricing, config.cost, (self._snapshots, self._whole, self._mixed))
        self.live = self._prices.live  # live_collectives.LiveCollectives; None without pricing

    # ----- workers -----
    def register(self, info: WorkerInfo) -> Retirement | None:
        superseded = self._registry.register(info)
        return None if superseded is None else self._on_retired(superseded)

    def heartbeat(self, worker_id: str, role_epoch: int) -> None:
        self._registry.heartbeat(worker_id, role_epoch)

    def report_load(self, worker_id: str, role_epoch: int, load: WorkerLoad) -> None:
        self._registry.report_load(worker_id, role_epoch, load)
        if load.prefix_hashes is not None:  # an in-process full set (synthetic clusters, tests)
            self._note_held(self._kv.replace(worker_id, role_epoch, load.prefix_hashes))
        self._snapshots.note_load(worker_id, load)
        self._whole.note_load(worker_id, load)
        self._mixed.note_load(worker_id, load)
        self._ledger.apply_ack(worker_id, load.applied_grant_seq)

    def report_collectives(self, worker_id: str, role_epoch: int, report: CollectiveReport) -> None:
        """A TP worker's collective seconds per phase since its last report (engine/tp_tally.py):
        its slots are re-priced once they move its live estimate (live_pricing.py)."""
        if self._registry.is_current(worker_id, role_epoch):
            self._prices.report(worker_id, self._registry.entry(worker_id).info.tp, report)

    def report_kv(self, worker_id: str, role_epoch: int, delta: KvDelta) -> KvOutcome:
        """Apply a worker's block events (kv_index.py); RESYNC_NEEDED: send it `ResyncKv`."""
        if not self._registry.is_current(worker_id, role_epoch):
            return KvOutcome.IGNORED
        applied: KvApplied = self._kv.apply(worker_id, role_epoch, delta)
        self._note_held(applied.changes)
        return applied.outcome

    def kv_index_stats(self) -> KvIndexStats:
        """The K/V index's figures, its memory with the prefix matrix built from it."""
        stats = self._kv.stats()
        return replace(stats, memory_bytes=stats.memory_bytes + self._prefixes.memory_bytes())

    def kv_held(self, worker_id: str) -> set[int] | frozenset[int]:
        """The block keys the cluster K/V index places on a worker (a live view)."""
        return self._kv.held(worker_id)

    def kv_holders(self, block_hash: int) -> tuple[Location, ...]:
        """Where the cluster K/V index places a block: (worker, tier, epoch) locations."""
        return self._kv.holders(block_hash)

    def _note_held(self, changes: tuple[HeldChange, ...]) -> None:
        """Patch the prefix sets of the snapshot in use; the other builder rebuilds when next used."""
        active = self._builder()
        (self._whole if active is self._snapshots else self._snapshots).invalidate()
        for change in changes:
            self._prefixes.patch(change.worker_id, change.added, change.removed)
            held = self._kv.held(change.worker_id)
            self._registry.set_prefixes(change.worker_id, held)
            active.note_prefix(change.worker_id, held, change.added, change.removed)
            self._mixed.note_prefix(change.worker_id, held, change.added, change.removed)

    def drain(self, worker_id: str, role_epoch: int) -> None:
        """Route nothing new to the worker: its role change begins (workers/roles.py)."""
        self._registry.drain(worker_id, role_epoch)
        self._events["drains"] += 1

    def set_disaggregation(self, enabled: bool) -> None:
        """Switch a disaggregated cluster between disaggregated routing and whole requests on its
        decode and colocated workers (live disable). Routes already made keep their holds."""
        if self.config.mode is not Mode.DISAGGREGATED and enabled:
            raise ValueError("a colocated cluster has no disaggregation to enable")
        self.disaggregation = enabled

    def deregister(self, worker_id: str, role_epoch: int) -> Retirement:
        return self._on_retired(self._registry.deregister(worker_id, role_epoch))

    def expire(self) -> list[Retirement]:
        return [self._on_retired(r) for r in self._registry.expire()]

    def excuse_stall(self, seconds: float) -> None:
        """The router did not run for `seconds`: no worker's heartbeat clock counts them."""
        self._registry.excuse(seconds)

    # ----- requests -----
    def route(self, request: RouteRequest, policy: str | None = None) -> RoutePlan | RouteRejection:
        name = policy or self.config.policy
        result = self._choose(self.snapshot(), request, name)
        if isinstance(result, Refusal) and self.disaggregation and self._mixed.present(self._registry):
            result = self._choose(self.snapshot(overflow=True), request, name)  # mixed workers before a refusal
        self.signals.observe_route(request.prompt_tokens)
        if isinstance(result, Refusal):
            self._route_total[(name, result.reason.value)] += 1
            return RouteRejection(request.request_id, name, result.reason, result.retry_after_s, result.detail)
        self._route_total[(name, ROUTED)] += 1
        if request.block_hashes:  # the blocks it reuses were used now (the index's LRU is by use)
            self._kv.touch(result.prefill_id, request.block_hashes)
            if result.decode_id != result.prefill_id:
                self._kv.touch(result.decode_id, request.block_hashes)
        return result

    def kv_published(self, request_id: str) -> None:
        self._ledger.publish(request_id)
        self._events["kv_published"] += 1

    def takeover_holds(
        self, request: RouteRequest, exclude: frozenset[str] = frozenset()
    ) -> tuple[tuple[HoldRequest, ...], tuple[HoldRequest, ...]]:
        """Decode workers that could take the request over (plan.takeover_holds): (K/V visible
        there, recompute there), each with the hold it would need, best first."""
        return takeover_holds(self.snapshot(), request, exclude, self.config.cost.block_size_tokens)

    def retake(self, request_id: str, hold: HoldRequest) -> BlockHold | None:
        """Move a request to a new single-worker route: release what its old route still holds (a
        lost worker's routes were already released), then take `hold`; None (nothing held any
        more) when the worker lacks the headroom."""
        if self._ledger.has_route(request_id):
            self.abort(request_id)
        reported = {hold.worker_id: self._registry.entry(hold.worker_id).load.free_blocks}
        taken = self._ledger.try_reserve(request_id, None, hold, reported)
        self._events["retaken" if taken else "retake_refused"] += 1
        return None if taken is None else taken[1]

    def grow_hold(self, request_id: str, worker_id: str, blocks: int) -> int | None:
        """The decode worker grew the request's hold by `blocks` (it outgrew its reservation):
        the ledger records it as an applied grant (reservations.ReservationLedger.grow)."""
        seq = self._ledger.grow(request_id, worker_id, blocks)
        self._events["hold_growths" if seq is not None else "hold_growths_ignored"] += 1
        return seq

    def held_blocks(self, request_id: str) -> int:
        return self._ledger.held_blocks(request_id)

    def complete(self, request_id: str) -> None:
        self._ledger.release(request_id)
        self._heavy_light.remove(request_id)
        self._events["completed"] += 1

    def abort(self, request_id: str) -> None:
        self._ledger.release(request_id)
        self._heavy_light.remove(request_id)
        self._events["aborted"] += 1

    def _choose(self, snapshot: Snapshot, request: RouteRequest, name: str) -> RoutePlan | Refusal:
        choice = POLICIES[name](snapshot, request, self._context(name))
        if self.config.decode_choice == "p2c" and isinstance(choice, Choice):
            choice = p2c_choice(snapshot, request, choice, self._heavy_light, self._p2c.picks(), self.config.cost.block_size_tokens)
        return self._admit(snapshot, request, choice, name) if isinstance(choice, Choice) else choice

    def lend(self, worker_id: str, role_epoch: int, to: Role | None) -> None:
        """Lend the worker to the `to` pool as well, or end its loan (None): no drain, no new
        epoch (registry.py's `lend`); the next snapshot offers it where it now serves."""
        self._registry.lend(worker_id, role_epoch, to)

    def lent_to(self, worker_id: str) -> Role | None:
        """The pool the worker's current epoch is lent to, None when it is not lent (or unknown)."""
        try:
            return self._registry.entry(worker_id).lent_to
        except UnknownWorkerError:
            return None

    def set_mixed_offer(self, offer: MixedOffer) -> None:
        """Which pools the mixed workers serve now (the pool controller's latched pressure)."""
        self.mixed_offer = offer

    # ----- views and checks -----
    def snapshot(self, overflow: bool = False) -> Snapshot:
        """The policies' view; mixed workers join the pools mixed_pool.membership names
        (`overflow`: both, once a route without them was refused)."""
        builder = self._builder()
        snapshot = builder.build(self._registry, self._ledger.in_flight())
        if builder is self._snapshots and self._mixed.present(self._registry):
            snapshot = self._mixed.view(snapshot, self._registry, self._ledger.in_flight(), self.mixed_offer, overflow)
        if not snapshot.colocated and not len(snapshot.prefill) and len(snapshot.decode) and self.config.pd.mode != "always":
            # the prompt pool is empty (Splitwise lent its last worker to the token pool, or it
            # restarts) and decode workers may prefill: requests run whole on them. With "always"
            # every request must take the handoff, so it waits for a prefill worker or is refused.
            return self._whole.build(self._registry, self._ledger.in_flight())
        return snapshot

    def _builder(self) -> SnapshotBuilder:
        return self._snapshots if self.disaggregation or self.config.mode is Mode.COLOCATED else self._whole

    def counters(self) -> RouterCounters:
        return RouterCounters(
            route_total=dict(self._route_total),
            workers_retired=dict(self._retired),
            num_stale_rejected=self._registry.num_stale_rejected,
            num_holds_granted=self._ledger.num_granted,
            num_holds_released=self._ledger.num_released,
            num_kv_published=self._events["kv_published"],
            num_completed=self._events["completed"],
            num_aborted=self._events["aborted"],
            num_orphaned=self._events["orphaned"],
            pd_decisions=dict(self._pd_total),
        )

    def worker_state(self, worker_id: str) -> WorkerState | None:
        """The registry state of the worker's current epoch, None when it is not registered."""
        try:
            return self._registry.entry(worker_id).state
        except UnknownWorkerError:
            return None

    def staging_holds(self) -> int:
        """Routes whose prefill staging hold waits on an unpublished transfer."""
        return self._ledger.num_staging()

    def live_requests(self) -> tuple[str, ...]:
        return self._ledger.live_requests()

    def check_invariants(self) -> None:
        self._ledger.check_invariants()

    def assert_no_leaks(self) -> None:
        self._ledger.assert_no_leaks()

    # ----- internals -----
    def _context(self, policy: str) -> PolicyContext:
        cfg = self.config
        turn = self._turns[policy]
        self._turns[policy] = turn + 1
        return new_frozen(
            PolicyContext, cost=self.link.apply(cfg.cost), ttft_slo_s=cfg.ttft_slo_s, tpot_slo_s=cfg.tpot_slo_s, turn=turn,
            retry_after_s=cfg.retry_after_s, max_retry_after_s=_MAX_RETRY_AFTER_S, kv_sharing=cfg.kv_sharing,
            kv_cost=self.kv_cost, host_held=self._kv.host_held if self._kv.host_workers else None,
        )

    def worker_cost(self, worker_id: str) -> CostModel:
        """One worker's own steps at its registered TP size, live where it has them (live_pricing.py),
        with the measured link."""
        return self.link.apply(self._prices.worker_cost(self._registry.entry(worker_id).info))

    def link_cost(self, cost: CostModel) -> CostModel:
        """`cost` with the handoff link as measured (itself before the first published transfer)."""
        return self.link.apply(cost)

    def observe_transfer(self, nbytes: int, seconds: float, same_host: bool) -> None:
        """A published serialized handoff as its source reported it: the link's next price."""
        self.link.observe(nbytes, seconds, same_host)

    def pair_cost(self, snapshot: Snapshot, prefill_slot: int, decode_slot: int) -> CostModel:
        """A chosen pair's cost model at its workers' TP sizes, each with its live collectives where
        it has them (`config.cost` without pricing; live_pricing.py), with the measured link."""
        return self.link.apply(self._prices.pair_cost(snapshot, prefill_slot, decode_slot))

    def _admit(self, snapshot: Snapshot, request: RouteRequest, choice: Choice, policy: str) -> RoutePlan | Refusal:
        """Take the holds the choice needs; the ledger re-checks headroom so nothing oversubscribes.
        The P/D decision and the plan's clocks price the chosen pair at its workers' TP sizes."""
        cost = self.pair_cost(snapshot, choice.prefill_slot, choice.decode_slot)
        pd = None if snapshot.colocated else self._decide_pd(snapshot, request, choice, cost)
        if pd is None or pd.disaggregate:
            prefill, decode = hold_requests(snapshot, request, choice, cost.block_size_tokens)
        else:
            prefill, decode = None, local_hold(snapshot, request, choice, cost.block_size_tokens)
        reported = {decode.worker_id: self._registry.entry(decode.worker_id).load.free_blocks}
        if prefill is not None:
            reported[prefill.worker_id] = self._registry.entry(prefill.worker_id).load.free_blocks
        holds = self._ledger.try_reserve(request.request_id, prefill, decode, reported)
        if holds is None:
            return Refusal(_shortfall_reason(decode, self._ledger, reported), self.config.retry_after_s)
        self._heavy_light.add(request.request_id, decode.worker_id, request.heavy)
        if pd is None:
            return route_plan(snapshot, request, choice, cost, policy, holds)
        self._pd_total[pd.label] += 1
        if pd.disaggregate:
            return route_plan(snapshot, request, choice, cost, policy, holds, pd)
        return local_route_plan(snapshot, request, choice, cost, policy, holds[1], pd)

    def heavy_light(self, worker_id: str) -> tuple[int, int]:
        """(heavy, light) live routes on a decode worker (--decode-choice p2c's load)."""
        return self._heavy_light.counts(worker_id)

    def _decide_pd(self, snapshot: Snapshot, request: RouteRequest, choice: Choice, cost: CostModel) -> PdDecision:
        """The P/D decision for the policy's chosen pair, over the same snapshot, priced by `cost` (the pair's)."""
        if snapshot.prefill.worker_ids[choice.prefill_slot] == snapshot.decode.worker_ids[choice.decode_slot]:
            return WHOLE_ON_MIXED  # both phases chose one mixed worker: it runs the request whole
        cfg = self.config
        return self.signals.decide(snapshot, request, choice, cost, cfg.pd, (cfg.ttft_slo_s, cfg.tpot_slo_s),
                                   lambda worker_id: sum(self._heavy_light.counts(worker_id)))  # live routes to D

    def _on_retired(self, retired: RetiredWorker) -> Retirement:
        for change in self._kv.retire(retired.worker_id, retired.role_epoch):  # its blocks vanish with its epoch
            self._prefixes.patch(change.worker_id, change.added, change.removed)
        self._prices.retire(retired.worker_id)  # a new epoch is priced from the profile until its own steps show
        orphaned = tuple(self._ledger.drop_worker(retired.worker_id))
        for request_id in orphaned:
            self._heavy_light.remove(request_id)
        self._retired[retired.reason] += 1
        self._events["orphaned"] += len(orphaned)
        return Retirement(retired, orphaned)


def _shortfall_reason(decode: HoldRequest, ledger: ReservationLedger, reported: Mapping[str, int]) -> RejectReason:
    if ledger.can_reserve([decode], reported):
        return RejectReason.NO_TRANSFER_BUFFER
    return RejectReason.NO_DECODE_CAPACITY
