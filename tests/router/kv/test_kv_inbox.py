"""Block events applied off the routing path (router/kv/kv_inbox.py, frontend_upkeep.apply_kv_slice):
queued and drained in slices, the index and the snapshot's prefix index equal those of a router
that applied every report on arrival (gaps, resyncs, retired epochs and the bound included); the
serving process's applier takes one slice per event-loop turn, behind what is ready to run."""

from __future__ import annotations

import asyncio
import random

from pdserve.engine.kv.kv_events import BlockEventKind, KvTier
from pdserve.router.kv.kv_inbox import SLICE_REPORTS, KvInbox
from pdserve.router.kv.kv_index import KvDelta, KvOutcome
from pdserve.router.messages import Role, WorkerInfo, WorkerLoad
from pdserve.router.process import frontend_upkeep as upkeep
from pdserve.router.synthetic import ABI, MODEL, EventFlow, engine_report, random_router
from pdserve.workers import messages as m


def cluster(seed: int, bound: int | None = None):
    router, workload = random_router(seed, 4, 4, "prefix")
    if bound is not None:
        router._kv.max_entries = bound  # the bound under pressure (the index checks it after every call)
    snapshot = router.snapshot()
    members = snapshot.prefill.members, snapshot.decode.members
    held = {w: frozenset(h) for ms in members for w, h in zip(ms.worker_ids, ms.held_prefixes)}
    return router, workload, held


def state(router) -> tuple:
    """Everything a route reads from the index: held and host-tier sets, the counters, and the
    snapshot's patched prefix index."""
    kv = router._kv
    kv.check_invariants()
    workers = sorted(kv._workers)
    sets = [(w, kv._workers[w].epoch, set(kv.held(w)), set(kv.host_held(w))) for w in workers]
    stats = kv.stats()
    return sets, (stats.entries, stats.num_evictions, stats.num_resyncs_requested), router.snapshot().prefix.owners


def stream(seed: int, held: dict, workload, reports: int) -> list[tuple[str, str, KvDelta]]:
    """Reports with everything that happens to them: most arrive, some are lost (a gap), some are
    a resync, and now and then a worker re-registers (a new epoch)."""
    rng, flow, ops = random.Random(seed), EventFlow(held, workload, 16), []
    for _ in range(reports):
        worker_id = rng.choice(sorted(held))
        delta = flow.report(rng, worker_id)
        roll = rng.random()
        if roll < 0.06:
            continue  # lost on the way: the next report leaves a gap
        if roll < 0.12:
            keys = set(flow.held[worker_id]) | set(flow.host[worker_id])
            delta = KvDelta(delta.last_seq, tuple((int(BlockEventKind.STORED), k, int(KvTier.DEVICE)) for k in keys), True)
        ops.append(("rejoin" if roll > 0.97 else "report", worker_id, delta))
    return ops


def rejoin(router, worker_id: str, epoch: int) -> None:
    role = Role.PREFILL if worker_id.startswith("p") else Role.DECODE
    router.register(WorkerInfo(worker_id, "host0", role, epoch, 20_000, MODEL, ABI))
    router.report_load(worker_id, epoch, WorkerLoad(0, 0, 20_000))


def run_both(seed: int, bound: int | None = None) -> int:
    """Both routers through the same stream; the eager one's evictions."""
    eager, workload, held = cluster(seed, bound)
    queued, _, _ = cluster(seed, bound)
    inbox, rng = KvInbox(), random.Random(seed + 1)
    epochs = dict.fromkeys(held, 1)
    asked_eager, asked_queued = [], []
    for op, worker_id, delta in stream(seed, held, workload, 300):
        if op == "rejoin":  # membership changes apply at once in both: the queue must drain first
            asked_queued += inbox.drain(queued)
            epochs[worker_id] += 1
            for router in (eager, queued):
                rejoin(router, worker_id, epochs[worker_id])
        if eager.report_kv(worker_id, epochs[worker_id], delta) is KvOutcome.RESYNC_NEEDED:
            asked_eager.append(worker_id)
        inbox.put(worker_id, epochs[worker_id], delta)
        if rng.random() < 0.3:  # an applier turn: a slice of what is queued
            asked_queued += inbox.drain(queued, rng.randint(1, 2 * SLICE_REPORTS))
            if not len(inbox):
                assert state(queued) == state(eager)
    asked_queued += inbox.drain(queued)
    assert state(queued) == state(eager) and asked_queued == asked_eager
    assert asked_eager and inbox.num_applied > 250
    return eager.kv_index_stats().num_evictions


def test_queued_slices_leave_the_index_equal_to_applying_every_report_on_arrival():
    for seed in range(2):
        assert run_both(seed) == 0


def test_queued_slices_are_exact_under_the_bound_too():
    assert run_both(7, bound=300) > 100


def test_the_inbox_records_how_long_a_report_waited():
    now = [10.0]
    inbox = KvInbox(clock=lambda: now[0])
    router, workload, held = cluster(0)
    flow, worker_id = EventFlow(held, workload, 8), sorted(held)[0]
    inbox.put(worker_id, 1, flow.report(random.Random(0), worker_id))
    now[0] = 10.25
    assert inbox.drain(router) == () and inbox.max_lag_s == 0.25 and len(inbox) == 0


class Backend:
    """What the applier touches of the serving backend: the router, the queue, the socket."""

    def __init__(self, router):
        self.router, self.kv_inbox, self.sent = router, KvInbox(), []

    async def _send(self, worker_id: str, msg) -> bool:
        self.sent.append((worker_id, msg))
        return True


def test_the_applier_takes_one_slice_per_loop_turn_behind_what_is_ready():
    async def main():
        router, workload, held = cluster(3)
        backend, rng, flow = Backend(router), random.Random(3), EventFlow(held, workload, 8)
        workers = sorted(held)
        seen: list[int] = []

        async def route_ready():  # a coroutine ready before the reports arrive runs before any slice
            seen.append(backend.kv_inbox.num_applied)

        task = asyncio.get_running_loop().create_task(route_ready())
        for _ in range(2 * SLICE_REPORTS + 3):
            worker_id = rng.choice(workers)
            upkeep.queue_kv(backend, worker_id, 1, KvDelta.from_report(engine_report(flow.report(rng, worker_id))))
        upkeep.queue_kv(backend, workers[0], 1, KvDelta(10**6, ((1, 5, 0),)))  # a gap: this worker must resync
        assert backend.kv_inbox.num_applied == 0  # the handler only queued them
        turns = []
        while len(backend.kv_inbox):
            await asyncio.sleep(0)
            turns.append(backend.kv_inbox.num_applied)
        await task
        await asyncio.sleep(0)  # the ResyncKv send
        assert seen == [0]
        assert turns == [SLICE_REPORTS, 2 * SLICE_REPORTS, 2 * SLICE_REPORTS + 4]
        assert [(w, type(msg)) for w, msg in backend.sent] == [(workers[0], m.ResyncKv)]

    asyncio.run(main())
