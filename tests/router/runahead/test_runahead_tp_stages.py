"""KV-Runahead partitions of chains whose workers run different TP sizes (issue 23): each stage's
chunks are priced at its own worker's size (router/runahead/runahead_plan.py `search_partition` with one
ChunkCost per stage; router/runahead/runahead.py `chunk_pricing`, the router's TpPricing formula), the
searched partition equals a brute-force reference on a plain per-chunk, per-layer simulation, a
faster stage takes more of the prompt, and the cache keeps one key and one file per tuple of stage
sizes. Costs are binary fractions, so every finish is exact."""

from __future__ import annotations

import itertools
import json
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from pdserve.latency.tp_collectives import CollectiveCosts
from pdserve.latency.tp_scaling import PhaseShares, TpScaling
from pdserve.router.config import Mode, RouterConfig
from pdserve.router.pricing.cost import CostModel
from pdserve.router.pricing.tp_pricing import TpPricing
from pdserve.router.router import Router
from pdserve.router.runahead.runahead import Runahead, chunk_pricing
from pdserve.router.runahead.runahead_plan import (
    ChainCaches,
    ChunkCost,
    LinkCost,
    PartitionCache,
    RunaheadKey,
    chain_finish_s,
    search_partition,
)

TP1 = ChunkCost(0.0, 1.0, 0.125)  # 1 s a row + 1/8 s a causal pair
TP2 = ChunkCost(0.0, 0.5, 0.0625)  # the same worker at half the time
STAGE = {1: TP1, 2: TP2}
LINK = LinkCost(0.0, 1.0, 1)  # one second per prefix row per layer
# the router's prior whose same-host link is LINK at 2 layers (2 bytes a token, 1 B/s, no setup)
LINK_PRIOR = CostModel(same_host_bytes_per_s=1.0, cross_host_bytes_per_s=1.0, transfer_overhead_s=0.0,
                       kv_bytes_per_token=2, fitted=True)
KEY = RunaheadKey("feedbeef", 2, "bfloat16", "avx2", (1, 1))


