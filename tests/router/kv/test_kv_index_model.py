"""Hypothesis: any interleaving of block events, shipped or lost reports, resyncs and retirements
leaves the cluster K/V index equal to a plain reference model of its contract, the changes it
reports rebuild its per-worker sets exactly, and the router's patched prefix index equals one
built from scratch."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.engine.kv.kv_events import BlockEventKind, KvTier
from pdserve.router.config import Mode, RouterConfig
from pdserve.router.kv.kv_index import KvDelta, KvIndex, KvOutcome
from pdserve.router.messages import Role, WorkerInfo, WorkerLoad
from pdserve.router.router import Router
from pdserve.router.state.snapshot import SnapshotBuilder
from tests.router.router_fixtures import ABI, MODEL

WORKERS = ("a", "b", "c")
S, R = int(BlockEventKind.STORED), int(BlockEventKind.REMOVED)
RETRY = 3


class Reference:
    """The contract in the plainest terms: a recency list of (key, worker) pairs (cut to the bound
    after each report) and, per worker, its epoch, the last event number applied (None: no
    baseline) and the reports seen since a gap."""

    def __init__(self, bound: int):
        self.bound, self.order, self.workers, self.evictions = bound, [], {}, 0

    def held(self, w):
        return {k for k, owner in self.order if owner == w}

    def retire(self, w, epoch):
        if w in self.workers and self.workers[w]["epoch"] <= epoch:
            del self.workers[w]
            self.order = [(k, o) for k, o in self.order if o != w]

    def apply(self, w, epoch, d: KvDelta) -> KvOutcome:
        state = self.workers.get(w)
        if state is not None and epoch < state["epoch"]:
            return KvOutcome.IGNORED
        if state is None or epoch > state["epoch"]:
            self.retire(w, epoch - 1)
            state = self.workers[w] = {"epoch": epoch, "last": None, "waiting": 0}
        numbers = set(range(d.last_seq - len(d.events) + 1, d.last_seq + 1))
        last = state["last"]
        if d.resync and (last is None or d.last_seq >= last):
            keys = [k for _, k, _ in d.events]
            self.order = [(k, o) for k, o in self.order if o != w or k in keys]
            for k in keys:
                self._store(w, k)
            self._bound()
            state.update(last=d.last_seq, waiting=0)
            return KvOutcome.RESYNCED
        if last is not None and d.last_seq <= last:
            return KvOutcome.IGNORED
        if last is None or (numbers and min(numbers) > last + 1) or (not numbers and d.last_seq > last):
            state["last"] = None
            state["waiting"] += 1
            return KvOutcome.RESYNC_NEEDED if state["waiting"] % RETRY == 1 else KvOutcome.AWAITING_RESYNC
        for number, (kind, k, _) in zip(sorted(numbers), d.events):
            if number <= last:
                continue
            if kind == S:
                self._store(w, k)
            elif (k, w) in self.order:
                self.order.remove((k, w))
        self._bound()
        state["last"] = d.last_seq
        return KvOutcome.APPLIED

    def _store(self, w, k):
        if (k, w) in self.order:
            self.order.remove((k, w))
        self.order.append((k, w))

    def _bound(self):  # the bound holds after every report
        while len(self.order) > self.bound:
            self.order.pop(0)
            self.evictions += 1


class TrueWorker:
    """The engine side: a prefix cache and its numbered event log."""

    def __init__(self):
        self.cache, self.seq, self.pending, self.epoch = set(), 0, [], 1
        self.wants_resync = True  # a new epoch's first report is a resync (as the worker's register() asks)

    def event(self, key: int) -> None:
        kind = R if key in self.cache else S
        (self.cache.discard if kind == R else self.cache.add)(key)
        self.seq += 1
        self.pending.append((kind, key, int(KvTier.DEVICE)))

    def report(self) -> KvDelta:
        """The next heartbeat's report: a resync when one was asked for, else the deltas."""
        if self.wants_resync:
            return self.resync()
        d, self.pending = KvDelta(self.seq, tuple(self.pending)), []
        return d

    def resync(self) -> KvDelta:
        self.pending, self.wants_resync = [], False
        return KvDelta(self.seq, tuple((S, k, int(KvTier.DEVICE)) for k in sorted(self.cache)), resync=True)


