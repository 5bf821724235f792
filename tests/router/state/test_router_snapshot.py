"""The incrementally patched snapshot equals one built from scratch after any sequence of events."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest

from pdserve.router.config import Mode
from pdserve.router.messages import RoutePlan
from pdserve.router.pricing.cost import CostModel
from pdserve.router.state.snapshot import Derived, SnapshotBuilder
from pdserve.router.synthetic import random_load, random_router


def fresh(router):
    """A snapshot rebuilt from the registry and ledger, with no incremental state."""
    builder = SnapshotBuilder(colocated=router.config.mode is Mode.COLOCATED)
    return builder.build(router._registry, router._ledger.in_flight())


def assert_same(got, want, cost):
    for name in ("prefill", "decode"):
        g, w = getattr(got, name), getattr(want, name)
        assert g.members == w.members
        for field in ("pending_tokens", "active_batch", "headroom_blocks"):
            assert np.array_equal(getattr(g, field), getattr(w, field)), (name, field)
            assert not getattr(g, field).flags.writeable
    assert np.array_equal(got.same_host, want.same_host)
    assert got.prefix.owners == want.prefix.owners
    patched, computed = got.derived(cost), Derived.compute(want.prefill, want.decode, cost)
    for a, b in zip(patched[:3], computed[:3]):
        assert a.tobytes() == b.tobytes()  # bit-identical, not merely close
    assert patched.worst_tpot_s >= computed.worst_tpot_s  # a bound, exact at least every pool-size patches
    for pool in (got.prefill, got.decode):
        assert len(pool) == 0 or pool.least_headroom <= pool.headroom_blocks.min()


@pytest.mark.parametrize("colocated", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_patched_snapshot_matches_rebuild(colocated, seed):
    router, workload = random_router(seed, 5, 4, "prefix", colocated=colocated)
    rng = random.Random(seed)
    snapshot = router.snapshot()
    worker_ids = snapshot.prefill.worker_ids + (() if colocated else snapshot.decode.worker_ids)
    live: list[RoutePlan] = []
    published: set[str] = set()
    for i in range(300):
        event = rng.random()
        if event < 0.3:
            held = workload.held_prefixes(rng) if rng.random() < 0.3 else None
            load = replace(random_load(rng, 20_000, held), applied_grant_seq=rng.randint(0, 40))  # settles grants
            router.report_load(rng.choice(worker_ids), 1, load)
        elif event < 0.7:
            result = router.route(workload.request(rng, f"r{i}"))
            if isinstance(result, RoutePlan):
                live.append(result)
        elif live:
            plan = live.pop(rng.randrange(len(live)))
            if plan.prefill_hold is not None and plan.request_id not in published and rng.random() < 0.5:
                router.kv_published(plan.request_id)  # P's staging hold goes; the route stays live
                published.add(plan.request_id)
                live.append(plan)
            elif rng.random() < 0.5:
                router.complete(plan.request_id)
            else:
                router.abort(plan.request_id)
        got = router.snapshot()
        assert_same(got, fresh(router), router.config.cost)
        assert got.derived(CostModel(block_size_tokens=32)) is got.derived(CostModel(block_size_tokens=32))


def test_unchanged_snapshot_is_reused():
    router, _ = random_router(0, 4, 4, "slo")
    assert router.snapshot() is router.snapshot()


def test_transfer_paths_match_transfer_s():
    cost = CostModel(same_host_bytes_per_s=3.3e9, cross_host_bytes_per_s=0.7e9, transfer_overhead_s=1.3e-3)
    nbytes = np.array([0, 1, 7, 524_288, 3 * 524_288 + 5, 10**12], dtype=np.int64)
    same, cross = cost.transfer_s_paths(nbytes)
    assert same.tobytes() == cost.transfer_s(nbytes, 1).tobytes()
    assert cross.tobytes() == cost.transfer_s(nbytes, 0).tobytes()
    for n in nbytes.tolist():
        assert cost.transfer_s_paths(n) == (cost.transfer_s(n, 1), cost.transfer_s(n, 0))
    stacked = cost.transfer_s_stacked(nbytes[1:])  # positive byte counts only
    assert stacked.tobytes() == np.stack([same[1:], cross[1:]]).tobytes()


def test_snapshot_arrays_are_read_only_views_patched_in_place():
    """A snapshot is valid until the next router call: its arrays are read-only views of the
    builder's buffers (no copy per publish), and the next build patches them."""
    router, _ = random_router(0, 3, 3, "slo")
    first = router.snapshot()
    view = first.decode.active_batch
    with pytest.raises(ValueError):
        view[0] = 7
    router.report_load(first.decode.worker_ids[0], 1, random_load(random.Random(9), 20_000, None))
    second = router.snapshot()
    assert second is not first
    assert np.shares_memory(second.decode.active_batch, view)
    assert view[0] == second.decode.active_batch[0]
    assert_same(second, fresh(router), router.config.cost)