def reference_finish(partition, chunk, layers, costs, link) -> float:
    """Stage by stage, chunk by chunk, layer by layer: a stage's first chunk runs layer l once its
    own layer l - 1 is done and the prefix's layer l has arrived; its later chunks run whole after
    it; the prefix's layer l reaches the next stage when this stage's last chunk finished layer l,
    plus the link's time for every row sent so far."""
    start, arrive, finish = 0, [0.0] * layers, 0.0
    for stage, rows in enumerate(partition):
        cuts = sorted({start, start + rows, *range((start // chunk + 1) * chunk, start + rows, chunk)})
        t, done = 0.0, [0.0] * layers
        for j, (lo, hi) in enumerate(zip(cuts, cuts[1:])):
            n = hi - lo
            tau = costs[stage].chunk_s(n, n * lo + n * (n + 1) // 2) / layers
            if j == 0:
                for layer in range(layers):
                    t = max(t, arrive[layer]) + tau
                    done[layer] = t
            else:
                done = [t + (layer + 1) * tau for layer in range(layers)]
                t = done[-1]
        start, finish = start + rows, t
        arrive = [d + link.layer_s(start) for d in done]
    return finish


def brute_force(num_tokens, k, chunk, layers, costs, link):
    """Every cut of the prompt on the chunk grid into k non-empty parts, smallest finish, ties to
    the lexicographically first."""
    grid = range(chunk, num_tokens, chunk)
    parts = sorted(tuple(b - a for a, b in zip((0, *cuts), (*cuts, num_tokens))) for cuts in itertools.combinations(grid, k - 1))
    best = min(parts, key=lambda p: (reference_finish(p, chunk, layers, costs, link), p))
    return best, reference_finish(best, chunk, layers, costs, link)


@pytest.mark.parametrize("tps, expected", [
    ((1, 1), (4, 28)), ((2, 1), (28, 4)), ((1, 2), (4, 28)),  # a faster first stage takes the prompt
    ((1, 1, 1), (4, 4, 24)), ((2, 1, 1), (4, 4, 24)), ((1, 2, 1), (4, 24, 4)), ((1, 1, 2), (4, 4, 24)),
])
def test_each_stage_at_its_own_price_matches_the_brute_force_reference(tps, expected):
    costs = tuple(STAGE[tp] for tp in tps)
    plan = search_partition(32, len(tps), 4, 2, costs, LINK)
    assert (plan.partition, plan.predicted_s) == brute_force(32, len(tps), 4, 2, costs, LINK)
    assert plan.partition == expected
    assert plan.single_s == reference_finish((32,), 4, 2, costs[-1:], LINK)  # the route's worker (last) alone
    for part in [(4, 28), (16, 16), (28, 4)] if len(tps) == 2 else [(4, 4, 24), (8, 12, 12), (4, 24, 4)]:
        assert chain_finish_s(part, 4, 2, costs, LINK) == reference_finish(part, 4, 2, costs, LINK)


def test_a_faster_first_stage_shortens_the_chain_by_exact_seconds():
    assert chain_finish_s((4, 28), 4, 2, (TP1, TP1), LINK) == 99.375
    assert chain_finish_s((28, 4), 4, 2, (TP2, TP1), LINK) == 82.3125
    # one ChunkCost prices every stage, as before
    assert chain_finish_s((4, 28), 4, 2, TP1, LINK) == 99.375 and search_partition(32, 2, 4, 2, TP1, LINK).partition == (4, 28)


def test_the_cache_keeps_one_key_and_file_per_tuple_of_stage_sizes(tmp_path):
    caches = ChainCaches(KEY, tmp_path, STAGE.__getitem__, LINK, 2)
    assert caches.partition(32, 4, (1, 1)) == (4, 28)
    assert caches.partition(32, 4, (2, 1)) == (28, 4)  # never the (1, 1) chain's answer
    assert caches.partition(32, 4, [2, 1]) == (28, 4) and caches.cache((2, 1)).num_searches == 1
    names = {tps: c.key.file_name() for tps, c in caches.caches.items()}
    assert names == {(1, 1): "feedbeef-k2-tp1x1-bfloat16-avx2.json", (2, 1): "feedbeef-k2-tp2x1-bfloat16-avx2.json"}
    stored = json.loads((tmp_path / "runahead" / names[(2, 1)]).read_text())
    assert stored["key"]["tps"] == [2, 1] and stored["partitions"] == {"4:32": [28, 4]}
    assert stored["costs"] == [{"overhead_s": 0.0, "s_per_row": 0.5, "s_per_pair": 0.0625},
                               {"overhead_s": 0.0, "s_per_row": 1.0, "s_per_pair": 0.125}]
    again = ChainCaches(KEY, tmp_path, STAGE.__getitem__, LINK, 2)  # a later process reads both files
    assert (again.partition(32, 4, (2, 1)), again.partition(32, 4, (1, 1))) == ((28, 4), (4, 28))
    assert [c.num_searches for c in again.caches.values()] == [0, 0]
    # a (2, 1) file whose stage costs differ from this process's (another fit) is searched again
    refit = PartitionCache(RunaheadKey("feedbeef", 2, "bfloat16", "avx2", (2, 1)), tmp_path, (TP1, TP1), LINK, 2)
    assert refit.partition(32, 4) == (4, 28) and refit.num_searches == 1


def test_bad_stage_sizes_and_counts_are_refused():
    with pytest.raises(ValueError, match="needs 2 stage TP sizes"):
        RunaheadKey("feedbeef", 2, "bfloat16", "avx2", (1,))
    with pytest.raises(ValueError, match="integers >= 1"):
        RunaheadKey("feedbeef", 2, "bfloat16", "avx2", (0, 1))
    with pytest.raises(ValueError, match=r"one ChunkCost per stage \(2\), got 3"):
        search_partition(32, 2, 4, 2, (TP1, TP1, TP2), LINK)
    with pytest.raises(ValueError, match=r"one ChunkCost per stage \(3\), got 2"):
        chain_finish_s((8, 8, 16), 4, 2, (TP1, TP2), LINK)
    with pytest.raises(ValueError, match=r"one ChunkCost per stage \(2\), got 1"):
        PartitionCache(KEY, None, (TP1,), LINK, 2)
    caches = ChainCaches(KEY, None, STAGE.__getitem__, LINK, 2)
    with pytest.raises(ValueError, match="needs 2 stage TP sizes"):
        caches.partition(32, 4, (1, 1, 1))
    with pytest.raises(ValueError, match="integers >= 1"):
        caches.partition(32, 4, (2, -1))
    assert caches.caches == {}  # nothing priced or kept for a refused chain
    with pytest.raises(ValueError, match="tensor-parallel size must be >= 1"):
        chunk_pricing(PRICING, None)(0)


# measured at TP 1 (1 thread): prefill 10 ms + 1 ms a row; TP 2: compute x 0.5, 8 all_reduces of
# 1 ms + 2 ms sync = 10 ms a step, 8 x 1000 B x 1 ns = 8 us a row (tests/router/pricing/test_tp_worker_pricing.py)
BASE = CostModel(prefill_s_per_token=1e-3, prefill_overhead_s=0.01, kv_bytes_per_token=100, block_size_tokens=16)
COSTS2 = CollectiveCosts(tp=2, pinned=True, allreduce_s=1e-3, allreduce_s_per_byte=1e-9, step_sync_s=2e-3)
PRICING = TpPricing(BASE, TpScaling(PhaseShares(0.0), PhaseShares(0.5), 1, num_layers=4, row_bytes=1000,
                                    collectives=(COSTS2,)))


def test_stage_chunk_costs_are_the_routers_worker_prices():
    at = chunk_pricing(PRICING, None)  # the router's affine prefill terms at each size
    assert at(1) == ChunkCost(0.01, 1e-3, 0.0)
    assert (at(2).overhead_s, at(2).s_per_row, at(2).s_per_pair) == pytest.approx((0.015, 5.08e-4, 0.0), rel=1e-14)
    assert (at(2).overhead_s, at(2).s_per_row) == (PRICING.worker(2).prefill_overhead_s, PRICING.worker(2).prefill_s_per_token)
    # a profile fit measured at TP 1: raw at TP 1, the same price at TP 2 (x 0.5 + 10 ms, + 8 us a row, pairs x 0.5)
    fit = chunk_pricing(PRICING, {"prefill_coef": [0.02, 4e-4, 1e-6], "meta": {"tp": 1}})
    assert fit(1) == ChunkCost(0.02, 4e-4, 1e-6)
    assert (fit(2).overhead_s, fit(2).s_per_row, fit(2).s_per_pair) == pytest.approx((0.02, 2.08e-4, 5e-7), rel=1e-14)
    # measured at TP 2: raw there; at TP 1, x 2 less the TP 2 collectives (0.04 - 0.02, 8e-4 - 16 us)
    fit2 = chunk_pricing(PRICING, {"prefill_coef": [0.02, 4e-4, 1e-6], "meta": {"tp": 2}})
    assert fit2(2) == ChunkCost(0.02, 4e-4, 1e-6)
    assert (fit2(1).overhead_s, fit2(1).s_per_row, fit2(1).s_per_pair) == pytest.approx((0.02, 7.84e-4, 2e-6), rel=1e-14)


def _backend(tps: dict[str, int], pending: dict[str, int], prior: CostModel = LINK_PRIOR):
    registered = {w: SimpleNamespace(role="prefill", handoff_address=("127.0.0.1", 1), tp=tp) for w, tp in tps.items()}
    loads = {w: SimpleNamespace(pending_prompt_tokens=pending[w], role_state="serving") for w in tps}
    router = Router(RouterConfig(Mode.DISAGGREGATED, "m", "abi", cost=prior))
    return SimpleNamespace(registered=registered, loads=loads, away=set(), router=router)


def test_the_router_searches_a_chain_at_its_workers_registered_sizes():
    runahead = Runahead(2, 1, 4, ChainCaches(KEY, None, STAGE.__getitem__, LINK, 2), LINK_PRIOR, CollectorRegistry())
    # p2 (TP 2, least loaded) runs first, the route's p0 (TP 1) last
    backend = _backend({"p0": 1, "p1": 1, "p2": 2}, {"p0": 0, "p1": 50, "p2": 10})
    assert runahead.plan_chain(backend, "p0", 32) == (("p2", "p0"), (28, 4))
    backend.loads["p1"].pending_prompt_tokens = 0  # now p1 (TP 1) runs first: the (1, 1) chain's cut
    assert runahead.plan_chain(backend, "p0", 32) == (("p1", "p0"), (4, 28))
    assert set(runahead.caches.caches) == {(2, 1), (1, 1)}
    assert runahead.plan_chain(backend, "p0", 4) is None  # one chunk: no chain
    assert runahead.plan_chain(_backend({"p0": 1}, {"p0": 0}), "p0", 32) is None  # nobody to chain with


def test_chain_links_are_priced_at_the_routers_measured_handoff_link():
    fast = CostModel(same_host_bytes_per_s=16.0, cross_host_bytes_per_s=16.0, transfer_overhead_s=0.0,
                     kv_bytes_per_token=2, fitted=True)  # the prior: 16 B/s, no setup
    runahead = Runahead(2, 1, 4, ChainCaches(KEY, None, STAGE.__getitem__, LinkCost.of(fast, 2), 2), fast,
                        CollectorRegistry())
    backend = _backend({"p0": 1, "p1": 1}, {"p0": 0, "p1": 0}, prior=fast)
    assert runahead.plan_chain(backend, "p0", 32) == (("p1", "p0"), (28, 4))  # a fast link: stage 0 takes most
    backend.router.observe_transfer(4, 6.0, True)  # published handoffs: 2 s of setup + 1 B/s
    backend.router.observe_transfer(8, 10.0, True)
    price = backend.router.link.price
    assert (price.overhead_s, price.same_host_bytes_per_s) == pytest.approx((2.0, 1.0), rel=1e-12)
    assert runahead.plan_chain(backend, "p0", 32) == (("p1", "p0"), (4, 28))  # the slow link: the cut moves
    assert runahead.caches.link == LinkCost(price.overhead_s, price.same_host_bytes_per_s, 1)  # the fit's figures
    measured = backend.router.link_cost(fast)  # the model the P/D decision prices its handoff with
    assert runahead.caches.link.layer_s(12) == measured.transfer_s(12, True)  # one formula: 12 bytes of a layer
    assert search_partition(32, 2, 4, 2, TP1, runahead.caches.link).predicted_s == pytest.approx(101.375, rel=1e-12)
    # the price searched with stands until the fit moves by more than REPRICE (a quarter) in a term
    assert not runahead.caches.follow_link(LinkCost(2.4, 1.2, 1)) and runahead.caches.link.overhead_s == price.overhead_s
    assert runahead.caches.follow_link(LinkCost(2.0, 1.5, 1)) and runahead.caches.caches == {}
