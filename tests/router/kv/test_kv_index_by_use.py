"""The cluster K/V index by use (issue 36, part 4): a route's reads and a block's tier moves
refresh its entries, so a shared root outlives the traffic on it; the prefix matrix is one per
router, counted in the index's memory figure, and a membership change moves none of it."""

from __future__ import annotations

import numpy as np

from pdserve.engine.kv.kv_events import BlockEventKind, KvTier
from pdserve.router.config import Mode, RouterConfig
from pdserve.router.kv.kv_index import (
    BYTES_PER_ENTRY,
    BYTES_PER_WORKER,
    KvDelta,
    KvIndex,
    KvOutcome,
)
from pdserve.router.kv.prefix_index import leading_hit_blocks
from pdserve.router.messages import Role, RouteRequest, WorkerInfo, WorkerLoad
from pdserve.router.router import Router
from pdserve.router.synthetic import chain
from tests.router.router_fixtures import ABI, MODEL

S, DEMOTED, PROMOTED = BlockEventKind.STORED, BlockEventKind.DEMOTED, BlockEventKind.PROMOTED
DEVICE, HOST = KvTier.DEVICE, KvTier.HOST


def stored(last_seq: int, *keys: int, resync: bool = False) -> KvDelta:
    return KvDelta(last_seq, tuple((S, key, DEVICE) for key in keys), resync)


def router(max_entries: int = 64) -> Router:
    r = Router(RouterConfig(Mode.DISAGGREGATED, MODEL, ABI, policy="prefix", kv_index_max_entries=max_entries))
    for wid, role in (("p0", Role.PREFILL), ("d0", Role.DECODE), ("d1", Role.DECODE)):
        join(r, wid, role, 1)
    return r


def join(r: Router, worker_id: str, role: Role, epoch: int) -> None:
    r.register(WorkerInfo(worker_id, "h0", role, epoch, 1000, MODEL, ABI))
    r.report_load(worker_id, epoch, WorkerLoad(0, 0, 1000))


def test_routes_on_a_shared_root_keep_it_through_eviction_pressure():
    """d0 holds a system prompt's 4 root blocks; d1's unrelated traffic stores 8 blocks a round,
    160 in all against a bound of 64. A conversation on the root is routed every round: its read
    refreshes the root, which stays (by store time it would have been the first to go)."""
    r = router(max_entries=64)
    root = chain(1, 7, 4)
    assert r.report_kv("d0", 1, stored(4, *root, resync=True)) is KvOutcome.RESYNCED
    assert r.report_kv("d1", 1, stored(0, resync=True)) is KvOutcome.RESYNCED
    for turn in range(20):
        conversation = tuple(root + chain(100 + turn, 7, 3))
        plan = r.route(RouteRequest(f"q{turn}", 7 * 16 + 5, 4, conversation))
        assert plan.decode_id == "d0" and plan.decode_hit_blocks == 4
        r.complete(plan.request_id)
        flood = chain(1000 + turn, 9, 8)
        assert r.report_kv("d1", 1, stored(8 * (turn + 1), *flood)) is KvOutcome.APPLIED
    stats = r.kv_index_stats()
    assert stats.entries == 64 and stats.num_evictions == 4 + 160 - 64
    assert set(root) <= set(r.kv_held("d0"))


def test_a_route_refreshes_only_the_leading_run_the_worker_holds():
    index = KvIndex(max_entries=4)
    index.apply("w", 1, stored(3, 1, 2, 3, resync=True))
    index.touch("w", [1, 9, 2])  # 1 is read; 2 sits after a miss: not reused, not refreshed
    index.touch("gone", [1])  # an unknown worker: nothing
    index.apply("w", 1, stored(5, 4, 5))  # one over the bound: the least recently used goes, 2
    assert set(index.held("w")) == {1, 3, 4, 5} and index.stats().num_evictions == 1
    index.check_invariants()


def test_demote_and_promote_refresh_the_entry():
    index = KvIndex(max_entries=3)
    index.apply("w", 1, stored(3, 1, 2, 3, resync=True))
    index.apply("w", 1, KvDelta(4, ((DEMOTED, 1, HOST),)))  # 1 moved to the host tier: used now
    index.apply("w", 1, stored(5, 4))
    assert set(index.held("w")) == {1, 3, 4} and set(index.host_held("w")) == {1}
    index.apply("w", 1, KvDelta(6, ((PROMOTED, 1, DEVICE),)))  # back on the device, used again
    index.apply("w", 1, stored(7, 5))  # 3 is now the least recently used
    assert set(index.held("w")) == {1, 4, 5} and not index.host_held("w")
    index.check_invariants()


def test_the_prefix_matrix_is_counted_in_the_index_memory():
    r = router(max_entries=1 << 12)
    docs = {"p0": chain(1, 1, 40), "d0": chain(2, 1, 50), "d1": chain(3, 1, 60)}
    for wid, doc in docs.items():
        r.report_kv(wid, 1, stored(len(doc), *doc, resync=True))
    r.snapshot()
    stats = r.kv_index_stats()
    index_only = stats.entries * BYTES_PER_ENTRY + stats.workers * BYTES_PER_WORKER
    matrix = stats.memory_bytes - index_only
    assert stats.entries == 150
    assert matrix >= 150 * 3  # at least one byte per (held block, worker column)
    assert matrix == r._prefixes.memory_bytes()


def test_a_restart_and_a_role_move_keep_the_matrix_and_its_answers():
    """The snapshot reads the router's one matrix before and after a worker restarts and another
    moves role (no rebuild: the same buffer), and every slot's hits equal a scan of its worker's
    held set after each step."""
    r = router(max_entries=1 << 12)
    docs = {"p0": chain(1, 1, 8), "d0": chain(1, 1, 6), "d1": chain(1, 1, 3)}
    for wid, doc in docs.items():
        r.report_kv(wid, 1, stored(len(doc), *doc, resync=True))
    request = docs["p0"]
    matrix = r.snapshot().prefix.held

    def check(expect: dict[str, int]) -> None:
        snapshot = r.snapshot()
        assert snapshot.prefix.held.base is matrix.base  # the same bytes: nothing rebuilt
        ids = snapshot.prefill.worker_ids + snapshot.decode.worker_ids
        hits = snapshot.prefix.leading_hits(request).tolist()
        assert hits == [leading_hit_blocks(request, frozenset(r.kv_held(w))) for w in ids]
        assert dict(zip(ids, hits)) == expect

    check({"p0": 8, "d0": 6, "d1": 3})
    r.deregister("d0", 1)  # a restart: its epoch's blocks go with it ...
    check({"p0": 8, "d1": 3})
    join(r, "d0", Role.DECODE, 2)  # ... and its next epoch resyncs
    r.report_kv("d0", 2, stored(2, *docs["d0"][:2], resync=True))
    check({"p0": 8, "d0": 2, "d1": 3})
    r.drain("d1", 1)  # a role move: drained, registered as prefill under the next epoch
    join(r, "d1", Role.PREFILL, 2)
    r.report_kv("d1", 2, stored(5, *docs["p0"][:5], resync=True))
    check({"d1": 5, "p0": 8, "d0": 2})
    assert np.array_equal(np.sort(r.snapshot().prefix.cols), np.arange(3))
