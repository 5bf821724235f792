"""The matrix prefix index answers exactly what a per-worker scan answers, before and after patches."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tests.router.router_reference import reference_cost_aware

from pdserve.router.kv.prefix_index import PrefixIndex, leading_hit_blocks
from pdserve.router.policy.plan import predicted_clocks
from pdserve.router.policy.policies import POLICIES, Choice, PolicyContext
from pdserve.router.synthetic import chain, random_load, random_router

pytestmark = pytest.mark.usefixtures("kernel_path")  # each test: compiled kernels, then numpy

CHAINS = [chain(c, 11, 8) for c in range(3)]
FOREIGN = [chain(100 + c, 11, 4) for c in range(2)]  # hashes some requests carry and no worker may hold
HELD_POOL = sorted({h for c in CHAINS for h in c})
ANY_HASH = HELD_POOL + sorted({h for c in FOREIGN for h in c})


def held_sets():
    """Leading runs (an LRU prefix cache), arbitrary subsets (runs with holes, tails without heads), or nothing."""
    runs = st.builds(lambda c, k: frozenset(CHAINS[c][:k]), st.integers(0, 2), st.integers(0, 8))
    tails = st.builds(lambda c, k: frozenset(CHAINS[c][k:]), st.integers(0, 2), st.integers(1, 8))
    return st.one_of(runs, tails, st.frozensets(st.sampled_from(HELD_POOL), max_size=12))


def requests():
    """Chain prefixes, chain prefixes continued by foreign blocks, arbitrary hash lists, empty."""
    prefix = st.builds(lambda c, k: CHAINS[c][:k], st.integers(0, 2), st.integers(0, 8))
    mixed = st.builds(lambda p, f, k: p + FOREIGN[f][:k], prefix, st.integers(0, 1), st.integers(0, 4))
    return st.one_of(prefix, mixed, st.lists(st.sampled_from(ANY_HASH), max_size=12))


def assert_matches_scan(index: PrefixIndex, held: list[frozenset[int]], block_hashes: list[int]) -> None:
    hits = index.leading_hits(block_hashes)
    assert hits.dtype == np.int64 and hits.shape == (len(held),)
    assert hits.tolist() == [leading_hit_blocks(block_hashes, h) for h in held]


def assert_consistent(index: PrefixIndex, held: list[frozenset[int]]) -> None:
    """Rows exist for exactly the held hashes; the sentinel and every recycled row are all false."""
    assert set(index.rows) == set().union(*held)
    assert 0 not in index.rows.values() and len(set(index.rows.values())) == len(index.rows)
    in_use = np.zeros(len(index.held), dtype=bool)
    in_use[list(index.rows.values())] = True
    assert not index.held[~in_use].any()
    assert index.owners == PrefixIndex.build(held).owners


@settings(max_examples=300, deadline=None)
@given(st.lists(held_sets(), max_size=70), requests())
def test_built_index_matches_per_worker_scan(held, block_hashes):
    """Pools from empty to 70 slots, straight from `build` (no patches)."""
    assert_matches_scan(PrefixIndex.build(held), held, block_hashes)


@settings(max_examples=200, deadline=None)
@given(st.lists(held_sets(), min_size=1, max_size=9), st.data())
def test_patched_index_matches_per_worker_scan(held, data):
    index = PrefixIndex.build(held)
    for _ in range(data.draw(st.integers(0, 6))):
        slot = data.draw(st.integers(0, len(held) - 1))
        new = data.draw(held_sets())
        index.replace_slot(slot, held[slot], new)
        held[slot] = new
        assert_matches_scan(index, held, data.draw(requests()))
    assert_consistent(index, held)
    for _ in range(3):
        assert_matches_scan(index, held, data.draw(requests()))


def test_rows_grow_and_recycle():
    held = [frozenset()] * 5
    index = PrefixIndex.build(held)
    rng = random.Random(3)
    long_chains = [chain(c, 5, 200) for c in range(4)]
    for step in range(60):
        slot = rng.randrange(len(held))
        doc = rng.choice(long_chains)
        new = frozenset(doc[: rng.randint(0, len(doc))]) if step % 7 else frozenset()
        index.replace_slot(slot, held[slot], new)
        held[slot] = new
        for doc in long_chains:
            assert_matches_scan(index, held, doc[: rng.randint(0, len(doc))] + FOREIGN[0])
    assert_consistent(index, held)
    assert len(index.held) > len(index.rows)  # grew past the distinct hashes, and freed rows are reused


def test_router_snapshots_match_reference_under_prefix_reports():
    """End to end at bench scale: reported prefix sets patch the live index; policies still agree with the loops."""
    rng = random.Random(5)
    for colocated in (False, True):
        router, workload = random_router(5, 16, 16, "prefix", colocated=colocated)
        snapshot = router.snapshot()
        worker_ids = snapshot.prefill.worker_ids + (() if colocated else snapshot.decode.worker_ids)
        ctx = PolicyContext(router.config.cost, 5.0, 0.05)
        for i in range(150):
            held = workload.held_prefixes(rng) if rng.random() < 0.5 else None
            router.report_load(rng.choice(worker_ids), 1, random_load(rng, 20_000, held))
            snapshot, request = router.snapshot(), workload.request(rng, f"r{i}")
            pools = (snapshot.prefill,) if colocated else (snapshot.prefill, snapshot.decode)
            held_sets = [h for pool in pools for h in pool.members.held_prefixes]
            assert_matches_scan(snapshot.prefix, held_sets, list(request.block_hashes))
            for name in ("prefix", "slo"):
                got = POLICIES[name](snapshot, request, ctx)
                want = reference_cost_aware(snapshot, request, ctx)
                if isinstance(want, Choice):
                    assert got == want and got.ttft_s == predicted_clocks(snapshot, request, got, ctx.cost)[0]
                else:
                    assert got.reason == want.reason
            result = router.route(request)
            if hasattr(result, "decode_hold"):
                router.complete(request.request_id)


@pytest.mark.parametrize("held_blocks", [0, 1, 127, 128, 129, 256, 300, 301])
def test_long_prompts_probe_in_chunks(held_blocks):
    """Prompts longer than one probe chunk (128 blocks): the hit stops at the first miss wherever
    it falls, including exactly at a chunk boundary and past the end of the request."""
    long_chain = chain(500, 11, 301)
    held = [frozenset(long_chain[:held_blocks]), frozenset(long_chain[:129]), frozenset()]
    index = PrefixIndex.build(held)
    for request in (long_chain, long_chain[:200], long_chain[:128] + FOREIGN[0]):
        assert_matches_scan(index, held, request)
