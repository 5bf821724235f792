"""The cluster K/V index (router/kv/kv_index.py): deltas, gaps and resyncs, retirement, the LRU bound,
the memory report; and the router feeding its snapshot's prefix sets from it."""

from __future__ import annotations

import random
import tracemalloc

import pytest

from pdserve.engine.kv.kv_events import BlockEventKind, KvTier
from pdserve.router.config import Mode, RouterConfig
from pdserve.router.kv.kv_index import (
    BYTES_PER_ENTRY,
    BYTES_PER_WORKER,
    HeldChange,
    KvDelta,
    KvIndex,
    KvOutcome,
    Location,
)
from pdserve.router.messages import Role, RouteRequest, WorkerInfo, WorkerLoad
from pdserve.router.router import Router
from tests.router.router_fixtures import ABI, MODEL

S, R = BlockEventKind.STORED, BlockEventKind.REMOVED
D = KvTier.DEVICE


def delta(last_seq: int, *events: tuple[int, int], resync: bool = False) -> KvDelta:
    return KvDelta(last_seq, tuple((kind, key, D) for kind, key in events), resync)


def resync(last_seq: int, *keys: int) -> KvDelta:
    return delta(last_seq, *((S, k) for k in keys), resync=True)


def synced(index: KvIndex, worker: str = "w", epoch: int = 1, *keys: int, seq: int = 0) -> None:
    assert index.apply(worker, epoch, resync(seq, *keys)).outcome is KvOutcome.RESYNCED


def test_deltas_apply_in_order_and_report_net_changes():
    index = KvIndex()
    synced(index, "w", 1, 10, 11)
    applied = index.apply("w", 1, delta(3, (S, 12), (R, 10), (S, 13)))
    assert applied.outcome is KvOutcome.APPLIED
    (change,) = applied.changes
    assert (change.worker_id, set(change.added), change.removed) == ("w", {12, 13}, (10,))
    assert index.held("w") == {11, 12, 13}
    assert index.holders(12) == (Location("w", KvTier.DEVICE, 1),)
    assert index.apply("w", 1, delta(4, (S, 14), (R, 14))).changes == ()  # stored then removed: no net change
    assert index.apply("w", 1, delta(6, (R, 11), (S, 11))).changes == ()  # removed then stored again: none
    assert index.apply("w", 1, delta(6)).outcome is KvOutcome.IGNORED  # nothing new
    assert index.apply("w", 1, delta(5, (S, 99))).outcome is KvOutcome.IGNORED  # already applied
    assert index.held("w") == {11, 12, 13} and len(index) == 3
    index.check_invariants()


def test_a_gap_asks_for_a_resync_and_applies_nothing_until_it_comes():
    index = KvIndex(resync_retry_reports=3)
    synced(index, "w", 1, 1, 2, seq=5)
    assert index.apply("w", 1, delta(8, (S, 3))).outcome is KvOutcome.RESYNC_NEEDED  # 6, 7 missing
    assert index.apply("w", 1, delta(9, (S, 4))).outcome is KvOutcome.AWAITING_RESYNC
    assert index.apply("w", 1, delta(10, (S, 5))).outcome is KvOutcome.AWAITING_RESYNC
    assert index.apply("w", 1, delta(11, (S, 6))).outcome is KvOutcome.RESYNC_NEEDED  # asked again (3rd report)
    assert index.held("w") == {1, 2}  # the old set stays until the resync replaces it
    applied = index.apply("w", 1, resync(11, 2, 7))
    assert applied.outcome is KvOutcome.RESYNCED and index.held("w") == {2, 7}
    assert applied.changes == (HeldChange("w", (7,), (1,)),)
    assert index.apply("w", 1, delta(12, (S, 8))).outcome is KvOutcome.APPLIED
    assert index.apply("w", 1, delta(14, (S, 9))).outcome is KvOutcome.RESYNC_NEEDED  # a later gap asks at once
    stats = index.stats()
    assert (stats.num_resyncs_requested, stats.num_resyncs_applied) == (3, 2)  # the first resync counts too


def test_a_new_worker_epoch_starts_without_a_baseline():
    index = KvIndex()
    assert index.apply("w", 1, delta(1, (S, 1))).outcome is KvOutcome.RESYNC_NEEDED
    assert len(index) == 0
    synced(index, "w", 1, 1, seq=1)
    synced(index, "w", 2, 5, seq=9)  # a re-registration: epoch 1's entries go first
    assert index.held("w") == {5} and index.holders(1) == ()
    assert index.apply("w", 1, resync(20, 1)).outcome is KvOutcome.IGNORED  # the older epoch is gone
    assert index.holders(5) == (Location("w", KvTier.DEVICE, 2),)