ops = st.lists(st.tuples(st.sampled_from(("event", "event", "event", "event", "ship", "ship", "lose", "resync", "retire")),
                         st.sampled_from(WORKERS), st.integers(0, 23)), min_size=10, max_size=100)


@settings(max_examples=300, deadline=None)
@given(ops, st.integers(2, 30))
def test_the_index_follows_the_reference_model(steps, bound):
    index, ref = KvIndex(max_entries=bound, resync_retry_reports=RETRY), Reference(bound)
    truth = {w: TrueWorker() for w in WORKERS}
    mirror = {w: set() for w in WORKERS}  # per-worker sets rebuilt from the reported changes only
    for op, w, key in steps:
        worker = truth[w]
        if op == "event":
            worker.event(key)
            continue
        if op == "retire":
            for change in index.retire(w, worker.epoch):
                mirror[w] -= set(change.removed)
            ref.retire(w, worker.epoch)
            worker.epoch += 1
            worker.wants_resync = True
            continue
        report = worker.resync() if op == "resync" else worker.report()
        if op == "lose":
            continue
        applied = index.apply(w, worker.epoch, report)
        assert applied.outcome is ref.apply(w, worker.epoch, report)
        worker.wants_resync |= applied.outcome is KvOutcome.RESYNC_NEEDED  # the router's ResyncKv
        for change in applied.changes:
            assert not mirror[change.worker_id] & set(change.added)
            assert set(change.removed) <= mirror[change.worker_id]
            mirror[change.worker_id] = (mirror[change.worker_id] | set(change.added)) - set(change.removed)
        for v in WORKERS:
            assert set(index.held(v)) == ref.held(v) == mirror[v]
        assert index.num_evictions == ref.evictions
        index.check_invariants()
    for w, worker in truth.items():  # a final resync of each worker: the index holds its cache (within the bound)
        index.apply(w, worker.epoch, worker.resync())
        assert set(index.held(w)) <= worker.cache
    if sum(len(worker.cache) for worker in truth.values()) <= bound:
        assert all(set(index.held(w)) == worker.cache for w, worker in truth.items())


@settings(max_examples=100, deadline=None)
@given(ops)
def test_the_router_s_patched_prefix_index_equals_a_rebuild(steps):
    router = Router(RouterConfig(Mode.DISAGGREGATED, MODEL, ABI, policy="prefix", kv_index_max_entries=20))
    truth = {w: TrueWorker() for w in WORKERS}
    roles = {"a": Role.PREFILL, "b": Role.DECODE, "c": Role.DECODE}

    def join(w):
        router.register(WorkerInfo(w, "h0", roles[w], truth[w].epoch, 1000, MODEL, ABI))
        router.report_load(w, truth[w].epoch, WorkerLoad(0, 0, 1000))

    for w in WORKERS:
        join(w)
    for op, w, key in steps:
        worker = truth[w]
        if op == "event":
            worker.event(key)
        elif op == "retire":
            router.deregister(w, worker.epoch)
            worker.epoch += 1
            worker.wants_resync = True
            join(w)
        else:
            report = worker.resync() if op == "resync" else worker.report()
            if op != "lose":
                worker.wants_resync |= router.report_kv(w, worker.epoch, report) is KvOutcome.RESYNC_NEEDED
        got = router.snapshot()
        fresh = SnapshotBuilder(colocated=False).build(router._registry, router._ledger.in_flight())
        assert got.prefix.owners == fresh.prefix.owners
        assert [set(h) for h in got.decode.members.held_prefixes] == [set(h) for h in fresh.decode.members.held_prefixes]