def test_retirement_drops_exactly_that_worker_s_entries():
    index = KvIndex()
    synced(index, "a", 1, 1, 2, 3)
    synced(index, "b", 4, 2, 3, 4)
    assert index.retire("a", 0) == ()  # an older epoch than the index holds: nothing
    (change,) = index.retire("a", 1)
    assert change.worker_id == "a" and set(change.removed) == {1, 2, 3} and not change.added
    assert index.held("a") == frozenset() and index.held("b") == {2, 3, 4} and len(index) == 3
    assert [loc.worker_id for loc in index.holders(2)] == ["b"]
    index.check_invariants()


def test_the_bound_evicts_the_least_recently_stored_entries_and_counts_them():
    index = KvIndex(max_entries=4)
    synced(index, "a", 1, 1, 2)
    synced(index, "b", 1, 3, 4)
    index.apply("a", 1, delta(1, (S, 1)))  # stored again: now the most recent
    applied = index.apply("b", 1, delta(2, (S, 5), (S, 6)))
    assert index.stats().num_evictions == 2
    assert index.held("a") == {1} and index.held("b") == {4, 5, 6}
    got = sorted((c.worker_id, set(c.added), c.removed) for c in applied.changes)
    assert got == [("a", set(), (2,)), ("b", {5, 6}, (3,))]
    assert index.apply("a", 1, delta(2, (R, 2))).changes == ()  # removing an evicted entry is a no-op
    index.check_invariants()


def test_the_memory_report_counts_entries_and_is_close_to_what_python_allocates():
    index = KvIndex()
    rng = random.Random(0)
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for w in range(4):
            synced(index, f"w{w}", 1, *(rng.getrandbits(63) for _ in range(5000)))
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    stats = index.stats()
    assert (stats.entries, stats.workers) == (20_000, 4)
    assert stats.memory_bytes == 20_000 * BYTES_PER_ENTRY + 4 * BYTES_PER_WORKER
    assert 0.7 * used <= stats.memory_bytes <= 1.4 * used


def test_a_bound_below_one_entry_is_refused():
    with pytest.raises(ValueError):
        KvIndex(max_entries=0)


# ---- through the router -------------------------------------------------------------------
def router() -> Router:
    r = Router(RouterConfig(Mode.DISAGGREGATED, MODEL, ABI, policy="prefix", kv_index_max_entries=64))
    for wid, role in (("p0", Role.PREFILL), ("d0", Role.DECODE), ("d1", Role.DECODE)):
        r.register(WorkerInfo(wid, "h0", role, 1, 1000, MODEL, ABI))
        r.report_load(wid, 1, WorkerLoad(0, 0, 1000))
    return r


def test_the_router_feeds_the_prefix_policy_from_the_index_and_retirement_removes_it():
    r = router()
    doc = tuple(range(100, 108))
    assert r.report_kv("d1", 1, resync(3, *doc)) is KvOutcome.RESYNCED
    assert r.report_kv("d1", 1, delta(4, (R, doc[-1]))) is KvOutcome.APPLIED
    request = RouteRequest("q", 8 * 16 + 3, 4, doc)
    plan = r.route(request)
    assert plan.decode_id == "d1" and plan.decode_hit_blocks == 7
    r.complete("q")
    assert r.kv_holders(doc[0]) == (Location("d1", KvTier.DEVICE, 1),)
    r.deregister("d1", 1)
    assert r.kv_holders(doc[0]) == () and r.kv_index_stats().entries == 0
    plan = r.route(RouteRequest("q2", 8 * 16 + 3, 4, doc))
    assert plan.decode_id == "d0" and plan.decode_hit_blocks == 0
    r.complete("q2")
    r.assert_no_leaks()


def test_a_retired_epoch_s_report_changes_nothing():
    r = router()
    r.deregister("d0", 1)
    assert r.report_kv("d0", 1, resync(1, 5)) is KvOutcome.IGNORED
    assert r.kv_index_stats().entries == 0


def test_metrics_export_the_index_at_scrape_time():
    from pdserve.router.process.metrics import RuntimeMetrics

    index = KvIndex(max_entries=2)
    synced(index, "w", 1, 1, 2, 3)  # one eviction
    assert index.apply("w", 1, delta(5, (S, 4))).outcome is KvOutcome.RESYNC_NEEDED
    text = RuntimeMetrics(kv_index=index.stats).text().decode()
    memory = 2 * BYTES_PER_ENTRY + BYTES_PER_WORKER
    for line in ("pdserve_kv_index_entries 2.0", f"pdserve_kv_index_memory_bytes {float(memory)}",
                 "pdserve_kv_index_evictions_total 1.0", 'pdserve_kv_index_resyncs_total{stage="requested"} 1.0',
                 'pdserve_kv_index_resyncs_total{stage="applied"} 1.0'):
        assert line + "\n" in text
    assert "pdserve_kv_index" not in RuntimeMetrics().text().decode()  # no index, no samples


# bench-router's events arm (route p99 with and without block events) is asserted in
# tests/router/test_router_router.py::test_bench_router_command_smoke: one invocation for both.
